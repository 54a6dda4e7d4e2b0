"""Helpers shared by the tests and the benchmarks: one copy of each.

Tests import them as `helpers` (pytest puts tests/ on sys.path for the rootdir conftest); a
benchmark puts the repository root and tests/ on sys.path first:

    ROOT = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from helpers import free_port

Standard library only at import, and nothing from pytest, so a benchmark runs without the test
extras (bench_cli imports the package when called).
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Debian's client has BuildKit built in; a newer client first on PATH may lack buildx.
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker")
                                                                      or "docker")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- waiting for something to happen ------------------------------------------------------------
# A test that waits for a process to start, a file to appear or a state to change looks at that
# condition until it holds: a fixed sleep is too long on a quiet machine and too short on a loaded
# one (CI's 2 cores), and passes on without noticing when the thing never happened.


def wait_for(condition: Callable[[], object], timeout: float = 10.0, interval: float = 0.01,
             what: str = "") -> None:
    """Return once `condition()` is true; AssertionError when it is still false after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what or 'the condition'}")
        time.sleep(interval)


async def until(condition: Callable[[], object], timeout: float = 10.0, interval: float = 0.01,
                what: str = "") -> None:
    """wait_for inside an event loop: it sleeps with asyncio, so the loop's tasks run meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what or 'the condition'}")
        await asyncio.sleep(interval)


def finishes(work: Callable[[], Any], seconds: float = 10) -> Any:
    """`work()`'s result (or its exception, raised here), failing when it has not returned in
    `seconds`: a FIFO open blocks for ever, and the thread is a daemon, so a hang fails the test
    instead of the run."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (hung)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# --- Docker -------------------------------------------------------------------------------------


def docker(*args: str, timeout: float = 60, env: Mapping[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    """`docker ARGS` with BuildKit on, output captured; never raises on a non-zero exit.

    `env` replaces the whole environment (for a sealed build); default: this one."""
    run_env = dict(env) if env is not None else dict(os.environ, DOCKER_BUILDKIT="1")
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env=run_env)


def image_id(tag: str) -> str:
    """The image ID `tag` names now ("" when there is none)."""
    found = docker("image", "inspect", "--format", "{{.Id}}", tag, timeout=30)
    return found.stdout.strip() if found.returncode == 0 else ""


def drop_replaced_image(before: str, tag: str) -> None:
    """After a rebuild of `tag`: remove the image it named before, which a changed build context
    left untagged (500 MB a run for the dashboard; CI's disk holds its past runs). Without -f:
    an image another tag or a container still uses stays."""
    if before and before != image_id(tag):
        docker("image", "rm", before, timeout=120)


def docker_ready(*images: str, env: Mapping[str, str] | None = None) -> bool:
    """The Docker engine answers and every one of `images` is present locally (`env` as for
    `docker`).

    scripts/test-env.sh starts the engine and builds the local images (the Debian base and the
    engine simulator); a test or benchmark that needs one checks here first."""
    try:
        return (docker("info", timeout=20, env=env).returncode == 0
                and all(docker("image", "inspect", image, timeout=20, env=env).returncode == 0
                        for image in images))
    except (OSError, subprocess.TimeoutExpired):
        return False


# --- throwaway projects -------------------------------------------------------------------------

# What a throwaway project needs to resolve profiles and run invoke; the package and the
# dashboard's build files only for tests that build the dashboard image.
PROJECT_DIRS = ("env", "chat-templates", "fp8_configs", "fused_moe_configs", "patches",
                "engine-plugins")
PROJECT_FILES = ("tasks.py", ".env.example", "compose.yaml")
PACKAGE_PARTS = ("vllmstack", "pyproject.toml", "Dockerfile.dashboard",
                 "Dockerfile.dashboard.dockerignore")


def copy_project(dest: Path, *, with_package: bool = False) -> Path:
    """A copy of the shipped project at `dest` (created) that `invoke` can run in."""
    dest.mkdir(parents=True, exist_ok=True)
    names = PROJECT_DIRS + PROJECT_FILES + (PACKAGE_PARTS if with_package else ())
    for name in names:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif src.is_file():
            shutil.copy(src, dest / name)
    return dest


def write_dotenv(root: Path, settings: dict[str, str]) -> None:
    """`.env` = `.env.example` with `settings` replacing (never duplicating) its lines."""
    lines = [line for line in (ROOT / ".env.example").read_text().splitlines()
             if line.split("=", 1)[0] not in settings]
    (root / ".env").write_text("\n".join([*lines, *(f"{k}={v}" for k, v in settings.items())]) + "\n")


def load_tasks() -> Any:
    """tasks.py, freshly loaded (invoke consumes a task's help when it builds its arguments)."""
    spec = importlib.util.spec_from_file_location("stack_tasks", ROOT / "tasks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_cli(url: str, tokenizer: Path, folder: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """`python -m vllmstack.bench ARGS --json` in-process against `url`; (exit code, JSON)."""
    from vllmstack.bench.cli import main
    from vllmstack.core.paths import Project

    out = io.StringIO()
    code = main([*args, "--url", url, "--model", "sim", "--tokenizer", str(tokenizer),
                 "--history-dir", str(folder), "--json"], environ={},
                project=Project(folder), out=out)
    return code, json.loads(out.getvalue())


# --- the engine simulator as a native engine ------------------------------------------------------

SIMULATOR = ROOT / "tests" / "simulator" / "server.py"


def simulator_project(dest: Path, profiles: Mapping[str, str], *, port: int,
                      settings: Mapping[str, str] | None = None,
                      commands: Mapping[str, str] | None = None) -> Path:
    """A throwaway project (copy_project) whose native engine is the simulator, with one model
    profile per entry of `profiles` (name -> its ENGINE_ENV, e.g. "SIM_FAULT=crash-at-boot"),
    each made for the cpu platform and served under its own name; the engine listens on `port`.
    `commands` gives a profile another engine command (NATIVE_ENGINE_COMMAND) than the simulator."""
    root = copy_project(dest)
    simulator = f"{shlex.quote(sys.executable)} {shlex.quote(str(SIMULATOR))}"
    for name, engine_env in profiles.items():
        command = (commands or {}).get(name, simulator)
        (root / "env" / "models" / f"{name}.env").write_text(
            f"PROFILE_DESCRIPTION=the engine simulator as {name}\nEXTENDS=models/qwen3-0.6b\n"
            f"PROFILE_PLATFORMS=cpu\nVLLM_SERVED_NAME={name}\nENGINE_ENV='{engine_env}'\n"
            f"NATIVE_ENGINE_COMMAND='{command}'\n")
    write_dotenv(root, {"PLATFORM": "cpu", "VLLM_PORT": str(port), "OTHER_ENGINE_PORTS": ",",
                        "RUNTIME": "native", "NATIVE_STOP_GRACE": "3", **(settings or {})})
    return root


def write_checkpoint(folder: Path) -> Path:
    """A 2-layer Qwen3 checkpoint folder as the KV calibration sees it (config, weights file,
    tokenizer); nothing in it loads."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2}))
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "tokenizer.json").write_text("{}")
    return folder

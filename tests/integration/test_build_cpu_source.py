"""vLLM compiled from source for the cpu target, served, and a patch seen by a client.

The whole path a maintainer takes after a bump, for real on this machine (no GPU):

    invoke build --platform cpu     # Dockerfile.fullbuild's cpu target: the pinned sdist, the
                                    # patch series verified and applied, the CPU extension compiled
    invoke up --platform cpu --model tiny    # Compose, the made model

A test patch carries the `tools: []` fix the `tools-empty-list` runtime overlay carries today, as
a build patch (the overlay is taken out of the project copy, or verification reports the conflict):
with it, a chat request with `"tools": []` is answered; without it (the one-patch rebuild), vLLM
answers 400. The image's labels list the applied patches, and the wheel version in the image names
the patch set. The first build is a cold one where nothing is cached (an hour or more on 2 cores);
the rebuild changes one Python file, so ccache reports no compile at all. While the patched image
serves, `invoke bench` (the server's version must be the image's wheel), the `thinkoff` and
`prefix-cache` probes and `stability smoke` must pass: what an operator runs after `up`.

Marked `source_build`: only `invoke test --slow` runs it (CI's time does not allow the compile).
The module holds /tmp/vllmstack-heavy.lock from its first build to its last `down`, like every
heavy job on a shared machine (so do not wrap it in `flock` yourself: that would wait forever).
Its times go to test-artifacts/cpu-source-build.json (benchmarks/ keeps the last run's evidence).
"""

from __future__ import annotations

import difflib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import need
from helpers import DOCKER, ROOT, copy_project, docker, docker_ready, free_port, write_dotenv

pytestmark = [pytest.mark.source_build, pytest.mark.slow, pytest.mark.docker]
BASE_IMAGE = "vllmstack/base:bookworm"
OVERLAY_TARGET = "vllm/entrypoints/openai/chat_completion/protocol.py"
TEST_PATCH = "0900-test-tools-empty-list.patch"
BUILD_TIMEOUT_S = 4 * 3600
BOOT_TIMEOUT_S = 600
LOCK = "/tmp/vllmstack-heavy.lock"
ARTIFACT = ROOT / "test-artifacts" / "cpu-source-build.json"


@dataclass
class Stack:
    root: Path
    home: Path
    port: int
    image: str
    env: dict[str, str] = field(default_factory=dict)
    times: dict[str, Any] = field(default_factory=dict)

    def invoke(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HOME": str(self.home), **self.env}
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=self.root, env=env,
                              text=True, capture_output=True, timeout=timeout, check=False)

    def must(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        result = self.invoke(*args, timeout=timeout)
        said = f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
        assert result.returncode == 0, f"invoke {' '.join(args)}:\n{said}"
        return result

    def labels(self) -> dict[str, str]:
        shown = docker("image", "inspect", "--format", "{{json .Config.Labels}}", self.image)
        assert shown.returncode == 0, shown.stderr
        labels: dict[str, str] = json.loads(shown.stdout)
        return labels

    def build(self, name: str) -> str:
        """`invoke build --platform cpu`: its log, and its time recorded."""
        started = time.monotonic()
        result = self.must("build", timeout=BUILD_TIMEOUT_S)
        log = result.stdout + result.stderr
        self.times[name] = {"seconds": round(time.monotonic() - started),
                            "ccache": ccache_stats(log)}
        return log

    def chat_with_empty_tools(self) -> tuple[int, str]:
        body = json.dumps({"model": "tiny", "max_tokens": 4, "tools": [],
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                         data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


def ccache_stats(log: str) -> dict[str, int]:
    """Hits and misses from the `ccache --show-stats` the vllm-build step ends with."""
    block = log[log.rfind("ccache after the vLLM build:"):]
    stats = {}
    for key in ("Hits", "Misses"):
        match = re.search(rf"\b{key}:\s+(\d+) /", block)  # the first: compiler calls
        if match:
            stats[key.lower()] = int(match.group(1))
    return stats


def overlay_as_patch(sdist: Path, version: str, mark: str) -> str:
    """The overlay's change as a build patch: upstream's file at the release -> the overlay file.
    `mark` (a comment line) makes this run's patch set new to the layer cache, so its build is a
    real one-patch rebuild every time, not a cached image of an earlier run."""
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"vllm-{version}/{OVERLAY_TARGET}")
        assert member is not None
        upstream = member.read().decode().splitlines(keepends=True)
    fixed = (ROOT / "patches" / "vllm" / "overlays" / "chat_completion" / "protocol.py").read_text()
    fixed += f"# {mark}\n"
    diff = "".join(difflib.unified_diff(upstream, fixed.splitlines(keepends=True),
                                        f"a/{OVERLAY_TARGET}", f"b/{OVERLAY_TARGET}"))
    assert diff, "the overlay no longer differs from upstream"
    return ("Subject: test: accept \"tools\": [] without a tool_choice (the tools-empty-list overlay)\n"
            "Why: tests/integration/test_build_cpu_source.py: a patch a client can see\n"
            "Upstream: none\nMade-for: vllm v" + version + "\nDrop-when: never (test only)\n\n"
            f"diff --git a/{OVERLAY_TARGET} b/{OVERLAY_TARGET}\n" + diff)


def compose_v2_env() -> dict[str, str]:
    """Compose v2 for `invoke up`: the plugin scripts/test-env.sh installed into a DOCKER_CONFIG of
    the stack's own, linked into this session's private one (as tests/integration/
    test_lifecycle_docker.py finds it)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    config = Path(os.environ.get("VLLMSTACK_COMPOSE_V2_CONFIG") or cache / "vllmstack" / "docker-config")
    plugin = config / "cli-plugins" / "docker-compose"
    private = os.environ.get("DOCKER_CONFIG")
    if not private or not plugin.is_file():
        return {"DOCKER_CONFIG": str(config)}
    link = Path(private) / "cli-plugins" / "docker-compose"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(plugin)
    return {}


def copy_inputs(root: Path) -> None:
    """The checkout's build inputs (sdist, torch wheel) and local oneDNN mirror, linked or copied
    into the project copy, so the test downloads nothing the checkout already has."""
    for name in ("Dockerfile.fullbuild", ".dockerignore"):
        shutil.copy(ROOT / name, root / name)
    (root / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "apply-patches.py", root / "scripts" / "apply-patches.py")
    inputs = ROOT / ".cache" / "build-inputs"
    if inputs.is_dir():
        (root / ".cache" / "build-inputs").mkdir(parents=True)
        for path in inputs.iterdir():
            try:
                os.link(path, root / ".cache" / "build-inputs" / path.name)
            except OSError:
                shutil.copy(path, root / ".cache" / "build-inputs" / path.name)
    if (ROOT / "upstream" / "onednn").is_dir():
        shutil.copytree(ROOT / "upstream" / "onednn", root / "upstream" / "onednn")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    need(docker_ready(BASE_IMAGE), f"a Docker engine and the {BASE_IMAGE} image are needed")
    lock = open(LOCK, "a")  # noqa: SIM115 (held for the whole module, released below)
    fcntl.flock(lock, fcntl.LOCK_EX)
    base = tmp_path_factory.mktemp("cpu-source")
    root = copy_project(base / "stack")
    copy_inputs(root)
    home = base / "home"
    home.mkdir()
    image = f"vllmstack-test/vllm-cpu-src:{uuid.uuid4().hex[:10]}"
    settings = {
        "PLATFORM": "cpu", "MODEL_PROFILE": "tiny", "RUNTIME": "compose", "DOCKER": DOCKER,
        "VLLM_IMAGE": image, "MAX_JOBS": "2", "VLLM_PORT": str(port := free_port()),
        "DASHBOARD_PORT": str(free_port()), "OTHER_ENGINE_PORTS": "",
        "HOST_CACHE_DIR": str(ROOT / ".cache" / "real-engine-tests"),
        "UP_TIMEOUT": str(BOOT_TIMEOUT_S), "HF_CACHE_DIR": str(home / ".cache" / "huggingface")}
    if (root / "upstream" / "onednn").is_dir():  # offline: the local mirror of the pinned commit
        settings["ONEDNN_REPO"] = "upstream/onednn"
    write_dotenv(root, settings)
    made = Stack(root, home, port, image, env=compose_v2_env())
    made.must("make-model")
    yield made
    made.invoke("down", timeout=180)
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    docker("image", "rm", "-f", image, timeout=120)
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.write_text(json.dumps(made.times, indent=2) + "\n")


def serve_and_ask(stack: Stack, *, measure: str = "") -> tuple[int, str]:
    """`up`, the `"tools": []` request, and with `measure` (the wheel version the image's label
    names) what an operator runs next: bench, the probes the CPU quick start runs, stability."""
    started = time.monotonic()
    stack.must("up", "--no-dashboard", timeout=BOOT_TIMEOUT_S + 120)
    stack.times.setdefault("boots", []).append(round(time.monotonic() - started))
    try:
        answer = stack.chat_with_empty_tools()
        if measure:
            bench_and_probe(stack, measure)
        return answer
    finally:
        stack.must("down", timeout=180)


def bench_and_probe(stack: Stack, wheel: str) -> None:
    """The issue's "bench and probes passing", against the engine the image runs."""
    done = stack.must("bench", "--pp", "256", "--tg", "128", "--runs", "3", "--json", timeout=600)
    record = json.loads(done.stdout)
    assert record["status"] == "ok" and record["server"]["version"] == wheel, record.get("server")
    [row] = record["results"]
    assert row["errors"] == 0 and row["requests"] == 3, row
    stack.times["bench"] = {"ttft_ms_p50": row["ttft_ms"]["p50"], "tg_tps_p50": row["tg_tps"]["p50"]}
    for check in (("probe", "thinkoff"), ("probe", "prefix-cache"), ("stability", "smoke")):
        stack.must(*check, timeout=600)
        stack.times.setdefault("passed", []).append(" ".join(check))


def test_built_from_source_with_the_series_and_a_patch_the_client_sees(stack: Stack) -> None:
    version = "0.31.0"
    sdist = ROOT / ".cache" / "build-inputs" / f"vllm-{version}.tar.gz"
    patches = stack.root / "patches" / "vllm"
    # The overlay would replace the patched file at run time (and verification says so): out.
    (patches / "overlays.toml").write_text("")
    shutil.rmtree(patches / "overlays")
    if not sdist.is_file():  # a fresh clone: the build fetches it; make the patch from the same
        stack.must("build", "--dry-run", timeout=1800)
        sdist = stack.root / ".cache" / "build-inputs" / f"vllm-{version}.tar.gz"
    (patches / TEST_PATCH).write_text(overlay_as_patch(sdist, version, f"test build {uuid.uuid4()}"))

    # One Python-only patch more than the images before: ccache compiles nothing.
    log = stack.build("one-patch-rebuild")
    assert stack.times["one-patch-rebuild"]["ccache"].get("misses") == 0, stack.times
    labels = stack.labels()
    applied = labels["vllmstack.patch-list.vllm"].split(",")
    assert TEST_PATCH in applied and applied == sorted(p.name for p in patches.glob("*.patch"))
    assert labels["vllmstack.target"] == "cpu"
    assert labels["vllmstack.vllm-package"] == "/opt/vllm-package"
    # The wheel in the image is the one the label names: the target and this patch set.
    wheel = labels["vllmstack.vllm-wheel-version"]
    assert wheel.startswith(f"{version}+cpu.p") and wheel[-8:] == labels["vllmstack.patches.vllm"][:8]
    shown = docker("run", "--rm", "--entrypoint", "python", stack.image, "-c",
                   "import importlib.metadata as m, vllm._C; print(m.version('vllm'))", timeout=300)
    assert shown.returncode == 0 and shown.stdout.strip() == wheel, shown.stdout + shown.stderr
    assert f"applied  {TEST_PATCH}" in log
    status, text = serve_and_ask(stack, measure=wheel)
    assert status == 200, text
    assert json.loads(text)["choices"][0]["message"]["role"] == "assistant"

    # Without the test patch: the shipped series again (from the layer cache when an earlier
    # build made it; else compiled with ccache hits only).
    (patches / TEST_PATCH).unlink()
    stack.build("without-test-patch")
    labels = stack.labels()
    assert TEST_PATCH not in labels["vllmstack.patch-list.vllm"].split(",")
    assert stack.times["without-test-patch"]["ccache"].get("misses", 0) == 0, stack.times
    status, text = serve_and_ask(stack)
    assert status == 400 and "must not be an empty array" in text, (status, text)

    # And no change at all: every layer comes from the cache.
    stack.build("no-change-rebuild")
    assert stack.labels()["vllmstack.vllm-wheel-version"] == labels["vllmstack.vllm-wheel-version"]
    print(json.dumps(stack.times, indent=2))

"""`invoke up/status/exec/down` for real against the engine simulator image, once per container
runtime: Compose v2 (the docker CLI plugin), Compose v1 (docker-compose) and Podman
(podman-compose). scripts/test-env.sh provisions all three; what differs between them is data in
vllmstack/runtime/flavours.py, and these tests are where each difference was found.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import requests
from conftest import need
from helpers import DOCKER, copy_project, docker_ready, free_port, write_dotenv

SIM_IMAGE = "vllmstack/engine-sim:latest"
BASE_IMAGE = "vllmstack/base:bookworm"
DASHBOARD_IMAGE = "vllmstack-test/dashboard:latest"
pytestmark = pytest.mark.docker


def compose_v2_config() -> Path:
    """The DOCKER_CONFIG whose cli-plugins/ holds the Compose v2 plugin scripts/test-env.sh
    installed (a folder of the stack's own: a user's plugin is never replaced)."""
    configured = os.environ.get("VLLMSTACK_COMPOSE_V2_CONFIG")
    if configured:
        return Path(configured)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "vllmstack" / "docker-config"


def compose_v2_env() -> dict[str, str]:
    """How the docker CLI finds that plugin: through the session's own DOCKER_CONFIG
    (tests/conftest.py keeps client state out of HOME) with the plugin linked in, else the
    plugin's folder itself."""
    plugin = compose_v2_config() / "cli-plugins" / "docker-compose"
    private = os.environ.get("DOCKER_CONFIG")
    if not private or not plugin.is_file():
        return {"DOCKER_CONFIG": str(compose_v2_config())}
    link = Path(private) / "cli-plugins" / "docker-compose"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(plugin)
    return {}


@dataclass(frozen=True)
class Runtime:
    name: str  # the RUNTIME setting
    engine: str  # the container CLI that sees its containers and images
    bare: tuple[str, ...]  # how a user would run compose by hand
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def missing(self) -> str | None:
        """Why this runtime cannot run here, or None."""
        if self.engine == "podman":
            if shutil.which("podman") is None or shutil.which(self.bare[0]) is None:
                return "podman and podman-compose are needed"
            if self.run("podman", "image", "exists", SIM_IMAGE).returncode != 0:
                return f"the simulator image {SIM_IMAGE} is not in podman's storage"
            return None
        if not docker_ready(SIM_IMAGE):
            return f"the Docker engine and the simulator image {SIM_IMAGE} are needed"
        if self.run(*self.bare, "version").returncode != 0:
            return f"`{' '.join(self.bare)} version` fails"
        return None


RUNTIMES = {
    "compose": Runtime("compose", DOCKER, (DOCKER, "compose")),
    "compose-v1": Runtime("compose-v1", DOCKER, ("docker-compose",)),
    "podman": Runtime("podman", "podman", ("podman-compose",)),
}


class Stack:
    def __init__(self, root: Path, home: Path, name: str, port: int, runtime: Runtime) -> None:
        self.root, self.home, self.name, self.port, self.runtime = root, home, name, port, runtime

    def invoke(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.runtime.env, "HOME": str(self.home)}
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=self.root, env=env,
                              text=True, capture_output=True, timeout=timeout, check=False)

    def up(self, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self.invoke("up", "--platform", "cpu", "--model", "qwen3-0.6b",
                           "--set", f"VLLM_IMAGE={SIM_IMAGE}", "--no-dashboard", *extra,
                           timeout=timeout)

    def containers(self) -> list[str]:
        out = self.runtime.run(self.runtime.engine, "ps", "-aq", "--filter",
                               f"label=com.docker.compose.project={self.name}")
        return out.stdout.split()

    def inspect(self, template: str) -> list[str]:
        out = self.runtime.run(self.runtime.engine, "inspect", "--format", template,
                               *self.containers())
        return out.stdout.split()


@pytest.fixture(params=list(RUNTIMES), scope="module")
def runtime(request: pytest.FixtureRequest) -> Runtime:
    chosen = RUNTIMES[request.param]
    if chosen.name == "compose":
        chosen = replace(chosen, env=compose_v2_env())
    why = chosen.missing()
    need(why is None, f"{chosen.name}: {why}")
    return chosen


@pytest.fixture
def stack(tmp_path: Path, runtime: Runtime) -> Iterator[Stack]:
    # The dashboard image is built from the project itself.
    root = copy_project(tmp_path / "stack", with_package=True)
    name = f"vst{os.getpid()}{tmp_path.name[-6:].replace('_', '')}".lower()
    port = free_port()
    # A cache folder with a space and a '#': its path reaches compose through the rendered env
    # file, which each compose parses with its own dotenv rules.
    write_dotenv(root, {"COMPOSE_PROJECT": name, "VLLM_PORT": str(port), "OTHER_ENGINE_PORTS": "",
                        "RUNTIME": runtime.name,
                        # Quoted: in .env an unquoted " #" starts a comment.
                        "HOST_CACHE_DIR": f"'{tmp_path / 'cache dir #1'}'"})
    home = tmp_path / "home"
    home.mkdir()
    stack = Stack(root, home, name, port, runtime)
    yield stack
    stack.invoke("down", "--timeout", "5", timeout=120)
    ids = stack.containers()
    if ids:
        runtime.run(runtime.engine, "rm", "-f", *ids)


def last_lines(result: subprocess.CompletedProcess[str], n: int = 2) -> str:
    return "\n".join((result.stdout + result.stderr).strip().splitlines()[-n:])


def test_healthy_boot_status_exec_idempotent_up_and_down(stack: Stack) -> None:
    result = stack.up("--set", "ENGINE_ENV=SIM_BOOT_SECONDS=2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "healthy after" in result.stdout and "warm-up answered" in result.stdout
    status = json.loads(stack.invoke("status", "--json").stdout)
    assert status["running"] is True and status["healthy"] is True
    assert status["model"] == "qwen3-0.6b" and status["runtime"] == "compose"
    assert status["kv_cache_usage"] is not None and status["restarts"] == 0
    # Each runtime names the container its own way; status reports the service either way.
    [member] = status["containers"]
    assert member["service"] == "vllm" and member["state"] == "running"
    separator = "-" if stack.runtime.name == "compose" else "_"
    assert member["name"] == f"{stack.name}{separator}vllm{separator}1"
    # The rendered files are there to read and reproduce the run by hand.
    assert (stack.root / "generated/compose.override.yaml").is_file()
    assert (stack.root / "generated/vllm-argv.txt").read_text().startswith("vllm serve")
    # What `up` recorded (and `status` shows) is what the container runs, word for word: the
    # override sets the kind's entrypoint, whatever the image declares (the simulator's own is
    # `python3 /sim/server.py`; its `vllm` on PATH is the shim a vLLM image would have).
    recorded = json.loads((stack.root / "generated/state.json").read_text())["argv"]
    out = stack.runtime.run(stack.runtime.engine, "inspect", "--format",
                            "{{json .Path}}\n{{json .Args}}", *stack.containers())
    path, args = (json.loads(line) for line in out.stdout.splitlines()[:2])
    assert [path, *args] == recorded, (path, args, recorded)
    assert recorded[:3] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]
    ran = stack.invoke("exec", "--", "python3", "-c", "print(6 * 7)")
    assert ran.returncode == 0 and ran.stdout.strip() == "42", ran.stdout + ran.stderr
    logs = stack.invoke("logs", "--no-follow", "--tail", "50")
    assert logs.returncode == 0 and "Application startup complete." in logs.stdout, logs.stderr
    # exec reports the command's own exit status (podman-compose 1.0.3 would say 0).
    assert stack.invoke("exec", "--", "sh", "-c", "exit 3").returncode == 3
    # The cache folder's path (space, '#') came through the env file exactly.
    write = "open('/cache/engine/probe', 'w').write('x')"
    assert stack.invoke("exec", "--", "python3", "-c", write).returncode == 0
    assert (stack.root.parent / "cache dir #1" / "vllmstack-engine" / "probe").is_file()
    # A second `up` with the same command is a no-op.
    again = stack.up("--set", "ENGINE_ENV=SIM_BOOT_SECONDS=2")
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
    down = stack.invoke("down")
    assert down.returncode == 0, down.stderr
    assert stack.containers() == []
    after = json.loads(stack.invoke("status", "--json").stdout)
    assert after["running"] is False and after["healthy"] is False


def test_crash_at_boot_is_diagnosed_from_the_log(stack: Stack) -> None:
    result = stack.up("--set", "ENGINE_ENV=SIM_FAULT=crash-at-boot SIM_BOOT_SECONDS=1")
    assert result.returncode == 1, result.stdout + result.stderr
    tail = last_lines(result)
    assert "out of memory for the KV cache" in tail and tail.splitlines()[-1].startswith("fix:")
    assert "No available memory for the cache blocks" in result.stderr
    # The container is kept (its log is the evidence) but not left crash-looping.
    assert stack.inspect("{{.State.Status}}") == ["exited"]


def test_crash_loop_is_detected(stack: Stack) -> None:
    fault = "Permission denied: '/dev/kfd'"
    result = stack.up("--set", f"ENGINE_ENV=SIM_FAULT=crash-loop SIM_BOOT_SECONDS=0.5 "
                               f'"SIM_FAULT_LOG={fault}"')
    assert result.returncode == 1, result.stdout + result.stderr
    tail = last_lines(result)
    assert "crash-looping" in tail or "exited with code" in tail
    assert "RENDER_GID" in tail


def test_hang_ends_at_the_timeout_with_the_log_tail(stack: Stack) -> None:
    result = stack.up("--set", "ENGINE_ENV=SIM_FAULT=hang", "--timeout", "6")
    assert result.returncode == 1
    assert "did not become healthy within 6 s" in result.stderr
    assert "--- last log lines ---" in result.stderr and "Loading model" in result.stderr


def test_other_engine_guard_refuses(stack: Stack) -> None:
    other = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", other))
        listener.listen()
        result = stack.up("--set", f"OTHER_ENGINE_PORTS={other}")
    assert result.returncode == 1
    assert f"port {other}" in result.stderr and "another engine" in result.stderr
    assert stack.containers() == []


def test_bare_compose_up_fails_with_the_invoke_hint(stack: Stack) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "USER_"))}
    result = subprocess.run([*stack.runtime.bare, "-p", stack.name, "up", "-d"], cwd=stack.root,
                            env={**env, **stack.runtime.env}, text=True, capture_output=True,
                            timeout=60, check=False)
    assert result.returncode != 0
    # Compose v2 names the first unset variable it meets, and it meets the services in Go's map
    # order, which varies from run to run: the engine's says `invoke up`, the dashboard's
    # `invoke dashboard-up` (CI saw the latter once). Either tells the user what to run.
    assert "invoke up" in result.stderr or "invoke dashboard-up" in result.stderr, result.stderr
    assert stack.containers() == []


def test_up_with_the_dashboard_then_down_removes_both(stack: Stack) -> None:
    need(stack.runtime.run(stack.runtime.engine, "image", "inspect", BASE_IMAGE).returncode == 0,
         f"the base image {BASE_IMAGE} is needed in {stack.runtime.engine}'s storage")
    dash_port = free_port()
    profile = ("--platform", "cpu", "--model", "qwen3-0.6b", "--set", f"VLLM_IMAGE={SIM_IMAGE}",
               "--set", f"DOCKER={DOCKER}", "--set", f"DASHBOARD_IMAGE={DASHBOARD_IMAGE}",
               "--set", f"DASHBOARD_BASE_IMAGE={BASE_IMAGE}", "--set", f"DASHBOARD_PORT={dash_port}")
    result = stack.invoke("up", *profile, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"dashboard at http://localhost:{dash_port}" in result.stdout
    metrics: dict[str, object] = {}
    for _ in range(60):
        try:
            metrics = requests.get(f"http://127.0.0.1:{dash_port}/api/metrics", timeout=2).json()
        except (requests.RequestException, ValueError):
            metrics = {}
        if metrics.get("engine_up"):
            break
        time.sleep(1)
    # The side-car reaches the engine by its service name on the project's network.
    assert metrics.get("engine_up") is True, metrics
    services = sorted(m["service"] for m in json.loads(stack.invoke("status", "--json").stdout)
                      ["containers"])
    assert services == ["dashboard", "vllm"]
    # The side-car alone goes and comes back (a fresh container, not the stopped one).
    gone = stack.invoke("dashboard-down")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert [m["service"] for m in json.loads(stack.invoke("status", "--json").stdout)
            ["containers"]] == ["vllm"]
    back = stack.invoke("dashboard-up", *profile, timeout=300)
    assert back.returncode == 0, back.stdout + back.stderr
    assert len(stack.containers()) == 2
    assert stack.invoke("down").returncode == 0
    assert stack.containers() == []


def test_default_rocm_profile_on_a_host_without_gpu_fails_at_once(tmp_path: Path) -> None:
    need(not Path("/dev/kfd").exists(), "this host has an AMD GPU")
    root = copy_project(tmp_path / "stack")
    write_dotenv(root, {"COMPOSE_PROJECT": f"vst{os.getpid()}rocm", "OTHER_ENGINE_PORTS": ""})
    result = subprocess.run([sys.executable, "-m", "invoke", "up"], cwd=root, text=True,
                            capture_output=True, timeout=60, check=False,
                            env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "no /dev/kfd, /dev/dri found" in result.stderr and "--platform cpu" in result.stderr

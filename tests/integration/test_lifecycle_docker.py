"""`invoke up/status/down` for real, on the local Docker engine, against the engine simulator image."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from conftest import need
from helpers import copy_project, docker_ready, free_port, write_dotenv

SIM_IMAGE = "vllmstack/engine-sim:latest"
pytestmark = pytest.mark.docker


def docker_ok() -> bool:
    return shutil.which("docker-compose") is not None and docker_ready(SIM_IMAGE)



class Stack:
    def __init__(self, root: Path, home: Path, name: str, port: int) -> None:
        self.root, self.home, self.name, self.port = root, home, name, port

    def invoke(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HOME": str(self.home)}
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=self.root, env=env,
                              text=True, capture_output=True, timeout=timeout, check=False)

    def up(self, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self.invoke("up", "--platform", "cpu", "--model", "qwen3-0.6b",
                           "--set", f"VLLM_IMAGE={SIM_IMAGE}", "--no-dashboard", *extra,
                           timeout=timeout)

    def containers(self) -> list[str]:
        out = subprocess.run(["docker", "ps", "-aq", "--filter",
                              f"label=com.docker.compose.project={self.name}"],
                             capture_output=True, text=True, check=False)
        return out.stdout.split()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    need(docker_ok(), "Docker engine, docker-compose and the simulator image are needed")
    # The dashboard image is built from the project itself.
    root = copy_project(tmp_path / "stack", with_package=True)
    name = f"vst{os.getpid()}{tmp_path.name[-6:].replace('_', '')}".lower()
    port = free_port()
    write_dotenv(root, {"COMPOSE_PROJECT": name, "VLLM_PORT": str(port), "OTHER_ENGINE_PORTS": "",
                        "RUNTIME": "compose-v1"})
    home = tmp_path / "home"
    home.mkdir()
    stack = Stack(root, home, name, port)
    yield stack
    stack.invoke("down", "--timeout", "5", timeout=120)
    ids = stack.containers()
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, check=False)


def last_lines(result: subprocess.CompletedProcess[str], n: int = 2) -> str:
    return "\n".join((result.stdout + result.stderr).strip().splitlines()[-n:])


def test_healthy_boot_status_and_down(stack: Stack) -> None:
    result = stack.up("--set", "ENGINE_ENV=SIM_BOOT_SECONDS=2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "healthy after" in result.stdout and "warm-up answered" in result.stdout
    status = json.loads(stack.invoke("status", "--json").stdout)
    assert status["running"] is True and status["healthy"] is True
    assert status["model"] == "qwen3-0.6b" and status["runtime"] == "compose"
    assert status["kv_cache_usage"] is not None
    assert [c["service"] for c in status["containers"]] == ["vllm"]
    # The rendered files are there to read and reproduce the run by hand.
    assert (stack.root / "generated/compose.override.yaml").is_file()
    assert (stack.root / "generated/vllm-argv.txt").read_text().startswith("vllm serve")
    ran = stack.invoke("exec", "--", "python3", "-c", "print(6 * 7)")
    assert ran.returncode == 0 and ran.stdout.strip() == "42", ran.stderr
    # A second `up` with the same command is a no-op.
    again = stack.up("--set", "ENGINE_ENV=SIM_BOOT_SECONDS=2")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    down = stack.invoke("down")
    assert down.returncode == 0, down.stderr
    assert stack.containers() == []
    after = json.loads(stack.invoke("status", "--json").stdout)
    assert after["running"] is False and after["healthy"] is False


def test_up_with_the_dashboard_then_down_removes_both(stack: Stack) -> None:
    dash_port = free_port()
    result = stack.invoke(
        "up", "--platform", "cpu", "--model", "qwen3-0.6b", "--set", f"VLLM_IMAGE={SIM_IMAGE}",
        "--set", "DOCKER=/usr/bin/docker", "--set", "DASHBOARD_IMAGE=vllmstack-test/dashboard:latest",
        "--set", "DASHBOARD_BASE_IMAGE=vllmstack/base:bookworm", "--set", f"DASHBOARD_PORT={dash_port}",
        timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"dashboard at http://localhost:{dash_port}" in result.stdout
    metrics = {}
    for _ in range(60):
        try:
            metrics = requests.get(f"http://127.0.0.1:{dash_port}/api/metrics", timeout=2).json()
        except (requests.RequestException, ValueError):
            metrics = {}
        if metrics.get("engine_up"):
            break
        time.sleep(1)
    assert metrics.get("engine_up") is True, metrics
    assert len(stack.containers()) == 2
    assert stack.invoke("down").returncode == 0
    assert stack.containers() == []


def test_crash_at_boot_is_diagnosed_from_the_log(stack: Stack) -> None:
    result = stack.up("--set", "ENGINE_ENV=SIM_FAULT=crash-at-boot SIM_BOOT_SECONDS=1")
    assert result.returncode == 1
    tail = last_lines(result)
    assert "out of memory for the KV cache" in tail and tail.splitlines()[-1].startswith("fix:")
    assert "No available memory for the cache blocks" in result.stderr
    # The container is kept (its log is the evidence) but not left crash-looping.
    state = subprocess.run(["docker", "inspect", "--format", "{{.State.Status}}",
                            *stack.containers()], capture_output=True, text=True, check=False)
    assert state.stdout.split() == ["exited"]


def test_crash_loop_is_detected(stack: Stack) -> None:
    fault = "Permission denied: '/dev/kfd'"
    result = stack.up("--set", f"ENGINE_ENV=SIM_FAULT=crash-loop SIM_BOOT_SECONDS=0.5 "
                               f'"SIM_FAULT_LOG={fault}"')
    assert result.returncode == 1
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
    result = subprocess.run(["docker-compose", "-p", stack.name, "up", "-d"], cwd=stack.root,
                            env=env, text=True, capture_output=True, timeout=60, check=False)
    assert result.returncode != 0
    assert "invoke up" in result.stderr
    assert stack.containers() == []


def test_default_rocm_profile_on_a_host_without_gpu_fails_at_once(stack: Stack) -> None:
    need(not Path("/dev/kfd").exists(), "this host has an AMD GPU")
    result = stack.invoke("up", timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "no /dev/kfd, /dev/dri found" in result.stderr and "--platform cpu" in result.stderr
    assert stack.containers() == []

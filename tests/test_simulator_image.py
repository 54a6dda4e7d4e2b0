"""The simulator image is a drop-in engine container: real argv, published port, prompt stop."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from conftest import need
from helpers import docker, docker_ready
from simulator.client import call
from simulator.fixture import free_port, health_status

SIM_IMAGE = "vllmstack/engine-sim:latest"
pytestmark = pytest.mark.docker
# What the stack's compose file passes after vLLM's `vllm serve` entrypoint.
SERVE_ARGS = ["/models/Qwen3-0.6B", "--served-model-name", "qwen3", "--port", "8000",
              "--max-model-len", "8k", "--max-num-seqs", "4", "--tensor-parallel-size", "2",
              "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}',
              "--enable-prefix-caching", "--gpu-memory-utilization", "0.9"]


@pytest.fixture
def container_name() -> Iterator[str]:
    need(docker_ready(SIM_IMAGE), f"Docker engine with {SIM_IMAGE} (scripts/test-env.sh builds it)")
    name = f"vllmstack-simtest-{uuid.uuid4().hex[:8]}"
    yield name
    docker("rm", "-f", name)


def wait_health(url: str, want: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_status(url) == want:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url}/health never answered {want}")


def test_container_serves_with_the_real_argv_and_stops_fast(container_name: str) -> None:
    port = free_port()
    started = docker("run", "-d", "--name", container_name, "-p", f"127.0.0.1:{port}:8000",
                     "-e", "SIM_BOOT_SECONDS=1", SIM_IMAGE, *SERVE_ARGS)
    assert started.returncode == 0, started.stderr
    url = f"http://127.0.0.1:{port}"
    wait_health(url, 200, 30)
    card = call(url, "/v1/models").json()["data"][0]
    assert (card["id"], card["root"], card["max_model_len"]) == (
        "qwen3", "/models/Qwen3-0.6B", 8000)
    metrics = call(url, "/metrics").body.decode()
    assert "vllm:spec_decode_num_drafts_total" in metrics
    stop_started = time.monotonic()
    assert docker("stop", "-t", "10", container_name).returncode == 0
    assert time.monotonic() - stop_started < 2.0  # SIGTERM handled, no 10 s kill timeout
    assert docker("inspect", "-f", "{{.State.ExitCode}}", container_name).stdout.strip() == "0"
    logs = docker("logs", container_name)
    assert "Starting vLLM server on http://0.0.0.0:8000" in logs.stdout + logs.stderr


def test_container_crash_at_boot_exits_1_with_the_root_cause(container_name: str) -> None:
    done = docker("run", "--name", container_name, "-e", "SIM_FAULT=crash-at-boot",
                  "-e", "SIM_BOOT_SECONDS=0", SIM_IMAGE, *SERVE_ARGS, timeout=60)
    assert done.returncode == 1
    assert "No available memory for the cache blocks" in done.stdout
    assert "Failed core proc(s): {}" in done.stdout + done.stderr


def test_vllm_entrypoint_works_too(container_name: str) -> None:
    done = docker("run", "--name", container_name, "--entrypoint", "vllm", SIM_IMAGE,
                  "serve", "m", "--max-model-len", "lots", timeout=60)
    assert done.returncode == 2
    assert "invalid human_readable_int_or_auto value: 'lots'" in done.stderr

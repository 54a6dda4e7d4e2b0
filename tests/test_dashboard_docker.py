"""Dockerfile.dashboard builds, its container serves the dashboard and turns healthy."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import need
from helpers import docker, docker_ready, drop_replaced_image, image_id
from simulator.fixture import free_port, run_simulator

from vllmstack.runtime import dashboard_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE = "vllmstack/base:bookworm"
IMAGE = "vllmstack-test/dashboard:latest"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    need(docker_ready(BASE_IMAGE), f"Docker engine with {BASE_IMAGE} (scripts/test-env.sh builds it)")
    # The context `invoke up` assembles (with the host's CA bundle, for a TLS-intercepting proxy).
    context = dashboard_image.build_context(ROOT, tmp_path_factory.mktemp("dashboard") / "context")
    argv = dashboard_image.build_argv("docker", IMAGE, BASE_IMAGE, context)
    before = image_id(IMAGE)
    built = docker(*argv[1:], timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    drop_replaced_image(before, IMAGE)
    return IMAGE


@pytest.fixture
def name() -> Iterator[str]:
    container = f"vllmstack-dashtest-{uuid.uuid4().hex[:8]}"
    yield container
    docker("rm", "-f", container)


def health(container: str) -> str:
    out = docker("inspect", "--format", "{{json .State.Health}}", container)
    return str(json.loads(out.stdout or "null").get("Status")) if out.returncode == 0 else ""


def test_container_serves_live_metrics_and_turns_healthy(image: str, name: str) -> None:
    port = free_port()
    with run_simulator(argv=["--served-model-name", "tiny"]) as sim:
        started = docker(
            "run", "-d", "--name", name, "--network", "host",
            "-e", f"DASHBOARD_CONTAINER_PORT={port}", image,
            "python", "-m", "vllmstack.dashboard", "--host", "127.0.0.1", "--port", str(port),
            "--engine-url", sim.url, "--history-dir", "/app/benchmarks")
        assert started.returncode == 0, started.stderr
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        metrics = None
        while time.monotonic() < deadline:
            try:
                metrics = httpx.get(f"{url}/api/metrics", timeout=2).json()
                if metrics["engine_up"]:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        assert metrics is not None and metrics["engine_up"] is True, docker("logs", name).stderr
        assert metrics["model"] == "tiny"
        page = httpx.get(url + "/", timeout=5)
        assert page.status_code == 200 and "vendor/chart.umd.min.js" in page.text
        # The image's HEALTHCHECK (Python urllib, no curl) reports healthy: interval 15 s.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and health(name) != "healthy":
            time.sleep(1)
        assert health(name) == "healthy"


def test_container_refuses_exposure_without_token(image: str, name: str) -> None:
    run = docker("run", "--name", name, image, "python", "-m", "vllmstack.dashboard",
                 "--host", "0.0.0.0", "--port", "3000", "--engine-url", "http://vllm:8000",
                 "--history-dir", "/app/benchmarks", timeout=60)
    assert run.returncode == 2
    assert "DASHBOARD_TOKEN" in run.stderr and "Traceback" not in run.stderr

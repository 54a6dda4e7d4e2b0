"""The router's stop and the lifecycle around it for real (issue 35, rows 18, 19, 25):
`python -m vllmstack.router` over the engine simulator on the native runtime (each load a real
`up`, each unload a real `down`), real signals, and `invoke down` / `invoke status` run as a
user runs them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import free_port, simulator_project, wait_for
from test_router import Router, engine_processes

from vllmstack.core.paths import Project
from vllmstack.serve.engines import named_report

TOKEN = "a-router-token-of-more-than-32-bytes-0123456789"
# An engine that ignores SIGTERM while it "boots" and never listens: the router's stop has to
# SIGKILL it after its grace (NATIVE_STOP_GRACE). Its log holds a warning the diagnosis would
# blame, as vLLM's did on the H200.
STUBBORN = """import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("INFO Loading model", flush=True)
print("WARNING flashinfer is not installed", flush=True)
time.sleep(600)
"""
PROFILES = {"sim-a": "SIM_BOOT_SECONDS=0.3", "sim-hang": "SIM_FAULT=hang",
            "sim-stubborn": ""}


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text(STUBBORN)
    made = simulator_project(tmp_path / "stack", PROFILES, port=free_port(),
                             settings={"NATIVE_STOP_GRACE": "1"},
                             commands={"sim-stubborn": f"{sys.executable} {stubborn}"})
    dotenv = made / ".env"
    dotenv.write_text("".join(line for line in dotenv.read_text().splitlines(keepends=True)
                              if not line.startswith("VLLM_PORT=")))
    for name in PROFILES:
        with (made / "env" / "models" / f"{name}.env").open("a") as handle:
            handle.write(f"VLLM_PORT={free_port()}\n" + ("UP_TIMEOUT=10\n" if name == "sim-hang"
                                                         else ""))
    yield made
    for pid in engine_processes(made):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start(root: Path) -> Iterator[Callable[..., Router]]:
    routers: list[Router] = []

    def run(**kwargs: Any) -> Router:
        router = Router(root, 0, "--profiles", ",".join(PROFILES), **kwargs)
        routers.append(router)
        return router.wait_ready()

    yield run
    for router in routers:
        router.stop(signal.SIGKILL)


def invoke(root: Path, *args: str, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root, text=True,
                          env={**os.environ, **(env or {})}, capture_output=True, timeout=300,
                          check=False)


@pytest.mark.slow
def test_invoke_down_while_a_router_serves_stops_its_engines_through_it_or_names_it(
        root: Path, start: Callable[..., Router]) -> None:
    router = start(env={"ROUTER_TOKEN": TOKEN})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert router.chat("sim-a", headers=auth).status_code == 200
    assert len(engine_processes(root)) == 1
    # Without the router's token: named, nothing stopped, no "report how it escaped".
    refused = invoke(root, "down", env={"ROUTER_TOKEN": ""})
    assert refused.returncode == 1, refused.stdout + refused.stderr
    text = refused.stdout + refused.stderr
    assert f"the router (pid {router.proc.pid}, {router.url}) serves this checkout" in text
    assert "escaped" not in text and f"kill {router.proc.pid}" in text
    assert len(engine_processes(root)) == 1
    # With it: the router stops its engine itself and says so; `down` ends with exit 0.
    done = invoke(root, "down", env={"ROUTER_TOKEN": TOKEN})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "its engines were stopped through it (POST /v1/unload)" in done.stdout
    assert engine_processes(root) == []
    health = requests.get(router.url + "/v1/health", headers=auth, timeout=5).json()
    assert health["models"]["sim-a"]["state"] == "unloaded"


@pytest.mark.slow
def test_a_load_that_timed_out_leaves_no_stale_engine_in_status(
        root: Path, start: Callable[..., Router]) -> None:
    router = start()
    failed = router.chat("sim-hang")  # never listens: `up` gives up after its UP_TIMEOUT (10 s)
    assert failed.status_code == 503, failed.text
    assert "did not become healthy within 10 s" in failed.text
    assert engine_processes(root) == []
    engines = {e["name"]: e for e in named_report(Project(root))}
    assert "sim-hang" not in engines, engines  # was: "not answering", from a stale state.json
    assert not (root / "generated" / "engines" / "sim-hang" / "state.json").exists()


@pytest.mark.slow
def test_an_engine_the_router_kills_as_it_stops_is_reported_as_stopped_not_diagnosed(
        root: Path, start: Callable[..., Router]) -> None:
    router = start()
    pending = subprocess.Popen([sys.executable, "-c", (
        "import requests, sys; r = requests.post(sys.argv[1] + '/v1/chat/completions', "
        "json={'model': 'sim-stubborn', 'messages': [{'role': 'user', 'content': 'x'}]}, "
        "timeout=120); print(r.status_code, r.text)"), router.url],
        stdout=subprocess.PIPE, text=True)
    wait_for(lambda: bool(engine_processes(root)), timeout=30, what="the stubborn engine runs")
    wait_for(lambda: "flashinfer is not installed" in router.output(), timeout=30,
             what="its boot logged the warning")
    began = time.monotonic()
    assert router.stop(signal.SIGTERM) == 0
    assert time.monotonic() - began < 30
    out, _ = pending.communicate(timeout=60)
    assert out.startswith("503") and "the router is stopping" in out, out
    log = router.output()
    assert "stopped by the router, which is stopping (stopped the native engine" in log, log
    assert "SIGKILL after the 1 s grace" in log
    assert "exited with code" not in log and "flashinfer" not in log.split("stopping (SIGTERM)")[1]
    assert engine_processes(root) == []

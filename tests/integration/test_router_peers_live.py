"""Peers under one URL for real (issue 40, item 1): two `python -m vllmstack.router` processes,
two checkouts on two free ports, each with the engine simulator as its engine (native runtime).
Router A has router B as its peer (ROUTER_PEERS, B's token in A's token folder): a request
through A for B's model is loaded by B's own router and answers, and streams; B killed is down
in A's /v1/models within 5 s and its requests get a 503 naming it; B started again is back
without restarting A."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import ROOT, free_port, simulator_project

from vllmstack.core.checkout import checkout_id

TOKEN_A = "router-a-token-0123456789abcdefghijklmnop"
TOKEN_B = "router-b-token-0123456789abcdefghijklmnop"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def engine_pids(root: Path) -> list[int]:
    """Live processes carrying the checkout's engine marker (what a killed router left)."""
    prefixes = tuple(f"VLLMSTACK_ENGINE_ID={checkout_id(root)}{sep}".encode() for sep in "-@")
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if any(e.startswith(prefixes) for e in (entry / "environ").read_bytes().split(b"\0")):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class Router:
    def __init__(self, root: Path, port: int, profile: str, token: str,
                 env: dict[str, str]) -> None:
        self.root, self.port, self.token = root, port, token
        self.url = f"http://127.0.0.1:{port}"
        self.auth = {"Authorization": f"Bearer {token}"}
        self.log = root / f"router-{port}-{time.monotonic_ns()}.out"
        environ = {**os.environ, "PYTHONPATH": str(ROOT), "ROUTER_TOKEN": token, **env}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllmstack.router", "--project", str(root),
                 "--port", str(port), "--profiles", profile],
                cwd=root, env=environ, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> Router:
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if requests.get(self.url + "/health", headers=self.auth, timeout=2).ok:
                    return self
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def models(self) -> dict[str, dict[str, Any]]:
        answer = requests.get(self.url + "/v1/models", headers=self.auth, timeout=5)
        assert answer.status_code == 200, answer.text
        return {m["id"]: m for m in answer.json()["data"]}

    def chat(self, model: str, **extra: Any) -> requests.Response:
        return requests.post(self.url + "/v1/chat/completions", json={"model": model, **CHAT,
                             **extra.pop("body", {})}, headers=self.auth, timeout=60, **extra)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=120)


@pytest.fixture
def boxes(tmp_path: Path) -> Iterator[dict[str, Any]]:
    roots = {
        "a": simulator_project(tmp_path / "a", {"sim-a": "SIM_BOOT_SECONDS=0.3"}, port=free_port()),
        "b": simulator_project(tmp_path / "b", {"sim-b": "SIM_BOOT_SECONDS=0.3 SIM_ITL_MS=20"},
                               port=free_port()),
    }
    tokens = tmp_path / "peer-tokens"
    tokens.mkdir()
    (tokens / "b.token").write_text(TOKEN_B + "\n")
    (tokens / "b.token").chmod(0o600)
    started: list[Router] = []
    yield {"roots": roots, "tokens": tokens, "started": started}
    for router in started:
        router.stop()
    for root in roots.values():
        for pid in engine_pids(root):
            os.kill(pid, signal.SIGKILL)


def until_cut(lines: Iterator[bytes]) -> list[bytes]:
    """The SSE data lines left, up to the close that cuts the body short (never framed as a
    complete answer: requests says the response ended prematurely)."""
    data: list[bytes] = []
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        for line in lines:
            if line.startswith(b"data: "):
                data.append(line)
    return data


def wait_for(seconds: float, router: Router, model: str, up: bool) -> float:
    began = time.monotonic()
    while router.models()[model]["peer_up"] is not up:
        assert time.monotonic() - began < seconds, router.log.read_text()
        time.sleep(0.05)
    return time.monotonic() - began


@pytest.mark.slow  # two routers, a boot through the peer, a kill and a restart: about 8 s
def test_a_peer_router_serves_through_a_goes_down_and_comes_back(boxes: dict[str, Any]) -> None:
    roots, started = boxes["roots"], boxes["started"]
    port_b = free_port()

    def start_b() -> Router:
        router = Router(roots["b"], port_b, "sim-b", TOKEN_B, {})
        started.append(router)
        return router.wait_ready()

    b = start_b()
    a = Router(roots["a"], free_port(), "sim-a", TOKEN_A,
               {"ROUTER_PEERS": f"b=http://127.0.0.1:{port_b}",
                "ROUTER_PEER_TOKEN_DIR": str(boxes["tokens"])})
    started.append(a)
    a.wait_ready()
    listed = a.models()
    assert list(listed) == ["sim-a", "sim-b"]
    assert (listed["sim-b"]["peer"], listed["sim-b"]["peer_up"], listed["sim-b"]["state"]) == \
        ("b", True, "unloaded")
    assert "peer b: http://127.0.0.1" in a.log.read_text()
    # Through A, B's router loads sim-b by its own plan and answers.
    answer = a.chat("sim-b")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "sim-b" and answer.json()["choices"][0]["message"]
    assert "sim-b" in b.log.read_text() and engine_pids(roots["a"]) == []
    # And streams: the simulator's SSE events arrive through both routers.
    with a.chat("sim-b", body={"stream": True}, stream=True) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [line for line in streamed.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) > 2
    assert json.loads(events[0][6:])["model"] == "sim-b"
    # B refuses anyone without its token: only A's link holds it.
    assert requests.get(b.url + "/v1/models", timeout=5).status_code == 401
    # B's router is killed mid-stream: the stream through A ends with an error event naming B.
    with a.chat("sim-b", body={"stream": True, "max_tokens": 2000}, stream=True) as long:
        lines = long.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))
        b.stop(signal.SIGKILL)
        rest = until_cut(lines)
    assert b"[DONE]" not in rest[-1]
    assert "peer b's answer broke off" in json.loads(rest[-1][6:])["error"]["message"]
    # A says B is down within 5 s, and names it in a 503.
    assert wait_for(5, a, "sim-b", False) < 5
    assert a.models()["sim-b"]["state"] == "unreachable"
    refused = a.chat("sim-b")
    assert refused.status_code == 503 and refused.json()["error"]["peer"] == ["b"], refused.text
    assert "sim-b lives on b" in refused.json()["error"]["message"]
    assert a.chat("sim-a").status_code == 200  # A's own model is A's
    # B starts again (it adopts its running engine): A takes it back, not restarted.
    start_b()
    wait_for(5, a, "sim-b", True)
    again = a.chat("sim-b")
    assert again.status_code == 200 and again.json()["model"] == "sim-b", again.text
    assert a.proc.poll() is None


@pytest.mark.slow  # two routers, a boot through the peer: about 4 s
def test_a_stopping_router_ends_a_peer_stream_with_an_error_event(boxes: dict[str, Any]) -> None:
    roots, started = boxes["roots"], boxes["started"]
    port_b = free_port()
    b = Router(roots["b"], port_b, "sim-b", TOKEN_B, {})
    started.append(b)
    b.wait_ready()
    a = Router(roots["a"], free_port(), "sim-a", TOKEN_A,
               {"ROUTER_PEERS": f"b=http://127.0.0.1:{port_b}",
                "ROUTER_PEER_TOKEN_DIR": str(boxes["tokens"])})
    started.append(a)
    a.wait_ready()
    with a.chat("sim-b", body={"stream": True, "max_tokens": 2000}, stream=True) as long:
        lines = long.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))
        a.proc.send_signal(signal.SIGTERM)
        rest = until_cut(lines)
    error = json.loads(rest[-1][6:])["error"]
    assert error["message"] == "the router is stopping" and error["code"] == 503
    assert a.proc.wait(timeout=30) == 0
    # B goes on serving its own clients.
    assert b.chat("sim-b").status_code == 200


def test_a_bad_peer_entry_stops_the_start_naming_the_key_file_and_line(tmp_path: Path) -> None:
    root = simulator_project(tmp_path / "a", {"sim-a": "SIM_BOOT_SECONDS=0.3"}, port=free_port())
    with (root / ".env").open("a") as dotenv:
        dotenv.write("ROUTER_PEERS=box2\n")
    line = len((root / ".env").read_text().splitlines())
    done = subprocess.run(
        [sys.executable, "-m", "vllmstack.router", "--project", str(root), "--port",
         str(free_port()), "--profiles", "sim-a"], cwd=root, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"error: ROUTER_PEERS (set at .env:{line}): 'box2' is not name=URL" in done.stderr
    assert "fix:   give each peer as name=URL" in done.stderr

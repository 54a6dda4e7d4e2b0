"""Hostile pass over the dashboard (issue 28, item 2, and its history and run records).

* Auth and limits come before the body: a 200 MB unauthenticated POST gets its 401 while the
  dashboard's peak memory stays flat; an authorised one over the limit gets 413 from
  Content-Length, or once a chunked body passes the limit; a deeply nested JSON body is a 400.
* Reading needs the token wherever one is required, and a loopback Host otherwise (a
  DNS-rebinding page cannot read history, run logs with their argv, or the router's state).
* The history file holds anything (deep lines, NaN, numeric ids, a FIFO): listing, download and
  delete answer as they should, and delete keeps the other records byte for byte.
* A run left running by a SIGKILLed dashboard is found by the next one (pid, start time and its
  marker), blocks a second run and can be cancelled; a record naming anything else is ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from helpers import ROOT, free_port

from vllmstack.bench.report import history
from vllmstack.dashboard.app import DashboardSettings, create_app
from vllmstack.dashboard.runs import RUN_RECORD_FILE, RunBusyError, RunManager

TOKEN = "s3cret-token-for-tests"
LOCAL = "http://127.0.0.1:8083"
EXPOSED = "http://192.168.1.20:8083"
MB = 1024 * 1024


def settings_for(tmp: Path, **kw: Any) -> DashboardSettings:
    base: dict[str, Any] = dict(engine_url="http://127.0.0.1:9", history_dir=tmp / "hist",
                                router_url="http://127.0.0.1:9", cancel_grace=1.0)
    base.update(kw)
    return DashboardSettings(**base)


def sleeper(kind: str, options: Any) -> list[str]:
    return [sys.executable, "-c", "import time; print('run', flush=True); time.sleep(60)"]


@pytest.fixture
def exposed(tmp_path: Path) -> Iterator[TestClient]:
    """Reachable from other machines: the token is required for everything under /api/."""
    app = create_app(settings_for(tmp_path, host="0.0.0.0", token=TOKEN), build_command=sleeper,
                     poll=False)
    with TestClient(app, base_url=EXPOSED) as client:
        yield client


@pytest.fixture
def local(tmp_path: Path) -> Iterator[TestClient]:
    """Loopback, no token: only requests addressed to this machine."""
    app = create_app(settings_for(tmp_path), build_command=sleeper, poll=False)
    with TestClient(app, base_url=LOCAL) as client:
        yield client


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"X-Dashboard-Token": token}


def add(folder: Path, kind: str, lines: list[str]) -> Path:
    path = history.history_path(folder, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        for line in lines:
            handle.write(line + "\n")
    return path


READ_ROUTES = ["/api/metrics", "/api/metrics/history", "/api/runs", "/api/runs/bench",
               "/api/history/bench", "/api/history/bench/r1", "/api/router"]


# --- reading needs the token where one is required; a loopback Host otherwise --------------------


@pytest.mark.parametrize("url", READ_ROUTES)
def test_reading_an_exposed_dashboard_needs_the_token(exposed: TestClient, tmp_path: Path,
                                                      url: str) -> None:
    add(tmp_path / "hist", "bench", ['{"id": "r1", "model": "m"}'])
    denied = exposed.get(url)
    assert denied.status_code == 401 and "DASHBOARD_TOKEN" in denied.json()["detail"]
    assert denied.headers["www-authenticate"].startswith("Bearer")
    assert exposed.get(url, headers=auth()).status_code == 200
    assert exposed.get(url, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize("headers", [
    {}, auth("wrong"), auth(TOKEN[:-1]), auth(TOKEN + "x"), auth(""),
    {"Authorization": "Bearer "}, {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN}, {"Cookie": f"token={TOKEN}"},
])
def test_only_the_exact_token_opens_the_exposed_dashboard(exposed: TestClient,
                                                          headers: dict[str, str]) -> None:
    assert exposed.get("/api/runs", headers=headers).status_code == 401
    assert exposed.get(f"/api/runs?token={TOKEN}", headers=headers).status_code == 401
    assert exposed.post("/api/runs/bench", headers=headers).status_code == 401


def test_the_open_routes_say_nothing_about_the_engine_without_the_token(
        exposed: TestClient) -> None:
    health = exposed.get("/api/health").json()
    assert health == {"ok": True, "engine_up": False}
    info = exposed.get("/api/info").json()
    assert info["authorized"] is False and info["auth_required"] is True
    assert not {"engine_url", "model", "active_run", "max_num_seqs"} & set(info)
    assert exposed.get("/api/info", headers=auth()).json()["engine_url"] == "http://127.0.0.1:9"
    page = exposed.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]


@pytest.mark.parametrize("url", READ_ROUTES)
@pytest.mark.parametrize("host", ["evil.example:8083", "127.0.0.1.evil.example", "10.0.0.5:8083"])
def test_a_dns_rebinding_name_cannot_read_a_loopback_dashboard(local: TestClient, tmp_path: Path,
                                                               url: str, host: str) -> None:
    add(tmp_path / "hist", "bench", ['{"id": "r1"}'])
    assert local.get(url, headers={"Host": host}).status_code == 403


@pytest.mark.parametrize("host", ["127.0.0.1:8083", "localhost:8083", "[::1]:8083", "127.0.0.2"])
def test_a_loopback_dashboard_answers_loopback_names(local: TestClient, host: str) -> None:
    assert local.get("/api/runs", headers={"Host": host}).status_code == 200


# --- auth and limits before the body ---------------------------------------------------------


def test_a_body_over_the_limit_is_refused_from_its_content_length(local: TestClient) -> None:
    r = local.post("/api/runs/bench", content=b" " * (64 * 1024 + 1),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "at most 65536" in r.json()["detail"]
    assert local.get("/api/runs").json()["active"] is None


def test_a_deeply_nested_json_body_is_a_400_not_a_500(local: TestClient) -> None:
    for depth in (17, 5000, 30_000):
        body = "[" * depth + "]" * depth
        r = local.post("/api/runs/bench", content=body.encode(),
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.json()["detail"], depth
    r = local.post("/api/runs/bench", content=b'{"pp": {"a": [[[1]]]}}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 422  # shallow but wrong: the usual validation error
    r = local.post("/api/runs/bench", content=b'{"pp": NaN}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 422


def test_an_unauthorised_write_is_refused_before_its_body_is_looked_at(exposed: TestClient) -> None:
    deep = ("[" * 5000 + "]" * 5000).encode()
    for body in (deep, b"x" * (70 * 1024), b"not json"):
        r = exposed.post("/api/runs/bench", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 401
    assert exposed.get("/api/runs", headers=auth()).json()["active"] is None


# --- a live dashboard: 200 MB unauthenticated, chunked over the limit ----------------------------


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A dashboard process on a free port, exposed (token required): (its pid, its port)."""
    port = free_port()
    env = {**os.environ, "DASHBOARD_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vllmstack.dashboard", "--host", "127.0.0.1",
                             "--port", str(port), "--engine-url", "http://127.0.0.1:9",
                             "--history-dir", str(tmp_path / "hist"), "--exposure", "192.168.1.20",
                             "--poll-interval", "5"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while status_of(port, "GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n") != 200:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        yield proc.pid, port
    finally:
        proc.kill()
        proc.wait()


def status_of(port: int, request: str, body: bytes = b"") -> int | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request.encode() + body)
            head = sock.recv(4096).decode(errors="replace")
    except OSError:
        return None
    return int(head.split()[1]) if head.startswith("HTTP/") else None


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def send_big(port: int, headers: str, size: int, chunked: bool = False) -> tuple[int, int]:
    """Stream a body of `size` bytes while reading the answer; (its status, bytes sent)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sent = 0

    def push() -> None:
        nonlocal sent
        chunk = b"[" * MB
        try:
            sock.sendall(headers.encode())
            while sent < size:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk)
                sent += len(chunk)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the dashboard answered and closed: the rest is never read

    sender = threading.Thread(target=push, daemon=True)
    sender.start()
    try:
        head = sock.recv(4096).decode(errors="replace")
    finally:
        sock.close()
        sender.join(timeout=30)
    return int(head.split()[1]), sent


@pytest.mark.slow  # a dashboard process and 200 MB pushed at it: about 5 s
def test_a_200_mb_unauthenticated_post_gets_401_and_memory_stays_flat(
        live: tuple[int, int]) -> None:
    pid, port = live
    before = memory(pid)
    head = (f"POST /api/runs/bench HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {200 * MB}\r\n\r\n")
    status, _ = send_big(port, head, 200 * MB)
    assert status == 401
    chunked = (f"POST /api/history/bench/clear HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert send_big(port, chunked, 200 * MB, chunked=True)[0] == 401
    # Authorised but too big: 413 from Content-Length, or as a chunked body passes the limit.
    token_head = head.replace("\r\n\r\n", f"\r\nX-Dashboard-Token: {TOKEN}\r\n\r\n")
    assert send_big(port, token_head, 200 * MB)[0] == 413
    token_chunked = chunked.replace("\r\n\r\n", f"\r\nX-Dashboard-Token: {TOKEN}\r\n\r\n")
    assert send_big(port, token_chunked, 50 * MB, chunked=True)[0] == 413
    after = memory(pid)
    grown = after["VmHWM"] - before["VmHWM"]
    print(f"dashboard peak RSS {before['VmHWM'] / MB:.0f} -> {after['VmHWM'] / MB:.0f} MB")
    assert grown < 50 * MB, (before, after)
    # It still serves.
    assert status_of(port, f"GET /api/runs HTTP/1.1\r\nHost: x\r\nX-Dashboard-Token: {TOKEN}"
                           "\r\n\r\n") == 200


@pytest.mark.parametrize("length", ["-1", "1e9", "12abc", "99999999999999999999999"])
def test_a_nonsense_content_length_is_refused(live: tuple[int, int], length: str) -> None:
    _, port = live
    status = status_of(port, f"POST /api/runs/bench HTTP/1.1\r\nHost: x\r\nX-Dashboard-Token: "
                             f"{TOKEN}\r\nContent-Length: {length}\r\n\r\n")
    assert status in (400, 413, None)  # the server's parser, or the gate; never a run started
    assert status_of(port, f"GET /api/runs HTTP/1.1\r\nHost: x\r\nX-Dashboard-Token: {TOKEN}"
                           "\r\n\r\n") == 200


# --- the history, whatever it holds ----------------------------------------------------------------


def test_history_with_deep_nan_numeric_and_garbage_lines(local: TestClient, tmp_path: Path) -> None:
    nan_line = '{"id": "keep-nan", "tokens_per_s": NaN, "model": "m"}'
    path = add(tmp_path / "hist", "bench", [
        "[" * 100_000, '{"a":' * 50_000, nan_line, '{"id": 7, "model": "numbered"}', "[1, 2]",
        '"text"', "\xff garbage", '{"id": "plain", "model": "m"}'])
    history.rotated_path(path).write_text("[" * 100_000 + "\n" + '{"id": "old"}\n')
    listed = local.get("/api/history/bench")
    assert listed.status_code == 200
    ids = [r["id"] for r in listed.json()["records"]]
    assert ids == ["old", "keep-nan", 7, "plain"]
    assert listed.json()["records"][1]["tokens_per_s"] is None  # NaN shows as missing
    assert local.get("/api/history/bench/7").status_code == 200
    assert local.get("/api/history/bench/keep-nan").json()["tokens_per_s"] is None
    # Delete finds what GET finds, and keeps the other records byte for byte (NaN included).
    assert local.delete("/api/history/bench/7").json() == {"deleted": "7"}
    assert nan_line.encode() in path.read_bytes()
    assert local.delete("/api/history/bench/plain").status_code == 200
    assert local.delete("/api/history/bench/plain").status_code == 404
    assert local.get("/api/history/bench/nothing").status_code == 404
    assert local.delete("/api/history/bench/old").status_code == 200
    assert [r["id"] for r in local.get("/api/history/bench").json()["records"]] == ["keep-nan"]


def test_a_history_file_that_is_a_fifo_or_a_folder_reads_as_empty(local: TestClient,
                                                                    tmp_path: Path) -> None:
    folder = tmp_path / "hist"
    folder.mkdir()
    os.mkfifo(history.history_path(folder, "bench"))
    history.history_path(folder, "depth").mkdir()
    started = time.monotonic()
    assert local.get("/api/history/bench").json()["records"] == []
    assert local.get("/api/history/depth").json()["records"] == []
    assert time.monotonic() - started < 5


# --- a run left by a killed dashboard --------------------------------------------------------------

FIRST_DASHBOARD = """
import sys, time
from pathlib import Path
from vllmstack.dashboard.runs import RunManager
runs = RunManager(lambda kind, options: [sys.executable, "-c", "import time; time.sleep(120)"],
                  record_path=Path(sys.argv[1]))
state = runs.start("depth", {})
print(state["pid"], flush=True)
time.sleep(120)
"""


@pytest.fixture
def orphan(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A dashboard (a RunManager in a process of its own) started a run, then was SIGKILLed:
    (the run record, the run's pid, still running)."""
    record = tmp_path / "state" / RUN_RECORD_FILE
    record.parent.mkdir()
    first = subprocess.Popen([sys.executable, "-c", FIRST_DASHBOARD, str(record)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    assert first.stdout is not None
    run_pid = int(first.stdout.readline())
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    assert record.is_file() and Path(f"/proc/{run_pid}").exists()
    try:
        yield record, run_pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run_pid, signal.SIGKILL)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_the_next_dashboard_finds_the_run_a_killed_one_left_and_can_stop_it(
        orphan: tuple[Path, int], tmp_path: Path) -> None:
    record, run_pid = orphan
    app = create_app(settings_for(tmp_path, state_dir=record.parent), build_command=sleeper,
                     poll=False)
    with TestClient(app, base_url=LOCAL) as client:
        runs = client.get("/api/runs").json()
        assert runs["active"] == "depth"
        state = runs["runs"]["depth"]
        assert state["running"] and state["pid"] == run_pid
        assert "earlier dashboard" in state["message"]
        busy = client.post("/api/runs/bench")
        assert busy.status_code == 409 and "depth run is in progress" in busy.json()["detail"]
        cancelled = client.post("/api/runs/depth/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert not running(run_pid) and not record.exists()
        started = client.post("/api/runs/bench")  # free again
        assert started.status_code == 202
        client.post("/api/runs/bench/cancel")


def test_an_adopted_run_that_ends_frees_the_dashboard(orphan: tuple[Path, int]) -> None:
    record, run_pid = orphan
    runs = RunManager(sleeper, record_path=record)
    assert runs.active == "depth"
    with pytest.raises(RunBusyError):
        runs.start("bench", {})
    os.killpg(run_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while runs.active is not None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert runs.state("depth")["status"] == "ended" and not record.exists()


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("content", [
    "deep", "list", "unmarked", "pid-1", "bool-pid", "unknown-kind", "nan"])
def test_a_run_record_that_proves_nothing_is_ignored_and_nothing_is_signalled(
        tmp_path: Path, bystander: subprocess.Popen[bytes], content: str) -> None:
    start = int(Path(f"/proc/{bystander.pid}/stat").read_text().rpartition(")")[2].split()[19])
    good = {"pid": bystander.pid, "start_ticks": start, "marker": "m" * 32, "kind": "bench"}
    text = {"deep": "[" * 100_000, "list": json.dumps([good]),
            "unmarked": json.dumps(good),  # the bystander's exact pid and start, not its marker
            "pid-1": json.dumps({**good, "pid": 1}), "bool-pid": json.dumps({**good, "pid": True}),
            "unknown-kind": json.dumps({**good, "kind": "rm -rf"}),
            "nan": json.dumps(good).replace(str(start), "NaN")}[content]
    record = tmp_path / RUN_RECORD_FILE
    record.write_text(text)
    runs = RunManager(sleeper, record_path=record, grace_s=0.5)
    assert runs.active is None and not record.exists()
    runs.shutdown()
    assert bystander.poll() is None

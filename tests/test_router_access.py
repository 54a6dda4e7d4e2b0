"""The one access rule the dashboard and the router share (core.access), and the router's state
as the dashboard reads it (router.router_state)."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers import copy_project, free_port, write_dotenv

from vllmstack.core import access
from vllmstack.core.paths import Project
from vllmstack.router import RouterError, router_state, run_router
from vllmstack.router.record import identity


@pytest.mark.parametrize(("host", "token", "required", "refused"), [
    ("127.0.0.1", "", False, False),
    ("localhost", "", False, False),
    ("::1", "", False, False),
    ("127.0.0.1", "t", True, False),  # a token set is a token required
    ("0.0.0.0", "t", True, False),
    ("0.0.0.0", "", True, True),  # beyond loopback without a token: refused at start
    ("192.168.1.5", "", True, True),
])
def test_when_a_token_is_required(host: str, token: str, required: bool, refused: bool) -> None:
    assert access.token_required(host, token) is required
    assert access.exposed_without_token(host, token) is refused


def test_a_token_in_use_must_be_sent() -> None:
    deny = access.write_denial
    assert deny({}, token="t", required=True) == access.NEEDS_TOKEN
    assert deny({"authorization": "Bearer x"}, token="t", required=True) == access.NEEDS_TOKEN
    assert deny({"authorization": "Bearer t"}, token="t", required=True) is None
    assert deny({"authorization": "bearer  t "}, token="t", required=True) is None
    assert deny({"x-dashboard-token": "t"}, token="t", required=True,
                token_header="x-dashboard-token") is None
    assert deny({"x-dashboard-token": "t"}, token="t", required=True) == access.NEEDS_TOKEN


def test_without_a_token_only_loopback_hosts_and_origins_may_change_state() -> None:
    deny = access.write_denial
    local = {"host": "127.0.0.1:8080"}
    assert deny(local, token="", required=False) is None
    assert deny({**local, "origin": "http://localhost:3000"}, token="", required=False) is None
    assert deny({**local, "origin": "https://evil.example"}, token="", required=False) == access.NOT_LOCAL
    assert deny({**local, "origin": "null"}, token="", required=False) == access.NOT_LOCAL
    assert deny({"host": "rebound.example:8080"}, token="", required=False) == access.NOT_LOCAL


def test_the_router_refuses_to_listen_beyond_loopback_without_a_token(tmp_path: Path) -> None:
    root = copy_project(tmp_path / "stack")
    write_dotenv(root, {"PLATFORM": "cpu"})
    with pytest.raises(RouterError) as caught:
        run_router(Project(root), {}, host="0.0.0.0", port=free_port(), profiles=["qwen3-0.6b"])
    assert "reachable from other machines, without a token" in caught.value.cause
    assert "ROUTER_TOKEN" in (caught.value.fix or "")
    write_dotenv(root, {"PLATFORM": "cpu", "ROUTER_TOKEN": "from-dotenv-" + "x" * 32})
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RouterError) as caught:  # the token from .env passes: the port does not
            run_router(Project(root), {}, host="0.0.0.0", port=port, profiles=["qwen3-0.6b"],
                       out=io.StringIO())
    assert caught.value.cause.startswith(f"cannot listen on 0.0.0.0:{port}: the port is taken")
    assert caught.value.fix == "choose another --port"


@pytest.fixture
def health_server() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            body = json.dumps({"status": "ok", "loaded": "a", "state": "ready", "queue": 2}).encode()
            self.send_response(200 if self.path == "/v1/health" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_router_state_for_the_dashboard(tmp_path: Path, health_server: str) -> None:
    project = Project(tmp_path)
    assert router_state(project) is None  # no router here
    (tmp_path / "generated").mkdir()
    record = {**identity(), "url": health_server, "loaded": "a", "state": "loading",
              "swaps": [{"unloaded": None, "loaded": "a", "stop_s": 0.0, "start_s": 1.5}]}
    (tmp_path / "generated" / "router.json").write_text(json.dumps(record))
    state = router_state(project)
    assert state is not None and state["live"] is True
    assert (state["state"], state["queue"], state["swaps"]) == ("ready", 2, record["swaps"])
    (tmp_path / "generated" / "router.json").write_text(json.dumps({**record, "url": "http://127.0.0.1:1"}))
    stale = router_state(project)
    assert stale is not None and stale["live"] is False and stale["state"] == "loading"
    (tmp_path / "generated" / "router.json").write_text(json.dumps({**record, "pid": 2 ** 22 + 1}))
    assert router_state(project) is None  # its router is gone
    # The pid was reused by another program (a live process, started at another time): not
    # believed. A record without the start time (a hand-made one) is not believed either.
    other = subprocess.Popen(["sleep", "30"])
    try:
        reused = {**record, "pid": other.pid}
        (tmp_path / "generated" / "router.json").write_text(json.dumps(reused))
        assert router_state(project) is None
        (tmp_path / "generated" / "router.json").write_text(json.dumps(
            {k: v for k, v in record.items() if k != "pid_start"}))
        assert router_state(project) is None
    finally:
        other.kill()
        other.wait()


def test_the_routers_limits_are_settings_checked_where_they_were_set(tmp_path: Path) -> None:
    from vllmstack.config.profiles import resolve
    from vllmstack.router.limits import Limits, LimitsError, read_limits

    root = copy_project(tmp_path / "stack")
    write_dotenv(root, {"PLATFORM": "cpu"})
    assert read_limits(resolve(Project(root), model="qwen3-0.6b", environ={})) == Limits()
    write_dotenv(root, {"PLATFORM": "cpu", "ROUTER_MAX_BODY_BYTES": "1048576",
                        "ROUTER_HEADER_TIMEOUT": "nan"})
    with pytest.raises(LimitsError) as caught:
        read_limits(resolve(Project(root), model="qwen3-0.6b", environ={}))
    assert caught.value.cause.startswith("ROUTER_HEADER_TIMEOUT expects a finite number")
    assert "(set at .env:" in caught.value.cause and "ROUTER_HEADER_TIMEOUT" in (caught.value.fix or "")
    write_dotenv(root, {"PLATFORM": "cpu", "ROUTER_MAX_BODY_BYTES": "1048576"})
    limits = read_limits(resolve(Project(root), model="qwen3-0.6b", environ={}))
    assert limits.max_body == 1048576 and limits.header_timeout == 60.0


def test_the_token_comes_from_a_file_the_environment_or_dotenv_never_argv(tmp_path: Path) -> None:
    from vllmstack.router.options import choose_token

    token_file = tmp_path / "token"
    token_file.write_text("  from-file-" + "x" * 32 + "\n")
    env = {"ROUTER_TOKEN": "from-env-" + "x" * 32}
    assert choose_token(None, token_file, env, "from-dotenv-" + "x" * 32) == "from-file-" + "x" * 32
    assert choose_token(None, None, env, "from-dotenv-" + "x" * 32) == "from-env-" + "x" * 32
    assert choose_token(None, None, {}, "from-dotenv-" + "x" * 32) == "from-dotenv-" + "x" * 32
    assert choose_token(None, None, {}, "") == ""
    for bad, cause in ((tmp_path / "missing", "No such file"), (tmp_path, "Is a directory")):
        with pytest.raises(RouterError, match=cause):
            choose_token(None, bad, env, "")
    token_file.write_text("two words\n")
    with pytest.raises(RouterError, match="characters a client cannot send"):
        choose_token(None, token_file, env, "")
    token_file.write_text("\n")
    with pytest.raises(RouterError, match="is empty"):
        choose_token(None, token_file, env, "")


def test_the_open_file_limit_is_raised_to_fit_the_connection_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 22: 1,100 idle connections exhausted a default `ulimit -n` of 1024.
    import resource

    from vllmstack.router import service
    from vllmstack.router.limits import Limits

    limits: dict[str, tuple[int, int]] = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])

    def setrlimit(which: int, value: tuple[int, int]) -> None:
        if value[0] > value[1]:
            raise ValueError("not allowed to raise maximum limit")
        limits["now"] = value

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    said: list[str] = []
    fitted = service.fit_open_files(Limits(max_connections=2000), said.append)
    assert fitted.max_connections == 2000 and limits["now"] == (2256, 4096) and said == []
    limits["now"] = (1024, 1024)  # a hard limit the router cannot pass: a smaller cap, said
    fitted = service.fit_open_files(Limits(max_connections=2000), said.append)
    assert fitted.max_connections == 1024 - service.FD_RESERVE
    assert "serving at most 768 client connections instead of 2000" in said[0]

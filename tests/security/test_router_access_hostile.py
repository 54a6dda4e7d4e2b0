"""Who may talk to the router (issue 35, rows 1-4), tried as a stranger would: reads without the
token, a rebound host name, short and guessed tokens, a token that is not ASCII. Each runs the
router's real aiohttp front (tests/router_harness.py) and talks to it over raw sockets."""

from __future__ import annotations

import io
import json
import socket
import time
from pathlib import Path

import pytest
import requests
from helpers import copy_project, write_dotenv
from router_harness import connect, exchange, get, read_response, running_router, status

from vllmstack.core.paths import Project
from vllmstack.router import RouterError, router_state, run_router
from vllmstack.router.limits import FailureThrottle, Limits
from vllmstack.router.record import identity

LIMITS = Limits(max_connections=64, keepalive_timeout=10.0)
TOKEN = "a-router-token-of-more-than-32-bytes-0123456789"
AUTH = f"authorization: Bearer {TOKEN}\r\n".encode()


@pytest.mark.parametrize("path", ["/v1/health", "/health", "/v1/models"])
def test_with_a_token_set_reads_need_it_too(path: str) -> None:
    with running_router(LIMITS, token=TOKEN) as router:
        refused = exchange(router.port, get(path))
        assert status(refused) == 401 and b"ROUTER_TOKEN" in refused
        assert b"engines" not in refused and b'"m"' not in refused  # no engine state leaks
        assert status(exchange(router.port, get(path, AUTH))) == 200


def test_the_dashboards_reader_sends_the_token_it_knows(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # router_state (the dashboard's view of router.json) asks the router's /v1/health: with
    # the token from the environment or the checkout's .env, as the router itself finds it.
    with running_router(LIMITS, token=TOKEN) as router:
        (tmp_path / "generated").mkdir()
        (tmp_path / "generated" / "router.json").write_text(json.dumps(
            {**identity(), "url": router.url, "loaded": None}))
        monkeypatch.delenv("ROUTER_TOKEN", raising=False)
        state = router_state(Project(tmp_path))
        assert state is not None and state["live"] is False  # no token known: refused
        (tmp_path / ".env").write_text(f"ROUTER_TOKEN={TOKEN}\n")
        state = router_state(Project(tmp_path))
        assert state is not None and state["live"] is True and "engines" in state
        (tmp_path / ".env").unlink()
        monkeypatch.setenv("ROUTER_TOKEN", TOKEN)
        state = router_state(Project(tmp_path))
        assert state is not None and state["live"] is True


@pytest.mark.parametrize("request_bytes", [
    get("/v1/health", host=b"evil.example"), get("/v1/models", host=b"evil.example:8080"),
    get("/health", host=b"rebound.example"),
    get("/v1/health", b"origin: http://evil.example\r\n"),
], ids=["health", "models", "plain health", "page of another origin"])
def test_a_loopback_router_without_a_token_answers_only_loopback_hosts(
        request_bytes: bytes) -> None:
    # DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 reads the
    # router from the user's own browser, unless the Host is checked on reads too.
    with running_router(LIMITS) as router:
        data = exchange(router.port, request_bytes)
        assert status(data) == 403 and b"engines" not in data, data[:300]
        assert status(exchange(router.port, get("/v1/health"))) == 200
        assert status(exchange(router.port, get("/v1/health", host=b"localhost:1"))) == 200


@pytest.mark.parametrize("where", ["environment", "dotenv", "file"])
def test_a_short_token_is_refused_at_start(tmp_path: Path, where: str) -> None:
    root = copy_project(tmp_path / "stack")
    settings = {"PLATFORM": "cpu"}
    environ: dict[str, str] = {}
    token_file = None
    if where == "environment":
        environ["ROUTER_TOKEN"] = "a"
    elif where == "dotenv":
        settings["ROUTER_TOKEN"] = "short-token"
    else:
        token_file = tmp_path / "token"
        token_file.write_text("short-token\n")
    write_dotenv(root, settings)
    # The port is taken: a router that took the token stops there instead of serving.
    with socket.create_server(("0.0.0.0", 0)) as taken, pytest.raises(RouterError) as caught:
        run_router(Project(root), environ, host="0.0.0.0", port=taken.getsockname()[1],
                   profiles=["qwen3-0.6b"], token_file=token_file, out=io.StringIO())
    cause, fix = caught.value.cause, caught.value.fix or ""
    assert "shorter than 32 bytes" in cause
    assert {"environment": "ROUTER_TOKEN in the environment", "dotenv": "(set at .env:",
            "file": str(token_file)}[where] in cause
    assert "ROUTER_TOKEN" in fix and "--token-file" in fix and "secrets.token_urlsafe(32)" in fix


def test_wrong_tokens_are_answered_ever_later_and_the_right_one_at_once() -> None:
    # Issue 35: about 2,700 guesses a second on one connection. After a few free failures each
    # further 401 waits longer (0.1 s, then doubling), and a right token is never held up.
    free, first = FailureThrottle.FREE_FAILURES, FailureThrottle.FIRST_DELAY_S
    wrong = get("/v1/models", b"authorization: Bearer " + b"g" * 40 + b"\r\n", close=False)
    with running_router(LIMITS, token=TOKEN) as router, connect(router.port) as sock:
        took = []
        for _ in range(free + 4):
            began = time.monotonic()
            sock.sendall(wrong)
            assert status(read_response(sock)) == 401
            took.append(time.monotonic() - began)
        assert max(took[:free]) < first  # the first few: at once
        assert took[free + 3] >= 8 * first * 0.9 and took[free + 3] > took[free] * 4
        began = time.monotonic()
        sock.sendall(get("/v1/models", AUTH, close=False))
        assert status(read_response(sock)) == 200 and time.monotonic() - began < first


def test_guesses_on_parallel_connections_wait_for_each_other() -> None:
    # The back-off is per client address, not per connection: 8 connections guessing at once
    # get their 401s one delay after another, not 8 at a time.
    with running_router(LIMITS, token=TOKEN) as router:
        bad = {"Authorization": "Bearer " + "g" * 40}
        for _ in range(FailureThrottle.FREE_FAILURES):
            assert requests.get(router.url + "/v1/models", headers=bad, timeout=5).status_code == 401
        socks = [connect(router.port) for _ in range(4)]
        began = time.monotonic()
        for sock in socks:
            sock.sendall(get("/v1/models", b"authorization: Bearer " + b"h" * 40 + b"\r\n"))
        for sock in socks:
            assert status(read_response(sock)) == 401
            sock.close()
        # 0.1 + 0.2 + 0.4 + 0.8 s one after another (in parallel it would be 0.8 s).
        assert time.monotonic() - began >= 1.5 * 0.9


def test_the_failure_table_stays_bounded() -> None:
    throttle = FailureThrottle()
    for n in range(FailureThrottle.MAX_PEERS + 500):
        throttle.failed(f"10.0.{n // 256}.{n % 256}", 0.0)
    assert len(throttle.peers) == FailureThrottle.MAX_PEERS
    for _ in range(FailureThrottle.FREE_FAILURES + 1):
        wait = throttle.failed("192.0.2.1", 0.0)
    assert wait > 0  # a peer still counted
    assert throttle.failed("192.0.2.1", FailureThrottle.FORGET_S * 3) == 0.0  # forgotten in time


@pytest.mark.parametrize("token", [b"\xc3\xa9t\xc3\xa9", b"\xff\xfe\x80", "é".encode() * 20])
def test_a_token_that_is_not_ascii_gets_401_not_500(token: bytes) -> None:
    with running_router(LIMITS, token=TOKEN) as router:
        for path in (b"/v1/completions", b"/v1/load"):
            request = (b"POST " + path + b" HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
                       b"content-length: 2\r\nauthorization: Bearer " + token + b"\r\n\r\n{}")
            data = exchange(router.port, request)
            assert status(data) == 401, data[:300]
        assert not [line for line in router.said if line.startswith("error:")], router.said

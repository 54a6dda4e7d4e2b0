"""The router's connection and memory limits under a hostile client (issue 35, rows 5-7): the
cap answered on uvloop's loop (the real router's), one client holding every connection, bodies
queued behind a load without a total bound. The router's real aiohttp front over raw sockets
(tests/router_harness.py)."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
from helpers import copy_project, wait_for, write_dotenv
from router_harness import connect, exchange, get, post, read_all, running_router, status

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.router import service
from vllmstack.router.limits import Limits, LimitsError, read_limits

LIMITS = Limits(max_connections=40, max_client_connections=8, keepalive_timeout=10.0,
                header_timeout=10.0)


def error_message(data: bytes) -> str:
    return str(json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"])


def test_over_the_cap_the_uvloop_router_answers_503() -> None:
    # The real router runs on uvloop (service.loop_factory), whose TCPTransport is no
    # asyncio.Transport: the refusal asserted it was, and the client read an empty reply.
    factory = service.loop_factory()
    assert factory is not None, "uvloop is the router's loop; it must be installed"
    limits = dataclasses.replace(LIMITS, max_connections=16, max_client_connections=64)
    with running_router(limits, loop_factory=factory) as router:
        held = [connect(router.port) for _ in range(limits.max_connections)]
        try:
            wait_for(lambda: router.front.open == limits.max_connections, what="all accepted")
            data = exchange(router.port, get("/v1/health"), wait=2)
            assert status(data) == 503 and "ROUTER_MAX_CONNECTIONS" in error_message(data), data
            assert not [line for line in router.said if "Error" in line], router.said
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: router.front.open < limits.max_connections, what="the closes seen")
        assert status(exchange(router.port, get("/v1/health"))) == 200


def test_one_client_cannot_hold_every_connection() -> None:
    # One address keeps a request open on every connection it may: it is capped at
    # ROUTER_MAX_CLIENT_CONNECTIONS, and another client (127.0.0.2) still gets in.
    with running_router(LIMITS) as router:
        held = [connect(router.port) for _ in range(LIMITS.max_client_connections)]
        try:
            for sock in held:  # a kept-alive request on each, as the hostile client did
                sock.sendall(get("/v1/models", close=False))
            wait_for(lambda: router.front.clients.get("127.0.0.1") == len(held), what="counted")
            data = exchange(router.port, get("/v1/models"), wait=2)
            assert status(data) == 503, data[:300]
            assert "ROUTER_MAX_CLIENT_CONNECTIONS" in error_message(data)
            other = exchange(router.port, get("/v1/models"), source="127.0.0.2")
            assert status(other) == 200, other[:300]
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: "127.0.0.1" not in router.front.clients, what="the closes seen")
        assert status(exchange(router.port, get("/v1/models"))) == 200


def test_the_per_client_cap_fits_a_local_benchmark_and_is_a_checked_setting(
        tmp_path: Path) -> None:
    # A loopback router's clients all come from 127.0.0.1: a 256-concurrency benchmark must fit.
    assert Limits().max_client_connections >= 256
    assert Limits().max_client_connections < Limits().max_connections
    root = copy_project(tmp_path / "stack")
    write_dotenv(root, {"PLATFORM": "cpu", "ROUTER_MAX_CLIENT_CONNECTIONS": "0",
                        "ROUTER_MAX_QUEUED_BODY_BYTES": "4096"})
    with pytest.raises(LimitsError) as caught:
        read_limits(resolve(Project(root), model="qwen3-0.6b", environ={}))
    assert caught.value.cause.startswith("ROUTER_MAX_CLIENT_CONNECTIONS")
    assert "(set at .env:" in caught.value.cause
    assert "ROUTER_MAX_CLIENT_CONNECTIONS" in (caught.value.fix or "")
    write_dotenv(root, {"PLATFORM": "cpu", "ROUTER_MAX_CLIENT_CONNECTIONS": "300",
                        "ROUTER_MAX_QUEUED_BODY_BYTES": "4096"})
    limits = read_limits(resolve(Project(root), model="qwen3-0.6b", environ={}))
    assert (limits.max_client_connections, limits.max_queued_body) == (300, 4096)


def test_bodies_queued_behind_a_slow_engine_are_bounded_in_all() -> None:
    # Issue 35: 40 bodies of 30 MiB queued behind a load grew the router by 3.7 GiB. Past
    # ROUTER_MAX_QUEUED_BODY_BYTES a body gets 503 (with Retry-After) until earlier ones are done.
    size = 60 * 1024
    limits = dataclasses.replace(LIMITS, max_body=64 * 1024, max_queued_body=150 * 1024)
    body = json.dumps({"model": "m", "prompt": "x" * size}).encode()
    with running_router(limits) as router:
        router.engine.gate.clear()  # the engine holds every answer: bodies stay queued
        answers: list[bytes] = []
        senders = [threading.Thread(target=lambda: answers.append(
            exchange(router.port, post("/v1/completions", body), wait=20))) for _ in range(2)]
        for sender in senders:
            sender.start()
        wait_for(lambda: len(router.engine.seen) == 2, what="both bodies at the engine")
        assert router.app.ledger.held >= 2 * size
        refused = exchange(router.port, post("/v1/completions", body), wait=5)
        assert status(refused) == 503, refused[:300]
        assert "ROUTER_MAX_QUEUED_BODY_BYTES" in error_message(refused)
        assert b"Retry-After: 1" in refused
        chunked = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                   b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        with connect(router.port) as sock:  # no Content-Length: counted as it is read
            sock.sendall(chunked)
            assert status(read_all(sock)) == 503
        assert len(router.engine.seen) == 2  # neither refused body reached the engine
        router.engine.gate.set()
        for sender in senders:
            sender.join(20)
        assert [status(a) for a in answers] == [200, 200]
        wait_for(lambda: router.app.ledger.held == 0, what="the bodies given back")
        assert status(exchange(router.port, post("/v1/completions", body))) == 200
        assert router.app.ledger.held == 0

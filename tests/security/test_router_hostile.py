"""A hostile pass over the router's front door (issue 22), as an attacker on the LAN would try it:
raw sockets, malformed framing, smuggling, oversized and slow requests, deep JSON, path tricks
toward the engine's dev-mode endpoints, the connection cap.

One router (its real aiohttp front, small limits) in a thread of this process, in front of a fake
engine that records every request it gets. Every case checks the status and OpenAI-shaped error
the router answers, that the router still answers /v1/health at once afterwards (nothing froze
it), and at the end that nothing unexpected reached the engine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from helpers import free_port, wait_for

from vllmstack.config.profiles import Resolved, Setting
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import EngineManager, Loaded
from vllmstack.router.front import Front
from vllmstack.router.limits import Limits
from vllmstack.router.server import RouterApp
from vllmstack.router.states import Adopted, Slept
from vllmstack.router.upstream import Upstream
from vllmstack.runtime.gpu import GpuMemory

LIMITS = Limits(max_head=4096, max_body=65536, max_json_depth=32, header_timeout=1.0,
                keepalive_timeout=1.5, max_connections=40)
DEV_PATHS = ("/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache")
HOP = ("x-secret", "keep-alive", "te", "upgrade", "proxy-authorization", "proxy-connection")


class Engine:
    """Records (method, path, headers, body) of every request; answers a small JSON."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                engine.seen.append((self.command, self.path,
                                    {k.lower(): v for k, v in self.headers.items()}, body))
                data = b'{"object": "text_completion"}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET = do_PUT = answer  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Lifecycle:
    def __init__(self, url: str) -> None:
        self.url, self.unloads = url, 0

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = "all") -> Loaded:
        return Loaded(self.url)

    def unload(self, entry: Entry) -> None:
        self.unloads += 1

    def abort(self, entry: Entry) -> None:
        pass

    def adoptable(self, catalog: Catalog) -> list[Adopted]:
        return []

    def sleep(self, entry: Entry, frees: str = "all") -> Slept:
        raise AssertionError("one engine at a time never sleeps")

    def wake(self, entry: Entry) -> float:
        raise AssertionError("one engine at a time never wakes")

    def memory(self) -> list[GpuMemory] | None:
        return None


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


@pytest.fixture(scope="module")
def lifecycle(engine: Engine) -> Lifecycle:
    return Lifecycle(engine.url)


# The router's Front by its port: how many client connections it holds (its `open`), which a
# test waits on instead of guessing how long the router takes to accept or to see a close.
FRONTS: dict[int, Front] = {}


@pytest.fixture(scope="module")
def port(lifecycle: Lifecycle) -> Iterator[int]:
    resolved = Resolved("cpu", "m", {"VLLM_PORT": Setting("VLLM_PORT", "1", "test")}, [])
    catalog = Catalog("cpu", {"m": Entry("m", "m", "vllm", resolved, 0.0)}, {})
    chosen, started = free_port(), threading.Event()
    loop = asyncio.new_event_loop()
    stop = loop.create_future()

    async def main() -> None:
        upstream = Upstream(LIMITS)
        manager = EngineManager(catalog, lifecycle, limits=LIMITS, probe=upstream.probe)
        app = RouterApp(catalog, manager, upstream, token="", exposed_on="127.0.0.1",
                        load_timeout=10, limits=LIMITS)
        FRONTS[chosen] = front = Front(app.handle, LIMITS)
        server = await loop.create_server(front, "127.0.0.1", chosen)
        started.set()
        await stop
        server.close()
        await upstream.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    yield chosen
    loop.call_soon_threadsafe(stop.set_result, None)
    thread.join(10)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def exchange(port: int, *parts: bytes, gap: float = 0.0, wait: float = 5.0) -> bytes:
    """Send `parts` (with `gap` seconds between them); read until the router closes or `wait`."""
    with connect(port) as sock:
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:
                break  # the router already answered and closed
            time.sleep(gap)
        sock.settimeout(wait)
        data = b""
        try:
            while piece := sock.recv(65536):
                data += piece
        except (TimeoutError, ConnectionResetError):
            pass
    return data


def status(data: bytes) -> int:
    line = data.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


def error_of(data: bytes) -> dict[str, Any]:
    body = data.split(b"\r\n\r\n", 1)[1]
    error = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == status(data)
    return dict(error)


def alive(port: int) -> None:
    """The router answers /v1/health at once: no case froze or wedged it."""
    began = time.monotonic()
    data = exchange(port, b"GET /v1/health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
    assert status(data) == 200 and time.monotonic() - began < 1.0, data[:200]


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n".encode() + extra + b"\r\n" + body)


def chunked(path: str, chunks: bytes, extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ntransfer-encoding: chunked\r\n".encode()
            + extra + b"\r\n" + chunks)


GOOD = b'{"model": "m", "prompt": "x"}'

# (name, request bytes, status). Each must be refused before anything reaches the engine.
REFUSED = [
    ("negative chunk size", chunked("/v1/completions", b"-6\r\n{}\r\n0\r\n\r\n"), 400),
    ("signed chunk size", chunked("/v1/completions", b"+2\r\n{}\r\n0\r\n\r\n"), 400),
    ("0x chunk size", chunked("/v1/completions", b"0x2\r\n{}\r\n0\r\n\r\n"), 400),
    ("overflowing chunk size", chunked("/v1/completions", b"FFFFFFFFFFFFFFFFFFFFFF\r\n{}"), 400),
    ("chunk size over the body limit", chunked("/v1/completions", b"FFFFFFFF\r\n" + b"x" * 70000),
     413),
    ("chunks summing over the body limit",
     chunked("/v1/completions", b"8000\r\n" + b"x" * 0x8000 + b"\r\n") * 1
     + b"8000\r\n" + b"x" * 0x8000 + b"\r\n" + b"10\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n", 413),
    ("bare LF after a header", b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\nx-evil: 1\r\n"
     b"content-length: 2\r\n\r\n{}", 400),
    ("bare LF everywhere", b"POST /v1/completions HTTP/1.1\nhost: 127.0.0.1\ncontent-length: 2\n\n{}",
     400),
    ("LF in the request target", b"POST /v1/completions\nx HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n", 400),
    ("bare LF in a chunk", chunked("/v1/completions", b"2\n{}\n0\n\n"), 400),
    ("obs-fold", post("/v1/completions", GOOD, b"x-a: 1\r\n  folded\r\n"), 400),
    ("two different Content-Length", b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
     b"content-length: 2\r\ncontent-length: 3\r\n\r\n{}x", 400),
    ("two equal Content-Length", b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
     b"content-length: 2\r\ncontent-length: 2\r\n\r\n{}", 400),
    ("Content-Length with Transfer-Encoding", b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
     b"content-length: 2\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400),
    ("gzip, chunked", chunked("/v1/completions", b"2\r\n{}\r\n0\r\n\r\n").replace(
        b"transfer-encoding: chunked", b"transfer-encoding: gzip, chunked"), 400),
    ("chunked, identity", chunked("/v1/completions", b"2\r\n{}\r\n0\r\n\r\n").replace(
        b"transfer-encoding: chunked", b"transfer-encoding: chunked, identity"), 400),
    ("two Transfer-Encoding headers", chunked("/v1/completions", b"2\r\n{}\r\n0\r\n\r\n",
                                              b"transfer-encoding: chunked\r\n"), 400),
    ("negative Content-Length", post("/v1/completions", b"").replace(b"length: 0", b"length: -1"),
     400),
    ("signed Content-Length", post("/v1/completions", b"{}").replace(b"length: 2", b"length: +2"),
     400),
    ("Content-Length in exponent form", post("/v1/completions", b"{}").replace(
        b"length: 2", b"length: 2e0"), 400),
    ("Content-Length over the body limit",
     b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 99999999\r\n\r\n", 413),
    ("100-continue over the body limit", b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
     b"expect: 100-continue\r\ncontent-length: 99999999\r\n\r\n", 413),
    ("space before the colon", post("/v1/completions", GOOD, b"content-type : x\r\n"), 400),
    ("NUL in a header value", post("/v1/completions", GOOD, b"x-a: a\x00b\r\n"), 400),
    ("CR alone in a header value", post("/v1/completions", GOOD, b"x-a: a\rb\r\n"), 400),
    ("8-bit header name", post("/v1/completions", GOOD, b"x-\xff: 1\r\n"), 400),
    ("lower-case method", b"post /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n", 400),
    ("HTTP/2.0 on the wire", b"POST /v1/completions HTTP/2.0\r\nhost: 127.0.0.1\r\n"
     b"content-length: 2\r\n\r\n{}", 400),
    ("no protocol version", b"GET /v1/models\r\n\r\n", 400),
    ("NUL in the path", b"GET /v1/mod\x00els HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n", 400),
    ("TLS hello on the plain port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
     400),
    ("one header line over the head limit", post("/v1/completions", GOOD,
                                                  b"x-big: " + b"a" * 5000 + b"\r\n"), 431),
    ("more than 100 header lines", post("/v1/completions", GOOD,
                                        b"".join(b"x-%d: 1\r\n" % i for i in range(150))), 431),
    ("many short lines over the head limit in one burst",
     post("/v1/completions", GOOD, b"".join(b"x-%02d: %s\r\n" % (i, b"a" * 90) for i in range(60))),
     431),
    ("a target over the head limit", b"GET /v1/models?" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n", 431),
    ("two Authorization headers", post("/v1/completions", GOOD,
                                       b"authorization: Bearer a\r\nauthorization: Bearer b\r\n"), 400),
    ("two Origin headers", post("/v1/completions", GOOD,
                                b"origin: http://localhost\r\norigin: http://evil.example\r\n"), 400),
    ("two Host headers", b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nhost: evil\r\n"
     b"content-length: 2\r\n\r\n{}", 400),
    ("a page of another origin", post("/v1/completions", GOOD, b"origin: http://evil.example\r\n"),
     403),
    ("a rebound host name", post("/v1/completions", GOOD).replace(b"host: 127.0.0.1",
                                                                  b"host: evil.example"), 403),
    ("JSON nested 30,000 deep", post("/v1/completions", b"[" * 30000 + b"]" * 30000), 400),
    ("JSON nested past the limit", post("/v1/completions", b'{"model": "m", "x": ' + b"[" * 40
                                        + b"]" * 40 + b"}"), 400),
    ("deep JSON to /v1/load", post("/v1/load", b"[" * 1000 + b"]" * 1000), 400),
    ("deep JSON to /v1/unload", post("/v1/unload", b"{\"a\":" * 100 + b"1" + b"}" * 100), 400),
    ("a body that is not JSON", post("/v1/chat/completions", b"\xff\xfe{not json"), 400),
    ("a JSON array as the body", post("/v1/completions", b"[]"), 400),
    ("a number as the model", post("/v1/completions", b'{"model": 0}'), 400),
    ("gzip-encoded body (never inflated)", post("/v1/completions", b"\x1f\x8b\x08\x00" + b"\x00" * 20,
                                                b"content-encoding: gzip\r\n"), 400),
    ("unload with a misspelt key", post("/v1/unload", b'{"modle": "m"}'), 400),
    ("unload with an array", post("/v1/unload", b"[]"), 400),
    ("unload with a number", post("/v1/unload", b'{"model": 0}'), 400),
    ("unload with null", post("/v1/unload", b'{"model": null}'), 400),
    ("unload with an empty name", post("/v1/unload", b'{"model": ""}'), 400),
    ("load with an extra key", post("/v1/load", b'{"model": "m", "x": 1}'), 400),
    ("PUT on a route", b"PUT /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 2\r\n"
     b"\r\n{}", 405),
]


@pytest.mark.parametrize(("name", "request_bytes", "expected"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_before_the_engine(port: int, engine: Engine, lifecycle: Lifecycle, name: str,
                                   request_bytes: bytes, expected: int) -> None:
    before, unloads = len(engine.seen), lifecycle.unloads
    data = exchange(port, request_bytes)
    assert status(data) == expected, data[:300]
    error = error_of(data)
    assert len(error["message"]) < 600  # never an echo of what was sent
    assert b"100 Continue" not in data
    assert len(engine.seen) == before and lifecycle.unloads == unloads
    alive(port)


@pytest.mark.parametrize("path", [
    *DEV_PATHS, "/v1/../sleep", "/%73leep", "//sleep", "/v1/chat/completions/../../sleep",
    "/sleep?level=1", "/SLEEP", "/v1/completions%2F..%2Fsleep", "/v1/%63ompletions",
    "http://127.0.0.1/sleep", "/v1/completions/", "/./v1/completions"])
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_paths_outside_the_routes_are_404_and_never_forwarded(port: int, engine: Engine, path: str,
                                                             method: str) -> None:
    before = len(engine.seen)
    data = exchange(port, f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n".encode()
                    + f"content-length: {len(GOOD)}\r\n\r\n".encode() + GOOD)
    assert status(data) == 404, data[:300]
    assert error_of(data)["type"] == "NotFoundError"
    assert len(engine.seen) == before


def test_a_request_that_passes_reaches_only_its_route_without_hop_by_hop_headers(
        port: int, engine: Engine) -> None:
    extra = b"".join(f"{name}: 1\r\n".encode() for name in HOP) + b"connection: x-secret\r\n"
    data = exchange(port, post("/v1/completions?stream=0", GOOD, extra))
    assert status(data) == 200, data[:300]
    method, path, headers, body = engine.seen[-1]
    assert (method, path, body) == ("POST", "/v1/completions?stream=0", GOOD)
    assert not set(HOP) & set(headers) and headers.get("connection", "") != "x-secret"


def test_a_huge_model_name_is_not_echoed(port: int) -> None:
    name = "n" * 60000
    data = exchange(port, post("/v1/completions", json.dumps({"model": name}).encode()))
    assert status(data) == 404
    message = error_of(data)["message"]
    assert len(message) < 300 and "(60000 characters)" in message


def test_one_byte_chunks_are_read_in_linear_time(port: int, engine: Engine) -> None:
    body = json.dumps({"model": "m", "prompt": "x" * 20000}).encode()
    chunks = b"".join(b"1\r\n" + body[i:i + 1] + b"\r\n" for i in range(len(body))) + b"0\r\n\r\n"
    began = time.monotonic()
    data = exchange(port, chunked("/v1/completions", chunks, b"connection: close\r\n"))
    assert status(data) == 200, data[:300]
    assert engine.seen[-1][3] == body
    assert time.monotonic() - began < 5  # the old parser re-read the buffer per chunk: 62 s/4.8 MB


def test_a_slow_head_gets_408_within_the_header_timeout(port: int) -> None:
    began = time.monotonic()
    data = exchange(port, b"POST /v1/completions HTTP/1.1\r\n", b"host: 127.0.0.1\r\n",
                    *[b"x-a: 1\r\n"] * 20, gap=0.1)
    assert status(data) == 408 and error_of(data)["type"] == "RequestTimeoutError"
    assert time.monotonic() - began < LIMITS.header_timeout + 2.5
    alive(port)


def test_a_stalled_body_gets_408(port: int, engine: Engine) -> None:
    before = len(engine.seen)
    data = exchange(port, b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                          b"content-length: 100\r\n\r\n{\"model\"", wait=LIMITS.header_timeout + 3)
    assert status(data) == 408 and len(engine.seen) == before


def test_an_idle_connection_is_closed_after_the_keepalive_timeout(port: int) -> None:
    with connect(port) as sock:
        sock.settimeout(LIMITS.keepalive_timeout + 3)
        began = time.monotonic()
        assert sock.recv(100) == b""  # closed, nothing said
        assert time.monotonic() - began < LIMITS.keepalive_timeout + 2


def test_a_malformed_request_in_a_pipeline_ends_the_connection(port: int, engine: Engine) -> None:
    # The parser refuses the burst at the malformed request: at most the one before it is
    # served, nothing after it, and the connection ends with the 400.
    before = len(engine.seen)
    good = post("/v1/completions", GOOD).replace(b"connection: close\r\n", b"")
    data = exchange(port, good + b"POST /v1/completions HTTP/1.1\r\nhost: x\nbad: 1\r\n\r\n" + good)
    assert data.count(b" 400 Bad Request") == 1 and data.rstrip().endswith(b"}"), data[:600]
    assert len(engine.seen) - before == data.count(b" 200 OK") <= 1


def test_connections_over_the_cap_get_503_and_the_cap_frees_up(port: int) -> None:
    held = [connect(port) for _ in range(LIMITS.max_connections)]
    try:
        wait_for(lambda: FRONTS[port].open == LIMITS.max_connections, what="all of them accepted")
        data = exchange(port, b"GET /v1/health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n", wait=2)
        assert status(data) == 503 and "ROUTER_MAX_CONNECTIONS" in error_of(data)["message"]
    finally:
        for sock in held:
            sock.close()
    # Freed up: room for one more (a connection an earlier case left may still be open).
    wait_for(lambda: FRONTS[port].open < LIMITS.max_connections, what="the router to see closes")
    alive(port)


def test_after_the_hostile_pass_the_engine_saw_only_routed_requests(port: int, engine: Engine) -> None:
    assert status(exchange(port, post("/v1/completions", GOOD))) == 200
    assert {path.split("?")[0] for _, path, _, _ in engine.seen} <= {"/v1/completions", "/health"}
    alive(port)

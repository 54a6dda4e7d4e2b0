"""The router's real aiohttp front (RouterApp + Front) in a thread of the test process, in front
of a stand-in engine that records what reaches it: what the issue-35 front-door tests share
(tests/security/test_router_access_hostile.py, test_router_limits_hostile.py,
tests/test_router_routes.py). `loop_factory` runs it on another event loop (uvloop's, as the
real router does: service.loop_factory)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from helpers import free_port

from vllmstack.config.profiles import Resolved, Setting
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import EngineManager, Loaded
from vllmstack.router.front import Front
from vllmstack.router.limits import Limits
from vllmstack.router.link import PeerLink
from vllmstack.router.peers import Peer
from vllmstack.router.server import RouterApp
from vllmstack.router.states import Adopted, Slept
from vllmstack.router.upstream import Upstream
from vllmstack.runtime.gpu import GpuMemory

STREAM = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]


class Engine:
    """Records (method, path, headers, body); answers JSON, or an SSE stream in HTTP chunks when
    the body asks `"stream": true`. While `gate` is clear, answers wait for it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.gate = threading.Event()
        self.gate.set()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                engine.seen.append((self.command, self.path,
                                    {k.lower(): v for k, v in self.headers.items()}, body))
                engine.gate.wait(30)
                if b'"stream": true' in body:
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for event in STREAM:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                data = b'{"object": "answer"}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


class Lifecycle:
    """Every model is already served by the one stand-in engine."""

    def __init__(self, url: str) -> None:
        self.url = url

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = "all") -> Loaded:
        return Loaded(self.url)

    def unload(self, entry: Entry) -> None:
        pass

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


@dataclass
class Running:
    port: int
    front: Front
    app: RouterApp
    engine: Engine
    said: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def running_router(limits: Limits, *, token: str = "", engine_kind: str = "vllm",
                   loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
                   model: str = "m", port: int | None = None, peers: Sequence[Peer] = (),
                   ) -> Iterator[Running]:
    """A router serving `model` (profile "p", engine `engine_kind`) on a free loopback port (or
    `port`), with `peers` (ROUTER_PEERS) polled as the real router polls them."""
    engine = Engine()
    resolved = Resolved("cpu", "p", {"VLLM_PORT": Setting("VLLM_PORT", "1", "test")}, [])
    catalog = Catalog("cpu", {model: Entry(model, "p", engine_kind, resolved, 0.0)}, {"p": model})
    lifecycle = Lifecycle(engine.url)
    chosen, started = port or free_port(), threading.Event()
    loop = loop_factory() if loop_factory else asyncio.new_event_loop()
    stop = loop.create_future()
    box: dict[str, Any] = {}
    said: list[str] = []

    async def main() -> None:
        upstream = Upstream(limits)
        manager = EngineManager(catalog, lifecycle, limits=limits, probe=upstream.probe)
        link = PeerLink(list(peers), upstream, said.append) if peers else None
        app = RouterApp(catalog, manager, upstream, token=token, exposed_on="127.0.0.1",
                        load_timeout=10, limits=limits, peers=link)
        front = Front(app.handle, limits, say=said.append)
        server = await loop.create_server(front, "127.0.0.1", chosen, reuse_address=True)
        watch = None
        if link is not None:
            await link.poll_all()
            watch = loop.create_task(link.watch())
        box.update(app=app, front=front)
        started.set()
        await stop
        if watch is not None:
            watch.cancel()
        server.close()
        for connection in front.connections:
            connection.force_close()
        await upstream.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield Running(chosen, box["front"], box["app"], engine, said)
    finally:
        engine.gate.set()
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(10)
        engine.close()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A client connection from `source` (any 127.0.0.0/8 address is another loopback client)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_all(sock: socket.socket, wait: float = 5.0) -> bytes:
    """What the router sends until it closes the connection (or `wait` passes)."""
    sock.settimeout(wait)
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while piece := sock.recv(65536):
            data += piece
    return data


def exchange(port: int, request: bytes, *, source: str = "127.0.0.1", wait: float = 5.0) -> bytes:
    with connect(port, source) as sock:
        sock.sendall(request)
        return read_all(sock, wait)


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length off a kept-alive connection."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        assert piece, data
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        piece = sock.recv(65536)
        assert piece, data
        rest += piece
    return head + b"\r\n\r\n" + rest


def status(data: bytes) -> int:
    line = data.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


def get(path: str, extra: bytes = b"", *, host: bytes = b"127.0.0.1", close: bool = True) -> bytes:
    return (f"GET {path} HTTP/1.1\r\n".encode() + b"host: " + host + b"\r\n"
            + (b"connection: close\r\n" if close else b"") + extra + b"\r\n")


def post(path: str, body: bytes, extra: bytes = b"", *, close: bool = True) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n".encode()
            + (b"connection: close\r\n" if close else b"")
            + f"content-length: {len(body)}\r\n".encode() + extra + b"\r\n" + body)

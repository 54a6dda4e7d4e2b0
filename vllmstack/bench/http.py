"""A small HTTP/1.1 client on asyncio protocols, made for timing token streams.

Why not httpx: measured on this project's 2-core box against a server that stamps its writes
(benchmarks/bench_client_overhead.py), httpx added ~1.2-2.6 ms between "request sent" and the
server seeing it and ~10-20 ms at p99 between "server wrote a chunk" and "client read it"; both
land directly in TTFT and ITL. Why a Protocol and not StreamReader coroutines: every chunk then
costs one event-loop callback, not a chain of coroutine wake-ups (125 µs -> ~30 µs of CPU per
chunk here), and the arrival time is taken inside that callback, as early as Python can.

Scope: keep-alive connections, TCP_NODELAY, Content-Length / chunked / close-delimited bodies,
optional TLS, an idle timeout. No redirects, compression or proxies: the endpoint is a local
inference server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

Sink = Callable[[bytes, float], None]
MAX_HEAD = 1 << 20


class HTTPError(OSError):
    """Connection-level failure: refused, reset, closed mid-response, malformed response."""


class HTTPTimeoutError(HTTPError):
    """No bytes within the idle timeout."""


class _Protocol(asyncio.Protocol):
    """One connection. Parses the response head and body as bytes arrive and hands body pieces
    to the current request's sink together with the time they were received."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_activity = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        loop = asyncio.get_running_loop()
        self.head_future: asyncio.Future[None] = loop.create_future()
        self.body_future: asyncio.Future[None] = loop.create_future()
        self.sink: Sink | None = None
        self.buffer = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.in_body = False
        self.chunked = False
        self.remaining: int | None = None
        self.complete = False
        self.head_time = 0.0
        # Body pieces that arrive before a sink is attached keep their own arrival times.
        self.pending: list[tuple[bytes, float]] = []

    # asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Without it a request body can wait for the server's delayed ACK (Nagle).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.last_activity = time.monotonic()
        try:
            self._parse(self.buffer + data if self.buffer else data, now)
        except HTTPError as exc:
            self._fail(exc)
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool | None:
        if self.in_body and self.remaining is None and not self.chunked:
            self.complete = True  # a close-delimited body ends here
            self._finish()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            if self.in_body and self.remaining is None and not self.chunked:
                self.complete = True
                self._finish()
            else:
                where = "in the middle of the response" if self.status else "without a response"
                self._fail(HTTPError(f"server closed the connection {where}"))

    # parsing -------------------------------------------------------------------------------

    def _parse(self, buf: bytes, now: float) -> None:
        if not self.in_body:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise HTTPError("response headers larger than 1 MiB")
                self.buffer = buf
                return
            self._parse_head(buf[:end])
            self.head_time = now
            buf = buf[end + 4:]
            self.in_body = True
            if self.remaining == 0 or self.status in (204, 304):
                self.complete = True
            if not self.head_future.done():
                self.head_future.set_result(None)
            if self.complete:
                self.buffer = b""
                self._finish()
                return
        if self.chunked:
            self._parse_chunked(buf, now)
            return
        if self.remaining is not None:
            if len(buf) >= self.remaining:
                buf = buf[:self.remaining]  # nothing may follow: we sent one request
                self.remaining = 0
                self.complete = True
            else:
                self.remaining -= len(buf)
        self.buffer = b""
        if buf:
            self._deliver(buf, now)
        if self.complete:
            self._finish()

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        try:
            self.status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError) as exc:
            raise HTTPError(f"malformed status line {lines[0][:80]!r}") from exc
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self.chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        if not self.chunked and length is not None:
            try:
                self.remaining = int(length)
            except ValueError as exc:
                raise HTTPError(f"bad content-length {length!r}") from exc

    def _parse_chunked(self, buf: bytes, now: float) -> None:
        pos = 0
        out: list[bytes] = []
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            try:
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
            except ValueError as exc:
                raise HTTPError(f"bad chunk size line {buf[pos:eol][:40]!r}") from exc
            if size == 0:
                tail = buf[eol + 2:]
                if tail.startswith(b"\r\n") or b"\r\n\r\n" in tail:
                    self.complete = True
                    pos = len(buf)
                break
            start = eol + 2
            if len(buf) < start + size + 2:
                break
            out.append(buf[start:start + size])
            pos = start + size + 2
        self.buffer = buf[pos:]
        if out:
            self._deliver(out[0] if len(out) == 1 else b"".join(out), now)
        if self.complete:
            self._finish()

    def _deliver(self, data: bytes, now: float) -> None:
        if self.sink is not None:
            self.sink(data, now)
        else:
            self.pending.append((data, now))

    def _finish(self) -> None:
        if not self.head_future.done():
            self.head_future.set_result(None)
        if not self.body_future.done():
            self.body_future.set_result(None)

    def _fail(self, exc: Exception) -> None:
        for future in (self.head_future, self.body_future):
            if not future.done():
                future.set_exception(exc)
                future.exception()  # mark retrieved: a caller may only await one of them


class Response:
    """Status and headers of a response whose body is still arriving."""

    def __init__(self, protocol: _Protocol, timeout_s: float) -> None:
        self._protocol = protocol
        self._timeout_s = timeout_s
        self.status = protocol.status
        self.headers = protocol.headers

    @property
    def complete(self) -> bool:
        return self._protocol.complete

    async def stream(self, sink: Sink) -> None:
        """Deliver body pieces to `sink(data, perf_counter_time)` until the body is complete.

        Pieces that arrived before this call are delivered first, each with its own time.
        """
        protocol = self._protocol
        early, protocol.pending = protocol.pending, []
        for data, at in early:
            sink(data, at)
        protocol.sink = sink
        await _wait(protocol, protocol.body_future, self._timeout_s)

    async def read(self) -> bytes:
        await _wait(self._protocol, self._protocol.body_future, self._timeout_s)
        parts, self._protocol.pending = self._protocol.pending, []
        return b"".join(data for data, _ in parts)

    def abort(self) -> None:
        """Stop reading: the connection is closed and not reused."""
        if self._protocol.transport is not None:
            self._protocol.transport.close()


async def _wait(protocol: _Protocol, future: asyncio.Future[None], idle_s: float) -> None:
    """Wait for `future`, failing when the connection has been silent for `idle_s` seconds.

    The idle check runs once per second at most, never per chunk.
    """
    step = min(1.0, idle_s)
    while True:
        done, _ = await asyncio.wait([future], timeout=step)
        if done:
            future.result()
            return
        if time.monotonic() - protocol.last_activity > idle_s:
            if protocol.transport is not None:
                protocol.transport.close()
            raise HTTPTimeoutError(f"no data for {idle_s:g} s")


class HTTPClient:
    """Keep-alive HTTP/1.1 to one origin. Safe for many concurrent requests on one loop."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None,
                 timeout_s: float = 600.0, connect_timeout_s: float = 10.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        host_header = self.host if parts.port is None else f"{self.host}:{self.port}"
        base = {"host": host_header, "user-agent": "vllmstack-bench", "accept": "*/*"}
        base.update({k.lower(): v for k, v in (headers or {}).items()})
        self._head = "".join(f"{k}: {v}\r\n" for k, v in base.items())
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Protocol] = []
        self._closed = False

    async def _connect(self) -> _Protocol:
        while self._idle:
            protocol = self._idle.pop()
            if not protocol.closed and protocol.transport is not None \
                    and not protocol.transport.is_closing():
                protocol._reset()
                return protocol
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(_Protocol, self.host, self.port, ssl=self.tls),
                self.connect_timeout_s)
        except TimeoutError as exc:
            raise HTTPTimeoutError(f"connecting to {self.host}:{self.port} timed out") from exc
        except OSError as exc:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return protocol

    @contextlib.asynccontextmanager
    async def request(self, method: str, path: str, body: bytes | None = None,
                      content_type: str = "application/json") -> AsyncIterator[Response]:
        """Send a request and yield the response once its head is in.

        No retries: a request the server read and then dropped must surface as a failure
        (stability runs count them). The connection goes back to the pool only when the body
        was read to the end.
        """
        if self._closed:
            raise HTTPError("client is closed")
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}"
        if body is not None:
            head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        payload = (head + "\r\n").encode("latin-1") + (body or b"")
        protocol = await self._connect()
        try:
            assert protocol.transport is not None
            protocol.transport.write(payload)
            protocol.last_activity = time.monotonic()
            await _wait(protocol, protocol.head_future, self.timeout_s)
            response = Response(protocol, self.timeout_s)
        except BaseException:
            if protocol.transport is not None:
                protocol.transport.close()
            raise
        try:
            yield response
        finally:
            keep = (protocol.complete and not protocol.closed and not self._closed
                    and protocol.headers.get("connection", "").lower() != "close")
            if keep:
                protocol.sink = None
                self._idle.append(protocol)
            elif protocol.transport is not None:
                protocol.transport.close()

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.request("GET", path) as response:
            return response.status, await response.read()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        async with self.request("POST", path, body) as response:
            return response.status, await response.read()

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            protocol = self._idle.pop()
            if protocol.transport is not None:
                protocol.transport.close()

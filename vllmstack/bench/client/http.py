"""A small HTTP/1.1 client on asyncio protocols, made for timing token streams.

Why not httpx: measured on this project's 2-core box against a server that stamps its writes
(benchmarks/bench_client_overhead.py), httpx added ~1.2-2.6 ms between "request sent" and the
server seeing it and ~10-20 ms at p99 between "server wrote a chunk" and "client read it"; both
land directly in TTFT and ITL. Why a Protocol and not StreamReader coroutines: every chunk then
costs one event-loop callback, not a chain of coroutine wake-ups (125 µs -> ~30 µs of CPU per
chunk here), and the arrival time is taken inside that callback, as early as Python can.

Scope: keep-alive connections, TCP_NODELAY, Content-Length / chunked / close-delimited bodies,
optional TLS, one total deadline per request. No redirects, compression or proxies: the endpoint
is a local inference server.

Bad servers: the deadline counts from the moment the request starts, so a server that keeps the
connection busy (SSE keep-alive comments, one byte a second) cannot hold a request past it. The
parser touches every byte once: a body trickled in one-byte reads costs linear time, never a
re-join of everything buffered so far.
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
MAX_LINE = 1 << 16  # a chunk-size or trailer line; real ones are a few bytes
MAX_BODY = 64 << 20  # what `read()` keeps; a /metrics page is ~100 KB

# Chunked-body parser states.
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class HTTPError(OSError):
    """Connection-level failure: refused, reset, closed mid-response, malformed response."""


class HTTPTimeoutError(HTTPError):
    """The request did not complete within its total deadline."""


class _Protocol(asyncio.Protocol):
    """One connection. Parses the response head and body as bytes arrive and hands body pieces
    to the current request's sink together with the time they were received."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        loop = asyncio.get_running_loop()
        self.head_future: asyncio.Future[None] = loop.create_future()
        self.body_future: asyncio.Future[None] = loop.create_future()
        self.sink: Sink | None = None
        self.head = bytearray()  # the response head while it is incomplete
        self.scanned = 0  # how much of `head` has been searched for the blank line
        self.status = 0
        self.headers: dict[str, str] = {}
        self.in_body = False
        self.chunked = False
        self.remaining: int | None = None
        self.complete = False
        self.head_time = 0.0
        self.state = _SIZE
        self.chunk_left = 0
        self.line = bytearray()  # a chunk-size or trailer line split across reads
        # Body pieces that arrive before a sink is attached keep their own arrival times.
        self.pending: list[tuple[bytes, float]] = []
        self.pending_bytes = 0

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
        try:
            if not self.in_body:
                data = self._take_head(data, now)
                if not data or self.complete:
                    return
            if not self.complete:
                self._parse_body(data, now)
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

    def _take_head(self, data: bytes, now: float) -> bytes:
        """Collect the head; returns the body bytes that came with it (b"" while incomplete)."""
        self.head += data
        # Resume the search where the last one stopped (minus a split "\r\n\r\n").
        end = self.head.find(b"\r\n\r\n", max(0, self.scanned - 3))
        if end < 0:
            if len(self.head) > MAX_HEAD:
                raise HTTPError("response headers larger than 1 MiB")
            self.scanned = len(self.head)
            return b""
        rest = bytes(self.head[end + 4:])
        self._parse_head(bytes(self.head[:end]))
        self.head = bytearray()
        self.head_time = now
        self.in_body = True
        if self.remaining == 0 or self.status in (204, 304):
            self.complete = True
        if not self.head_future.done():
            self.head_future.set_result(None)
        if self.complete:
            self._finish()
        return rest

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
            if self.remaining < 0:
                raise HTTPError(f"bad content-length {length!r}")

    def _parse_body(self, data: bytes, now: float) -> None:
        if self.chunked:
            self._parse_chunked(data, now)
            return
        if self.remaining is not None:
            if len(data) >= self.remaining:
                data = data[:self.remaining]  # nothing may follow: we sent one request
                self.remaining = 0
                self.complete = True
            else:
                self.remaining -= len(data)
        if data:
            self._deliver(data, now)
        if self.complete:
            self._finish()

    def _parse_chunked(self, data: bytes, now: float) -> None:
        """One pass over `data`: chunk payload goes out as it arrives, even mid-chunk."""
        pos, end = 0, len(data)
        out: list[bytes] = []
        while pos < end and not self.complete:
            if self.state == _DATA:
                take = min(self.chunk_left, end - pos)
                out.append(data[pos:pos + take])
                pos += take
                self.chunk_left -= take
                if self.chunk_left == 0:
                    self.state, self.chunk_left = _DATA_END, 2
            elif self.state == _DATA_END:
                take = min(self.chunk_left, end - pos)  # the CRLF after a chunk's data
                pos += take
                self.chunk_left -= take
                if self.chunk_left == 0:
                    self.state = _SIZE
            else:
                eol = data.find(b"\n", pos)
                if eol < 0:
                    self.line += data[pos:]
                    if len(self.line) > MAX_LINE:
                        raise HTTPError("chunk-size line longer than 64 KiB")
                    break
                line = bytes(self.line) + data[pos:eol] if self.line else data[pos:eol]
                self.line = bytearray()
                pos = eol + 1
                self._chunk_line(line.rstrip(b"\r"))
        if out:
            self._deliver(out[0] if len(out) == 1 else b"".join(out), now)
        if self.complete:
            self._finish()

    def _chunk_line(self, line: bytes) -> None:
        if self.state == _TRAILER:
            if not line:
                self.complete = True  # the blank line after the last chunk
            return
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError as exc:
            raise HTTPError(f"bad chunk size line {line[:40]!r}") from exc
        if size < 0:
            raise HTTPError(f"bad chunk size line {line[:40]!r}")
        if size == 0:
            self.state = _TRAILER
        else:
            self.state, self.chunk_left = _DATA, size

    def _deliver(self, data: bytes, now: float) -> None:
        if self.sink is not None:
            self.sink(data, now)
            return
        self.pending_bytes += len(data)
        if self.pending_bytes > MAX_BODY:
            raise HTTPError(f"response body larger than {MAX_BODY >> 20} MiB")
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

    def __init__(self, protocol: _Protocol, deadline: float, timeout_s: float) -> None:
        self._protocol = protocol
        self._deadline = deadline
        self._timeout_s = timeout_s
        self.status = protocol.status
        self.headers = protocol.headers

    @property
    def complete(self) -> bool:
        return self._protocol.complete

    @property
    def content_type(self) -> str:
        """The media type without parameters, lower-cased ("" when the server sent none)."""
        return self.headers.get("content-type", "").split(";", 1)[0].strip().lower()

    async def stream(self, sink: Sink) -> None:
        """Deliver body pieces to `sink(data, perf_counter_time)` until the body is complete.

        Pieces that arrived before this call are delivered first, each with its own time.
        """
        protocol = self._protocol
        early, protocol.pending = protocol.pending, []
        protocol.pending_bytes = 0
        for data, at in early:
            sink(data, at)
        protocol.sink = sink
        await _wait(protocol, protocol.body_future, self._deadline, self._timeout_s)

    async def read(self) -> bytes:
        await _wait(self._protocol, self._protocol.body_future, self._deadline, self._timeout_s)
        parts, self._protocol.pending = self._protocol.pending, []
        return b"".join(data for data, _ in parts)

    def abort(self) -> None:
        """Stop reading: the connection is closed and not reused."""
        if self._protocol.transport is not None:
            self._protocol.transport.close()


async def _wait(protocol: _Protocol, future: asyncio.Future[None], deadline: float,
                timeout_s: float) -> None:
    """Wait for `future` until the request's deadline; then close the connection and fail.

    Bytes arriving do not move the deadline (one timer per wait, nothing per chunk).
    """
    left = deadline - time.monotonic()
    if not future.done() and left > 0:
        await asyncio.wait([future], timeout=left)
    if future.done():
        future.result()
        return
    if protocol.transport is not None:
        protocol.transport.close()
    raise HTTPTimeoutError(f"no complete response within {timeout_s:g} s (--timeout)")


class HTTPClient:
    """Keep-alive HTTP/1.1 to one origin. Safe for many concurrent requests on one loop."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None,
                 timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 keep_alive: bool = True) -> None:
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
        # False: one connection per request, for servers that close a connection after a streamed
        # response without saying so (llama-server: a request sent on it meanwhile is lost).
        self.keep_alive = keep_alive
        self._idle: list[_Protocol] = []
        self._closed = False

    async def _connect(self, deadline: float) -> _Protocol:
        while self._idle:
            protocol = self._idle.pop()
            if not protocol.closed and protocol.transport is not None \
                    and not protocol.transport.is_closing():
                protocol._reset()
                return protocol
        loop = asyncio.get_running_loop()
        limit = max(0.0, min(self.connect_timeout_s, deadline - time.monotonic()))
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(_Protocol, self.host, self.port, ssl=self.tls), limit)
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
        was read to the end. The whole exchange, connecting included, ends by `timeout_s`.
        """
        if self._closed:
            raise HTTPError("client is closed")
        deadline = time.monotonic() + self.timeout_s
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}"
        if body is not None:
            head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        payload = (head + "\r\n").encode("latin-1") + (body or b"")
        protocol = await self._connect(deadline)
        try:
            assert protocol.transport is not None
            protocol.transport.write(payload)
            await _wait(protocol, protocol.head_future, deadline, self.timeout_s)
            response = Response(protocol, deadline, self.timeout_s)
        except BaseException:
            if protocol.transport is not None:
                protocol.transport.close()
            raise
        try:
            yield response
        finally:
            keep = (self.keep_alive and protocol.complete and not protocol.closed
                    and not self._closed
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

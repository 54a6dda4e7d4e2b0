"""A small HTTP/1.1 client on asyncio streams, made for timing token streams.

Why not httpx: measured on this project's 2-core box against a server that stamps its writes
(benchmarks/bench_client_overhead.py), httpx added ~1.2 ms between "request sent" and the server
seeing it, and its layered async iterators delayed chunk delivery by ~2 ms at p90 under load,
against 0.3 ms for a plain asyncio reader. Both land directly in TTFT and ITL, so the benchmark
client talks HTTP itself: keep-alive connections, TCP_NODELAY, Content-Length and chunked
bodies, optional TLS. Nothing else (no redirects, no compression, no proxies: the endpoint is a
local inference server).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

READ_SIZE = 65536


class HTTPError(OSError):
    """Connection-level failure: refused, reset, closed mid-response, malformed response."""


class HTTPTimeoutError(HTTPError):
    """No response bytes within the timeout."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    _conn: _Connection = field(repr=False)
    _chunked: bool = False
    _remaining: int | None = None  # Content-Length bytes still unread
    _buf: bytes = b""
    _done: bool = False
    _timeout: float | None = None

    async def iter_raw(self) -> AsyncIterator[tuple[bytes, float]]:
        """Body bytes as they arrive, each with the perf_counter time of the read that got it."""
        reader = self._conn.reader
        clock = time.perf_counter
        if not self._chunked:
            if self._buf:
                data, self._buf = self._buf, b""
                if self._remaining is not None:
                    self._remaining -= len(data)
                yield data, clock()
            while self._remaining is None or self._remaining > 0:
                want = READ_SIZE if self._remaining is None else min(READ_SIZE, self._remaining)
                data = await self._read(reader, want)
                if not data:
                    if self._remaining is None:
                        break  # close-delimited body
                    raise HTTPError("connection closed in the middle of the response body")
                if self._remaining is not None:
                    self._remaining -= len(data)
                yield data, clock()
            self._done = True
            return
        buf = self._buf
        self._buf = b""
        now = clock()
        while True:
            out: list[bytes] = []
            pos = 0
            while True:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                try:
                    size = int(buf[pos:eol].split(b";", 1)[0], 16)
                except ValueError as exc:
                    raise HTTPError(f"bad chunk size line {buf[pos:eol][:40]!r}") from exc
                if size == 0:
                    # The last chunk; (optional trailers and) an empty line end the body.
                    tail = buf[eol + 2:]
                    if tail.startswith(b"\r\n") or b"\r\n\r\n" in tail:
                        if out:
                            yield b"".join(out), now
                        self._done = True
                        return
                    break
                start = eol + 2
                if len(buf) < start + size + 2:
                    break
                out.append(buf[start:start + size])
                pos = start + size + 2
            if out:
                yield (out[0] if len(out) == 1 else b"".join(out)), now
            buf = buf[pos:]
            data = await self._read(reader, READ_SIZE)
            now = clock()
            if not data:
                raise HTTPError("connection closed in the middle of a chunked response")
            buf = buf + data if buf else data

    async def _read(self, reader: asyncio.StreamReader, size: int) -> bytes:
        try:
            if self._timeout is None:
                return await reader.read(size)
            return await asyncio.wait_for(reader.read(size), self._timeout)
        except TimeoutError as exc:
            raise HTTPTimeoutError(f"no data for {self._timeout:g} s") from exc
        except (ConnectionError, OSError) as exc:
            raise HTTPError(f"connection failed while reading: {exc}") from exc

    async def read(self) -> bytes:
        parts = [data async for data, _ in self.iter_raw()]
        return b"".join(parts)


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


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
        self._idle: list[_Connection] = []
        self._closed = False

    async def _connect(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()  # the server closed it while idle
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.tls,
                                        limit=4 * READ_SIZE),
                self.connect_timeout_s)
        except TimeoutError as exc:
            raise HTTPTimeoutError(f"connecting to {self.host}:{self.port} timed out") from exc
        except OSError as exc:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # Without it a request body can wait for the server's delayed ACK (Nagle).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(reader, writer)

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, path: str, body: bytes | None = None,
        content_type: str = "application/json",
    ) -> AsyncIterator[Response]:
        """Send a request and yield the response once its headers are in.

        The connection goes back to the pool only when the body was read to the end; a
        response left early (a stopped stream) closes its connection.
        """
        if self._closed:
            raise HTTPError("client is closed")
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head}"
        if body is not None:
            head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        payload = (head + "\r\n").encode("latin-1") + (body or b"")
        # No retries: a request the server read and then dropped must surface as a failure
        # (stability runs count them), so stale pooled connections are discarded up front.
        conn = await self._connect()
        try:
            conn.writer.write(payload)
            await conn.writer.drain()
            response = await self._read_head(conn)
        except HTTPError:
            conn.close()
            raise
        except (ConnectionError, OSError) as exc:
            conn.close()
            raise HTTPError(f"request failed: {exc}") from exc
        try:
            yield response
        finally:
            if response._done and not self._closed and response.headers.get(
                    "connection", "").lower() != "close":
                self._idle.append(conn)
            else:
                conn.close()

    async def _read_head(self, conn: _Connection) -> Response:
        buf = b""
        while b"\r\n\r\n" not in buf:
            try:
                data = await asyncio.wait_for(conn.reader.read(READ_SIZE), self.timeout_s)
            except TimeoutError as exc:
                raise HTTPTimeoutError(f"no response within {self.timeout_s:g} s") from exc
            if not data:
                raise HTTPError("server closed the connection without a response")
            buf += data
            if len(buf) > 1 << 20:
                raise HTTPError("response headers larger than 1 MiB")
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError) as exc:
            raise HTTPError(f"malformed status line {lines[0][:80]!r}") from exc
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        remaining = None if chunked or length is None else int(length)
        response = Response(status, headers, conn, chunked, remaining, rest,
                            _timeout=self.timeout_s)
        if remaining == 0 or status in (204, 304):
            response._done = True
        return response

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.request("GET", path) as response:
            return response.status, await response.read()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        async with self.request("POST", path, body) as response:
            return response.status, await response.read()

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()

"""HTTP/1.1 for the router: client connections (an asyncio protocol, standard library).

A client connection parses one request at a time (keep-alive; a pipelined request waits in the
buffer) and hands it to the app, which answers with `send_json` or forwards it (relay.py: the
engine's bytes go to the client from a relay thread, never through the loop). A client that goes
away cancels what its request waits for: a load queue place, or the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

MAX_HEAD = 64 * 1024
# Reads go into one buffer per connection (BufferedProtocol, and the relay's recv_into): a plain
# protocol receives into a fresh 256 KiB bytes object each time, ~20 µs per read.
READ_SIZE = 64 * 1024
MAX_BODY = 64 * 1024 * 1024
# Hop-by-hop headers (RFC 9110 7.6.1) and those the router sets itself on the way to the engine.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length", "expect"})
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 411: "Length Required", 413: "Content Too Large",
           431: "Request Header Fields Too Large", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable"}


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class UpstreamError(Exception):
    """The engine could not be reached, or closed the connection without answering."""


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names
    raw_headers: list[tuple[str, str]]  # as sent, in order
    body: bytes
    keep_alive: bool

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


Handler = Callable[[Request, "Connection"], Awaitable[None]]


def parse_head(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
    """(method, target, version, headers) of a request head (without its blank line)."""
    try:
        text = head.decode("latin-1")
        line, *lines = text.split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        raise HttpError(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise HttpError(400, f"unsupported protocol {version!r}")
    headers = []
    for item in lines:
        name, sep, value = item.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, f"malformed header line {item[:60]!r}")
        headers.append((name, value.strip()))
    return method, target, version, headers


def chunked_body(buf: bytes | bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a chunked body beginning at `start`: (body, end offset), or None while incomplete."""
    parts: list[bytes] = []
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        except ValueError:
            raise HttpError(400, "malformed chunk size") from None
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)  # no trailers are expected; skip any
            return (b"".join(parts), end + 4) if end >= 0 else None
        if eol + 2 + size + 2 > len(buf):
            return None
        parts.append(bytes(buf[eol + 2:eol + 2 + size]))
        pos = eol + 2 + size + 2
        if pos - start > MAX_BODY:
            raise HttpError(413, f"request body over {MAX_BODY} bytes")


def response_head(status: int, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, '')}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Connection(asyncio.BufferedProtocol):
    """One client connection: requests one at a time, each handled by `handler`."""

    def __init__(self, handler: Handler, connections: set[Connection]) -> None:
        self.handler, self.connections = handler, connections
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.view = memoryview(bytearray(READ_SIZE))
        self.task: asyncio.Task[None] | None = None
        self.relay: Any = None  # relay.Relay while a forwarded answer is being piped
        self.closed = False
        self.keep_alive = True
        self.continued = False  # "100 Continue" sent for the request being read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small SSE writes must not wait for delayed ACKs
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections.add(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view

    def buffer_updated(self, nbytes: int) -> None:
        self.buffer += self.view[:nbytes]
        if self.task is None:
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.connections.discard(self)
        if self.relay is not None:
            self.relay.cancel()  # closes the engine connection: the engine aborts the request
        if self.task is not None:
            self.task.cancel()  # e.g. a request still waiting for its model to load

    def _next(self) -> None:
        try:
            request = self._parse()
        except HttpError as exc:
            self.keep_alive = False
            self.send_json(exc.status, error_body(exc.message, exc.status))
            self.close()
            return
        if request is not None:
            self.task = asyncio.get_running_loop().create_task(self._run(request))

    def _parse(self) -> Request | None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                raise HttpError(431, f"request head over {MAX_HEAD} bytes")
            return None
        method, target, version, raw = parse_head(bytes(self.buffer[:end]))
        headers = {name.lower(): value for name, value in raw}
        start = end + 4
        if "chunked" in headers.get("transfer-encoding", "").lower():
            decoded = chunked_body(self.buffer, start)
            if decoded is None:
                self._continue(headers)
                return None
            body, stop = decoded
        else:
            try:
                length = int(headers.get("content-length") or 0)
            except ValueError:
                raise HttpError(400, "malformed Content-Length") from None
            if length < 0 or length > MAX_BODY:
                raise HttpError(413, f"request body over {MAX_BODY} bytes")
            if len(self.buffer) < start + length:
                self._continue(headers)
                return None
            body, stop = bytes(self.buffer[start:start + length]), start + length
        del self.buffer[:stop]
        self.continued = False
        connection = headers.get("connection", "").lower()
        keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        return Request(method, target, headers, raw, body, keep)

    def _continue(self, headers: dict[str, str]) -> None:
        if headers.get("expect", "").lower() == "100-continue" and not self.continued:
            self.continued = True
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    async def _run(self, request: Request) -> None:
        self.keep_alive = request.keep_alive
        try:
            await self.handler(request, self)
        except asyncio.CancelledError:
            self.keep_alive = False
        finally:
            self.task = None
            if not self.keep_alive or self.closed:
                self.close()
            elif self.buffer:
                self._next()

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        headers = [("content-type", content_type), ("content-length", str(len(body)))]
        if not self.keep_alive:
            headers.append(("connection", "close"))
        self.write(response_head(status, headers) + body)

    def send_json(self, status: int, data: Any) -> None:
        self.send(status, json.dumps(data).encode())

    def abort(self) -> None:
        """Cut the connection now (a request in flight is ended: its relay and task cancelled)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """An OpenAI-style error body, shaped as vLLM's (`{"error": {message, type, param, code}}`)."""
    names = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
             404: "NotFoundError", 503: "ServiceUnavailableError"}
    error = {"message": message, "type": err_type or names.get(status, "ServerError"),
             "param": param, "code": status, **extra}
    return {"error": error}

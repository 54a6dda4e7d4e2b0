"""The router's front door: aiohttp's HTTP/1.1 server with the router's limits on every connection.

aiohttp parses requests (llhttp, strict: a bare LF, an obs-fold, a signed or oversized chunk size,
duplicate Content-Length, Content-Length with Transfer-Encoding are all refused before the router
sees a request). What aiohttp leaves open is added here, per connection, without parsing anything:

* a cap on open connections (ROUTER_MAX_CONNECTIONS): one more is answered 503 and closed;
* a cap per client address (ROUTER_MAX_CLIENT_CONNECTIONS), answered the same way;
* a head that is not complete within ROUTER_HEADER_TIMEOUT of its first byte: 408 (slowloris);
* a head over ROUTER_MAX_HEAD_BYTES in all (aiohttp bounds each line, not their sum): 431;
* aiohttp's own refusals reshaped as OpenAI errors (a too-long line is 431, the rest 400), never
  logged as the router's faults.

The idle keep-alive timeout is aiohttp's (ROUTER_KEEPALIVE_TIMEOUT); body limits and the body
timeout are applied where the body is read (server.read_body).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

from aiohttp import http_exceptions, web
from aiohttp.web import RequestHandler

from vllmstack.router.limits import Limits, error_json

REFUSAL_LINGER_S = 0.5  # a refused connection reads (and drops) what the client sends meanwhile
MAX_HEADERS = 100  # header lines per request (aiohttp's default 128; nginx sends 400 past its buffers)


def raw_response(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection."""
    body = error_json(message, status)
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


def parser_refusal(exc: BaseException | None, limits: Limits) -> tuple[int, str]:
    """The status and message for a request aiohttp's parser refused."""
    if isinstance(exc, http_exceptions.LineTooLong):
        return 431, (f"a request line or header is longer than {limits.max_head} bytes "
                     "(ROUTER_MAX_HEAD_BYTES)")
    text = (getattr(exc, "message", None) or str(exc or "malformed request")).split("\n")[0]
    if "Too many headers" in text:
        return 431, f"the request has more than {MAX_HEADERS} header lines"
    return 400, f"malformed HTTP request: {text.rstrip(':')[:200]}"


def peer_address(transport: asyncio.BaseTransport) -> str:
    """The client's IP address (its port left out: one client opens many connections)."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return str(peer or "")


class Refusal(asyncio.Protocol):
    """A connection over the cap: answered 503 at once, closed after a short linger."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not asyncio.Transport: uvloop's TCPTransport (the router's loop) is no subclass of it,
        # and an isinstance assert there answered nothing at all (issue 35).
        cast(asyncio.WriteTransport, transport).write(raw_response(
            503, f"the router holds its most client connections ({self.limit}, "
                 "ROUTER_MAX_CONNECTIONS); try again"))
        asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass


class Connection(RequestHandler):
    """One client connection: aiohttp's handler plus the head's timeout and total size."""

    def __init__(self, front: Front, **kwargs: Any) -> None:
        super().__init__(front, **kwargs)
        self.front = front
        self.limits = front.limits
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted_out = False
        self._finished = 0  # requests whose handling ended; aiohttp counts those it parsed
        self.peer = ""  # the client's address; "" until connected, or when over its own cap
        self._over_cap = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Count the connection against its peer address's cap (ROUTER_MAX_CLIENT_CONNECTIONS):
        one client keeping a request on every connection locked everyone out (issue 35). Over
        it: 503, and closed after the same linger as a Refusal, so the client reads the 503."""
        super().connection_made(transport)
        peer = peer_address(transport)
        if not peer:
            return  # no address to count by (not a TCP peer)
        if self.front.clients.get(peer, 0) >= self.limits.max_client_connections:
            self._over_cap = True
            cast(asyncio.WriteTransport, transport).write(raw_response(
                503, f"this client holds its most connections to the router "
                     f"({self.limits.max_client_connections}, ROUTER_MAX_CLIENT_CONNECTIONS); "
                     "reuse one or try again"))
            asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, self.force_close)
            return
        self.peer = peer
        self.front.clients[peer] = self.front.clients.get(peer, 0) + 1

    def _between_requests(self) -> bool:
        """No request parsed and unfinished: the next bytes are a head. Not `_request_in_progress`
        alone: aiohttp starts a parsed request's handler in a task of its own, a loop turn later,
        and body bytes read in between were counted as head (a 431 for a 70 KB body, seen in CI);
        nor after a refusal, when the connection closes and aiohttp drops what follows."""
        return (self._request_count == self._finished and not self._messages
                and not self._force_close and not self._close)

    async def _handle_request(self, request: web.BaseRequest, start_time: float | None,
                              request_handler: Callable[[web.BaseRequest],
                                                        Awaitable[web.StreamResponse]],
                              ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._finished += 1

    def data_received(self, data: bytes) -> None:
        if self._over_cap:
            return None  # read and dropped until the linger ends
        waiting = self._between_requests()
        if waiting and data:
            if self._head_timer is None:
                self._head_timer = asyncio.get_running_loop().call_later(
                    self.limits.header_timeout, self._head_late)
            self._head_bytes += len(data)
        super().data_received(data)
        if self._messages or self._request_in_progress:  # a complete head
            self._head_done()
        elif waiting and self._head_bytes > self.limits.max_head:
            self.refuse(431, f"the request head is over {self.limits.max_head} bytes "
                             "(ROUTER_MAX_HEAD_BYTES)")
        return None

    def _head_done(self) -> None:
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._between_requests() and self.transport is not None:
            self.refuse(408, f"the request head did not arrive within "
                             f"{self.limits.header_timeout:g} s (ROUTER_HEADER_TIMEOUT)")

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` and close, outside any request (the head never completed)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(raw_response(status, message))
        self._head_done()
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._head_done()
        if not self._counted_out:
            self._counted_out = True
            self.front.open -= 1
            if self.peer:
                left = self.front.clients.get(self.peer, 1) - 1
                if left > 0:
                    self.front.clients[self.peer] = left
                else:  # the table holds connected peers only
                    self.front.clients.pop(self.peer, None)
        super().connection_lost(exc)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None,
                     ) -> web.StreamResponse:
        """aiohttp's error answer (a refused request, or an exception out of the handler),
        as an OpenAI error; an unexpected exception goes to the router's log."""
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun; the connection is closed instead")
        if status == 400:
            status, text = parser_refusal(exc, self.limits)
        else:
            text = HTTPStatus(status).phrase
            if exc is not None:
                self.front.say(f"error: {request.method} {request.rel_url.raw_path[:200]}: "
                               f"{type(exc).__name__}: {exc}")
                text = f"the router failed: {type(exc).__name__} (see its log)"
        response = web.Response(status=status, body=error_json(text, status),
                                content_type="application/json")
        response.force_close()
        return response


class Front(web.Server):
    """aiohttp's low-level server (one handler, no URL dispatcher: the router's routes are a
    short fixed list) making Connections, or a Refusal beyond the connection cap."""

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                 limits: Limits, *, say: Callable[[str], None] = lambda line: None) -> None:
        # Each Connection's keyword arguments, kept here (not read back from the Server's own
        # private copy): tests/test_router_aiohttp_contract.py checks RequestHandler takes them.
        self.options: dict[str, Any] = {
            "keepalive_timeout": limits.keepalive_timeout, "max_line_size": limits.max_head,
            "max_field_size": limits.max_head, "max_headers": MAX_HEADERS,
            "auto_decompress": False,  # no gzip bombs
            "access_log": None, "lingering_time": 2.0}
        # handler_cancellation: a client that leaves ends its handler (and so the engine request).
        super().__init__(self._checked, handler_cancellation=True, **self.options)
        self.handler, self.limits, self.say = handler, limits, say
        self.open = 0  # Connections made and not yet lost
        self.clients: dict[str, int] = {}  # per peer address: its Connections not yet lost

    async def _checked(self, request: web.BaseRequest) -> web.StreamResponse:
        """The head's total size, which aiohttp bounds only line by line (a head read in one
        burst never reached Connection's running count)."""
        size = len(request.method) + len(request.raw_path) + 12 + sum(
            len(name) + len(value) + 4 for name, value in request.raw_headers)
        if size > self.limits.max_head:
            response = web.Response(status=431, content_type="application/json", body=error_json(
                f"the request head is over {self.limits.max_head} bytes (ROUTER_MAX_HEAD_BYTES)",
                431))
            response.force_close()
            return response
        return await self.handler(request)

    def __call__(self) -> Any:
        if self.open >= self.limits.max_connections:
            return Refusal(self.limits.max_connections)
        self.open += 1
        return Connection(self, loop=asyncio.get_running_loop(), **self.options)

"""The router's client to its engines: one pooled, keep-alive aiohttp session.

A request is forwarded on a kept-alive connection to the engine (a fresh connect per request cost
~2 ms of TTFT on the H200). Kept connections are dropped after UPSTREAM_KEEPALIVE_S idle, before
the engine's own server closes them (uvicorn's default is 5 s), so a request never goes out on a
connection the engine is closing. Timeouts are the ROUTER_UPSTREAM_* settings: connect, and the
longest wait for the engine's next bytes (its answer's head, then each streamed chunk).

`relay` copies the engine's body to the client as it comes, HTTP chunk for HTTP chunk (an SSE
event the engine wrote as one chunk leaves as one chunk), without parsing it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from vllmstack.router.limits import Limits

UPSTREAM_KEEPALIVE_S = 4.0
PROBE_TIMEOUT_S = 2.0
CUT_ABORT_S = 2.0
# Hop-by-hop headers (RFC 9110 7.6.1) and those each side sets for itself.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade",
                        "host", "content-length", "expect"})


class UpstreamError(Exception):
    """The engine could not be reached, timed out, or sent something that is not HTTP."""

    def __init__(self, message: str, *, timeout: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.timeout, self.refused = timeout, refused


@dataclass(eq=False)
class Cut:
    """How a forwarded request is ended early by the router (a swap's drain, a stop), with a
    reason: the engine connection is closed (the engine aborts the request) and the client's
    stream ends with an error event; before the engine's answer began, the wait is cancelled. A
    request still not ended CUT_ABORT_S later (its client reads nothing, so the error event
    cannot be written) loses its client connection: a drain never waits on a stalled client."""

    task: asyncio.Task[Any] | None = None  # the request's handler
    transport: asyncio.Transport | None = None  # its client connection
    reason: str = ""
    answer: aiohttp.ClientResponse | None = None
    done: bool = False  # the request ended (its connection may serve the next one)

    def __call__(self, reason: str) -> None:
        if self.reason or self.done:
            return
        self.reason = reason
        if self.answer is not None:
            self.answer.close()  # the pending read ends now; the engine sees the close
        elif self.task is not None:
            self.task.cancel()
        asyncio.get_running_loop().call_later(CUT_ABORT_S, self._abort)

    def _abort(self) -> None:
        if not self.done and self.transport is not None and not self.transport.is_closing():
            self.transport.abort()  # connection_lost cancels the handler, which then ends


def listed_in_connection(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The header names a Connection header declares hop-by-hop (RFC 9110 7.6.1)."""
    return frozenset(token.strip().lower() for name, value in headers
                     if name.lower() == "connection" for token in value.split(","))


def request_headers(headers: Iterable[tuple[str, str]], drop: frozenset[str]) -> CIMultiDict[str]:
    """The client's headers for the engine: hop-by-hop ones (also those its Connection header
    names) and `drop` left out."""
    pairs = list(headers)
    skip = HOP_BY_HOP | drop | listed_in_connection(pairs)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in pairs:
        if name.lower() not in skip:
            out.add(name, value)
    return out


def response_headers(answer: aiohttp.ClientResponse) -> CIMultiDict[str]:
    """The engine's response headers for the client, hop-by-hop ones left out."""
    pairs = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in answer.raw_headers]
    skip = HOP_BY_HOP | listed_in_connection(pairs)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in pairs:
        if name.lower() not in skip:
            out.add(name, value)
    return out


class Upstream:
    """The session every forward and health probe goes through (made on the event loop)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S,
                                             use_dns_cache=False)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                # Only what the client sent goes to the engine: no User-Agent, Accept or
                # Accept-Encoding of aiohttp's own.
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.limits.connect_timeout,
                                              sock_read=self.limits.read_timeout))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def probe(self, url: str) -> bool:
        """Whether the engine at `url` answers /health with 200 (within PROBE_TIMEOUT_S)."""
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(
                    total=PROBE_TIMEOUT_S)) as answer:
                await answer.read()
                return answer.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def post_bare(self, url: str, timeout: float) -> tuple[int, bytes]:
        """POST with no body (an engine's dev-mode /sleep and /wake_up): its status and body.
        Its own `timeout` in all, not the forwards' read timeout: a first sleep takes minutes.
        UpstreamError when no answer came."""
        try:
            async with self.session.post(url, allow_redirects=False, timeout=aiohttp.ClientTimeout(
                    total=timeout, sock_connect=self.limits.connect_timeout)) as answer:
                return answer.status, await answer.read()
        except TimeoutError:
            raise UpstreamError(f"no answer within {timeout:g} s", timeout=True) from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(f"cannot connect ({exc.os_error.strerror or exc.os_error})",
                                refused=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(_describe(exc)) from None

    @contextlib.asynccontextmanager
    async def open(self, url: str, headers: CIMultiDict[str], body: bytes, cut: Cut
                   ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST `body` to `url`; the engine's response once its head arrived. UpstreamError when
        there is none. The connection goes back to the pool only after a complete body."""
        try:
            answer = await self.session.post(url, data=body, headers=headers,
                                             allow_redirects=False)
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise UpstreamError(f"no answer within {self.limits.read_timeout:g} s "
                                "(ROUTER_UPSTREAM_READ_TIMEOUT)", timeout=True) from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(f"cannot connect ({exc.os_error.strerror or exc.os_error})",
                                refused=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(_describe(exc)) from None
        cut.answer = answer
        try:
            yield answer
        finally:
            cut.answer = None
            answer.release()  # complete: back to the pool; not complete: closed


async def begin_response(request: web.BaseRequest, answer: aiohttp.ClientResponse
                         ) -> web.StreamResponse:
    """The client's response to the upstream `answer`, its head sent: the status and headers
    (hop-by-hop ones left out), framed as the client can read it."""
    response = web.StreamResponse(status=answer.status, reason=answer.reason,
                                  headers=response_headers(answer))
    length = answer.headers.get("content-length")
    if length is not None and length.isdigit() and "transfer-encoding" not in answer.headers:
        response.content_length = int(length)
    elif request.version >= aiohttp.HttpVersion11:
        response.enable_chunked_encoding()
    else:  # HTTP/1.0 has no chunks (a 500 with them): the body ends at the close
        response.force_close()
    await response.prepare(request)
    return response


async def relay(answer: aiohttp.ClientResponse, response: web.StreamResponse) -> None:
    """Copy the engine's body to the client as it arrives. A chunked body leaves chunk for chunk
    (a chunk split across reads is written once whole); any other body piece by piece."""
    chunked = "chunked" in answer.headers.get("transfer-encoding", "").lower()
    write, read = response.write, answer.content.readchunk  # the hot loop: no iterator objects
    pending = b""
    while True:
        data, end = await read()
        if not data and not end:
            return  # the body's end (readchunk's own marker)
        if not chunked:
            await write(data)
        elif not end:
            pending += data
        elif pending:
            await write(pending + data)
            pending = b""
        elif data:
            await write(data)


def _describe(exc: BaseException) -> str:
    text = str(exc).split("\n")[0][:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

"""The gate every request to the dashboard passes before the app sees it: who may ask, and how much.

FastAPI reads and parses a route's body before its dependencies run, so a token check written as
a dependency came after the body: a 300 MB unauthenticated POST grew the dashboard to 938 MB
before its 401. This ASGI middleware decides from the headers alone, before one byte of the body
is read:

* access: a state-changing request (POST, PUT, PATCH, DELETE) needs the token when one is
  required, else a loopback Host and Origin (core.access.write_denial). A reading request to
  `/api/` (history, run logs with their argv, router state, metrics) needs the token whenever one
  is required (the dashboard is reachable beyond loopback, or a token is set), else a loopback
  Host, so a DNS-rebinding page cannot read them either. `/api/health` and `/api/info` stay open
  (the page learns from /api/info whether to ask for a token; it says little without one).
* size: a body over MAX_BODY_BYTES is refused with 413, from Content-Length when there is one,
  else as soon as the chunks received pass the limit (nothing more is read).
* depth: a JSON body nested deeper than MAX_JSON_DEPTH is refused with 400 (json.loads raises
  RecursionError on deep nesting, which was a 500).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from vllmstack.core import access
from vllmstack.core.files import parse_json

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# The largest body any route takes is a run's options: a few hundred bytes.
MAX_BODY_BYTES = 64 * 1024
MAX_JSON_DEPTH = 16
TOKEN_HEADER = "x-dashboard-token"
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Readable without a token: the page asks these before it knows whether it needs one.
OPEN_PATHS = frozenset({"/api/health", "/api/info"})

NEEDS_TOKEN_TEXT = ("this dashboard needs its token: send DASHBOARD_TOKEN as 'Authorization: "
                    "Bearer TOKEN' or 'X-Dashboard-Token'")
NOT_LOCAL_TEXT = ("state-changing requests must come from this machine (http://127.0.0.1 or "
                  "http://localhost); set DASHBOARD_TOKEN to allow others")
NOT_LOCAL_READ_TEXT = ("this dashboard answers only requests addressed to this machine "
                       "(http://127.0.0.1 or http://localhost); set DASHBOARD_TOKEN to allow others")


def header_map(scope: Scope) -> dict[str, str]:
    """The request's headers, lower-case names; the first of a repeated header wins."""
    out: dict[str, str] = {}
    for name, value in scope.get("headers") or []:
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


def authorized(headers: dict[str, str], *, token: str, required: bool) -> bool:
    """The request carries the token (always true where none is required)."""
    return not required or access.write_denial(headers, token=token, required=True,
                                               token_header=TOKEN_HEADER) is None


def read_denial(headers: dict[str, str], *, token: str, required: bool) -> str | None:
    """Why a reading request is refused: the token where one is required, else a loopback Host."""
    if required:
        return access.write_denial(headers, token=token, required=True, token_header=TOKEN_HEADER)
    host = urlsplit("//" + headers.get("host", "")).hostname or ""
    return None if access.is_loopback(host) else access.NOT_LOCAL


class Gate:
    """ASGI middleware: access, body size and JSON depth, decided before the app runs."""

    def __init__(self, app: App, *, token: str, required: bool,
                 max_body: int = MAX_BODY_BYTES, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app, self.token, self.required = app, token, required
        self.max_body, self.max_depth = max_body, max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = header_map(scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _answer(send, *refusal)
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                await _answer(send, 400, "Content-Length is not a number")
                return
            if int(length) > self.max_body:
                await _answer(send, 413, f"the body is {int(length)} bytes; this dashboard takes "
                                         f"at most {self.max_body}")
                return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = bool(message.get("more_body"))
            if len(body) > self.max_body:
                await _answer(send, 413, f"the body is larger than {self.max_body} bytes, the most "
                                         "this dashboard takes")
                return
        if body and "json" in headers.get("content-type", ""):
            try:
                parse_json(bytes(body), max_depth=self.max_depth, allow_nan=True)
            except ValueError as exc:
                if "nested too deeply" in str(exc):
                    await _answer(send, 400, f"the JSON body is {exc}")
                    return
                # Other bad JSON: the app's own 422 names where it breaks.
        await self.app(scope, _replay(bytes(body), receive), send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str] | None:
        method, path = scope.get("method", "GET").upper(), scope.get("path", "")
        if method in WRITE_METHODS:
            denial = access.write_denial(headers, token=self.token, required=self.required,
                                         token_header=TOKEN_HEADER)
            text = NOT_LOCAL_TEXT
        elif path.startswith("/api/") and path not in OPEN_PATHS:
            denial = read_denial(headers, token=self.token, required=self.required)
            text = NOT_LOCAL_READ_TEXT
        else:
            return None
        if denial == access.NEEDS_TOKEN:
            return 401, NEEDS_TOKEN_TEXT
        if denial == access.NOT_LOCAL:
            return 403, text
        return None


def _replay(body: bytes, live: Receive) -> Receive:
    """A receive() that hands the app the body already read, then the live one (which says when
    the client disconnects)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await live()

    return receive


async def _answer(send: Send, status: int, detail: str) -> None:
    payload = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"cache-control", b"no-store"), (b"connection", b"close")]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="vllmstack dashboard"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})

"""The router's running count of a request head must not take in its body (issue 22's limits).

aiohttp parses a head, then starts its handler in a task of its own, a loop turn later. Body bytes
read in that turn were counted as the next head, and past ROUTER_MAX_HEAD_BYTES the connection was
answered 431 instead of the request's own answer (CI, test_router_hostile: a 70 KB chunked body
got 431, not 413). Driven here without sockets, so the turn is hit every time.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from vllmstack.router.front import Front
from vllmstack.router.limits import Limits


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


async def deliver(parts: list[bytes], limits: Limits) -> tuple[bytes, bool]:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        return web.Response(text=f"{len(body)}")

    front = Front(handler, limits)
    connection = front()
    transport = Transport()
    connection.connection_made(transport)
    connection.data_received(parts[0])
    # Let aiohttp's loop take the parsed request off its queue and schedule the handler's task,
    # but not run it: the window the next bytes used to fall into.
    for _ in range(3):
        if not connection._messages:
            break
        await asyncio.sleep(0)
    window = not connection._messages and not connection._request_in_progress
    for part in parts[1:]:
        connection.data_received(part)
    for _ in range(50):
        await asyncio.sleep(0.01)
        if b"\r\n\r\n" in transport.written and transport.written.split(b"\r\n\r\n", 1)[1]:
            break
    connection.connection_lost(None)
    return transport.written, window


def test_body_bytes_read_before_the_handler_starts_are_not_a_head() -> None:
    body = b"x" * 20000
    head = f"POST /v1/x HTTP/1.1\r\nhost: a\r\ncontent-length: {len(body)}\r\n\r\n".encode()
    written, window = asyncio.run(deliver([head + body[:6000], body[6000:]], Limits(max_head=4096)))
    assert window, "the second read did not land between the parse and the handler's start"
    assert written.startswith(b"HTTP/1.1 200"), written[:200]
    assert written.endswith(b"20000")


def test_a_head_over_the_limit_in_pieces_is_still_431() -> None:
    pieces = [b"POST /v1/x HTTP/1.1\r\nhost: a\r\n"] + [b"x-pad: " + b"p" * 1000 + b"\r\n"] * 6
    written, _ = asyncio.run(deliver(pieces, Limits(max_head=4096)))
    assert written.startswith(b"HTTP/1.1 431"), written[:200]

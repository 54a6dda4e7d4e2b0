"""The benchmark's own HTTP/1.1 client: framing, keep-alive, failures that must surface."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import pytest

from vllmstack.bench.client.http import HTTPClient, HTTPError, HTTPTimeoutError, _Protocol

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length) if length else b""


def serve(handler: Handler, test: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await test(f"http://127.0.0.1:{port}")
        finally:
            server.close()

    asyncio.run(main())


def chunked(*parts: bytes) -> bytes:
    body = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts)
    return (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream"
            b"\r\n\r\n" + body + b"0\r\n\r\n")


def test_chunked_body_split_into_single_bytes_is_reassembled() -> None:
    response = chunked(b"data: one\n\n", b"data: two\n\n")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for i in range(len(response)):  # the worst case: every byte its own segment
            writer.write(response[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        writer.close()

    async def test(url: str) -> None:
        client = HTTPClient(url)
        got: list[bytes] = []
        async with client.request("POST", "/x", b"{}") as r:
            assert r.status == 200
            await r.stream(lambda data, now: got.append(data))
        assert b"".join(got) == b"data: one\n\ndata: two\n\n"
        await client.aclose()

    serve(handler, test)


def test_keep_alive_reuses_one_connection_and_sends_body() -> None:
    connections = []
    bodies = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while True:
            try:
                bodies.append(await read_request(reader))
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async def test(url: str) -> None:
        client = HTTPClient(url)
        for i in range(3):
            assert await client.post("/p", f'{{"n":{i}}}'.encode()) == (200, b"ok")
        assert await client.get("/g") == (200, b"ok")
        await client.aclose()

    serve(handler, test)
    assert len(connections) == 1
    assert bodies == [b'{"n":0}', b'{"n":1}', b'{"n":2}', b""]


def test_dropped_request_is_an_error_not_a_retry() -> None:
    seen = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.close()  # read it, answer nothing

    async def test(url: str) -> None:
        client = HTTPClient(url)
        with pytest.raises(HTTPError, match="without a response"):
            await client.post("/p", b"{}")
        await client.aclose()

    serve(handler, test)
    assert len(seen) == 1


def test_connection_cut_mid_body_and_refused_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort")
        await writer.drain()
        writer.close()

    async def test(url: str) -> None:
        client = HTTPClient(url)
        with pytest.raises(HTTPError, match="in the middle of the response"):
            await client.get("/")
        await client.aclose()
        with pytest.raises(HTTPError, match="cannot connect"):
            await HTTPClient("http://127.0.0.1:9").get("/")

    serve(handler, test)


def test_silent_server_times_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def test(url: str) -> None:
        client = HTTPClient(url, timeout_s=0.3)
        with pytest.raises(HTTPTimeoutError, match=r"no complete response within 0\.3 s"):
            await client.get("/")
        await client.aclose()

    serve(handler, test)


def test_trickling_server_cannot_extend_the_deadline() -> None:
    # A byte every 50 ms keeps the connection busy forever; an idle timeout would never fire.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"1\r\n:\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)

    async def test(url: str) -> None:
        client = HTTPClient(url, timeout_s=0.6)
        started = time.monotonic()
        got: list[bytes] = []
        async with client.request("POST", "/x", b"{}") as response:
            with pytest.raises(HTTPTimeoutError):
                await response.stream(lambda data, now: got.append(data))
        assert time.monotonic() - started < 1.5
        assert len(got) >= 3  # bytes did arrive; they just cannot buy more time
        await client.aclose()

    serve(handler, test)


def test_body_split_anywhere_is_parsed_the_same() -> None:
    """Chunk framing cut at every possible point, including inside size lines and CRLFs."""
    body = [b"data: " + bytes([65 + i % 26]) * (i * 37 % 300 + 1) + b"\n\n" for i in range(40)]
    raw = chunked(*body)

    async def main() -> None:
        for step in (1, 2, 3, 5, 17, 4096):
            protocol = _Protocol()
            got: list[bytes] = []
            protocol.sink = lambda data, now, got=got: got.append(data)
            for i in range(0, len(raw), step):
                protocol.data_received(raw[i:i + step])
            assert protocol.complete, step
            assert b"".join(got) == b"".join(body), step

    asyncio.run(main())


def test_malformed_chunk_size_is_an_error() -> None:
    async def main() -> None:
        protocol = _Protocol()
        protocol.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")
        with pytest.raises(HTTPError, match="bad chunk size"):
            protocol.body_future.result()

    asyncio.run(main())


def test_close_delimited_body() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    async def test(url: str) -> None:
        client = HTTPClient(url)
        assert await client.get("/") == (200, b"all of it")
        await client.aclose()

    serve(handler, test)

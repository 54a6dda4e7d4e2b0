"""Client cost per streamed chunk, and how late chunks reach the client. Prints numbers.

    python benchmarks/bench_client_overhead.py [--chunks 20000] [--streams 8]

1. parser only: vLLM-shaped SSE events fed to the stream parser (µs per chunk, CPU);
2. end to end: the bench client reading S parallel streams from a local server that writes
   chunks as fast as it can; client process CPU time / chunks (target: at most 30 µs);
3. timing fidelity: a server that stamps each chunk with CLOCK_MONOTONIC at write time (the
   client's perf_counter reads the same clock), so "request sent -> server saw it" and
   "server wrote -> client read" are measured directly, for this client and for httpx.
The server runs in a child process so it does not share the client's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers import free_port  # noqa: E402

from vllmstack.bench.client.client import ChatClient, RequestResult, _StreamState  # noqa: E402
from vllmstack.bench.client.stats import percentile  # noqa: E402

HEAD = ('"id":"chatcmpl-8d8a60308144a586","object":"chat.completion.chunk",'
        '"created":1795968669,"model":"tiny"')


def vllm_chunk(i: int, stamp: float | None = None) -> bytes:
    """One chunk as vLLM 0.27 sends it with continuous usage stats (plus an optional stamp)."""
    extra = f',"t_write":{stamp!r}' if stamp is not None else ""
    return (f'data: {{{HEAD},"choices":[{{"index":0,"delta":{{"content":" word{i % 97}"}},'
            f'"logprobs":null,"finish_reason":null,"token_ids":null}}],"usage":{{'
            f'"prompt_tokens":26,"total_tokens":{27 + i},"completion_tokens":{i + 1}}}'
            f'{extra}}}\n\n').encode()


# --- the child-process server -------------------------------------------------------------


def serve(port: int, chunks: int, gap_s: float) -> None:
    def handle(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = conn.makefile("rb")
        while True:
            line = reader.readline()
            if not line:
                return
            t_req = time.monotonic()
            length = 0
            while True:
                header = reader.readline()
                if header in (b"\r\n", b""):
                    break
                if header.lower().startswith(b"content-length:"):
                    length = int(header.split(b":")[1])
            reader.read(length)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            first = (f'data: {{"t_req":{t_req!r},"choices":[{{"index":0,"delta":{{"role":'
                     f'"assistant","content":""}}}}]}}\n\n').encode()
            conn.sendall(f"{len(first):x}\r\n".encode() + first + b"\r\n")
            for i in range(chunks):
                if gap_s:
                    time.sleep(gap_s)
                data = vllm_chunk(i, time.monotonic())
                conn.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            done = b"data: [DONE]\n\n"
            conn.sendall(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def start_server(chunks: int, gap_s: float) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--chunks",
                             str(chunks), "--gap-us", str(gap_s * 1e6)])
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("stamp server did not start")


# --- measurements -------------------------------------------------------------------------


def parser_cost(chunks: int) -> float:
    events = [vllm_chunk(i) for i in range(chunks)] + [b"data: [DONE]\n\n"]
    start = time.process_time()
    result = RequestResult()
    state = _StreamState(result)
    for i, event in enumerate(events):
        state.feed(event, float(i))
    state.close()
    assert result.tokens == chunks
    return (time.process_time() - start) / chunks * 1e6


def parser_cost_after_idle(idle_s: float, chunks: int = 400) -> tuple[float, float]:
    """Median µs of one parse, and of a bare json.loads, when the process slept before it.

    Shows the machine's cold-cache cost: on a busy box the same code runs several times
    slower after sleeping between chunks, which is what paced streams do.
    """
    result = RequestResult()
    state = _StreamState(result)
    parse, plain = [], []
    payload = vllm_chunk(1)[6:-2]
    for i in range(chunks):
        time.sleep(idle_s)
        start = time.perf_counter()
        state.feed(vllm_chunk(i), start)
        parse.append(time.perf_counter() - start)
        time.sleep(idle_s)
        start = time.perf_counter()
        json.loads(payload)
        plain.append(time.perf_counter() - start)
    return statistics.median(parse) * 1e6, statistics.median(plain) * 1e6


async def client_cpu(url: str, streams: int, rounds: int) -> tuple[float, float, float, int]:
    """(process CPU µs per chunk, callback µs per chunk mean, median per read, chunks).

    The callback time is everything the client does for a chunk (HTTP framing, SSE split,
    json.loads, bookkeeping): with a Protocol there is no per-chunk coroutine switch on top.
    """
    from vllmstack.bench.client import http

    spent: list[float] = []
    original = http._Protocol.data_received

    def timed(self: http._Protocol, data: bytes) -> None:
        start = time.perf_counter()
        original(self, data)
        spent.append(time.perf_counter() - start)

    http._Protocol.data_received = timed  # type: ignore[method-assign]
    try:
        async with ChatClient(url) as client:
            await client.stream_chat({"model": "x"})  # connect and warm up
            spent.clear()
            start = time.process_time()
            total = 0
            for _ in range(rounds):
                results = await asyncio.gather(*[client.stream_chat({"model": "x"})
                                                 for _ in range(streams)])
                for r in results:
                    assert r.ok, r.error
                    total += len(r.chunk_times)
            cpu = (time.process_time() - start) / total * 1e6
    finally:
        http._Protocol.data_received = original  # type: ignore[method-assign]
    return cpu, sum(spent) / total * 1e6, statistics.median(spent) * 1e6, total


def _stamps(raw_chunks: list[tuple[bytes, float]]) -> tuple[float | None, list[float]]:
    t_req = None
    delays = []
    for data, now in raw_chunks:
        for line in data.split(b"\n"):
            if line.startswith(b"data: {"):
                obj = json.loads(line[6:])
                if "t_req" in obj:
                    t_req = obj["t_req"]
                if "t_write" in obj:
                    delays.append(now - obj["t_write"])
    return t_req, delays


def _collector(store: list[tuple[bytes, float]]) -> Callable[[bytes, float], None]:
    def sink(data: bytes, now: float) -> None:
        store.append((data, now))

    return sink


class _NoopReader(asyncio.Protocol):
    """Reads one response and does nothing with it: the event loop's own cost per read."""

    def __init__(self) -> None:
        self.reads = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.reads += 1
        if data.endswith(b"0\r\n\r\n") and not self.done.done():
            self.done.set_result(None)


async def loop_floor(port: int, streams: int) -> float:
    """CPU per read of an asyncio Protocol that does nothing (epoll wake-ups, callbacks)."""
    loop = asyncio.get_running_loop()
    readers = []
    for _ in range(streams):
        transport, reader = await loop.create_connection(_NoopReader, "127.0.0.1", port)
        readers.append((transport, reader))
    start = time.process_time()
    for transport, _ in readers:
        transport.write(b"POST / HTTP/1.1\r\ncontent-length: 0\r\n\r\n")
    await asyncio.gather(*[r.done for _, r in readers])
    cost = (time.process_time() - start) / sum(r.reads for _, r in readers) * 1e6
    for transport, _ in readers:
        transport.close()
    return cost


async def fidelity_ours(url: str, requests: int) -> tuple[list[float], list[float]]:
    from vllmstack.bench.client.http import HTTPClient

    sends, delays = [], []
    http = HTTPClient(url)
    for _ in range(requests):
        t0 = time.perf_counter()
        got: list[tuple[bytes, float]] = []
        async with http.request("POST", "/v1/chat/completions", b'{"x":1}') as response:
            await response.stream(_collector(got))
        t_req, d = _stamps(got)
        sends.append((t_req or t0) - t0)
        delays.extend(d)
    await http.aclose()
    return sends, delays


async def fidelity_httpx(url: str, requests: int) -> tuple[list[float], list[float]] | None:
    try:
        import httpx
    except ImportError:
        return None
    sends, delays = [], []
    async with httpx.AsyncClient(base_url=url) as client:
        for _ in range(requests):
            t0 = time.perf_counter()
            got = []
            async with client.stream("POST", "/v1/chat/completions", content=b'{"x":1}') as resp:
                async for data in resp.aiter_raw():
                    got.append((data, time.perf_counter()))
            t_req, d = _stamps(got)
            sends.append((t_req or t0) - t0)
            delays.extend(d)
    return sends, delays


def describe(name: str, sends: list[float], delays: list[float]) -> str:
    delays = sorted(delays)
    return (f"  {name:<14} send->server median {statistics.median(sends) * 1000:6.3f} ms   "
            f"write->read p50 {percentile(delays, 50) * 1000:6.3f}  p90 "
            f"{percentile(delays, 90) * 1000:6.3f}  p99 {percentile(delays, 99) * 1000:6.3f} ms")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", type=int)
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--gap-us", type=float, default=0.0)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.chunks, args.gap_us / 1e6)
        return 0
    print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"1. parser only: {parser_cost(args.chunks):.2f} µs CPU per chunk, back to back "
          f"({args.chunks} vLLM-shaped chunks)")
    for idle in (0.0005, 0.005):
        parse, plain = parser_cost_after_idle(idle)
        print(f"   after {idle * 1000:g} ms idle: {parse:.1f} µs per chunk (a bare json.loads "
              f"of the same chunk: {plain:.1f} µs)")
    cases = [(f"{args.streams} streams back to back", args.streams, 2000, 0.0, 3),
             ("1 stream, a chunk every 0.5 ms", 1, 1000, 0.0005, 2),
             ("1 stream, a chunk every 5 ms", 1, 200, 0.005, 2)]
    print("2. end to end: client work per chunk = time in the connection's data callback "
          "(HTTP framing, SSE, json.loads, bookkeeping); process CPU adds the event loop's own "
          "wake-ups (measured alone: the loop floor, an asyncio Protocol that only counts reads)")
    for label, streams, chunks, gap, rounds in cases:
        proc, port = start_server(chunks, gap)
        try:
            url = f"http://127.0.0.1:{port}"
            floor = asyncio.run(loop_floor(port, streams))
            cpu, work, median_read, total = asyncio.run(client_cpu(url, streams, rounds))
        finally:
            proc.terminate()
            proc.wait()
        verdict = "OK" if work <= 30 else "ABOVE TARGET"
        print(f"   {label:<34} client work {work:5.1f} µs/chunk (median read {median_read:5.1f}"
              f" µs; target <= 30: {verdict}); process CPU {cpu:6.1f} µs/chunk, loop floor "
              f"{floor:6.1f} µs/read; {total} chunks")
    proc, port = start_server(200, 0.002)
    try:
        url = f"http://127.0.0.1:{port}"
        print("3. timing fidelity (200 chunks every 2 ms per request, 10 requests):")
        sends, delays = asyncio.run(fidelity_ours(url, 10))
        print(describe("bench client", sends, delays))
        other = asyncio.run(fidelity_httpx(url, 10))
        if other is not None:
            print(describe("httpx", *other))
    finally:
        proc.terminate()
        proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

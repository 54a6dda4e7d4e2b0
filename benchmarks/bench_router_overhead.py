"""What the router adds over talking to the engine directly: TTFT and per streamed chunk.

    python benchmarks/bench_router_overhead.py [--pairs 30] [--tokens 200] [--swaps 2] [--json]
    python benchmarks/bench_router_overhead.py --engine-url http://127.0.0.1:8000 [--pairs 30]
    flock /tmp/vllmstack-heavy.lock python benchmarks/bench_router_overhead.py --real-cpu
    python benchmarks/bench_router_overhead.py --candidates [--pairs 30]

Every mode measures in one run, in alternating pairs (direct then routed, then routed then
direct, ...: drift and the machine's load hit both alike), each path over one kept-alive client
connection, and reports medians and the router's added median:

* TTFT: a streamed one-token completion; request sent to the first body chunk read (goal: the
  router adds at most 1 ms).
* Per chunk: on the stamping engine (this file with --stamp-engine: every chunk carries the
  CLOCK_MONOTONIC time it was written, one about every 0.2 ms), the client's read time minus that stamp:
  the delay the router adds to each chunk (goal: at most 20 us). On any engine, the median gap
  between chunks of a long stream (what the router does to a stream's pace), and the router
  process's CPU time per chunk forwarded (what it costs the machine).

Modes:
* default: the engine simulator (tests/simulator) and the stamping engine, loaded by the router
  itself through `up` (native runtime), and the router's swaps (stop, start, its own share).
* --engine-url URL: an engine that already runs (vLLM on the H200): the router (its real server,
  client and scheduler, `run_router`) in front of it, in a subprocess, with a lifecycle that
  "loads" by pointing at URL. No stamping there: TTFT, chunk gap and CPU.
* --real-cpu: the real CPU vLLM engine of this checkout (.cache/engines, the made tiny model),
  started with `invoke up` in a throwaway copy, then --engine-url against it; run it under
  `flock /tmp/vllmstack-heavy.lock`.
* --candidates: how the router's server was chosen: minimal streaming proxies on each candidate
  (uvicorn with h11 or httptools, aiohttp's server; httpx or aiohttp as the engine client;
  asyncio or uvloop) against the stamping engine, side by side with direct access.

Exit 1 when an added median is over its goal (TTFT, and the stamped chunk latency where measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

from helpers import copy_project, free_port, simulator_project, write_dotenv  # noqa: E402

TTFT_GOAL_S = 1e-3
CHUNK_GOAL_S = 20e-6
SIM_ENV = "SIM_BOOT_SECONDS=0.3 SIM_TTFT_MS=0 SIM_ITL_MS=0"  # pacing off: chunks as fast as written
STAMP_GAP_S = 0.0002  # one chunk every 0.2 ms: each a wake-up of its own for the router
Run = tuple[float, list[tuple[float, bytes]]]  # (TTFT, [(read time, chunk data)])


# --- the stamping engine (a profile the router loads, or the --candidates engine) ----------------


def stamp_engine(argv: list[str]) -> None:
    """Enough of an engine for `up` (/health, /v1/models, the warm-up) whose streamed chunks carry
    the time they were written: `data: {"t": PERF_COUNTER}`. Takes vLLM's argv (--host, --port)."""
    import http.server
    import socketserver

    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    port = int(argv[argv.index("--port") + 1])

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def send_json(self, data: dict[str, Any]) -> None:
            body = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self.send_json({} if self.path == "/health" else {"object": "list", "data": []})

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if not request.get("stream"):
                self.send_json({"choices": [{"message": {"content": "Paris"}}]})
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            deadline = time.perf_counter()
            for _ in range(int(request.get("max_tokens", 16))):
                deadline += STAMP_GAP_S
                # A sleep, not a spin: the stamp is taken after it, so its jitter does not enter
                # the latency, and a spinning engine would take a core the router needs (on a
                # 2-core machine, half of it).
                time.sleep(max(0.0, deadline - time.perf_counter()))
                data = f'data: {{"t": {time.perf_counter()!r}}}\n\n'.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True
        allow_reuse_address = True

    print("Application startup complete.", flush=True)
    Server((host, port), Handler).serve_forever()


# --- the client ------------------------------------------------------------------------------------


class Client:
    """A minimal kept-alive HTTP/1.1 client that timestamps what it reads."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.sock = socket.create_connection((self.host, self.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stream(self, path: str, body: dict[str, Any]) -> Run:
        """POST; (seconds from sent to the first body chunk, [(read time, data)] per chunk)."""
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n").encode()
        self.sock.sendall(head + data)
        sent = time.perf_counter()
        buf, chunks = b"", []
        while b"\r\n\r\n" not in buf:
            buf += self._recv()
        head_end = buf.index(b"\r\n\r\n")
        if buf.split(b" ", 2)[1] != b"200":
            raise RuntimeError(f"{path} answered {buf[:head_end].decode()}: {buf[head_end:][:300]!r}")
        buf = buf[head_end + 4:]
        now = time.perf_counter()
        while True:
            # Chunked framing: size line, data, CRLF; a zero size (and its CRLF) ends the body.
            while b"\r\n" not in buf:
                buf += self._recv()
                now = time.perf_counter()
            size_line, _, rest = buf.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                rest += self._recv()
                now = time.perf_counter()
            buf = rest[size + 2:]
            if size == 0:
                return chunks[0][0] - sent, chunks
            chunks.append((now, rest[:size]))

    def _recv(self) -> bytes:
        data = self.sock.recv(1 << 16)
        if not data:
            raise RuntimeError("the server closed the connection")
        return data

    def close(self) -> None:
        self.sock.close()


def get_json(url: str, timeout: float = 5) -> Any:
    import requests

    return requests.get(url, timeout=timeout).json()


def post_json(url: str, body: dict[str, Any], timeout: float = 300) -> Any:
    import requests

    answer = requests.post(url, json=body, timeout=timeout)
    answer.raise_for_status()
    return answer.json()


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid` (ns resolution, /proc/PID/task/*/schedstat)."""
    return sum(int((task / "schedstat").read_text().split()[0])
               for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9


def alternate(direct: str, routed: str, pairs: int, body: dict[str, Any], warm: int = 5
              ) -> dict[str, list[Run]]:
    """`pairs` streams each way, direct and routed in turn, the order swapped every pair."""
    clients = {"direct": Client(direct), "router": Client(routed)}
    for client in clients.values():  # warm both paths (imports, first connections, caches)
        for _ in range(warm):
            client.stream("/v1/completions", body)
    out: dict[str, list[Run]] = {"direct": [], "router": []}
    for i in range(pairs):
        for name in ("direct", "router")[:: 1 if i % 2 else -1]:
            out[name].append(clients[name].stream("/v1/completions", body))
    for client in clients.values():
        client.close()
    return out


def measure(direct: str, routed: str, model: str, pid: int, args: argparse.Namespace, *,
            stamped: bool) -> dict[str, Any]:
    """TTFT pairs, then long-stream pairs (stamped latency when the engine stamps)."""
    one = {"model": model, "prompt": "hello there", "max_tokens": 1, "stream": True,
           "temperature": 0}
    runs = alternate(direct, routed, args.pairs, one)
    ttft = {name: [first for first, _ in results] for name, results in runs.items()}
    long = {**one, "max_tokens": args.tokens, "ignore_eos": True}
    before = cpu_seconds(pid)
    runs = alternate(direct, routed, args.pairs, long, warm=2)
    spent = cpu_seconds(pid) - before
    routed_chunks = sum(len(chunks) for _, chunks in runs["router"]) + 2 * len(runs["router"][0][1])
    # A stream's pace: (last chunk - first chunk) / gaps; reads that coalesce chunks average out.
    gap = {name: [(c[-1][0] - c[0][0]) / (len(c) - 1) for _, c in results]
           for name, results in runs.items()}
    out: dict[str, Any] = {"ttft": ttft, "gap": gap, "cpu_per_chunk_s": spent / routed_chunks,
                           "chunks": routed_chunks}
    if stamped:
        out["latency"] = {name: [read - json.loads(event[6:])["t"] for _, chunks in results
                                 for read, data in chunks
                                 for event in data.split(b"\n\n") if event.strip()]
                          for name, results in runs.items()}
    return out


def added(data: dict[str, list[float]]) -> float:
    return statistics.median(data["router"]) - statistics.median(data["direct"])


def table(title: str, numbers: dict[str, Any]) -> tuple[list[str], bool]:
    """Markdown rows of one measurement; whether it met the goals."""
    rows = [f"### {title}", "", "| | direct | router | added | goal |", "|---|---:|---:|---:|---|"]
    ok = True
    for key, label, scale, unit, goal in (
            ("ttft", "TTFT median", 1e3, "ms", TTFT_GOAL_S),
            ("latency", "chunk latency (stamped) median", 1e6, "µs", CHUNK_GOAL_S),
            ("gap", "chunk gap (stream pace) median", 1e6, "µs", None)):
        if key not in numbers:
            continue
        data = numbers[key]
        d, r, a = statistics.median(data["direct"]), statistics.median(data["router"]), added(data)
        verdict = ""
        if goal is not None:
            verdict = f"≤ {goal * scale:g} {unit} " + ("ok" if a <= goal else "OVER")
            ok = ok and a <= goal
        rows.append(f"| {label} | {d * scale:.3f} {unit} | {r * scale:.3f} {unit} | "
                    f"{a * scale:+.3f} {unit} | {verdict} |")
    rows.append(f"| router CPU per chunk | | {numbers['cpu_per_chunk_s'] * 1e6:.1f} µs | | "
                f"({numbers['chunks']} chunks) |")
    rows += ["", f"{len(numbers['ttft']['direct'])} alternating pairs per measure.", ""]
    return rows, ok


# --- the router in front of an engine that already runs ----------------------------------------


class External:
    """engines.Lifecycle over an engine the bench did not start: a load points at it."""

    def __init__(self, url: str) -> None:
        self.url = url

    def load(self, entry: Any, util: Any = None, sleep_mode: bool = False) -> Any:
        from vllmstack.router.engines import Loaded

        return Loaded(self.url)

    def unload(self, entry: Any) -> None:
        pass

    def abort(self, entry: Any) -> None:
        pass

    def adoptable(self, catalog: Any) -> Any:
        return []

    def sleep(self, entry: Any) -> Any:
        raise RuntimeError("the bench's engine is never put to sleep")

    def wake(self, entry: Any) -> float:
        raise RuntimeError("the bench's engine is never put to sleep")

    def memory(self) -> Any:
        return None


def serve_router(argv: list[str]) -> int:
    """(--serve-router URL PROJECT PORT) the router in front of URL, as `invoke router` runs it."""
    from vllmstack.core.paths import Project
    from vllmstack.router.service import run_router

    url, project, port = argv[0], Path(argv[1]), int(argv[2])
    return run_router(Project(project), {}, port=port, profiles=["ext"], ttl=0,
                      lifecycle=External(url))


def external(url: str, args: argparse.Namespace) -> dict[str, Any]:
    model = get_json(url.rstrip("/") + "/v1/models")["data"][0]["id"]
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        root = copy_project(Path(tmp) / "stack")
        (root / "env" / "models" / "ext.env").write_text(
            f"PROFILE_DESCRIPTION=the engine at {url}\nEXTENDS=models/qwen3-0.6b\n"
            f"PROFILE_PLATFORMS=cpu\nVLLM_SERVED_NAME={model}\nVLLM_PORT={free_port()}\n")
        write_dotenv(root, {"PLATFORM": "cpu", "OTHER_ENGINE_PORTS": ","})
        port = free_port()
        router = subprocess.Popen([sys.executable, __file__, "--serve-router", url, str(root),
                                   str(port)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        routed = f"http://127.0.0.1:{port}"
        try:
            wait_for(routed, router)
            post_json(routed + "/v1/load", {"model": model})
            return {"model": model, **measure(url, routed, model, router.pid, args, stamped=False)}
        finally:
            stop(router)


def wait_for(url: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            get_json(url + "/v1/health", timeout=2)
            return
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.communicate(timeout=10)[0] if proc.poll() is not None else ""
                raise RuntimeError(f"{url} did not start: {out[-2000:]}") from None
            time.sleep(0.1)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=180)[0]
    if proc.returncode not in (0, -signal.SIGTERM):
        print(out[-3000:], file=sys.stderr)


def real_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """The CPU vLLM engine of this checkout, up in a throwaway copy, then `external`."""
    with tempfile.TemporaryDirectory(prefix="bench-router-cpu-") as tmp:
        root = copy_project(Path(tmp) / "stack")
        (root / ".cache").mkdir()
        (root / ".cache" / "engines").symlink_to(ROOT / ".cache" / "engines")
        port = free_port()
        write_dotenv(root, {"PLATFORM": "cpu", "MODEL_PROFILE": "tiny", "RUNTIME": "native",
                            "VLLM_PORT": str(port), "OTHER_ENGINE_PORTS": ",",
                            "HOST_CACHE_DIR": str(ROOT / ".cache" / "real-engine-tests"),
                            "UP_TIMEOUT": "900"})

        def invoke(*words: str, timeout: float) -> None:
            done = subprocess.run([sys.executable, "-m", "invoke", *words], cwd=root, text=True,
                                  capture_output=True, timeout=timeout, check=False)
            if done.returncode:
                raise RuntimeError(f"invoke {' '.join(words)}: {done.stdout[-2000:]}{done.stderr[-2000:]}")

        invoke("make-model", timeout=600)
        invoke("up", "--no-dashboard", timeout=1000)
        try:
            return external(f"http://127.0.0.1:{port}", args)
        finally:
            invoke("down", timeout=300)


# --- the default mode: the simulator and the stamping engine, loaded by the router -------------


def simulated(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        engine_port, router_port = free_port(), free_port()
        stamp = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} --stamp-engine"
        root = simulator_project(Path(tmp) / "stack", {"sim-a": SIM_ENV, "sim-b": SIM_ENV,
                                                       "stamp": ""},
                                 port=engine_port, commands={"stamp": stamp})
        env = {k: v for k, v in os.environ.items() if k != "ROUTER_TOKEN"}
        router = subprocess.Popen(
            [sys.executable, "-m", "vllmstack.router", "--project", str(root), "--port",
             str(router_port), "--ttl", "0", "--profiles", "sim-a,sim-b,stamp"], cwd=root,
            env={**env, "PYTHONPATH": str(ROOT)}, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        routed = f"http://127.0.0.1:{router_port}"

        def direct(model: str) -> str:  # each profile's own engine (one port per profile)
            return str(get_json(routed + "/v1/health")["engines"][model]["url"])

        try:
            wait_for(routed, router)
            post_json(routed + "/v1/load", {"model": "sim-a"})
            simulator = measure(direct("sim-a"), routed, "sim-a", router.pid, args, stamped=False)
            swaps = []
            for i in range(args.swaps):
                target = "sim-b" if i % 2 == 0 else "sim-a"
                began = time.perf_counter()
                post_json(routed + "/v1/load", {"model": target})
                wall = time.perf_counter() - began
                swap = get_json(routed + "/v1/health")["swaps"][-1]
                swaps.append({**swap, "wall_s": wall,
                              "router_s": wall - swap["stop_s"] - swap["start_s"]})
            post_json(routed + "/v1/load", {"model": "stamp"})
            stamped = measure(direct("stamp"), routed, "stamp", router.pid, args, stamped=True)
        finally:
            stop(router)
    return {"simulator": simulator, "stamp": stamped, "swaps": swaps}


# --- --candidates: how the router's server and engine client were chosen ------------------------

CANDIDATES = ("uvicorn-h11-httpx", "uvicorn-httptools-httpx", "uvicorn-httptools-aiohttp",
              "aiohttp-aiohttp")


def serve_proxy(flavour: str, port: int, engine_port: int) -> None:
    """(--proxy FLAVOUR-LOOP PORT ENGINE_PORT) a minimal streaming proxy: the request's body to
    the engine, the engine's chunks back as they come, nothing else."""
    import asyncio

    *parts, loop_kind = flavour.split("-")
    server, client = parts[0], parts[-1]
    engine = f"http://127.0.0.1:{engine_port}"
    skip = ("transfer-encoding", "connection", "content-length")

    def make_client() -> Any:
        if client == "httpx":
            import httpx

            return httpx.AsyncClient(timeout=None)
        import aiohttp

        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     auto_decompress=False)

    async def chunks(session: Any, path: str, body: bytes) -> Any:
        if client == "httpx":
            request = session.build_request("POST", engine + path, content=body,
                                            headers={"content-type": "application/json"})
            answer = await session.send(request, stream=True)
            yield answer.status_code, list(answer.headers.items())
            async for piece in answer.aiter_raw():
                yield piece
            await answer.aclose()
            return
        async with session.post(engine + path, data=body,
                                headers={"content-type": "application/json"}) as answer:
            yield answer.status, list(answer.headers.items())
            async for piece, _ in answer.content.iter_chunks():
                yield piece

    if server == "uvicorn":
        import uvicorn

        state: dict[str, Any] = {}

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    state["session"] = make_client()
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
                return
            body, more = b"", True
            while more:
                message = await receive()
                body, more = body + message.get("body", b""), message.get("more_body", False)
            stream = chunks(state["session"], scope["path"], body)
            status, headers = await anext(stream)
            await send({"type": "http.response.start", "status": status, "headers": [
                (k.encode(), v.encode()) for k, v in headers if k.lower() not in skip]})
            async for piece in stream:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        uvicorn.run(app, host="127.0.0.1", port=port, http=parts[1], loop=loop_kind,
                    log_level="warning", access_log=False)
        return
    from aiohttp import web

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        stream = chunks(request.app_session, request.path, await request.read())  # type: ignore[attr-defined]
        status, headers = await anext(stream)
        response = web.StreamResponse(status=status, headers={
            k: v for k, v in headers if k.lower() not in skip})
        response.enable_chunked_encoding()
        await response.prepare(request)
        async for piece in stream:
            await response.write(piece)
        await response.write_eof()
        return response

    async def run() -> None:
        session = make_client()
        web.BaseRequest.app_session = session  # type: ignore[attr-defined]
        await asyncio.get_running_loop().create_server(web.Server(handle), "127.0.0.1", port)
        await asyncio.Event().wait()

    if loop_kind == "uvloop":
        import uvloop

        uvloop.run(run())
    else:
        asyncio.run(run())


def compare(args: argparse.Namespace) -> int:
    import importlib.util

    engine_port = free_port()
    engine = subprocess.Popen([sys.executable, __file__, "--stamp-engine", "--port",
                               str(engine_port)], stdout=subprocess.DEVNULL)
    direct = f"http://127.0.0.1:{engine_port}"
    time.sleep(1.0)
    loops = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])
    rows = ["| server - engine client - loop | TTFT added | chunk latency added | CPU per chunk |",
            "|---|---:|---:|---:|"]
    try:
        for flavour in (f"{c}-{loop}" for c in CANDIDATES for loop in loops):
            needed = {"uvicorn": "uvicorn", "httptools": "httptools", "httpx": "httpx",
                      "aiohttp": "aiohttp"}
            if any(importlib.util.find_spec(needed[w]) is None for w in flavour.split("-")
                   if w in needed):
                rows.append(f"| {flavour} | (not installed) | | |")
                continue
            port = free_port()
            proxy = subprocess.Popen([sys.executable, __file__, "--proxy", flavour, str(port),
                                      str(engine_port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 30
                while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
                    assert time.monotonic() < deadline, f"{flavour} did not start"
                    time.sleep(0.1)
                numbers = measure(direct, f"http://127.0.0.1:{port}", "stamp", proxy.pid, args,
                                  stamped=True)
            finally:
                proxy.kill()
                proxy.wait()
            rows.append(f"| {flavour} | {added(numbers['ttft']) * 1e3:+.3f} ms | "
                        f"{added(numbers['latency']) * 1e6:+.1f} µs | "
                        f"{numbers['cpu_per_chunk_s'] * 1e6:.1f} µs |")
            print(rows[-1], flush=True)
    finally:
        engine.kill()
        engine.wait()
    print("\n".join(rows))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--stamp-engine"]:
        stamp_engine(argv[1:])
        return 0
    if argv[:1] == ["--serve-router"]:
        return serve_router(argv[1:])
    if argv[:1] == ["--proxy"]:
        serve_proxy(argv[1], int(argv[2]), int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=30, help="alternating pairs per measure (>= 30)")
    parser.add_argument("--tokens", type=int, default=200, help="chunks per long stream")
    parser.add_argument("--swaps", type=int, default=2, help="swaps to time (default mode)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--engine-url", help="an engine that already runs, e.g. http://127.0.0.1:8000")
    mode.add_argument("--real-cpu", action="store_true", help="the checkout's real CPU vLLM engine")
    mode.add_argument("--candidates", action="store_true", help="the server/client candidates")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    if args.candidates:
        return compare(args)
    if args.engine_url or args.real_cpu:
        numbers = external(args.engine_url, args) if args.engine_url else real_cpu(args)
        sections = {f"engine {numbers['model']} at "
                    f"{args.engine_url or 'the real CPU vLLM engine'}": numbers}
    else:
        numbers = simulated(args)
        sections = {"engine simulator (pacing off)": numbers["simulator"],
                    "stamping engine (a chunk every 0.2 ms)": numbers["stamp"]}
    if args.json:
        print(json.dumps(numbers, indent=1))
    ok = True
    for title, data in sections.items():
        rows, fine = table(title, data)
        ok = ok and fine
        print("\n".join(rows))
    for swap in numbers.get("swaps", []):
        print(f"swap {swap['unloaded']} -> {swap['loaded']}: stop {swap['stop_s']:.3f} s, start "
              f"{swap['start_s']:.3f} s, router {swap['router_s'] * 1e3:.1f} ms, wall "
              f"{swap['wall_s']:.3f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

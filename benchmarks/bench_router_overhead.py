"""What the router adds over talking to the engine directly, and what a swap costs. Prints a table.

    python benchmarks/bench_router_overhead.py [--requests 300] [--streams 40] [--tokens 400]
                                               [--swaps 4] [--json]

One run, against the engine simulator (tests/simulator/server.py) started natively by the
router itself (two profiles, sim-a and sim-b), with the router in its own process
(`python -m vllmstack.router`), as users run it:

1. TTFT: streamed one-token completions, alternately straight to the engine and through the
   router (each over a kept-alive client connection; the router opens a new engine connection
   per request, as it does in use); time from the request's last byte sent to the first body
   byte read. Median and p90 of each, and the router's added median (target: at most 1 ms).
2. Per streamed chunk, three ways. (a) Latency: a third profile, `stamp`, runs a tiny engine
   (this file with --stamp-engine: /health, the warm-up, and streams whose every chunk carries
   the CLOCK_MONOTONIC time it was written, one every 0.2 ms); the client's read time minus that
   stamp, direct and routed: the router's added median per chunk (target: at most 20 µs).
   (b) Throughput: long simulator streams with pacing off (sim-a, SIM_ITL_MS=0), alternately
   direct and routed; per stream (last chunk - first chunk) / (chunks - 1). (c) Cost: the router
   process's CPU time per chunk forwarded (/proc/PID/task/*/schedstat; user and kernel from
   /proc/PID/stat), on the paced streams of (a), where every chunk is a wake-up of its own as
   with a real engine; kernel time includes the extra socket hop. Shown, not judged: it is what
   the router costs the machine, not what a chunk waits.
3. Swaps: /v1/load of the other profile, repeatedly; the wall time split into the old engine's
   stop (`down`, to memory released), the new one's start (`up`: checks, boot to /health 200,
   warm-up) and the router's own share (wall - stop - start).

Exit 1 when an added cost is over its target. The machine's load shows in the p90 columns: run
it on a quiet machine for numbers to quote.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers import free_port, simulator_project  # noqa: E402

TTFT_TARGET_S = 1e-3
CHUNK_TARGET_S = 20e-6
# Pacing off (chunks as fast as the simulator writes them); no boot delay to speak of.
SIM_ENV = "SIM_BOOT_SECONDS=0.3 SIM_TTFT_MS=0 SIM_ITL_MS=0"
STAMP_GAP_S = 0.0002  # one chunk every 0.2 ms: each one a wake-up of its own for the router


# --- the stamping engine (run by the router as profile `stamp`) ----------------------------------


def stamp_engine(argv: list[str]) -> None:
    """Enough of an engine for `up` (/health, the warm-up) whose streamed chunks carry the time
    they were written: `data: {"t": PERF_COUNTER}`. Takes vLLM's argv; uses --host and --port."""
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
                while time.perf_counter() < deadline:
                    pass  # a spin: sleep() would add its own jitter to the gaps
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

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stream(self, path: str, body: dict[str, Any]) -> tuple[float, list[tuple[float, bytes]]]:
        """POST; (seconds from sent to the first body chunk, [(read time, data)] per chunk)."""
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\n"
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


def post_json(port: int, path: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    import requests

    answer = requests.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=timeout)
    answer.raise_for_status()
    data: dict[str, Any] = answer.json()
    return data


def health(port: int) -> dict[str, Any]:
    import requests

    data: dict[str, Any] = requests.get(f"http://127.0.0.1:{port}/v1/health", timeout=5).json()
    return data


def cpu_seconds(pid: int) -> tuple[float, float, float]:
    """CPU time of `pid`: (total of its threads, ns resolution from /proc/PID/task/*/schedstat;
    user and kernel, in clock ticks from /proc/PID/stat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "schedstat") as handle:
            total += int(handle.read().split()[0])
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return total / 1e9, int(fields[11]) / tick, int(fields[12]) / tick


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def start_router(root: Path, port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ROUTER_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "vllmstack.router", "--project", str(root),
                             "--port", str(port), "--ttl", "0", "--profiles", "sim-a,sim-b,stamp"],
                            cwd=root, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            health(port)
            return proc
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.communicate(timeout=10)[0] if proc.poll() is not None else ""
                raise RuntimeError(f"the router did not start: {out}") from None
            time.sleep(0.1)


def alternate(engine_port: int, router_port: int, rounds: int, body: dict[str, Any]
              ) -> dict[str, list[tuple[float, list[tuple[float, bytes]]]]]:
    """`rounds` streams each way, direct and routed in turn (so drift hits both alike)."""
    clients = {"direct": Client(engine_port), "router": Client(router_port)}
    for client in clients.values():  # warm both paths (imports, first connections)
        for _ in range(10):
            client.stream("/v1/completions", body)
    out: dict[str, list[tuple[float, list[tuple[float, bytes]]]]] = {"direct": [], "router": []}
    for i in range(rounds):
        for name in ("direct", "router")[:: 1 if i % 2 else -1]:
            out[name].append(clients[name].stream("/v1/completions", body))
    for client in clients.values():
        client.close()
    return out


def measure(args: argparse.Namespace, engine_port: int, router_port: int, pid: int
            ) -> dict[str, Any]:
    post_json(router_port, "/v1/load", {"model": "sim-a"})
    one = {"model": "sim-a", "prompt": "hello there", "max_tokens": 1, "stream": True}
    runs = alternate(engine_port, router_port, args.requests, one)
    ttft = {name: [first for first, _ in results] for name, results in runs.items()}
    long = {"model": "sim-a", "prompt": "hello there", "max_tokens": args.tokens, "stream": True}
    runs = alternate(engine_port, router_port, args.streams, long)
    per_chunk = {name: [(c[-1][0] - c[0][0]) / (len(c) - 1) for _, c in results]
                 for name, results in runs.items()}
    swaps_done = swaps(router_port, args.swaps)
    post_json(router_port, "/v1/load", {"model": "stamp"})
    stamped = {"model": "stamp", "prompt": "x", "max_tokens": args.tokens, "stream": True}
    before = cpu_seconds(pid)
    runs = alternate(engine_port, router_port, args.streams, stamped)
    after = cpu_seconds(pid)
    latency = {name: [read - json.loads(data[6:])["t"] for _, chunks in results
                      for read, data in chunks] for name, results in runs.items()}
    routed = sum(len(chunks) for _, chunks in runs["router"]) + 10 * args.tokens  # + warm-up
    total, user, kernel = (b - a for a, b in zip(before, after, strict=True))
    return {"ttft": ttft, "per_chunk": per_chunk, "latency": latency, "swaps": swaps_done,
            "cpu_per_chunk_s": total / routed, "user_per_chunk_s": user / routed,
            "kernel_per_chunk_s": kernel / routed, "chunks_routed": routed}


def swaps(router_port: int, count: int) -> list[dict[str, Any]]:
    out = []
    for i in range(count):
        target = "sim-b" if i % 2 == 0 else "sim-a"
        began = time.perf_counter()
        post_json(router_port, "/v1/load", {"model": target})
        wall = time.perf_counter() - began
        swap = health(router_port)["swaps"][-1]
        out.append({**swap, "wall_s": wall,
                    "router_s": wall - swap["stop_s"] - swap["start_s"]})
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--stamp-engine"]:
        stamp_engine(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="TTFT requests per path")
    parser.add_argument("--streams", type=int, default=40, help="long streams per path")
    parser.add_argument("--tokens", type=int, default=400, help="chunks per long stream")
    parser.add_argument("--swaps", type=int, default=4, help="swaps to time")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        engine_port, router_port = free_port(), free_port()
        stamp = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} --stamp-engine"
        root = simulator_project(Path(tmp) / "stack", {"sim-a": SIM_ENV, "sim-b": SIM_ENV,
                                                       "stamp": ""},
                                 port=engine_port, commands={"stamp": stamp})
        router = start_router(root, router_port)
        try:
            numbers = measure(args, engine_port, router_port, router.pid)
        finally:
            router.send_signal(signal.SIGTERM)
            log = router.communicate(timeout=120)[0]
        if router.returncode != 0:
            print(log, file=sys.stderr)
            raise SystemExit(f"the router exited with {router.returncode}")
    return report(numbers, args.json)


def report(numbers: dict[str, Any], as_json: bool) -> int:
    ttft, chunk, latency = numbers["ttft"], numbers["per_chunk"], numbers["latency"]
    added = {name: statistics.median(data["router"]) - statistics.median(data["direct"])
             for name, data in (("ttft", ttft), ("per_chunk", chunk), ("latency", latency))}
    ok = added["ttft"] <= TTFT_TARGET_S and added["latency"] <= CHUNK_TARGET_S
    summary = {"ttft_added_median_s": added["ttft"], "chunk_latency_added_median_s": added["latency"],
               "chunk_gap_added_median_s": added["per_chunk"], "ok": ok, **numbers}
    if as_json:
        print(json.dumps(summary, indent=2))
        return 0 if ok else 1
    print(f"{'':34} {'direct':>12} {'router':>12} {'added':>12}  target")
    rows = (("TTFT", ttft, TTFT_TARGET_S, 1e3, "ms"),
            ("chunk latency (stamped)", latency, CHUNK_TARGET_S, 1e6, "µs"),
            ("chunk gap, unpaced stream", chunk, None, 1e6, "µs"))
    for label, data, target, scale, unit in rows:
        for stat, q in (("median", 0.5), ("p90", 0.9)):
            d, r = pct(data["direct"], q), pct(data["router"], q)
            verdict = ""
            if stat == "median" and target is not None:
                verdict = f"≤ {target * scale:g} {unit} {'ok' if r - d <= target else 'OVER'}"
            print(f"{label + ' ' + stat:34} {d * scale:>9.3f} {unit} {r * scale:>9.3f} {unit} "
                  f"{(r - d) * scale:>9.3f} {unit}  {verdict}")
    print(f"{'router CPU per chunk (paced)':34} {'':>12} {numbers['cpu_per_chunk_s'] * 1e6:>9.3f} µs"
          f"   (user {numbers['user_per_chunk_s'] * 1e6:.1f} µs, kernel "
          f"{numbers['kernel_per_chunk_s'] * 1e6:.1f} µs; {numbers['chunks_routed']} chunks)")
    print(f"({len(ttft['direct'])} TTFT requests, {len(chunk['direct'])} unpaced and "
          f"{len(latency['direct']) // max(1, len(chunk['direct']))}-chunk stamped streams per path)")
    print()
    print("swap: stop old = `down` to memory released; start new = `up`: checks and guards, "
          "boot to /health 200, warm-up")
    print(f"{'swap':16} {'stop old':>9} {'start new':>10} {'(checks':>8} {'boot':>7} "
          f"{'warm-up)':>9} {'router':>8} {'wall':>8}")
    for swap in numbers["swaps"]:
        checks = swap["start_s"] - swap["boot_s"] - swap["warmup_s"]
        print(f"{swap['unloaded'] + ' -> ' + swap['loaded']:16} {swap['stop_s']:>8.3f}s "
              f"{swap['start_s']:>9.3f}s {checks:>7.3f}s {swap['boot_s']:>6.3f}s "
              f"{swap['warmup_s']:>8.3f}s {swap['router_s'] * 1e3:>6.1f}ms {swap['wall_s']:>7.3f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

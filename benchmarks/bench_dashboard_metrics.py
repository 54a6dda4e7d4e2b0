"""How much the dashboard's metrics path costs, with vLLM's full /metrics text.

    python benchmarks/bench_dashboard_metrics.py [--n 300]

Serves a real vLLM 0.27.1 /metrics capture (tests/data/metrics-load.txt, ~640
lines) from a local HTTP server, points the dashboard app at it, and prints the
median and p90 of:

  * parse, full text         prometheus_client parser over every family
  * parse, live families     the dashboard's filtered parse (no buckets, no _created)
  * record (parse + rates)   LiveMetrics.record: what each poll computes
  * poll cycle               the app's poll: HTTP fetch of /metrics + parse + rates
  * GET /api/metrics         end to end over HTTP against the app under uvicorn

Target: GET /api/metrics and the poll cycle at most 10 ms at the median. Exit
status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers import free_port  # noqa: E402

from vllmstack.dashboard.app import DashboardSettings, create_app  # noqa: E402
from vllmstack.dashboard.live import LiveMetrics  # noqa: E402
from vllmstack.observe.metrics import LIVE_FAMILIES, parse_metrics  # noqa: E402

CAPTURE = ROOT / "tests" / "data" / "metrics-load.txt"
TARGET_MS = 10.0


def timed(fn: Callable[[], object], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def report(name: str, samples: list[float], target: float | None = None) -> bool:
    samples = sorted(samples)
    median = statistics.median(samples)
    p90 = samples[int(0.9 * (len(samples) - 1))]
    ok = target is None or median <= target
    verdict = "" if target is None else (f"  target ≤ {target:.0f} ms: {'ok' if ok else 'MISSED'}")
    print(f"{name:<28} median {median:7.3f} ms   p90 {p90:7.3f} ms   n={len(samples)}{verdict}")
    return ok


def serve_capture(body: bytes) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes; without this, Nagle + delayed ACK add ~40 ms
        # per request (an artefact of this stand-in, not of vLLM's uvicorn server).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300, help="samples per measurement")
    args = parser.parse_args()
    n = args.n
    text = CAPTURE.read_text()
    print(f"/metrics text: {len(text.splitlines())} lines, {len(text)} bytes ({CAPTURE.name})")

    report("parse, full text", timed(lambda: parse_metrics(text), n))
    report("parse, live families", timed(lambda: parse_metrics(text, only=LIVE_FAMILIES), n))
    live = LiveMetrics("http://bench")
    clock = iter(range(10**9))
    report("record (parse + rates)", timed(lambda: live.record(text, float(next(clock))), n))

    import httpx
    import uvicorn

    engine, engine_url = serve_capture(text.encode())
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        settings = DashboardSettings(engine_url=engine_url, history_dir=Path(tmp))
        app = create_app(settings, poll=True)

        async def poll_cycles() -> list[float]:
            samples = []
            for _ in range(n):
                start = time.perf_counter()
                await app.state.poll_once()
                samples.append((time.perf_counter() - start) * 1000)
            return samples

        ok &= report("poll cycle (fetch+parse+rates)", asyncio.run(poll_cycles()), TARGET_MS)

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
                assert client.get("/api/metrics").json()["engine_up"] is True
                ok &= report("GET /api/metrics", timed(lambda: client.get("/api/metrics"), n),
                             TARGET_MS)
        finally:
            server.should_exit = True
            thread.join(10)
            engine.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark client against bad servers: linear-time parsing, and a deadline that holds.

    python benchmarks/bench_client_bad_servers.py [--root /path/to/another/checkout]

1. SSE parser: one event of N bytes arriving in 64-byte reads (a server trickling a huge line).
   Target: linear, so 8x the bytes costs at most ~12x the time (a re-join of the buffer per read
   is quadratic: 64x).
2. HTTP chunked framing: one chunk of N bytes in 64-byte reads, the same target.
3. Deadline: `stream_chat` with `timeout_s=2` against the simulator's keepalive fault (an SSE
   comment every 200 ms, forever) and trickle fault (a byte every 5 ms). Target: the request
   ends between 2.0 and 2.5 s, whatever keeps arriving.
`--root` imports the package from another checkout (before/after a change); a request that does
not end is cut at 10 s and reported as such.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = (256 << 10, 512 << 10, 1 << 20, 2 << 20)
STEP = 64


def parser_seconds(size: int) -> float:
    from vllmstack.bench.client import client

    state_cls = client._StreamState
    line = b'data: {"x":"' + b"a" * size + b'"}\n\n'
    state = state_cls(client.RequestResult())
    started = time.perf_counter()
    for i in range(0, len(line), STEP):
        state.feed(line[i:i + STEP], 0.0)
    return time.perf_counter() - started


def framing_seconds(size: int) -> float:
    from vllmstack.bench.client.http import _Protocol

    async def run() -> float:
        protocol = _Protocol()
        got = [0]

        def sink(data: bytes, now: float) -> None:
            got[0] += len(data)

        protocol.sink = sink
        raw = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
               + f"{size:x}\r\n".encode() + b"a" * size + b"\r\n0\r\n\r\n")
        started = time.perf_counter()
        for i in range(0, len(raw), STEP):
            protocol.data_received(raw[i:i + STEP])
        took = time.perf_counter() - started
        assert protocol.complete and got[0] == size
        return took

    return asyncio.run(run())


def deadline_seconds(env: dict[str, str]) -> tuple[float, str]:
    from simulator.fixture import run_simulator

    from vllmstack.bench.client.client import ChatClient, chat_body

    async def one(url: str) -> tuple[float, str]:
        async with ChatClient(url, timeout_s=2.0) as chat:
            started = time.perf_counter()
            try:
                result = await asyncio.wait_for(
                    chat.stream_chat(chat_body("sim", [{"role": "user", "content": "hi"}], 8)),
                    10.0)
            except TimeoutError:
                return time.perf_counter() - started, "did not end (cut at 10 s)"
            return time.perf_counter() - started, str(result.error)

    base = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "5", "SIM_ITL_MS": "2"}
    with run_simulator(env={**base, **env}, argv=["--served-model-name", "sim"]) as sim:
        return asyncio.run(one(sim.url))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to import from")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(args.root.resolve()))
    import vllmstack

    print(f"package: {Path(vllmstack.__file__).parent}")
    missed = 0
    for name, measure in (("SSE parser", parser_seconds), ("HTTP framing", framing_seconds)):
        times = [measure(size) for size in SIZES]
        ratio = times[-1] / max(times[0], 1e-9)
        row = ", ".join(f"{size >> 10} KiB {t * 1000:.1f} ms" for size, t in zip(SIZES, times,
                                                                                  strict=True))
        ok = ratio <= 12
        missed += not ok
        print(f"{name}: {row}; 8x bytes -> {ratio:.1f}x time{'' if ok else '  MISSED'}")
        if not ok and times[-1] > 30:
            break
    for label, env in (("keepalive comments every 200 ms",
                        {"SIM_FAULT": "keepalive", "SIM_KEEPALIVE_MS": "200"}),
                       ("a byte every 5 ms", {"SIM_FAULT": "trickle", "SIM_TRICKLE_MS": "5"})):
        took, error = deadline_seconds(env)
        ok = 2.0 <= took <= 2.5
        missed += not ok
        print(f"deadline 2 s, {label}: ended after {took:.2f} s: {error}"
              + ("" if ok else "  MISSED"))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark accuracy against the engine simulator, whose pacing is known. Prints numbers.

    python benchmarks/bench_client_accuracy.py [--runs 5] [--duration 20] [--quick]

Truth is the simulator's configured pacing: a request that gets a slot at once sees its first
token at  SIM_TTFT_MS + prompt_tokens / SIM_PREFILL_TPS (+ SIM_ROLE_DELAY_MS), then a step every
SIM_ITL_MS carrying SIM_TOKENS_PER_CHUNK tokens. So TTFT, pp t/s (= SIM_PREFILL_TPS), decode t/s
(= tokens per chunk / ITL) and per-token ITL are known exactly. The "server-observed" TTFT is the
simulator's own /metrics histogram (arrival to first token write), which shows how much of an
error is the simulator running late on a busy machine rather than the client.

Cases at concurrency 1: vLLM-like stream; role chunk 200 ms before the first token; 4 tokens per
chunk with per-chunk usage; 4 tokens per chunk with only a final usage. Then closed-loop
concurrency 8 and 32.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from simulator.fixture import run_simulator, sim_env  # noqa: E402

from vllmstack.bench.client.client import ChatClient, chat_body  # noqa: E402
from vllmstack.bench.client.stats import percentile  # noqa: E402
from vllmstack.bench.runs.runs import (  # noqa: E402
    RunOptions,
    Session,
    measure_overhead,
    run_conc_level,
)
from vllmstack.bench.target import target_from_url  # noqa: E402
from vllmstack.observe.metrics import parse_metrics  # noqa: E402
from vllmstack.workload.prompts import PromptBuilder, load_tokenizer  # noqa: E402
from vllmstack.workload.selftest_tokenizer import train_corpus_tokenizer  # noqa: E402

TTFT_MS, PREFILL_TPS, ITL_MS = 100.0, 20000.0, 20.0
PACING = {"ttft_ms": TTFT_MS, "prefill_tps": PREFILL_TPS, "itl_ms": ITL_MS}
TTFT_METRIC = "vllm:time_to_first_token_seconds"


def decode_truth_tps(tg: int, tokens_per_chunk: int) -> float:
    """The simulator's exact decode rate for one stream: after the first token, ceil((tg-1)/k)
    steps of SIM_ITL_MS carry the other tg-1 tokens (the last step may be partly filled)."""
    steps = -(-(tg - 1) // tokens_per_chunk)
    return (tg - 1) / (steps * ITL_MS / 1000)


async def server_ttft(client: ChatClient) -> tuple[float, float]:
    snap = parse_metrics(await client.get_text("/metrics"))
    return (snap.value(TTFT_METRIC + "_sum") or 0.0, snap.value(TTFT_METRIC + "_count") or 0.0)


async def single_stream(url: str, tokenizer: Any, *, pp: int, tg: int, runs: int,
                        role_delay_ms: float, tokens_per_chunk: int,
                        extra: dict[str, Any] | None = None) -> dict[str, float]:
    """c=1 with the bench's own primitives; one /metrics scrape around each request."""
    builder = PromptBuilder(tokenizer, seed=3)
    target = target_from_url(url, "sim", tokenizer="unused")
    async with ChatClient(url, tokenizer=tokenizer) as client:
        session = Session(client, builder, target, RunOptions(extra_body=extra or {}),
                          progress=lambda _: None)
        session.overhead = await measure_overhead(session)
        await client.stream_chat(session.body([{"role": "user", "content":
                                                builder.build(pp).text}], tg))  # warm-up
        ttft_err, ttft_vs_server, pp_rates, tg_rates, itl = [], [], [], [], []
        sources = set()
        for _ in range(runs):
            before = await server_ttft(client)
            body = chat_body("sim", [{"role": "user", "content": builder.build(pp).text}], tg,
                             extra=extra)
            result = await client.stream_chat(body)
            after = await server_ttft(client)
            assert result.ok and result.ttft_s is not None, result.error
            truth = (TTFT_MS + (result.prompt_tokens or 0) / PREFILL_TPS * 1000
                     + role_delay_ms)
            measured = result.ttft_s * 1000
            ttft_err.append(measured - truth)
            ttft_vs_server.append(measured - (after[0] - before[0]) * 1000)
            overhead = session.overhead  # the per-run two-point rate (session.pp_estimate's input)
            pp_rates.append((result.prompt_tokens - overhead.prompt_tokens)
                            / (result.ttft_s - overhead.ttft_s))
            tg_rates.append(result.decode_tps or 0.0)
            itl.extend(result.itl_samples_s())
            sources.add(result.token_source)
    itl.sort()
    tg_truth = decode_truth_tps(tg, tokens_per_chunk)
    itl_truth = 1000 / tg_truth
    return {
        "ttft_err_ms": statistics.mean(ttft_err),
        "ttft_err_max_ms": max(ttft_err, key=abs),
        "ttft_vs_server_ms": statistics.mean(ttft_vs_server),
        "pp_err_pct": (statistics.mean(pp_rates) / PREFILL_TPS - 1) * 100,
        "tg_err_pct": (statistics.mean(tg_rates) / tg_truth - 1) * 100,
        "itl_mean_err_pct": (statistics.mean(itl) * 1000 / itl_truth - 1) * 100,
        "itl_p50_err_pct": (percentile(itl, 50) * 1000 / itl_truth - 1) * 100,
        "itl_p99_ms": percentile(itl, 99) * 1000,
        "itl_truth_ms": itl_truth,
        "sources": ",".join(sorted(sources)),
    }


async def conc_level(url: str, tokenizer: Any, level: int, duration: float
                     ) -> tuple[dict[str, Any], float]:
    """One closed-loop level through the bench's own run_conc_level, plus the simulator's mean
    arrival-to-first-token over exactly those requests."""
    target = target_from_url(url, "sim", tokenizer="unused", max_num_seqs=64)
    async with ChatClient(url, tokenizer=tokenizer) as client:
        session = Session(client, PromptBuilder(tokenizer, seed=level), target,
                          RunOptions(pp=[512], tg=[64], duration_s=duration),
                          progress=lambda _: None)
        session.overhead = await measure_overhead(session)
        before = await server_ttft(client)
        row = await run_conc_level(session, level, 512, 64)
        after = await server_ttft(client)
    server_mean = (after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1000
    return row, server_mean


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="fewer runs, shorter levels")
    args = parser.parse_args()
    runs, duration = (3, 8.0) if args.quick else (args.runs, args.duration)
    with tempfile.TemporaryDirectory(prefix="bench-accuracy-") as folder:
        return measure(Path(folder), runs, duration)


def measure(folder: Path, runs: int, duration: float) -> int:
    tokenizer_path = train_corpus_tokenizer(folder / "tokenizer.json")
    tokenizer = load_tokenizer(tokenizer_path)
    argv = ["--served-model-name", "sim", "--max-model-len", "32768", "--max-num-seqs", "64"]
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"pacing TTFT {TTFT_MS:g} ms + P/{PREFILL_TPS:g} t/s, step {ITL_MS:g} ms")
    print(f"\nconcurrency 1, pp 4096, tg 128, {runs} runs per case")
    header = (f"{'case':<36}{'TTFT err':>10}{'worst':>9}{'vs server':>11}{'pp err':>9}"
              f"{'tg err':>9}{'ITL err':>9}{'ITL p99':>9}  tokens from")
    print(header)
    print("-" * len(header))
    cases = [
        ("vLLM-like (role with 1st token)", {}, 0.0, 1, None),
        ("role chunk 200 ms early", {"SIM_ROLE_DELAY_MS": "200"}, 200.0, 1, None),
        ("4 tokens/chunk, per-chunk usage", {"SIM_TOKENS_PER_CHUNK": "4"}, 0.0, 4, None),
        ("4 tokens/chunk, final usage only", {"SIM_TOKENS_PER_CHUNK": "4"}, 0.0, 4,
         {"stream_options": {"include_usage": True}}),
    ]
    for label, extra_env, role, per_chunk, extra_body in cases:
        with run_simulator(env=sim_env(tokenizer_path, **PACING, **extra_env), argv=argv) as sim:
            r = asyncio.run(single_stream(sim.url, tokenizer, pp=4096, tg=128, runs=runs,
                                          role_delay_ms=role, tokens_per_chunk=per_chunk,
                                          extra=extra_body))
        print(f"{label:<36}{r['ttft_err_ms']:>+8.2f}ms{r['ttft_err_max_ms']:>+7.2f}ms"
              f"{r['ttft_vs_server_ms']:>+9.2f}ms{r['pp_err_pct']:>+8.2f}%"
              f"{r['tg_err_pct']:>+8.2f}%{r['itl_mean_err_pct']:>+8.2f}%"
              f"{r['itl_p99_ms']:>7.2f}ms  {r['sources']}")
    print("(TTFT err = mean measured - modelled truth; vs server = measured - the simulator's "
          "own arrival-to-first-token; ITL err = mean per-token ITL vs truth; truth for a "
          "finite stream: tg-1 tokens over ceil((tg-1)/k) steps)")
    print(f"\nclosed-loop concurrency, pp 512, tg 64, {duration:g} s per level")
    header = (f"{'c':>3}{'requests':>10}{'TTFT err':>10}{'p99':>9}{'vs server':>11}"
              f"{'tg/req err':>12}{'ITL err':>9}{'ITL p99':>9}{'total t/s':>11}{'c*tg/e2e':>10}")
    print(header)
    print("-" * len(header))
    tg_truth = decode_truth_tps(64, 1)
    with run_simulator(env=sim_env(tokenizer_path, **PACING), argv=argv) as sim:
        for level in (1, 8, 32):
            row, server_mean = asyncio.run(conc_level(sim.url, tokenizer, level, duration))
            truth = TTFT_MS + row["prompt_tokens"]["mean"] / PREFILL_TPS * 1000
            expected_total = level * 64 / (row["e2e_ms"]["mean"] / 1000)
            print(f"{level:>3}{row['requests']:>10}{row['ttft_ms']['mean'] - truth:>+8.2f}ms"
                  f"{row['ttft_ms']['p99'] - truth:>+7.2f}ms"
                  f"{row['ttft_ms']['mean'] - server_mean:>+9.2f}ms"
                  f"{(row['tg_tps']['mean'] / tg_truth - 1) * 100:>+11.2f}%"
                  f"{(row['itl_ms']['mean'] / (1000 / tg_truth) - 1) * 100:>+8.2f}%"
                  f"{row['itl_ms']['p99']:>7.2f}ms{row['total_tg_tps']:>11.1f}"
                  f"{expected_total:>10.1f}")
    print("(TTFT err: mean and p99 against the modelled pacing; vs server: client mean minus "
          "the simulator's own mean over the same requests; c*tg/e2e is the closed-loop rate "
          "the measured request latency implies, a cross-check for the windowed total)")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

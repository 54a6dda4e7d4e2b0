"""The concurrency run: a closed-loop ladder, steady load per level, total and per-request speed."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

from vllmstack.bench.client.client import RequestResult
from vllmstack.bench.client.row import BenchRow
from vllmstack.bench.runs.session import (
    RunError,
    Session,
    progress_line,
    steady_heap,
    summarize_results,
    user,
)
from vllmstack.workload.ladders import conc_ladder
from vllmstack.workload.prompts import Prompt


async def run_conc(session: Session, max_num_seqs: int | None) -> list[BenchRow]:
    opts = session.options
    if opts.concurrency is not None:
        levels = list(opts.concurrency)
    else:
        if not max_num_seqs:
            raise RunError("no max_num_seqs known (set VLLM_MAX_NUM_SEQS or pass "
                           "--max-num-seqs / --concurrency 1 2 4 ...)")
        levels = conc_ladder(max_num_seqs)
    pp, tg = opts.pp[0], opts.tg[0]
    session.progress(f"concurrency ladder {levels}: closed loop, {opts.duration_s:g} s per level, "
                     f"pp {pp}, tg {tg}")
    if opts.warmup:
        await session.send(user((await session.builder.build_async(pp)).text), tg)
    rows = []
    for level in levels:
        rows.append(await run_conc_level(session, level, pp, tg))
    return rows


async def run_conc_level(session: Session, level: int, pp: int, tg: int) -> BenchRow:
    """`level` workers, each sending its next request as soon as the last ends, for a duration.

    What one stream measures must not depend on the loop around it: prompts are built before the
    clock starts (building one costs ~1 ms of the single event loop, which would otherwise show
    up as jitter in every other stream's timestamps), the heap is frozen as in `bench`, and a
    re-used prompt only swaps its leading marker for a fresh random one of the same length. (A
    marker made from the worker and sequence numbers repeated across runs, so a second run
    against the same server got prefix-cache hits and a TTFT that was mostly cache.)
    """
    opts = session.options
    per_worker = 4
    pool = [await session.builder.build_async(pp) for _ in range(level * per_worker)]
    results: list[tuple[int, int, RequestResult]] = []

    async def worker(index: int, stop_at: float) -> None:
        sequence = 0
        while time.perf_counter() < stop_at:
            prompt = pool[(index * per_worker + sequence) % len(pool)]
            text = prompt.text if sequence < per_worker else fresh_marker(prompt)
            result = await session.send(user(text), tg)
            results.append((index, sequence, result))
            sequence += 1
            if not result.ok:
                await asyncio.sleep(0.05)  # do not spin on a failing server

    with steady_heap():
        start = time.perf_counter()
        stop_at = start + opts.duration_s
        async with asyncio.TaskGroup() as group:
            for i in range(level):
                group.create_task(worker(i, stop_at))
    # Steady state starts once every worker's first request is decoding and ends when workers
    # stop sending; only tokens that arrived inside it count toward the total rate.
    firsts = [r.t_first_token for i, s, r in results if s == 0 and r.t_first_token is not None]
    window_start = max(firsts) if len(firsts) == level else start
    window_end = stop_at
    if window_end - window_start < 0.25 * opts.duration_s:
        session.warn(f"c={level}: the steady window is short ({window_end - window_start:.1f} s "
                     f"of {opts.duration_s:g} s); raise --duration")
        window_start = start
    window = max(window_end - window_start, 1e-9)
    in_window = 0
    for _, _, r in results:
        for t, k in zip(r.chunk_times, r.chunk_tokens, strict=False):
            if window_start <= t <= window_end:
                in_window += k
    finished = sum(1 for _, _, r in results if r.ok and window_start <= r.t_end <= window_end)
    plain = [r for _, _, r in results]
    total = in_window / window
    row = replace(summarize_results(session, plain, pp=pp, tg=tg, depth=0, concurrency=level),
                  duration_s=opts.duration_s, window_s=window, total_tg_tps=total,
                  requests_per_s=finished / window)
    session.progress(progress_line(row, f"c{level}") + f", total {total:.1f} t/s over "
                     f"{row.requests} requests")
    return row



def fresh_marker(prompt: Prompt) -> str:
    """The prompt's text behind a new random marker of the same length (no cache hit)."""
    marker = prompt.marker
    if marker and prompt.text.startswith(marker):
        return f"[{uuid.uuid4().hex[:len(marker) - 2]}]" + prompt.text[len(marker):]
    # A prompt too short to carry a marker: prefixing one is all that can be done.
    return f"[{uuid.uuid4().hex[:12]}] " + prompt.text

"""itl-stall: decoders keep streaming while one huge prompt is prefilled.

The verdict is the choke ratio: p99 of the victims' per-token gaps during that prefill over their
p50 before it. vLLM prefills a long prompt in chunks of at most `max_num_batched_tokens` tokens,
and every decoder waits for each chunk, so a FAIL comes with what to change: a table of chunk
budgets against the stall each would cause, from this run's own prefill rate.

Victims are sized from the live server, not from the profile alone: the probe starts as many as
the profile (or 8) allows, and when /metrics shows some of them waiting for a slot, the live
max_num_seqs is what is running; the queued ones are cancelled and one slot is left for the big
prompt. (With 7 victims against a server running 2 sequences the old probe could only say
INCONCLUSIVE.)
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from vllmstack.bench.client.client import RequestResult, chat_body
from vllmstack.bench.client.stats import percentile
from vllmstack.bench.probes.probe_base import THINKING_OFF, ProbeContext
from vllmstack.bench.probes.verdict import INFO, Verdict

MAX_VICTIMS = 8
# Chunk budgets the advice table projects (vLLM's default on large GPUs is 8192 or 16384).
CHUNK_BUDGETS = (16384, 8192, 4096, 2048, 1024, 512, 256)


def stall_windows(
    victims: Sequence[RequestResult], fired: float, prefilled: float
) -> tuple[list[float], list[float], list[float]]:
    """Per-token gaps (s) of the victims before, during and after the big prefill.

    A gap belongs to "during" when it overlaps [fired, prefilled]: the gap that spans the end of
    the prefill is the stall itself and must be counted.
    """
    before: list[float] = []
    during: list[float] = []
    after: list[float] = []
    for r in victims:
        times, counts = r.chunk_times, r.chunk_tokens
        for i in range(1, min(len(times), len(counts))):
            k = max(1, counts[i])
            gap = (times[i] - times[i - 1]) / k
            start, end = times[i - 1], times[i]
            if end <= fired:
                before.extend([gap] * k)
            elif start >= prefilled:
                after.extend([gap] * k)
            else:
                during.extend([gap] * k)
    return before, during, after


def chunks_seen(victims: Sequence[RequestResult], fired: float, prefilled: float,
                p50_before: float) -> int:
    """How many prefill chunks the victims waited for: gaps inside the prefill over 5x the
    normal step, median over victims (each chunk stalls every decoder once)."""
    counts = []
    for r in victims:
        times = r.chunk_times
        stalls = sum(1 for i in range(1, len(times))
                     if times[i] > fired and times[i - 1] < prefilled
                     and times[i] - times[i - 1] > 5 * p50_before)
        counts.append(stalls)
    return int(statistics.median(counts)) if counts else 0


def stall_advice(bully_tokens: int, prefill_s: float, p50_before_s: float, max_choke: float,
                 chunks: int = 0) -> list[dict[str, Any]]:
    """Chunk budget -> projected stall and choke, from this run's prefill rate.

    A chunk of N tokens costs about N x (prefill time / prompt tokens); later chunks of a very
    long prompt cost more (attention over the context grows), so these are lower bounds there.
    The first row is the chunk size seen in this run, when the stalls showed it.
    """
    if bully_tokens <= 0 or prefill_s <= 0 or p50_before_s <= 0:
        return []
    per_token = prefill_s / bully_tokens
    budgets = list(CHUNK_BUDGETS)
    if chunks > 0:
        budgets = [-(-bully_tokens // chunks)] + [b for b in budgets if b < bully_tokens // chunks]
    rows = []
    for n, budget in enumerate(budgets):
        stall = budget * per_token + p50_before_s
        choke = stall / p50_before_s
        rows.append({"max_num_batched_tokens": budget, "stall_ms": stall * 1000,
                     "choke": choke, "passes": choke <= max_choke,
                     "seen": chunks > 0 and n == 0})
    return rows


def _advise(v: Verdict, rows: list[dict[str, Any]], max_choke: float) -> None:
    for row in rows:
        label = (f"~{row['max_num_batched_tokens']} (this run)" if row["seen"]
                 else str(row["max_num_batched_tokens"]))
        v.add(f"if max_num_batched_tokens = {label}",
              f"stall ~{row['stall_ms']:.0f} ms, choke ~{row['choke']:.0f}", INFO,
              "within limit" if row["passes"] else f"over limit {max_choke:g}")
    fits = [r["max_num_batched_tokens"] for r in rows if r["passes"] and not r["seen"]]
    if fits:
        v.add("what to change", f"VLLM_MAX_BATCHED_TOKENS={max(fits)}", INFO,
              "smaller prefill chunks: decoders stall less, long prompts prefill slower (each "
              "step has a fixed cost, so the stalls above are lower bounds)")
    else:
        v.add("what to change", "no chunk size meets the limit", INFO,
              "the model's step is too slow for this prompt length: fewer victims per GPU, "
              "or a higher max_choke for this hardware")


async def _live_slots(ctx: ProbeContext, results: list[RequestResult],
                      tasks: list[asyncio.Task[RequestResult]], fire_at: float,
                      deadline: float) -> tuple[list[int], str | None]:
    """Wait until the victims stream; trim them to the live max_num_seqs (one slot kept free).

    Returns the indexes of the victims to keep, and a note when they were trimmed. Raises
    LookupError with the reason when they cannot stream.
    """
    queued_since: float | None = None
    next_scrape = 0.0
    while True:
        streaming = [i for i, r in enumerate(results) if r.tokens > 0]
        if all(r.tokens >= fire_at for r in results):
            return list(range(len(results))), None
        now = time.perf_counter()
        if any(t.done() for t in tasks) or now > deadline:
            errors = [r.error for r in results if r.error]
            raise LookupError("victims did not start streaming: "
                              + (errors[0] if errors else "finished or timed out early"))
        if streaming and len(streaming) < len(results):
            queued_since = queued_since or now
            if now - queued_since > 1.0 and now >= next_scrape:
                next_scrape = now + 0.5  # a scrape parses ~100 KB: not at the loop's pace
                snap = await ctx.metrics()
                waiting = snap.requests_waiting if snap is not None else None
                running = snap.requests_running if snap is not None else None
                if waiting and running:
                    keep = streaming[:len(streaming) - 1]
                    if not keep:
                        raise LookupError(f"the live max_num_seqs is {running:.0f}: no room for a "
                                          "victim beside the big prompt")
                    note = (f"{running:.0f} running, {waiting:.0f} queued: live max_num_seqs "
                            f"{running:.0f}; {len(keep)} victim(s) kept, one slot left for the "
                            "big prompt")
                    return keep, note
        await asyncio.sleep(0.05)


async def probe_itl_stall(ctx: ProbeContext) -> Verdict:
    v = Verdict("itl-stall")
    if ctx.builder is None:
        return v.inconclusive("needs the model tokenizer (--tokenizer) to size the big prompt")
    seqs = ctx.max_num_seqs
    planned = int(ctx.param("victims", max(1, min((seqs or MAX_VICTIMS + 1) - 1, MAX_VICTIMS))))
    window = ctx.max_model_len or 8192
    bully_tokens = int(ctx.param("bully_tokens", max(256, min(131072, window - 256))))
    victim_prompt = int(ctx.param("victim_prompt", 256))
    victim_tokens = int(ctx.param("victim_tokens", 2048))
    fire_at = int(ctx.param("fire_at", 32))
    max_choke = float(ctx.param("max_choke", 10.0))
    if bully_tokens + 1 > window:
        return v.inconclusive(f"bully prompt {bully_tokens} does not fit max_model_len {window}")
    bully_text = ctx.builder.build(max(1, bully_tokens - 64)).text  # room for the chat template
    results = [RequestResult() for _ in range(planned)]
    stop = asyncio.Event()
    tasks = []
    for i in range(planned):
        prompt = ctx.builder.build(victim_prompt).text + "\nContinue this text at length."
        body = chat_body(ctx.model, [{"role": "user", "content": prompt}], victim_tokens,
                         extra=THINKING_OFF)
        tasks.append(asyncio.create_task(ctx.client.stream_chat(body, result=results[i],
                                                                stop=stop)))
    try:
        deadline = time.perf_counter() + float(ctx.param("start_timeout_s", 300))
        try:
            keep, trimmed = await _live_slots(ctx, results, tasks, fire_at, deadline)
        except LookupError as exc:
            return v.inconclusive(str(exc))
        for i, task in enumerate(tasks):
            if i not in keep:
                task.cancel()  # a queued request is dropped when its connection closes
        results = [results[i] for i in keep]
        if trimmed:
            v.add("victims (live)", trimmed, INFO)
            try:  # the kept ones still have to reach fire_at
                await _live_slots(ctx, results, [tasks[i] for i in keep], fire_at, deadline)
            except LookupError as exc:
                return v.inconclusive(str(exc))
        elif seqs and len(results) + 1 > seqs:
            v.add("slots", f"{len(results)} victims + 1 > max_num_seqs {seqs}", INFO,
                  "the big prompt may queue until a victim finishes")
        ctx.progress(f"{len(results)} victim(s) streaming; sending the {bully_tokens}-token "
                     "prompt")
        fired = time.perf_counter()
        bully = await ctx.client.stream_chat(chat_body(
            ctx.model, [{"role": "user", "content": bully_text + "\nWhat is 19*21?"}], 1,
            extra=THINKING_OFF))
        prefilled = bully.t_first_token or time.perf_counter()
        await asyncio.sleep(float(ctx.param("after_s", 1.0)))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not bully.ok:
        return v.inconclusive(f"the big prompt failed: {bully.why}")
    if any(r.t_end and r.t_end < prefilled and not r.stopped for r in results):
        return v.inconclusive("a victim finished before the big prefill ended; raise "
                              "--param victim_tokens")
    return _judge(v, results, bully, fired, prefilled, max_choke)


def _judge(v: Verdict, victims: list[RequestResult], bully: RequestResult, fired: float,
           prefilled: float, max_choke: float) -> Verdict:
    before, during, after = stall_windows(victims, fired, prefilled)
    prefill_s = prefilled - fired
    v.details = {"victims": len(victims), "bully_tokens": bully.prompt_tokens,
                 "bully_ttft_ms": prefill_s * 1000,
                 "before_n": len(before), "during_n": len(during), "after_n": len(after)}
    v.add("big prompt", f"{bully.prompt_tokens} tokens, TTFT {prefill_s * 1000:.0f} ms", INFO)
    if len(before) < 10 or not during:
        return v.inconclusive(f"too few samples (before {len(before)}, during {len(during)}); "
                              "raise --param bully_tokens or victim_tokens")
    before.sort()
    during.sort()
    p50_before = percentile(before, 50)
    p99_during = percentile(during, 99)
    choke = p99_during / p50_before if p50_before > 0 else float("inf")
    v.details.update({"p50_before_ms": p50_before * 1000, "p99_during_ms": p99_during * 1000,
                      "max_during_ms": during[-1] * 1000, "choke": choke})
    v.add("victim ITL p50 before", f"{p50_before * 1000:.1f} ms", INFO)
    v.add("victim ITL p99 during", f"{p99_during * 1000:.1f} ms", INFO,
          f"max {during[-1] * 1000:.1f} ms over {len(during)} tokens")
    if after:
        after.sort()
        v.add("victim ITL p50 after", f"{percentile(after, 50) * 1000:.1f} ms", INFO)
    passed = v.expect("choke ratio p99(during)/p50(before)", choke <= max_choke, f"{choke:.2f}",
                      f"limit {max_choke:g}")
    if not passed and bully.prompt_tokens:
        chunks = chunks_seen(victims, fired, prefilled, p50_before)
        rows = stall_advice(bully.prompt_tokens, prefill_s, p50_before, max_choke, chunks)
        v.details["advice"] = rows
        _advise(v, rows, max_choke)
    return v

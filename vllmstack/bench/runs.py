"""bench (pp/tg matrix), depth (context ladder) and conc (closed-loop concurrency ladder) runs.

pp t/s is overhead-corrected with a two-point estimate: a tiny request (a few prompt tokens, one
output token) measures the fixed cost of a request -- HTTP, tokenisation, scheduling, the first
decode step -- and pp = (P - P0) / (TTFT - TTFT0). Dividing the whole TTFT instead leaves that
fixed cost inside and understates pp badly for short prompts; subtracting only a network round
trip leaves most of it in as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.bench import history
from vllmstack.bench.client import ChatClient, EndpointError, RequestResult, chat_body
from vllmstack.bench.ladders import DEFAULT_MARGIN, conc_ladder, depth_ladder
from vllmstack.bench.prompts import PromptBuilder, load_tokenizer, resolve_tokenizer
from vllmstack.bench.stats import summarize
from vllmstack.bench.target import Target
from vllmstack.observe.metrics import MetricsError, MetricsSnapshot, parse_metrics

Progress = Callable[[str], None]

OVERHEAD_PROMPT_TOKENS = 16
OVERHEAD_SAMPLES = 3
# A two-phase depth run counts as a cache hit when at least this share of the context was reused
# (the tail of the context below one KV block can never be a hit).
CACHE_HIT_SHARE = 0.9
RUN_KINDS = ("bench", "depth", "conc")


class RunError(RuntimeError):
    """The run could not start or produced nothing; the message says what to check."""


@dataclass
class RunOptions:
    pp: list[int] = field(default_factory=lambda: [2048])
    tg: list[int] = field(default_factory=lambda: [128])
    runs: int = 3
    depths: list[int] | None = None  # depth: explicit rungs instead of the live ladder
    concurrency: list[int] | None = None  # conc: explicit levels instead of the ladder
    duration_s: float = 30.0  # conc: closed-loop time per level
    margin: int = DEFAULT_MARGIN
    prefix_caching: str = "auto"  # depth: auto | on | off
    warmup: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    timeout_s: float = 600.0

    def check(self) -> None:
        if not self.pp or min(self.pp) < 1:
            raise RunError("--pp needs positive token counts")
        if not self.tg or min(self.tg) < 1:
            raise RunError("--tg needs positive token counts")
        if self.runs < 1:
            raise RunError("--runs must be at least 1")
        if self.duration_s <= 0:
            raise RunError("--duration must be positive seconds")
        if self.prefix_caching not in ("auto", "on", "off"):
            raise RunError("--prefix-caching must be auto, on or off")


@dataclass
class Overhead:
    """Fixed cost of one request: median TTFT and prompt size of tiny one-token requests."""

    ttft_s: float
    prompt_tokens: int

    def pp_rate(self, prompt_tokens: int | None, ttft_s: float | None) -> float | None:
        if not prompt_tokens or prompt_tokens <= 0 or not ttft_s or ttft_s <= 0:
            return None
        if prompt_tokens > self.prompt_tokens and ttft_s > self.ttft_s:
            return (prompt_tokens - self.prompt_tokens) / (ttft_s - self.ttft_s)
        return prompt_tokens / ttft_s


@dataclass
class Session:
    client: ChatClient
    builder: PromptBuilder
    target: Target
    options: RunOptions
    progress: Progress
    overhead: Overhead | None = None
    warnings: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)
            self.progress(f"warning: {text}")

    def body(self, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
        return chat_body(self.target.model, messages, max_tokens, extra=self.options.extra_body)

    async def send(self, messages: list[dict[str, Any]], max_tokens: int) -> RequestResult:
        result = await self.client.stream_chat(self.body(messages, max_tokens))
        if not result.ok:
            self.failures.append(result.error or "failed")
        elif result.completion_tokens is not None and result.completion_tokens != max_tokens:
            self.warn(f"asked for {max_tokens} tokens, the server produced "
                      f"{result.completion_tokens} (ignore_eos/min_tokens unsupported?)")
        if result.ok and result.token_source in ("usage-final", "tokenizer"):
            self.warn(f"tokens per chunk estimated from {result.token_source}: the server sends "
                      "neither token_ids nor per-chunk usage")
        if result.ok and result.token_source == "none":
            self.warn("the server reports no usage and no tokenizer was loaded: decode t/s "
                      "and ITL cannot be measured")
        return result

    async def metrics(self) -> MetricsSnapshot | None:
        try:
            return parse_metrics(await self.client.get_text("/metrics"))
        except (EndpointError, MetricsError):
            return None


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _ms(values: Sequence[float | None]) -> dict[str, float] | None:
    return summarize([v * 1000 for v in values if v is not None])


async def measure_overhead(session: Session) -> Overhead:
    """Median TTFT of tiny one-token requests (fixed per-request cost, see the module doc)."""
    ttfts: list[float] = []
    sizes: list[int] = []
    for _ in range(OVERHEAD_SAMPLES):
        prompt = session.builder.build(OVERHEAD_PROMPT_TOKENS)
        result = await session.client.stream_chat(session.body(user(prompt.text), 1))
        if not result.ok:
            raise RunError(f"the endpoint failed a one-token request: {result.error}")
        if result.ttft_s is not None:
            ttfts.append(result.ttft_s)
        if result.prompt_tokens:
            sizes.append(result.prompt_tokens)
    if not ttfts:
        raise RunError("no token arrived for a one-token request; is this a chat model endpoint?")
    overhead = Overhead(statistics.median(ttfts), int(statistics.median(sizes)) if sizes else 0)
    session.progress(f"request overhead: {overhead.ttft_s * 1000:.1f} ms for "
                     f"{overhead.prompt_tokens} prompt tokens (subtracted from pp)")
    return overhead


def summarize_results(
    session: Session,
    results: Sequence[RequestResult],
    *,
    pp: int,
    tg: int,
    depth: int,
    concurrency: int,
    pp_values: Sequence[float | None] | None = None,
) -> dict[str, Any]:
    """One result row: distributions over the successful requests plus counts."""
    good = [r for r in results if r.ok]
    overhead = session.overhead
    if pp_values is None:
        pp_values = [overhead.pp_rate(r.prompt_tokens, r.ttft_s) if overhead else None
                     for r in good]
    itl: list[float] = []
    for r in good:
        itl.extend(r.itl_samples_s())
    sources = sorted({r.token_source for r in good})
    return {
        "pp": pp,
        "tg": tg,
        "depth": depth,
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(good),
        "ttft_ms": _ms([r.ttft_s for r in good]),
        "ttfr_ms": _ms([r.ttfr_s for r in good]),
        "pp_tps": summarize([v for v in pp_values if v is not None]),
        "tg_tps": summarize([v for v in (r.decode_tps for r in good) if v is not None]),
        "itl_ms": _ms(itl),
        "e2e_ms": _ms([r.t_end - r.t_sent for r in good]),
        "prompt_tokens": summarize([float(r.prompt_tokens) for r in good if r.prompt_tokens]),
        "completion_tokens": summarize([float(r.tokens) for r in good]),
        "token_source": sources[0] if len(sources) == 1 else sources,
    }


def _line(row: dict[str, Any], label: str) -> str:
    def mean(key: str, fmt: str) -> str:
        s = row.get(key)
        return format(s["mean"], fmt) if s else "-"

    return (f"{label}: ttft {mean('ttft_ms', '.1f')} ms, pp {mean('pp_tps', '.0f')} t/s, "
            f"tg {mean('tg_tps', '.2f')} t/s, itl p50/p99 "
            f"{row['itl_ms']['p50'] if row.get('itl_ms') else 0:.2f}/"
            f"{row['itl_ms']['p99'] if row.get('itl_ms') else 0:.2f} ms"
            + (f", {row['errors']} failed" if row.get("errors") else ""))


async def run_bench(session: Session) -> list[dict[str, Any]]:
    opts = session.options
    rows: list[dict[str, Any]] = []
    for pp in opts.pp:
        for tg in opts.tg:
            if opts.warmup:
                # One discarded request of the same shape: first-use costs (graph capture, JIT,
                # allocator growth) must not land in the first measured run.
                await session.send(user(session.builder.build(pp).text), tg)
            results = []
            for run in range(opts.runs):
                prompt = session.builder.build(pp)
                result = await session.send(user(prompt.text), tg)
                results.append(result)
                session.progress(
                    f"bench pp={pp} tg={tg} run {run + 1}/{opts.runs}: "
                    + (f"ttft {result.ttft_s * 1000:.1f} ms, tg {result.decode_tps or 0:.2f} t/s"
                       if result.ok and result.ttft_s is not None else f"FAILED {result.error}"))
            row = summarize_results(session, results, pp=pp, tg=tg, depth=0, concurrency=1)
            session.progress(_line(row, f"pp{pp} tg{tg}"))
            rows.append(row)
    return rows


async def _prefix_caching_on(session: Session) -> bool:
    mode = session.options.prefix_caching
    if mode != "auto":
        return mode == "on"
    snap = await session.metrics()
    if snap is not None:
        flag = snap.cache_config.get("enable_prefix_caching")
        if flag is not None:
            return flag.lower() == "true"
    if session.target.prefix_caching is not None:
        return session.target.prefix_caching
    session.warn("cannot tell whether prefix caching is on (no vllm:cache_config_info); "
                 "depth runs are single-phase (blended); pass --prefix-caching on to force")
    return False


async def run_depth(session: Session, max_model_len: int | None) -> list[dict[str, Any]]:
    opts = session.options
    pp, tg = opts.pp[0], opts.tg[0]
    if opts.depths is not None:
        depths = list(opts.depths)
    else:
        if not max_model_len:
            raise RunError("the server did not report max_model_len and no --depth list was "
                           "given; pass --depth 0 4096 ...")
        depths = depth_ladder(max_model_len, pp, tg, margin=opts.margin)
    two_phase = await _prefix_caching_on(session)
    how = ("two-phase: context load, then pp over the cached context" if two_phase
           else "blended (d+pp)/TTFT: prefix caching off")
    session.progress(f"depth ladder {depths} (pp {pp}, tg {tg}, {how})")
    if opts.warmup:
        # One warm-up per server, not per depth: re-filling a 100K+ context per rung doubles
        # the run time for nothing.
        await session.send(user(session.builder.build(pp).text), tg)
    rows = []
    for depth in depths:
        if depth == 0:
            rows.append(await _depth_zero(session, pp, tg))
        elif two_phase:
            rows.append(await _depth_two_phase(session, depth, pp, tg))
        else:
            rows.append(await _depth_blended(session, depth, pp, tg))
    return rows


async def _depth_zero(session: Session, pp: int, tg: int) -> dict[str, Any]:
    results = [await session.send(user(session.builder.build(pp).text), tg)
               for _ in range(session.options.runs)]
    row = summarize_results(session, results, pp=pp, tg=tg, depth=0, concurrency=1)
    row["mode"] = "cold"
    session.progress(_line(row, "d0"))
    return row


async def _depth_blended(session: Session, depth: int, pp: int, tg: int) -> dict[str, Any]:
    results = []
    for _ in range(session.options.runs):
        context = session.builder.build(depth)
        question = session.builder.build(pp)
        messages = [{"role": "system", "content": context.text},
                    {"role": "user", "content": question.text}]
        results.append(await session.send(messages, tg))
    row = summarize_results(session, results, pp=pp, tg=tg, depth=depth, concurrency=1)
    row["mode"] = "blended"  # pp_tps = all (depth + pp) prompt tokens over the whole prefill
    session.progress(_line(row, f"d{depth} (blended)"))
    return row


async def _depth_two_phase(session: Session, depth: int, pp: int, tg: int) -> dict[str, Any]:
    results: list[RequestResult] = []
    pp_values: list[float | None] = []
    ctx_pp: list[float | None] = []
    hits: list[float] = []
    all_hit = True
    overhead = session.overhead
    for _ in range(session.options.runs):
        context = session.builder.build(depth)
        system = {"role": "system", "content": context.text}
        load = await session.send([system, {"role": "user", "content": "."}], 1)
        if load.ok and overhead:
            ctx_pp.append(overhead.pp_rate(load.prompt_tokens, load.ttft_s))
        before = await session.metrics()
        question = session.builder.build(pp)
        result = await session.send([system, {"role": "user", "content": question.text}], tg)
        after = await session.metrics()
        results.append(result)
        if not result.ok:
            continue
        cached = _cached_tokens(before, after, result)
        if cached is None:
            # Some of the prompt was cached, but how much is unknown: any pp figure would be
            # invented. TTFT and decode still stand.
            session.warn("cannot attribute prefix-cache hits (no cached_tokens in usage, and the "
                         "vllm:prefix_cache_hits counter is missing or moved by other traffic); "
                         f"pp at depth {depth} is not reported")
            all_hit = False
            pp_values.append(None)
            continue
        if cached < CACHE_HIT_SHARE * depth:
            session.warn(f"depth {depth}: the prefix cache served only {cached:.0f} of "
                         f"{depth} context tokens; pp at this depth is blended, not pp@d")
            all_hit = False
        hits.append(cached)
        fresh = (result.prompt_tokens or 0) - int(cached)
        pp_values.append(overhead.pp_rate(fresh, result.ttft_s) if overhead else None)
    row = summarize_results(session, results, pp=pp, tg=tg, depth=depth, concurrency=1,
                            pp_values=pp_values)
    row["mode"] = "two-phase" if all_hit else "blended"
    row["ctx_pp_tps"] = summarize([v for v in ctx_pp if v is not None])
    row["cache_hit_tokens"] = summarize(hits)
    session.progress(_line(row, f"d{depth} ({row['mode']})"))
    return row


def _cached_tokens(
    before: MetricsSnapshot | None, after: MetricsSnapshot | None, result: RequestResult
) -> float | None:
    """Prompt tokens the prefix cache served for `result`: the server's own count in usage when
    it gives one, else the /metrics delta (which other clients' traffic can inflate, so a delta
    larger than the request's whole prompt proves nothing and counts as unknown)."""
    if result.cached_tokens is not None:
        return float(result.cached_tokens)
    if before is not None and after is not None:
        old, new = before.prefix_cache_hits, after.prefix_cache_hits
        if old is not None and new is not None:
            delta = max(0.0, new - old)
            return delta if delta <= (result.prompt_tokens or 0) else None
    return None


async def run_conc(session: Session, max_num_seqs: int | None) -> list[dict[str, Any]]:
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
        await session.send(user(session.builder.build(pp).text), tg)
    rows = []
    for level in levels:
        rows.append(await run_conc_level(session, level, pp, tg))
    return rows


async def run_conc_level(session: Session, level: int, pp: int, tg: int) -> dict[str, Any]:
    """`level` workers, each sending its next request as soon as the last ends, for a duration.

    Prompts are built before the clock starts (building one costs ~1 ms of the single event
    loop, which would otherwise show up as jitter in every other stream's timestamps).
    """
    opts = session.options
    per_worker = 4
    pool = [session.builder.build(pp).text for _ in range(level * per_worker)]
    results: list[tuple[int, int, RequestResult]] = []
    start = time.perf_counter()
    stop_at = start + opts.duration_s

    async def worker(index: int) -> None:
        sequence = 0
        while time.perf_counter() < stop_at:
            text = pool[(index * per_worker + sequence) % len(pool)]
            if sequence >= per_worker:
                # Re-used prompt: a fresh leading marker keeps it out of the prefix cache.
                text = f"[{index:03d}-{sequence:05d}]" + text[text.find("]") + 1:]
            result = await session.send(user(text), tg)
            results.append((index, sequence, result))
            sequence += 1
            if not result.ok:
                await asyncio.sleep(0.05)  # do not spin on a failing server

    async with asyncio.TaskGroup() as group:
        for i in range(level):
            group.create_task(worker(i))
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
    row = summarize_results(session, plain, pp=pp, tg=tg, depth=0, concurrency=level)
    row.update({
        "duration_s": opts.duration_s,
        "window_s": window,
        "total_tg_tps": in_window / window,
        "requests_per_s": finished / window,
    })
    session.progress(_line(row, f"c{level}") + f", total {row['total_tg_tps']:.1f} t/s over "
                     f"{row['requests']} requests")
    return row


@dataclass
class Outcome:
    record: dict[str, Any]
    exit_code: int


async def find_served_model(client: ChatClient, model: str) -> dict[str, Any]:
    """The /v1/models entry for `model`; RunError listing what the server serves instead."""
    models = await client.models()
    for entry in models:
        if entry.get("id") == model:
            return entry
    names = ", ".join(str(m.get("id")) for m in models) or "(none)"
    raise RunError(f"the server at {client.base_url} does not serve {model!r}; it serves: {names}")


async def execute(
    kind: str,
    target: Target,
    options: RunOptions,
    *,
    environ: dict[str, str],
    history_dir: Path | None,
    progress: Progress,
    client: ChatClient | None = None,
) -> Outcome:
    """Run one benchmark kind end to end, append it to history, return the record."""
    if kind not in RUN_KINDS:
        raise RunError(f"unknown run kind {kind!r}; use one of {', '.join(RUN_KINDS)}")
    options.check()
    if not target.tokenizer:
        raise RunError("no tokenizer: pass --tokenizer (tokenizer.json or model folder) or set "
                       "VLLM_TOKENIZER; prompts of exact length need the model's tokenizer")
    tokenizer_path = resolve_tokenizer(target.tokenizer, environ)
    tokenizer = load_tokenizer(tokenizer_path)
    own_client = client is None
    if client is None:
        client = ChatClient(target.url, api_key=target.api_key, timeout_s=options.timeout_s,
                            tokenizer=tokenizer)
    started = time.time()
    t0 = time.perf_counter()
    try:
        live = await find_served_model(client, target.model)
        max_model_len = live.get("max_model_len") or target.max_model_len
        server: dict[str, Any] = {"max_model_len": max_model_len}
        with contextlib.suppress(EndpointError, ValueError):
            version = await client.get_json("/version")
            server["version"] = version.get("version") if isinstance(version, dict) else None
        session = Session(client, PromptBuilder(tokenizer, seed=options.seed), target, options,
                          progress)
        session.overhead = await measure_overhead(session)
        if kind == "bench":
            rows = await run_bench(session)
        elif kind == "depth":
            rows = await run_depth(session, max_model_len)
        else:
            rows = await run_conc(session, target.max_num_seqs)
    finally:
        if own_client:
            await client.aclose()
    failed = sum(row["errors"] for row in rows)
    status = "ok" if rows and not failed else "failed"
    record: dict[str, Any] = {
        "kind": kind,
        "status": status,
        "started": started,
        "elapsed_s": time.perf_counter() - t0,
        **target.describe(),
        "tokenizer_path": str(tokenizer_path),
        "server": server,
        "options": asdict(options),
        "overhead": asdict(session.overhead) if session.overhead else None,
        "results": rows,
        "warnings": session.warnings,
        "failures": session.failures[:20],
    }
    if history_dir is not None:
        record = history.append_record(history.history_path(history_dir, kind), record)
    if failed:
        progress(f"{failed} request(s) failed; first: {session.failures[0]}")
    return Outcome(record, 0 if status == "ok" else 1)

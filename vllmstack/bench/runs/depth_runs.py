"""The depth run: decode and prefill speed over a ladder of context depths.

With prefix caching on, each rung first loads the context, then asks the question over the cached
context and checks (usage or /metrics) that the cache really served it; otherwise the row is
labelled "blended" ((depth + pp) / TTFT).
"""

from __future__ import annotations

from dataclasses import replace

from vllmstack.bench.client.client import RequestResult
from vllmstack.bench.client.row import BenchRow, Stat
from vllmstack.bench.runs.session import (
    RunError,
    Session,
    pp_estimate,
    progress_line,
    summarize_results,
    user,
)
from vllmstack.observe.metrics import MetricsSnapshot
from vllmstack.workload.ladders import depth_ladder

# A two-phase depth run counts as a cache hit when at least this share of the context was reused
# (the tail of the context below one KV block can never be a hit).
CACHE_HIT_SHARE = 0.9


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


async def run_depth(session: Session, max_model_len: int | None) -> list[BenchRow]:
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
        await session.send(user((await session.builder.build_async(pp)).text), tg)
    rows = []
    for depth in depths:
        if depth == 0:
            rows.append(await _depth_zero(session, pp, tg))
        elif two_phase:
            rows.append(await _depth_two_phase(session, depth, pp, tg))
        else:
            rows.append(await _depth_blended(session, depth, pp, tg))
    return rows


async def _depth_zero(session: Session, pp: int, tg: int) -> BenchRow:
    results = [await session.send(user((await session.builder.build_async(pp)).text), tg)
               for _ in range(session.options.runs)]
    row = replace(summarize_results(session, results, pp=pp, tg=tg, depth=0, concurrency=1),
                  mode="cold")
    session.progress(progress_line(row, "d0"))
    return row


async def _depth_blended(session: Session, depth: int, pp: int, tg: int) -> BenchRow:
    results = []
    for _ in range(session.options.runs):
        context = await session.builder.build_async(depth)
        question = await session.builder.build_async(pp)
        messages = [{"role": "system", "content": context.text},
                    {"role": "user", "content": question.text}]
        results.append(await session.send(messages, tg))
    # pp_tps = all (depth + pp) prompt tokens over the whole prefill
    row = replace(summarize_results(session, results, pp=pp, tg=tg, depth=depth, concurrency=1),
                  mode="blended")
    session.progress(progress_line(row, f"d{depth} (blended)"))
    return row


async def _depth_two_phase(session: Session, depth: int, pp: int, tg: int) -> BenchRow:
    results: list[RequestResult] = []
    pp_pairs: list[tuple[int | None, float | None]] = []
    ctx_pairs: list[tuple[int | None, float | None]] = []
    hits: list[float] = []
    all_hit = True
    for _ in range(session.options.runs):
        context = await session.builder.build_async(depth)
        system = {"role": "system", "content": context.text}
        load = await session.send([system, {"role": "user", "content": "."}], 1)
        if load.ok:
            ctx_pairs.append((load.prompt_tokens, load.ttft_s))
        before = await session.metrics()
        question = await session.builder.build_async(pp)
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
            continue
        if cached < CACHE_HIT_SHARE * depth:
            session.warn(f"depth {depth}: the prefix cache served only {cached:.0f} of "
                         f"{depth} context tokens; pp at this depth is blended, not pp@d")
            all_hit = False
        hits.append(cached)
        fresh = (result.prompt_tokens or 0) - int(cached)
        pp_pairs.append((fresh, result.ttft_s))
    row = replace(summarize_results(session, results, pp=pp, tg=tg, depth=depth, concurrency=1,
                                    pp_pairs=pp_pairs),
                  mode="two-phase" if all_hit else "blended",
                  # The context load's prefill rate: the same estimate, over the load requests.
                  ctx_pp_tps=pp_estimate(session.overhead, ctx_pairs).pp_tps,
                  cache_hit_tokens=Stat.of(hits))
    session.progress(progress_line(row, f"d{depth} ({row.mode})"))
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


"""bench (pp/tg matrix), depth (context ladder) and conc (closed-loop concurrency ladder) runs.

`execute` runs one kind end to end. The pieces live next to it: `session` (options, overhead
correction, summary rows), `depth_runs` and `conc_runs`; the names other code imports from here
are re-exported below.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from vllmstack.bench.client.client import ChatClient, EndpointError
from vllmstack.bench.client.row import BenchRow
from vllmstack.bench.report import history, roofline
from vllmstack.bench.runs.conc_runs import run_conc, run_conc_level
from vllmstack.bench.runs.depth_runs import run_depth
from vllmstack.bench.runs.session import (
    Overhead,
    Progress,
    RunError,
    RunOptions,
    Session,
    measure_overhead,
    progress_line,
    steady_heap,
    summarize_results,
    user,
)
from vllmstack.bench.target import Target
from vllmstack.workload.prompts import PromptBuilder, load_tokenizer, resolve_tokenizer

__all__ = [
    "RUN_KINDS",
    "Outcome",
    "Overhead",
    "RunError",
    "RunOptions",
    "Session",
    "execute",
    "find_served_model",
    "live_max_model_len",
    "measure_overhead",
    "run_bench",
    "run_conc",
    "run_conc_level",
    "run_depth",
]

RUN_KINDS = ("bench", "depth", "conc")


async def run_bench(session: Session) -> list[BenchRow]:
    opts = session.options
    rows: list[BenchRow] = []
    for pp in opts.pp:
        for tg in opts.tg:
            if opts.warmup:
                # One discarded request of the same shape: first-use costs (graph capture, JIT,
                # allocator growth) must not land in the first measured run.
                await session.send(user((await session.builder.build_async(pp)).text), tg)
            results = []
            # Every prompt is built before the first request is timed, as the closed loop does:
            # both then time the same thing, a request and nothing else.
            prompts = [(await session.builder.build_async(pp)).text for _ in range(opts.runs)]
            with steady_heap():
                for run, text in enumerate(prompts):
                    result = await session.send(user(text), tg)
                    results.append(result)
                    session.progress(
                        f"bench pp={pp} tg={tg} run {run + 1}/{opts.runs}: "
                        + (f"ttft {result.ttft_s * 1000:.1f} ms, "
                           + ("all tokens in one burst" if result.burst
                              else f"tg {result.decode_tps or 0:.2f} t/s")
                           if result.ok and result.ttft_s is not None
                           else f"FAILED: {result.why}"))
            row = summarize_results(session, results, pp=pp, tg=tg, depth=0, concurrency=1)
            session.progress(progress_line(row, f"pp{pp} tg{tg}"))
            rows.append(row)
    return rows


@dataclass
class Outcome:
    record: dict[str, Any]
    exit_code: int


def live_max_model_len(entry: dict[str, Any]) -> int | None:
    """The window a /v1/models entry reports, when it is a usable whole number."""
    value = entry.get("max_model_len")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


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
        raise RunError("no tokenizer: prompts of exact length need the model's tokenizer",
                       "pass --tokenizer (tokenizer.json or model folder) or set VLLM_TOKENIZER")
    tokenizer_path = resolve_tokenizer(target.tokenizer, environ, target.hf_cache)
    tokenizer = load_tokenizer(tokenizer_path)
    own_client = client is None
    if client is None:
        client = ChatClient(target.url, api_key=target.api_key, timeout_s=options.timeout_s,
                            tokenizer=tokenizer)
    started = time.time()
    t0 = time.perf_counter()
    try:
        live = await find_served_model(client, target.model)
        max_model_len = live_max_model_len(live) or target.max_model_len
        options.check_window(kind, max_model_len)
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
    # % of what the card allows at best (None on a CPU)
    rows = [replace(row, roofline=roofline.row_roofline(row, target.roofline)) for row in rows]
    for row in rows:
        line = roofline.progress_line(row, f"pp{row.pp} tg{row.tg}")
        if line:
            progress(line)
    failed = sum(row.errors or 0 for row in rows)
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
        "results": [row.to_json() for row in rows],
        "warnings": session.warnings,
        "failures": session.failures[:20],
    }
    if history_dir is not None:
        record = history.append_record(history.history_path(history_dir, kind), record)
    if failed:
        progress(f"{failed} request(s) failed; first: {session.failures[0]}")
    return Outcome(record, 0 if status == "ok" else 1)

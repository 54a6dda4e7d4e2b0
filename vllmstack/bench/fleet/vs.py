"""`invoke bench-vs -t ENGINE:PROFILE ...`: the same measurements on each target, one resident at a
time, in one table.

Each target is brought up through the stack's lifecycle (checks, guards, diagnosis), measured with
the bench's own client and definitions (`session`, `runs.run_bench`, `conc_runs.run_conc_level`:
TTFT, pp with its overhead correction, decode t/s, tokens from usage), and taken down (`down` waits
until its GPU memory has drained) before the next one starts. A target that fails to start, or
whose measurement fails, gets a row that says why; the others still run. A target that does not
stop ends the run: starting the next would put two engines on the card.

Per target: single-stream at `pp` (decode t/s, TTFT), one prompt of about `ctx` tokens (decode
there, and prefill t/s, where prefill is long enough to resolve), `concurrency` closed-loop streams
(aggregate decode t/s), GPU memory read while measuring, and `up`'s boot time. Prompts come from
the same corpus at the same seeded positions on every target, cut to length with each engine's
own tokenizer: the profile's tokenizer.json for vLLM, llama-server's /tokenize for llama.cpp.
Thinking is off unless `think` (`chat_template_kwargs.enable_thinking`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from vllmstack.bench.client.client import ChatClient, EndpointError
from vllmstack.bench.client.row import BenchRow, mean_of
from vllmstack.bench.fleet.resident import (
    CollectingSession,
    ResidentResult,
    ServerTokenizer,
    Started,
    VramSampler,
    diagnosis,
    ensure_idle,
    keep_alive,
    one_line,
    open_profile,
    server_timings,
    start,
    take_down,
)
from vllmstack.bench.fleet.vs_report import assign_pairs, checkpoint_of, spec_draft, write_markdown
from vllmstack.bench.report import history
from vllmstack.bench.runs.conc_runs import run_conc_level
from vllmstack.bench.runs.runs import find_served_model, live_max_model_len, run_bench
from vllmstack.bench.runs.session import Progress, RunError, RunOptions, measure_overhead
from vllmstack.bench.target import Target, shared_platform, target_from_profile
from vllmstack.config.engines.table import ENGINES as KINDS
from vllmstack.config.engines.table import display_name, engine_of, kind_named
from vllmstack.config.profiles import Resolved, resolve
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project, results_folder
from vllmstack.core.runner import Runner, SubprocessRunner
from vllmstack.workload.ladders import DEFAULT_MARGIN
from vllmstack.workload.prompts import PromptBuilder, TokenizerError, load_tokenizer, resolve_tokenizer

ENGINES = tuple(KINDS)
KIND = "bench-vs"


class VsError(StackError, ValueError):
    """A target or option bench-vs cannot use; nothing was started."""


@dataclass(frozen=True)
class VsOptions:
    ctx: int = 8000
    concurrency: int = 4
    think: bool = False
    pp: int = 512
    tg: int = 128
    runs: int = 3
    duration_s: float = 15.0
    timeout_s: float = 600.0
    seed: int = 0

    def check(self) -> None:
        for flag, value, low in (("--ctx", self.ctx, 1), ("--concurrency", self.concurrency, 1),
                                 ("--pp", self.pp, 1), ("--tg", self.tg, 1),
                                 ("--runs", self.runs, 1)):
            if value < low:
                raise VsError(f"{flag} must be at least {low}, got {value}", f"pass {flag} {low} or more")
        for flag, seconds in (("--duration", self.duration_s), ("--timeout", self.timeout_s)):
            if not seconds > 0 or seconds == float("inf"):
                raise VsError(f"{flag} must be a positive, finite number of seconds, got {seconds}")


@dataclass(frozen=True)
class VsTarget:
    spec: str  # as given: "vllm:tiny"
    engine: str
    profile: str
    resolved: Resolved


class VsResult(ResidentResult):
    @property
    def failed(self) -> bool:
        """A target that did not start or measured nothing (a partial row has its numbers)."""
        return any(row.get("status") not in ("ok", "partial") for row in self.rows)


def parse_target(text: str) -> tuple[str, str]:
    """ENGINE:PROFILE -> (engine, profile); VsError naming the accepted engines otherwise."""
    engine, sep, profile = text.strip().partition(":")
    if not sep or not engine or not profile:
        raise VsError(f"target {text!r} is not ENGINE:PROFILE",
                      f"write e.g. -t vllm:tiny -t llamacpp:tiny-gguf (engines: {', '.join(ENGINES)})")
    if engine not in ENGINES:
        raise VsError(f"target {text!r}: unknown engine {engine!r}",
                      f"use one of: {', '.join(ENGINES)}")
    return engine, profile


def resolve_targets(project: Project, environ: Mapping[str, str], targets: Sequence[str],
                    platform: str | None, say: Callable[[str], None] | None = None
                    ) -> list[VsTarget]:
    """Every target resolved before anything starts: a typo must not cost a model load first.
    Without `platform`, the one every target is made for when .env's is not (`say` is told)."""
    if not targets:
        raise VsError("no targets", "give at least one, e.g. -t vllm:tiny -t llamacpp:tiny-gguf")
    parsed = [(text, *parse_target(text)) for text in targets]
    platform, note = shared_platform(project, environ, [p for _, _, p in parsed], platform)
    if note and say is not None:
        say(note)
    out = []
    for text, engine, profile in parsed:
        resolved = resolve(project, platform=platform, model=profile, environ=environ)
        declared = engine_of(resolved)
        if declared != engine:
            where = resolved.source("ENGINE") or "the schema default"
            raise VsError(
                f"target {text!r}: profile {profile} runs ENGINE={declared} (set at {where}), "
                f"not {engine}",
                f"write -t {declared}:{profile}, or pick a {display_name(engine)} profile")
        out.append(VsTarget(text, engine, profile, resolved))
    return out


def run_bench_vs(
    project: Project,
    environ: Mapping[str, str],
    targets: list[str],
    *,
    ctx: int = 8000,
    concurrency: int = 4,
    think: bool = False,
    platform: str | None = None,
    runtime: str | None = None,
    out: TextIO,
    pp: int = VsOptions.pp,
    tg: int = VsOptions.tg,
    runs: int = VsOptions.runs,
    duration_s: float = VsOptions.duration_s,
    timeout_s: float = VsOptions.timeout_s,
    up_timeout: float | None = None,
    history_dir: Path | None = None,
    runner: Runner | None = None,
) -> VsResult:
    """Bring each target up, measure it, take it down; append JSON history and the markdown.

    Raises VsError (bad targets or options) or a StackError (the stack already runs something)
    before anything starts; failures of single targets are rows, not exceptions."""
    opts = VsOptions(ctx, concurrency, think, pp, tg, runs, duration_s, timeout_s)
    opts.check()
    chosen = resolve_targets(project, environ, targets, platform,
                             say=lambda line: print(line, file=out, flush=True))
    ensure_idle(project)
    runner = runner or SubprocessRunner()
    started_at = time.time()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    blocked: str | None = None  # set when a target did not stop: nothing else may start
    for number, vt in enumerate(chosen, start=1):
        label = f"[bench-vs {number}/{len(chosen)}] {vt.spec}"
        row = _base_row(vt, environ)
        if blocked is not None:
            row.update(status="skipped", diagnosis=blocked)
        else:
            print(f"{label}: bringing it up", file=out, flush=True)
            blocked = _run_target(project, environ, vt, opts, row, runner=runner,
                                  runtime=runtime, out=out, up_timeout=up_timeout,
                                  progress=_prefixed(out, label))
        print(f"{label}: {row['status']}" + (f" ({row['diagnosis']})" if row.get("diagnosis")
                                             else ""), file=out, flush=True)
        rows.append(row)
    assign_pairs(rows)
    record: dict[str, Any] = {
        "kind": KIND,
        "status": "ok" if all(r["status"] == "ok" for r in rows) else "failed",
        "started": started_at,
        "elapsed_s": time.perf_counter() - t0,
        "platform": chosen[0].resolved.platform,
        "runtime": runtime,
        "targets": [vt.spec for vt in chosen],
        "options": asdict(opts),
        "rows": rows,
    }
    if not any(r["status"] in ("ok", "partial") for r in rows):
        # Nothing was measured: a history of diagnoses would read as results (issue 23).
        print("bench-vs: no target was measured, so nothing was added to the history",
              file=out, flush=True)
        return VsResult(record, [])
    folder = history_dir or results_folder(project)
    stored = history.append_record(history.history_path(folder, KIND), record)
    written = [history.history_path(folder, KIND), *write_markdown(folder, stored)]
    return VsResult(stored, written)


def _prefixed(out: TextIO, label: str) -> Progress:
    def progress(line: str) -> None:
        print(f"{label}: {line}", file=out, flush=True)

    return progress


def _base_row(vt: VsTarget, environ: Mapping[str, str]) -> dict[str, Any]:
    return {"target": vt.spec, "engine": vt.engine, "profile": vt.profile,
            "platform": vt.resolved.platform, "served_name": vt.resolved.get_str("VLLM_SERVED_NAME"),
            "checkpoint": checkpoint_of(vt.resolved, environ).as_record(),
            "spec_draft": spec_draft(vt.resolved), "status": "failed", "diagnosis": None,
            "fix": None, "load_s": None, "load_kind": None, "vram": None, "notes": []}


def _fail(row: dict[str, Any], exc: StackError, prefix: str = "") -> None:
    row.update(status="failed", diagnosis=prefix + diagnosis(exc), fix=exc.fix)


def _run_target(project: Project, environ: Mapping[str, str], vt: VsTarget, opts: VsOptions,
                row: dict[str, Any], *, runner: Runner, runtime: str | None, out: TextIO,
                up_timeout: float | None, progress: Progress) -> str | None:
    """Up, measure, down; fills `row`. Returns why nothing else may start (it did not stop)."""
    target = target_from_profile(vt.resolved)
    tokenizer_path: Path | None = None
    if not kind_named(vt.engine).model_file:
        try:  # before `up`: a missing tokenizer must not cost a model load
            tokenizer_path = resolve_tokenizer(target.tokenizer or "", environ, target.hf_cache)
        except TokenizerError as exc:
            _fail(row, exc, "no tokenizer: ")
            return None
    try:
        stack = open_profile(project, vt.resolved, environ, runner, runtime=runtime, out=out)
    except StackError as exc:
        _fail(row, exc)
        return None
    row["runtime"] = stack.engine.flavour
    try:
        started = start(stack, timeout=up_timeout)
        row.update(load_s=started.boot_s, load_kind=started.load_kind,
                   compile_cache_files=list(started.cache_files), boot=started.boot)
        measured = asyncio.run(_measure(started, vt, target, tokenizer_path, opts, progress))
        row.update(measured)
    except StackError as exc:
        _fail(row, exc, "" if row["load_s"] is None else "measuring: ")
    finally:
        blocked = take_down(stack, vt.spec, row["notes"])  # also when interrupted: no engine left behind
    return blocked


async def _measure(started: Started, vt: VsTarget, target: Target, tokenizer_path: Path | None,
                   opts: VsOptions, progress: Progress) -> dict[str, Any]:
    local = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    # llama.cpp counts come from its usage; no tokenizer in the client means no blocking
    # /tokenize calls on the event loop while streams are timed.
    async with ChatClient(target.url, api_key=target.api_key, timeout_s=opts.timeout_s,
                          tokenizer=local, keep_alive=keep_alive(vt.engine)) as client:
        live = await find_served_model(client, target.model)
        if not kind_named(vt.engine).vllm_cli:  # the VLLM_* limits say nothing about it
            window, slots = await _llamacpp_limits(client)
        else:
            window = live_max_model_len(live) or target.max_model_len
            slots = target.max_num_seqs
        tokenizer = local if local is not None else ServerTokenizer(target.url, target.api_key)
        base = RunOptions(pp=[opts.pp], tg=[opts.tg], runs=opts.runs, duration_s=opts.duration_s,
                          extra_body={"chat_template_kwargs": {"enable_thinking": opts.think}},
                          seed=opts.seed, timeout_s=opts.timeout_s)
        session = CollectingSession(client, PromptBuilder(tokenizer, seed=opts.seed), target, base,
                                    progress)
        notes: list[str] = []
        if window is None:
            raise RunError(f"{target.url} reports no context window (vLLM: max_model_len in "
                           "/v1/models; llama-server: n_ctx in /props)",
                           "set VLLM_MAX_MODEL_LEN in the profile (vLLM), or check that this is "
                           "the llama-server the profile starts")
        room = window - opts.tg - DEFAULT_MARGIN
        pp, ctx = min(opts.pp, room), min(opts.ctx, room)
        if pp < 1:
            raise RunError(f"the server's window ({window} tokens) leaves no room for a prompt "
                           f"plus {opts.tg} generated tokens", "lower --tg or raise the window")
        if pp < opts.pp or ctx < opts.ctx:
            notes.append(f"prompts cut to {pp} / {ctx} tokens: the server's window is {window}")
        if slots is not None and slots < opts.concurrency:
            notes.append(f"the server runs {slots} requests at once: the other streams of "
                         f"--concurrency {opts.concurrency} queue")
        async with VramSampler(started.stack.probe) as vram:
            session.overhead = await measure_overhead(session)
            single, single_results = await _one_shape(session, base, pp, opts.tg)
            ctx_row, ctx_results = await _one_shape(session, base, ctx, opts.tg)
            progress(f"{opts.concurrency} streams for {opts.duration_s:g} s")
            conc = await run_conc_level(session, opts.concurrency, pp, opts.tg)
    errors = sum(r.errors or 0 for r in (single, ctx_row, conc))
    answered = any(mean_of(r.tg_tps) is not None for r in (single, ctx_row)) \
        or bool(conc.total_tg_tps)
    measured: dict[str, Any] = {
        # Some failed requests among many that answered (a random-weight model can trip
        # llama-server's chat-output parser) leave the numbers standing, marked "partial".
        "status": "ok" if not errors else ("partial" if answered else "failed"),
        "diagnosis": (f"{errors} request(s) failed: {one_line(session.failures[0])}"
                      if errors and session.failures else None),
        "window": window, "slots": slots, "pp": pp, "tg": opts.tg, "ctx_tokens": ctx,
        "overhead": asdict(session.overhead) if session.overhead else None,
        "single": single.to_json(), "ctx": ctx_row.to_json(), "conc": conc.to_json(),
        "timings": {"single": server_timings(single_results), "ctx": server_timings(ctx_results)},
        "vram": vram.record(started.baseline_bytes),
        "notes": notes, "warnings": session.warnings, "failures": session.failures[:10],
    }
    return measured


async def _llamacpp_limits(client: ChatClient) -> tuple[int | None, int | None]:
    """llama-server's per-slot context and slot count (GET /props): its /v1/models has neither."""
    try:
        props = await client.get_json("/props")
    except EndpointError:
        return None, None
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    total = props.get("total_slots") if isinstance(props, dict) else None
    return (n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None,
            total if isinstance(total, int) and total > 0 else None)


async def _one_shape(session: CollectingSession, base: RunOptions, pp: int, tg: int
                     ) -> tuple[BenchRow, list[Any]]:
    """`invoke bench` for one pp/tg cell (a warm-up, then the runs); its row and its results."""
    session.options = replace(base, pp=[pp], tg=[tg])
    session.collected = []
    (row,) = await run_bench(session)
    measured = session.collected[-base.runs:]  # the warm-up request came first
    return row, measured

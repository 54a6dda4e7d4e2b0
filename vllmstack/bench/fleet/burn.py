"""`invoke burn`: every profile made for this platform, loaded in turn, a few measured runs each,
one PASS/FAIL table.

For each profile (those whose PROFILE_PLATFORMS names the platform, or `--profiles`): `up` through
the stack's lifecycle (checks, guards, crash diagnosis), the warm-up runs (discarded), the measured
runs (single stream, exactly `max_tokens` each), `down` (which waits for the GPU memory to drain),
then the next. A profile that fails to load, or whose runs fail, is a FAIL row carrying the
diagnosis line; the rest still run. A profile that does not stop ends the burn: the next load
would put two engines on the card.

tok/s is `invoke bench`'s decode rate (tokens after the first token chunk over their span; tokens
from usage), TTFT the bench's time to first token; mean ± std over the measured runs. A row whose
std is over 10 % of its mean is flagged "unstable". Load time is `up`'s boot, cold when the engine's
compile caches were empty or it filled them while starting, else warm.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from vllmstack.bench.client.client import ChatClient, RequestResult, chat_body
from vllmstack.bench.client.row import Stat
from vllmstack.bench.fleet.resident import (
    ResidentResult,
    append_text,
    diagnosis,
    ensure_idle,
    keep_alive,
    md_table,
    one_line,
    open_profile,
    server_timings,
    stamp,
    start,
    take_down,
    today,
)
from vllmstack.bench.report import history
from vllmstack.bench.runs.runs import find_served_model
from vllmstack.bench.runs.session import user
from vllmstack.bench.target import Target, target_from_profile
from vllmstack.config.engines.table import display_name, engine_of
from vllmstack.config.profiles import available, list_profiles, resolve
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project, results_folder
from vllmstack.core.runner import Runner, SubprocessRunner
from vllmstack.workload.prompts import load_corpus

KIND = "burn"
UNSTABLE_SPREAD = 0.10  # std over this share of the mean flags a row
LATEST_MD = "burn-latest.md"
HEADER = ["profile", "engine", "status", "tok/s mean ± std", "min", "max", "TTFT ms",
          "load s (cold)", "load s (warm)"]


class BurnError(StackError, ValueError):
    """An option or profile list burn cannot use; nothing was started."""


class BurnResult(ResidentResult):
    @property
    def failed(self) -> bool:
        return any(row["status"] != "PASS" for row in self.rows)


def unstable(stat: Stat | None) -> bool:
    """std over 10 % of the mean (a spread that large says the numbers are not one speed)."""
    if stat is None or not stat.mean > 0:
        return False
    return (stat.std or 0.0) > UNSTABLE_SPREAD * stat.mean


def select_profiles(project: Project, environ: Mapping[str, str], platform: str | None,
                    profiles: Sequence[str] | None) -> tuple[str, list[str]]:
    """(platform, profiles to burn): the given ones (each must exist), else every model profile
    whose PROFILE_PLATFORMS names the platform."""
    names = available(project, "models")
    if not names:
        raise BurnError("there are no model profiles (env/models/*.env)")
    if profiles:
        unknown = [p for p in profiles if p not in names]
        if unknown:
            raise BurnError(f"unknown profile(s): {', '.join(unknown)}",
                            f"choose from: {', '.join(names)}")
    platform_name = resolve(project, platform=platform, model=(profiles or names)[0],
                            environ=environ).platform
    if profiles:
        return platform_name, list(profiles)
    chosen = [info.name for info in list_profiles(project)
              if info.kind == "model" and platform_name in info.platforms]
    if not chosen:
        raise BurnError(f"no model profile lists platform {platform_name} in PROFILE_PLATFORMS",
                        "pass --profiles a,b, or add the platform to a profile's PROFILE_PLATFORMS")
    return platform_name, chosen


def run_burn(
    project: Project,
    environ: Mapping[str, str],
    *,
    profiles: Sequence[str] | None = None,
    runs: int = 5,
    warmup: int = 2,
    max_tokens: int = 200,
    platform: str | None = None,
    runtime: str | None = None,
    out: TextIO,
    timeout_s: float = 600.0,
    up_timeout: float | None = None,
    history_dir: Path | None = None,
    runner: Runner | None = None,
) -> BurnResult:
    """Load, warm up, measure and unload every profile in turn; JSON history and markdown."""
    for flag, value, low in (("--runs", runs, 1), ("--warmup", warmup, 0),
                             ("--max-tokens", max_tokens, 2)):
        if value < low:
            # Two tokens at least: decode t/s is measured after the first.
            raise BurnError(f"{flag} must be at least {low}, got {value}")
    platform_name, chosen = select_profiles(project, environ, platform, profiles)
    ensure_idle(project)
    runner = runner or SubprocessRunner()
    started_at, t0 = time.time(), time.perf_counter()
    rows: list[dict[str, Any]] = []
    blocked: str | None = None
    for number, name in enumerate(chosen, start=1):
        label = f"[burn {number}/{len(chosen)}] {name}"
        row: dict[str, Any] = {"profile": name, "engine": None, "status": "FAIL",
                               "diagnosis": None, "fix": None, "load_s": None, "load_kind": None,
                               "tps": None, "ttft_ms": None, "unstable": False, "notes": []}
        if blocked is not None:
            row["diagnosis"] = blocked
        else:
            print(f"{label}: loading", file=out, flush=True)
            blocked = _burn_one(project, environ, name, platform_name, row, runs=runs,
                                warmup=warmup, max_tokens=max_tokens, runtime=runtime,
                                runner=runner, out=out, timeout_s=timeout_s,
                                up_timeout=up_timeout)
        print(f"{label}: {row['status']}" + (f" ({row['diagnosis']})" if row["diagnosis"] else ""),
              file=out, flush=True)
        rows.append(row)
    record: dict[str, Any] = {
        "kind": KIND,
        "status": "ok" if all(r["status"] == "PASS" for r in rows) else "failed",
        "started": started_at, "elapsed_s": time.perf_counter() - t0,
        "platform": platform_name, "runtime": runtime,
        "options": {"profiles": chosen, "runs": runs, "warmup": warmup,
                    "max_tokens": max_tokens, "timeout_s": timeout_s},
        "rows": rows,
    }
    folder = history_dir or results_folder(project)
    stored = history.append_record(history.history_path(folder, KIND), record)
    return BurnResult(stored, [history.history_path(folder, KIND), *write_markdown(folder, stored)])


def _burn_one(project: Project, environ: Mapping[str, str], name: str, platform: str,
              row: dict[str, Any], *, runs: int, warmup: int, max_tokens: int,
              runtime: str | None, runner: Runner, out: TextIO, timeout_s: float,
              up_timeout: float | None) -> str | None:
    """One profile: up, runs, down; fills `row`. Returns why nothing else may start."""
    try:
        resolved = resolve(project, platform=platform, model=name, environ=environ)
        row["engine"] = engine_of(resolved)
        stack = open_profile(project, resolved, environ, runner, runtime=runtime, out=out)
    except StackError as exc:  # an unknown profile (ProfileError) too
        row.update(diagnosis=diagnosis(exc), fix=exc.fix)
        return None
    try:
        started = start(stack, timeout=up_timeout)
        row.update(load_s=started.boot_s, load_kind=started.load_kind, boot=started.boot)
        results = asyncio.run(_runs(target_from_profile(resolved), runs=runs, warmup=warmup,
                                    max_tokens=max_tokens, timeout_s=timeout_s,
                                    keep=keep_alive(row["engine"])))
        row.update(summarize_runs(results))
    except StackError as exc:
        where = "" if row["load_s"] is None else "measuring: "
        row.update(status="FAIL", diagnosis=where + diagnosis(exc), fix=exc.fix)
    finally:
        blocked = take_down(stack, name, row["notes"])  # also when interrupted
    return blocked


async def _runs(target: Target, *, runs: int, warmup: int, max_tokens: int, timeout_s: float,
                keep: bool) -> list[RequestResult]:
    """The warm-up runs (discarded) and the measured ones, one at a time, each exactly
    `max_tokens` long, thinking off; every prompt starts with its own marker (no cache hit)."""
    text = load_corpus()[0]
    async with ChatClient(target.url, api_key=target.api_key, timeout_s=timeout_s,
                          keep_alive=keep) as client:
        await find_served_model(client, target.model)
        results = []
        for n in range(warmup + runs):
            body = chat_body(target.model, user(f"[{uuid.uuid4().hex[:12]}] {text}"), max_tokens,
                             extra={"chat_template_kwargs": {"enable_thinking": False}})
            result = await client.stream_chat(body)
            if result.ok and result.t_first_token is None:
                result.error = result.why
            if n >= warmup:
                results.append(result)
    return results


def summarize_runs(results: Sequence[RequestResult]) -> dict[str, Any]:
    """PASS when every measured run gave a decode rate; the row's numbers either way."""
    good = [r for r in results if r.ok and r.decode_tps is not None]
    tps = Stat.of(r.decode_tps for r in good if r.decode_tps is not None)
    ttft = Stat.of(r.ttft_s * 1000 for r in good if r.ttft_s is not None)
    failed = [r for r in results if not (r.ok and r.decode_tps is not None)]
    out: dict[str, Any] = {"status": "PASS" if not failed else "FAIL",
                           "tps": tps.to_json() if tps else None,
                           "ttft_ms": ttft.to_json() if ttft else None,
                           "unstable": unstable(tps), "runs": len(results),
                           "server_timings": server_timings(results),
                           "tokens": [r.tokens for r in results]}
    if failed:
        first = failed[0].why if not failed[0].ok else "no decode rate (fewer than 2 tokens)"
        out["diagnosis"] = f"{len(failed)} of {len(results)} runs failed: {one_line(first)}"
    return out


# --- markdown -------------------------------------------------------------------------------------


def _num(stat: Stat | None, key: str, fmt: str = ".1f") -> str:
    value = getattr(stat, key) if stat is not None else None
    return "-" if value is None else format(value, fmt)


def _stat(row: Mapping[str, Any], key: str) -> Stat | None:
    data = row.get(key)
    return None if data is None else Stat.read_json(data, f"burn row {row.get('profile')}", key)


def table_row(row: Mapping[str, Any]) -> list[str]:
    tps = _stat(row, "tps")
    spread = f"{_num(tps, 'mean')} ± {_num(tps, 'std')}" if tps else "-"
    if row.get("unstable"):
        spread += " unstable"
    status = "PASS" if row.get("status") == "PASS" else (
        "FAIL: " + one_line(row.get("diagnosis") or "failed", 200))
    load = row.get("load_s")
    # Split by kind, so a column compares like with like: a cold load includes compilation.
    cold = warm = "-"
    if isinstance(load, int | float):
        if row.get("load_kind") == "cold":
            cold = f"{load:.1f}"
        else:
            warm = f"{load:.1f}"
    engine = row.get("engine")
    return [str(row.get("profile")), display_name(str(engine)) if engine else "-", status, spread,
            _num(tps, "min"), _num(tps, "max"), _num(_stat(row, "ttft_ms"), "mean"), cold, warm]


def render(record: Mapping[str, Any]) -> str:
    opts = record.get("options") or {}
    rows: Sequence[Mapping[str, Any]] = record.get("rows") or []
    passed = sum(1 for r in rows if r.get("status") == "PASS")
    head = (f"## {stamp(record.get('started'))} · {record.get('platform')} · {passed}/{len(rows)} "
            f"PASS\n\n{opts.get('runs')} measured runs after {opts.get('warmup')} warm-up(s), "
            f"{opts.get('max_tokens')} tokens each, one stream, thinking off. tok/s: `invoke "
            "bench`'s decode rate; \"unstable\": std over 10 % of the mean; load time: `up`'s boot "
            "(cold: compile caches empty or filled by this start).\n")
    notes = [f"* {r.get('profile')}: fix: {r['fix']}" for r in rows
             if r.get("status") != "PASS" and r.get("fix")]
    notes += [f"* {r.get('profile')}: {one_line(n, 400)}" for r in rows for n in r.get("notes") or []]
    return (head + "\n" + md_table(HEADER, [table_row(r) for r in rows]) + "\n"
            + ("\n" + "\n".join(notes) + "\n" if notes else ""))


def write_markdown(folder: Path, record: Mapping[str, Any]) -> list[Path]:
    """Append the run to burn-<date>.md (every burn of that day) and make it burn-latest.md."""
    section = render(record)
    dated = folder / f"burn-{today(record.get('started'))}.md"
    if not dated.exists():
        append_text(dated, f"# Burn test, {today(record.get('started'))}\n\n")
    append_text(dated, section + "\n")
    latest = folder / LATEST_MD
    latest.write_text("# Burn test: latest run\n\n" + section, encoding="utf-8")
    return [dated, latest]

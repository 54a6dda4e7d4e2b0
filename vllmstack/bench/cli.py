"""Command line for benchmarks, probes, stability runs and reports.

`python -m vllmstack.bench COMMAND ...` and the invoke tasks (`invoke bench`, `bench-depth`,
`bench-conc`, `probe`, `stability`, `report`) both end up in `main(argv)`, so the dashboard, the
CLI and the tasks run exactly the same code.

Without --url the target is the running stack: URL, served model name, tokenizer and
max_num_seqs come from the resolved profile (--profile/--platform/--set pick it).
Output: progress lines on stdout; with --json the progress goes to stderr and stdout carries one
JSON document. Exit codes: bench/depth/conc 0 ok, 1 failed; probe and stability 0 pass, 1 fail,
2 inconclusive. SIGTERM or Ctrl-C stops the run: open streams are closed, nothing is appended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from vllmstack.bench import history
from vllmstack.bench.client import ChatClient, EndpointError
from vllmstack.bench.ladders import DEFAULT_MARGIN, LadderError
from vllmstack.bench.probes import PROBES, ProbeContext, run_probe
from vllmstack.bench.prompts import PromptBuilder, TokenizerError, load_tokenizer
from vllmstack.bench.prompts import resolve_tokenizer as find_tokenizer
from vllmstack.bench.report import build_report
from vllmstack.bench.runs import RunError, RunOptions, execute, find_served_model
from vllmstack.bench.stability import MODES, run_stability
from vllmstack.bench.target import Target, TargetError, target_from_profile, target_from_url
from vllmstack.bench.verdict import Verdict
from vllmstack.core.paths import Project

EXIT_USAGE = 2
RUN_COMMANDS = {"bench": "bench", "depth": "depth", "conc": "conc",
                "bench-depth": "depth", "bench-conc": "conc"}


class CliError(Exception):
    """A problem with the arguments or the environment; printed as `error: ...`."""


def _add_target(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target (default: the running stack from the profile)")
    g.add_argument("--url", help="OpenAI-compatible server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--model", help="served model name (default: VLLM_SERVED_NAME)")
    g.add_argument("--tokenizer", help="tokenizer.json, model folder or cached HF id "
                                       "(default: VLLM_TOKENIZER); never downloaded")
    g.add_argument("--api-key", default=None, help="Bearer token (default: $VLLM_API_KEY)")
    g.add_argument("--max-num-seqs", type=int, help="server's max_num_seqs (ladders, probes)")
    g.add_argument("--profile", help="model profile when targeting the stack")
    g.add_argument("--platform", help="platform layer when targeting the stack")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="profile override, repeatable")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _add_history(p: argparse.ArgumentParser) -> None:
    p.add_argument("--history-dir", type=Path, help="history folder (default: benchmarks/)")
    p.add_argument("--no-history", action="store_true", help="do not append to history")


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return key.replace("-", "_"), parsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vllmstack.bench",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("bench", "pp/tg matrix at concurrency 1"),
                            ("depth", "decode and prefill speed over a context-depth ladder"),
                            ("conc", "closed-loop concurrency ladder")):
        p = sub.add_parser(name, help=help_text, aliases=[f"bench-{name}"] if name != "bench"
                           else [])
        _add_target(p)
        _add_history(p)
        p.add_argument("--pp", type=int, nargs="+", default=[2048], help="prompt tokens")
        p.add_argument("--tg", type=int, nargs="+", default=[128], help="generated tokens")
        p.add_argument("--runs", type=int, default=3,
                       help="measured runs per cell" if name != "conc" else
                       "not used by conc (--duration sets the sample); accepted so every run "
                       "kind takes the same options")
        p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
        p.add_argument("--extra-body", default="{}", help="JSON merged into every request")
        p.add_argument("--seed", type=int, default=0, help="prompt text position seed")
        if name == "depth":
            p.add_argument("--depth", type=int, nargs="+", help="explicit depths (default: "
                           "powers of two up to the live max_model_len)")
            p.add_argument("--margin", type=int, default=DEFAULT_MARGIN,
                           help="tokens kept free at the top of the window")
            p.add_argument("--prefix-caching", choices=("auto", "on", "off"), default="auto",
                           help="two-phase (on) or blended (off); auto reads /metrics")
        p.add_argument("--duration", type=float, default=30.0,
                       help="closed-loop seconds per level" if name == "conc" else
                       "used by conc only; accepted so every run kind takes the same options")
        if name == "conc":
            p.add_argument("--concurrency", type=int, nargs="+",
                           help="explicit levels (default: powers of two up to max_num_seqs)")
    p = sub.add_parser("probe", help="regression probe; exit 0 pass, 1 fail, 2 inconclusive")
    p.add_argument("name", choices=sorted(PROBES))
    _add_target(p)
    _add_history(p)
    p.add_argument("--param", "-p", action="append", type=_param, default=[],
                   metavar="KEY=VALUE", help="probe setting, e.g. victims=3, max_choke=8")
    p = sub.add_parser("stability", help="smoke, stress or long run with a pass/fail table")
    p.add_argument("mode", choices=MODES)
    _add_target(p)
    _add_history(p)
    p.add_argument("--workers", type=int, help="stress: parallel workers (default 2)")
    p.add_argument("--requests", type=int, help="stress: requests per worker (default 200)")
    p.add_argument("--max-tokens", type=int, help="tokens per answer")
    p.add_argument("--runs", type=int, help="long: runs (default 3)")
    p.add_argument("--param", "-p", action="append", type=_param, default=[],
                   metavar="KEY=VALUE", help="other settings, e.g. context_tokens=30000")
    p = sub.add_parser("report", help="markdown table (and PNG charts) from history")
    p.add_argument("--kind", nargs="+", choices=history.KINDS, default=list(history.KINDS))
    p.add_argument("--last", type=int, default=20, help="records per kind")
    p.add_argument("--history-dir", type=Path)
    p.add_argument("--out", type=Path, help="write the markdown here (charts next to it)")
    p.add_argument("--png", action="store_true", help="also draw PNG charts")
    p.add_argument("--json", action="store_true", help="print {markdown, charts} as JSON")
    return parser


def resolve_target(args: argparse.Namespace, project: Project,
                   environ: Mapping[str, str]) -> Target:
    """From --url/--model, or from the profile; explicit flags win field by field."""
    api_key = args.api_key or environ.get("VLLM_API_KEY") or None
    if args.url and args.model and not (args.profile or args.platform or args.set):
        return target_from_url(args.url, args.model, tokenizer=args.tokenizer,
                               max_num_seqs=args.max_num_seqs, api_key=api_key)
    from vllmstack.config.profiles import ProfileError, resolve

    try:
        resolved = resolve(project, platform=args.platform, model=args.profile,
                           overrides=args.set, environ=environ)
    except ProfileError as exc:
        raise CliError(f"{exc} (or pass --url and --model to target any server)") from exc
    target = target_from_profile(resolved, url=args.url, model=args.model,
                                 tokenizer=args.tokenizer, max_num_seqs=args.max_num_seqs)
    if api_key:
        target.api_key = api_key
    return target


def _history_dir(args: argparse.Namespace, project: Project) -> Path | None:
    if getattr(args, "no_history", False):
        return None
    folder: Path | None = args.history_dir
    return folder if folder is not None else project.benchmarks


def _load_builder(target: Target, environ: Mapping[str, str], required: bool
                  ) -> tuple[PromptBuilder | None, Any]:
    if not target.tokenizer:
        if required:
            raise CliError("no tokenizer: pass --tokenizer or set VLLM_TOKENIZER")
        return None, None
    try:
        tokenizer = load_tokenizer(find_tokenizer(target.tokenizer, environ))
    except TokenizerError:
        if required:
            raise
        return None, None
    return PromptBuilder(tokenizer), tokenizer


async def _live_limits(client: ChatClient, target: Target) -> int | None:
    entry = await find_served_model(client, target.model)
    value = entry.get("max_model_len")
    return int(value) if isinstance(value, int) else target.max_model_len


async def _run_checks(args: argparse.Namespace, target: Target, environ: Mapping[str, str],
                      progress: Callable[[str], None]) -> Verdict:
    needs_tokenizer = args.command == "probe" and args.name == "itl-stall"
    builder, tokenizer = _load_builder(target, environ, needs_tokenizer)
    params = dict(args.param)
    async with ChatClient(target.url, api_key=target.api_key, timeout_s=args.timeout,
                          tokenizer=tokenizer) as client:
        max_len = await _live_limits(client, target)
        ctx = ProbeContext(client, target.model, builder, target.max_num_seqs, max_len,
                           params, progress)
        if args.command == "probe":
            return await run_probe(args.name, ctx)
        for key in ("workers", "requests", "max_tokens", "runs"):
            if getattr(args, key) is not None:
                params[key] = getattr(args, key)
        return await run_stability(args.mode, ctx)


def _options(args: argparse.Namespace) -> RunOptions:
    try:
        extra = json.loads(args.extra_body)
    except ValueError as exc:
        raise CliError(f"--extra-body is not JSON: {exc}") from exc
    if not isinstance(extra, dict):
        raise CliError("--extra-body must be a JSON object")
    return RunOptions(
        pp=args.pp, tg=args.tg, runs=args.runs, depths=getattr(args, "depth", None),
        concurrency=getattr(args, "concurrency", None),
        duration_s=getattr(args, "duration", 30.0), margin=getattr(args, "margin",
                                                                  DEFAULT_MARGIN),
        prefix_caching=getattr(args, "prefix_caching", "auto"), warmup=not args.no_warmup,
        extra_body=extra, seed=args.seed, timeout_s=args.timeout,
    )


async def _dispatch(args: argparse.Namespace, project: Project, environ: Mapping[str, str],
                    out: TextIO, progress: Callable[[str], None]) -> int:
    if args.command == "report":
        folder = args.history_dir or project.benchmarks
        chart_dir = (args.out.parent if args.out else project.generated / "report") \
            if args.png else None
        text, charts = build_report(folder, args.kind, last=args.last, chart_dir=chart_dir)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
            progress(f"wrote {args.out}")
        if args.json:
            out.write(json.dumps({"markdown": text, "charts": [str(c) for c in charts]}) + "\n")
        elif not args.out:
            out.write(text)
        for chart in charts:
            progress(f"chart: {chart}")
        return 0
    target = resolve_target(args, project, environ)
    folder = _history_dir(args, project)
    if args.command in RUN_COMMANDS:
        kind = RUN_COMMANDS[args.command]
        outcome = await execute(kind, target, _options(args), environ=dict(environ),
                                history_dir=folder, progress=progress)
        if args.json:
            out.write(json.dumps(outcome.record, indent=2) + "\n")
        return outcome.exit_code
    verdict = await _run_checks(args, target, environ, progress)
    kind = "probe" if args.command == "probe" else "stability"
    record = {"kind": kind, **verdict.as_record(), **target.describe()}
    if folder is not None:
        record = history.append_record(history.history_path(folder, kind), record)
    if args.json:
        out.write(json.dumps(record, indent=2) + "\n")
    else:
        out.write(verdict.table() + "\n")
    return verdict.exit_code


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None,
         project: Project | None = None, out: TextIO | None = None) -> int:
    """Parse, run, print; returns the exit code (never raises for user errors)."""
    environ = os.environ if environ is None else environ
    out = out or sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    project = project or Project.find()
    log = sys.stderr if getattr(args, "json", False) else out

    def progress(line: str) -> None:
        log.write(line + "\n")
        log.flush()

    try:
        return _run_with_signals(_dispatch(args, project, environ, out, progress))
    except asyncio.CancelledError:
        progress("stopped by signal; nothing was appended to history")
        return 1
    except (CliError, RunError, TargetError, TokenizerError, EndpointError, LadderError,
            history.HistoryError) as exc:
        progress(f"error: {exc}")
        return EXIT_USAGE if isinstance(exc, CliError) else 1


def _run_with_signals(coro: Any) -> int:
    """Run `coro`; SIGTERM/SIGINT cancel it, so open streams close and the loop ends cleanly."""

    async def runner() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, task.cancel if task else (lambda: None))
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread (tests): signals stay with the caller
        try:
            result: int = await coro
            return result
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    return asyncio.run(runner())

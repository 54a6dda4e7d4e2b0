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
from typing import Any, NoReturn, TextIO

from vllmstack.bench.client.client import ChatClient
from vllmstack.bench.options import COMMANDS, add_arguments
from vllmstack.bench.probes.params import ParamError, check_params
from vllmstack.bench.probes.probes import ProbeContext, run_probe
from vllmstack.bench.probes.stability import run_stability
from vllmstack.bench.probes.verdict import Verdict
from vllmstack.bench.report import history
from vllmstack.bench.report.report import build_report
from vllmstack.bench.runs.decay_runs import make_depth_rows
from vllmstack.bench.runs.runs import (
    RUN_KINDS,
    RunOptions,
    execute,
    find_served_model,
    live_max_model_len,
)
from vllmstack.bench.target import Target, target_from_profile, target_from_url
from vllmstack.core.errors import StackError
from vllmstack.core.files import writable_file, writable_folder
from vllmstack.core.paths import Project, results_folder
from vllmstack.workload.ladders import DEFAULT_MARGIN
from vllmstack.workload.prompts import PromptBuilder, TokenizerError, load_tokenizer
from vllmstack.workload.prompts import resolve_tokenizer as find_tokenizer

EXIT_USAGE = 2
# Subcommand (or alias) -> run kind.
RUN_COMMANDS = {name: cmd.name for cmd in COMMANDS if cmd.name in RUN_KINDS
                for name in (cmd.name, *cmd.aliases)}


class CliError(StackError):
    """A problem with the arguments or the environment; printed as `error: ...`, exit 2."""


class StoppedError(StackError):
    """SIGTERM or Ctrl-C ended the run: open streams were closed, nothing was appended."""


class Parser(argparse.ArgumentParser):
    """argparse, whose usage errors are the stack's: `error:` and `fix:`, not its usage block."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {message}", f"see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m vllmstack.bench",
                    description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS:
        add_arguments(sub.add_parser(cmd.name, help=cmd.doc, aliases=list(cmd.aliases)), cmd)
    return parser


def resolve_target(args: argparse.Namespace, project: Project,
                   environ: Mapping[str, str]) -> Target:
    """From --url/--model, or from the profile; explicit flags win field by field."""
    api_key = args.api_key or environ.get("VLLM_API_KEY") or None
    if args.url and args.model and not (args.profile or args.platform or args.set):
        return target_from_url(args.url, args.model, tokenizer=args.tokenizer,
                               max_num_seqs=args.max_num_seqs, api_key=api_key)
    from vllmstack.config.profiles import ProfileError, resolve
    from vllmstack.serve.running import resolve_following

    try:
        # Without --url, the stack that runs: the profile `up` recorded, not .env's (issue 23).
        resolved = (resolve(project, platform=args.platform, model=args.profile,
                            overrides=args.set, environ=environ) if args.url else
                    resolve_following(project, model=args.profile, platform=args.platform,
                                      overrides=args.set, environ=environ,
                                      say=lambda line: print(line, file=sys.stderr)))
    except ProfileError as exc:
        raise CliError(exc.cause, f"{exc.fix + ', ' if exc.fix else ''}or pass --url and --model "
                       "to target any server") from exc
    target = target_from_profile(resolved, url=args.url, model=args.model,
                                 tokenizer=args.tokenizer, max_num_seqs=args.max_num_seqs)
    target.roofline = roofline_inputs(resolved, environ)
    if api_key:
        target.api_key = api_key
    return target


def roofline_inputs(resolved: Any, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The roofline's inputs; a profile too vague for them costs the column, not the run."""
    from vllmstack.bench.report import roofline

    try:
        return roofline.inputs_from_profile(resolved, environ)
    except (StackError, ValueError) as exc:
        print(f"note: no roofline: {exc}", file=sys.stderr)
        return None


def _history_dir(args: argparse.Namespace, project: Project) -> Path | None:
    if getattr(args, "no_history", False):
        return None
    folder: Path | None = args.history_dir
    # A file, a device or /proc given as the history folder is refused before a run, not after it.
    return writable_folder(folder, "--history-dir") if folder is not None else results_folder(project)


def _load_builder(target: Target, environ: Mapping[str, str], required: bool
                  ) -> tuple[PromptBuilder | None, Any]:
    if not target.tokenizer:
        if required:
            raise CliError("no tokenizer: this probe builds prompts of exact length",
                           "pass --tokenizer or set VLLM_TOKENIZER")
        return None, None
    try:
        tokenizer = load_tokenizer(find_tokenizer(target.tokenizer, environ, target.hf_cache))
    except TokenizerError:
        if required:
            raise
        return None, None
    return PromptBuilder(tokenizer), tokenizer


async def _live_limits(client: ChatClient, target: Target) -> int | None:
    entry = await find_served_model(client, target.model)
    return live_max_model_len(entry) or target.max_model_len


async def _run_checks(args: argparse.Namespace, target: Target, environ: Mapping[str, str],
                      progress: Callable[[str], None]) -> Verdict:
    owner = args.name if args.command == "probe" else args.mode
    params = dict(args.param)
    if args.command == "stability":
        for key in ("workers", "requests", "max_tokens", "runs"):
            if getattr(args, key) is not None:
                params[key] = getattr(args, key)
    params = check_params(owner, params)  # before anything is loaded or sent
    needs_tokenizer = args.command == "probe" and args.name in ("itl-stall", "depth-decay")
    builder, tokenizer = _load_builder(target, environ, needs_tokenizer)
    async with ChatClient(target.url, api_key=target.api_key, timeout_s=args.timeout,
                          tokenizer=tokenizer) as client:
        max_len = await _live_limits(client, target)
        ctx = ProbeContext(client, target.model, builder, target.max_num_seqs, max_len,
                           params, progress, settings=dict(target.settings),
                           depth_rows=make_depth_rows(client, builder, target, progress)
                           if builder is not None else None, roofline=target.roofline)
        if args.command == "probe":
            return await run_probe(args.name, ctx)
        return await run_stability(args.mode, ctx)


def _options(args: argparse.Namespace) -> RunOptions:
    fix = "pass --extra-body a JSON object, e.g. --extra-body '{\"temperature\": 0.7}'"
    try:
        extra = json.loads(args.extra_body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested thousands deep
        raise CliError(f"--extra-body is not JSON: {str(exc)[:200]}", fix) from None
    if not isinstance(extra, dict):
        raise CliError("--extra-body must be a JSON object", fix)
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
        if args.out:
            writable_file(args.out, "--out")
        folder = args.history_dir or results_folder(project)
        chart_dir = (args.out.parent if args.out else project.generated / "report") \
            if args.png else None
        text, charts = build_report(folder, args.kind, last=args.last, chart_dir=chart_dir,
                                    warn=lambda line: progress(f"warning: {line}"))
        if args.out:
            try:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(text)
            except OSError as exc:
                raise CliError(f"cannot write --out {args.out}: {exc.strerror or exc}",
                               "pass --out a file in a folder you can write to") from None
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


def run(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None,
        project: Project | None = None, out: TextIO | None = None) -> int:
    """Parse and run; returns the result's exit code (a probe's verdict, a failed run) and raises
    StackError for a run that could not be done: the invoke tasks end on it with `error:` /
    `fix:` and exit 1."""
    return run_args(build_parser().parse_args(argv), environ=environ, project=project, out=out)


def run_args(args: argparse.Namespace, *, environ: Mapping[str, str] | None = None,
            project: Project | None = None, out: TextIO | None = None) -> int:
    """Run parsed arguments (see `run`): progress on `out`, or on stderr with --json."""
    environ = os.environ if environ is None else environ
    out = out or sys.stdout
    project = project or Project.find()
    log = sys.stderr if getattr(args, "json", False) else out

    def progress(line: str) -> None:
        log.write(line + "\n")
        log.flush()

    try:
        return _run_with_signals(_dispatch(args, project, environ, out, progress))
    except asyncio.CancelledError:
        raise StoppedError("stopped by signal; nothing was appended to history",
                           "run it again to measure") from None


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None,
         project: Project | None = None, out: TextIO | None = None,
         err: TextIO | None = None) -> int:
    """`python -m vllmstack.bench`: never raises for user errors. An error is printed where the
    progress goes (stdout, or stderr with --json; `err` when given): exit 2 for the arguments,
    else 1."""
    out = out or sys.stdout
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except CliError as exc:
        (err or sys.stderr).write(exc.render() + "\n")
        return EXIT_USAGE
    log = err or (sys.stderr if getattr(args, "json", False) else out)
    try:
        return run_args(args, environ=environ, project=project, out=out)
    except StackError as exc:  # RunError, TargetError, TokenizerError, EndpointError, ...
        log.write(exc.render() + "\n")
        log.flush()
        return EXIT_USAGE if isinstance(exc, CliError | ParamError) else 1


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

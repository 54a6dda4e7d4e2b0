"""invoke tasks: parse arguments, call one vllmstack function, render the result.

All logic lives in the vllmstack package; see README.md for the commands.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any

from invoke import Context, Exit, task

from vllmstack.config.profiles import ProfileError, Resolved, resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner

# Help shared by every task that resolves a profile.
PROFILE_HELP = {
    "model": "model profile (env/models/NAME.env); default: MODEL_PROFILE in .env",
    "platform": "platform layer (env/platforms/NAME.env); default: PLATFORM in .env",
    "set": "KEY=VALUE override, repeatable; applied last",
}
JSON_HELP = {"json": "print JSON instead of text"}


def _project() -> Project:
    return Project.find()


def _resolve(model: str | None, platform: str | None, sets: list[str] | None) -> Resolved:
    try:
        return resolve(_project(), platform=platform, model=model, overrides=sets or [],
                       environ=os.environ)
    except ProfileError as exc:
        raise Exit(f"error: {exc}", code=1) from exc


def _runner(dry_run: bool) -> SubprocessRunner:
    return SubprocessRunner(dry_run=dry_run)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))
    sys.stdout.flush()


# --- profiles, config, check -----------------------------------------------------

@task
def profiles(c: Context) -> None:
    """List platforms and model profiles, one line each."""
    from vllmstack.config.profiles import list_profiles
    from vllmstack.config.view import render_profiles

    print(render_profiles(list_profiles(_project())))


@task(
    iterable=["set"],
    help={**PROFILE_HELP, **JSON_HELP, "explain": "show which layer set each value",
          "vllm_args": "print the exact vllm serve argv"},
)
def config(
    c: Context,
    model: str | None = None,
    platform: str | None = None,
    set: list[str] | None = None,
    explain: bool = False,
    vllm_args: bool = False,
    json: bool = False,
) -> None:
    """Show the resolved settings; --explain shows where each came from; --vllm-args the argv."""
    from vllmstack.config import view as config_view

    resolved = _resolve(model, platform, set)
    try:
        output = config_view.render_config(resolved, explain=explain, vllm_args=vllm_args,
                                           as_json=json)
    except config_view.ConfigError as exc:
        raise Exit(f"error: {exc}", code=1) from exc
    print(output)


# --- development ------------------------------------------------------------------

@task(help={"quick": "unit tests only: no Docker engine, no browser, no real vLLM parser",
            "k": "pytest -k expression"})
def test(c: Context, quick: bool = False, k: str | None = None) -> None:
    """Run every check: ruff, mypy, pytest. Brings up what the tests need when it is missing."""
    from vllmstack.devtools.testsuite import run_test_suite

    code = run_test_suite(_project(), _runner(False), quick=quick, keyword=k)
    if code:
        raise Exit(code=code)


@task(
    iterable=["set"],
    help={**PROFILE_HELP, **JSON_HELP, "deep": "also parse the argv with the pinned vLLM's own parser",
          "verbose": "show info findings too"},
)
def check(
    c: Context,
    model: str | None = None,
    platform: str | None = None,
    set: list[str] | None = None,
    json: bool = False,
    deep: bool = False,
    verbose: bool = False,
) -> None:
    """Report every problem found before boot, each with the key, the file that set it and a fix."""
    from vllmstack.checks import registry as checks

    resolved = _resolve(model, platform, set)
    findings = checks.check_profile(_project(), resolved, os.environ, _runner(False), deep=deep)
    if json:
        _print_json(checks.report_json(resolved, findings))
    else:
        print(checks.render_report(resolved, findings, verbose=verbose))
    if any(f.severity == "error" for f in findings):
        raise Exit(code=1)


# --- serving lifecycle ---------------------------------------------------------------------

LIFECYCLE_HELP = {
    **PROFILE_HELP,
    "runtime": "compose | compose-v1 | podman | native (default: RUNTIME, else auto-detect)",
    "dry_run": "print the commands instead of running them",
}


def _stack(model: str | None, platform: str | None, sets: list[str] | None, runtime: str | None,
           dry_run: bool = False) -> Any:
    from vllmstack.serve import lifecycle

    resolved = _resolve(model, platform, sets)
    try:
        return lifecycle.open_stack(_project(), resolved, os.environ, _runner(dry_run),
                                    runtime=runtime)
    except lifecycle.LifecycleError as exc:
        raise Exit(exc.render(), code=1) from exc


def _lifecycle_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from vllmstack.serve import lifecycle

    try:
        return fn(*args, **kwargs)
    except lifecycle.LifecycleError as exc:
        sys.stdout.flush()
        raise Exit(exc.render(), code=1) from exc


@task(iterable=["set"], help={**LIFECYCLE_HELP, "timeout": "seconds to wait for /health",
                              "force": "start even when a guard refuses (loudly)",
                              "no_dashboard": "do not start the dashboard service"})
def up(c: Context, model: str | None = None, platform: str | None = None,
       set: list[str] | None = None, runtime: str | None = None,
       timeout: float | None = None, force: bool = False, no_dashboard: bool = False,
       dry_run: bool = False) -> None:
    """Guards, render, start, wait for /health (diagnosing a crash at once), warm up, dashboard."""
    from vllmstack.serve import lifecycle

    stack = _stack(model, platform, set, runtime, dry_run)
    result = _lifecycle_call(lifecycle.up, stack, timeout=timeout, force=force,
                             dashboard=not no_dashboard, dry_run=dry_run)
    if not dry_run:
        print(f"ready: {result.served_name} at {result.url}/v1")


@task(iterable=["set"], help={**LIFECYCLE_HELP, "timeout": "seconds to wait for GPU memory release"})
def down(c: Context, model: str | None = None, platform: str | None = None,
         set: list[str] | None = None, runtime: str | None = None,
         timeout: float = 120.0, dry_run: bool = False) -> None:
    """Stop everything the stack started and wait until GPU memory is released."""
    from vllmstack.serve import lifecycle

    stack = _stack(model, platform, set, runtime, dry_run)
    _lifecycle_call(lifecycle.down, stack, timeout=timeout, dry_run=dry_run)


@task(iterable=["set"], help={**PROFILE_HELP, **JSON_HELP, "runtime": LIFECYCLE_HELP["runtime"]})
def status(c: Context, model: str | None = None, platform: str | None = None,
           set: list[str] | None = None, runtime: str | None = None,
           json: bool = False) -> None:
    """Containers (or processes), health, served model and KV cache usage."""
    from vllmstack.serve import lifecycle

    stack = _stack(model, platform, set, runtime)
    report = _lifecycle_call(lifecycle.status, stack)
    if json:
        _print_json(report)
    else:
        print(lifecycle.render_status(report))


@task(iterable=["set"], help={**PROFILE_HELP, "runtime": LIFECYCLE_HELP["runtime"],
                              "follow": "keep following (default)",
                              "tail": "lines of history to show", "service": "vllm or dashboard"})
def logs(c: Context, model: str | None = None, platform: str | None = None,
         set: list[str] | None = None, runtime: str | None = None,
         follow: bool = True, tail: int = 200, service: str = "vllm") -> None:
    """Follow the engine log."""
    from vllmstack.serve import lifecycle

    stack = _stack(model, platform, set, runtime)
    raise Exit(code=_lifecycle_call(lifecycle.logs, stack, follow=follow, tail=tail,
                                    service=service))


@task(name="exec", help={"runtime": LIFECYCLE_HELP["runtime"]})
def exec_(c: Context, runtime: str | None = None) -> None:
    """Run a command in the engine container, the image's Python first on PATH: invoke exec -- CMD."""
    from vllmstack.serve import lifecycle

    command = _remainder() or shlex.split(c.remainder)
    stack = _stack(None, None, None, runtime)
    raise Exit(code=_lifecycle_call(lifecycle.exec_in_engine, stack, command,
                                    tty=sys.stdin.isatty()))


def _remainder() -> list[str]:
    """Words after `--`, as given (invoke's own remainder is one string, which loses quoting)."""
    argv = sys.argv
    return argv[argv.index("--") + 1:] if "--" in argv else []


@task(help={"runtime": LIFECYCLE_HELP["runtime"], "dry_run": LIFECYCLE_HELP["dry_run"]})
def clear_caches(c: Context, runtime: str | None = None, dry_run: bool = False) -> None:
    """Delete the engine's compile and JIT caches (vLLM, Triton, Inductor, AITER); keeps models."""
    from vllmstack.serve import lifecycle

    stack = _stack(None, None, None, runtime, dry_run)
    _lifecycle_call(lifecycle.clear_caches, stack, dry_run=dry_run)


@task(iterable=["set"], help={**PROFILE_HELP, "runtime": LIFECYCLE_HELP["runtime"]})
def dashboard_up(c: Context, model: str | None = None, platform: str | None = None,
                 set: list[str] | None = None, runtime: str | None = None) -> None:
    """Start the dashboard service alone (against the running engine)."""
    from vllmstack.serve import lifecycle

    stack = _stack(model, platform, set, runtime)
    _lifecycle_call(lifecycle.dashboard_up, stack)


@task(help={"runtime": LIFECYCLE_HELP["runtime"]})
def dashboard_down(c: Context, runtime: str | None = None) -> None:
    """Stop the dashboard service."""
    from vllmstack.serve import lifecycle

    stack = _stack(None, None, None, runtime)
    _lifecycle_call(lifecycle.dashboard_down, stack)


# --- dashboard ---------------------------------------------------------------------------

@task(iterable=["set"], help={
    **PROFILE_HELP,
    "host": "address to listen on (default: DASHBOARD_BIND, else 127.0.0.1)",
    "port": "port (default: DASHBOARD_PORT)",
    "engine_url": "engine base URL (default: http://127.0.0.1:VLLM_PORT); any engine works",
    "tokenizer": "tokenizer for runs started from the page (default: VLLM_TOKENIZER)",
})
def dashboard(c: Context, host: str | None = None, port: str | None = None,
              engine_url: str | None = None, tokenizer: str | None = None,
              model: str | None = None, platform: str | None = None,
              set: list[str] | None = None) -> None:
    """Serve the dashboard in the foreground (development, or against any engine URL)."""
    from vllmstack.dashboard.__main__ import run, settings_from_profile

    project = _project()
    try:
        values = resolve(project, platform=platform, model=model, overrides=set or [],
                         environ=os.environ).as_env()
    except ProfileError as exc:
        if engine_url is None:
            raise Exit(f"error: {exc}", code=1) from exc
        print(f"note: no profile ({exc}); using defaults", file=sys.stderr)
        values = {}
    try:
        port_number = int(port) if port else None  # invoke hands over the flag's text
    except ValueError as exc:
        raise Exit(f"error: --port must be a number, got {port!r}", code=1) from exc
    settings = settings_from_profile(values, project.benchmarks, host=host, port=port_number,
                                     engine_url=engine_url, tokenizer=tokenizer)
    code = run(settings, os.environ)
    if code:
        raise Exit(code=code)


# --- build and patches ---------------------------------------------------------------------

PATCH_HELP = {
    "ref": "NAME=REF: check NAME (vllm, aiter, flash-attention) at this tag, branch or commit",
    "repo": "NAME=URL_OR_PATH: use this repository instead of <NAME>_REPO",
    "patches": "NAME=DIR: use this patch folder instead of patches/NAME",
}
BUILD_HELP = {
    **PROFILE_HELP,
    "dry_run": "verify patches, then print the docker build command instead of running it",
    "target": "build only up to this Dockerfile.fullbuild stage (e.g. vllm-source)",
}


@task(iterable=["ref", "repo", "patches"], help={**PATCH_HELP, **JSON_HELP})
def verify_patches(c: Context, ref: list[str] | None = None, repo: list[str] | None = None,
                   patches: list[str] | None = None,
                   json: bool = False) -> None:  # the CLI flag is --json
    """Check every patch and overlay against the pinned (or given) refs; exit 1 if one fails."""
    from vllmstack.image import patches as patch_set

    try:
        report = patch_set.verify_patches(
            _project(), _resolve(None, None, None), _runner(False), environ=os.environ,
            refs=patch_set.parse_component_pairs(ref or [], "--ref"),
            repos=patch_set.parse_component_pairs(repo or [], "--repo"),
            patch_dirs=patch_set.parse_component_pairs(patches or [], "--patches"))
    except patch_set.PatchError as exc:
        raise Exit(f"error: {exc}", code=1) from exc
    if json:
        _print_json(report.as_json())
    else:
        print(patch_set.render_report(report))
    if report.failed:
        raise Exit(code=1)


def _build(model: str | None, platform: str | None, sets: list[str] | None, dry_run: bool,
           target: str | None, no_cache: bool) -> None:
    from vllmstack.image import build as image_build

    outcome = image_build.build_image(_project(), _resolve(model, platform, sets),
                                      _runner(dry_run), environ=os.environ, no_cache=no_cache,
                                      target=target)
    for finding in outcome.findings:
        print(finding.render(), file=sys.stderr)
    if outcome.report is not None and outcome.report.failed:
        raise Exit("error: patches do not verify, so nothing was built (see above)", code=1)
    if outcome.result is None:
        raise Exit("error: the build did not start (see above)", code=1)
    if not outcome.result.ok:
        raise Exit(f"error: docker build failed (exit {outcome.result.returncode})",
                   code=outcome.result.returncode or 1)


@task(iterable=["set"], help=BUILD_HELP)
def build(c: Context, model: str | None = None, platform: str | None = None,
          set: list[str] | None = None,  # the CLI flag is --set
          dry_run: bool = False, target: str | None = None) -> None:
    """Verify patches, then build Dockerfile.fullbuild from the pins (BuildKit, cache mounts)."""
    _build(model, platform, set, dry_run, target, no_cache=False)


@task(iterable=["set"], help=BUILD_HELP)
def rebuild(c: Context, model: str | None = None, platform: str | None = None,
            set: list[str] | None = None,  # the CLI flag is --set
            dry_run: bool = False, target: str | None = None) -> None:
    """Like build, without Docker's layer cache (pip and ccache mounts still speed it up)."""
    _build(model, platform, set, dry_run, target, no_cache=True)


@task(help={"name": "write env/models/NAME.env from the model keys (never overwrites)",
            "extends": "layer the written profile builds on, e.g. families/qwen3.6"})
def import_env(c: Context, file: str, name: str | None = None, extends: str | None = None) -> None:
    """Read a profile of the earlier just/compose stack and report what maps where."""
    from pathlib import Path

    from vllmstack.config import migrate

    source = Path(file)
    if not source.is_file():
        raise Exit(f"error: {file} does not exist", code=1)
    mappings = migrate.map_env_file(source)
    print(migrate.render_mapping(mappings))
    if name:
        try:
            written = migrate.write_profile(_project(), name, source, mappings, extends)
        except FileExistsError as exc:
            raise Exit(f"error: {exc}", code=1) from exc
        print(f"wrote {written}; next: invoke check --model {name}")


# --- benchmarks ---------------------------------------------------------------------------
# Every benchmark task builds the argv of `python -m vllmstack.bench` and calls its main(), so
# the tasks, the dashboard and the module entry run the same code. Here --model is the served
# model name (the bench contract); --profile picks the model profile.

BENCH_HELP = {
    "url": "server root, e.g. http://127.0.0.1:8000 (default: the running stack)",
    "model": "served model name (default: VLLM_SERVED_NAME of the profile)",
    "tokenizer": "tokenizer.json, model folder or cached HF id; never downloaded",
    "profile": "model profile when targeting the stack (env/models/NAME.env)",
    "platform": "platform layer when targeting the stack",
    "set": "profile override KEY=VALUE, repeatable",
    "history_dir": "history folder (default: benchmarks/)",
    "json": "print one JSON document on stdout (progress goes to stderr)",
}
RUN_HELP = {**BENCH_HELP, "pp": "prompt tokens (repeatable in bench)",
            "tg": "generated tokens (repeatable in bench)", "runs": "measured runs per cell",
            "extra_body": "JSON object merged into every request"}


def _flags(pairs: list[tuple[str, Any]]) -> list[str]:
    argv: list[str] = []
    for flag, value in pairs:
        if isinstance(value, list):
            argv += [flag, *map(str, value)] if value else []
        elif value is True:
            argv.append(flag)
        elif value not in (None, False, ""):
            argv += [flag, str(value)]
    return argv


def _bench_cli(command: list[str], target: dict[str, Any], extra: list[tuple[str, Any]]) -> None:
    from vllmstack.bench.cli import main

    argv = [*command, *_flags(list(target.items())), *_flags(extra)]
    code = main(argv)
    if code:
        raise Exit(code=code)


def _target(url: str | None, model: str | None, tokenizer: str | None, profile: str | None,
            platform: str | None, history_dir: str | None, json_out: bool) -> dict[str, Any]:
    return {"--url": url, "--model": model, "--tokenizer": tokenizer, "--profile": profile,
            "--platform": platform, "--history-dir": history_dir, "--json": json_out}


def _sets(sets: list[str] | None) -> list[tuple[str, Any]]:
    return [("--set", item) for item in sets or []]


@task(iterable=["pp", "tg", "set"], help=RUN_HELP)
def bench(c: Context, url: str | None = None, model: str | None = None,
          tokenizer: str | None = None, pp: list[str] | None = None,
          tg: list[str] | None = None, runs: int = 3, extra_body: str | None = None,
          profile: str | None = None, platform: str | None = None,
          set: list[str] | None = None,  # the CLI flag is --set
          history_dir: str | None = None, json: bool = False) -> None:
    """pp/tg matrix at concurrency 1: TTFT, pp t/s, decode t/s, ITL p50/p90/p99, mean ± spread."""
    _bench_cli(["bench"], _target(url, model, tokenizer, profile, platform, history_dir, json),
               [("--pp", pp), ("--tg", tg), ("--runs", runs), ("--extra-body", extra_body),
                *_sets(set)])


@task(iterable=["depth", "set"], help={
    **RUN_HELP, "depth": "explicit depth, repeatable (default: ladder from live max_model_len)",
    "prefix_caching": "auto | on (two-phase, cache hit checked) | off (blended)",
    "margin": "tokens kept free at the top of the window"})
def bench_depth(c: Context, url: str | None = None, model: str | None = None,
                tokenizer: str | None = None, pp: int = 2048, tg: int = 128, runs: int = 2,
                depth: list[str] | None = None, prefix_caching: str = "auto", margin: int = 256,
                extra_body: str | None = None, profile: str | None = None,
                platform: str | None = None,
                set: list[str] | None = None,  # the CLI flag is --set
                history_dir: str | None = None, json: bool = False) -> None:
    """Decode and prefill speed over a context-depth ladder (powers of two up to the window)."""
    _bench_cli(["depth"], _target(url, model, tokenizer, profile, platform, history_dir, json),
               [("--pp", pp), ("--tg", tg), ("--runs", runs), ("--depth", depth),
                ("--prefix-caching", prefix_caching), ("--margin", margin),
                ("--extra-body", extra_body), *_sets(set)])


@task(iterable=["concurrency", "set"], help={
    **{k: v for k, v in RUN_HELP.items() if k != "runs"},
    "concurrency": "explicit level, repeatable (default: ladder up to max_num_seqs)",
    "duration": "closed-loop seconds per level", "max_num_seqs": "override VLLM_MAX_NUM_SEQS"})
def bench_conc(c: Context, url: str | None = None, model: str | None = None,
               tokenizer: str | None = None, pp: int = 2048, tg: int = 128,
               concurrency: list[str] | None = None, duration: float = 30.0,
               max_num_seqs: int | None = None, extra_body: str | None = None,
               profile: str | None = None, platform: str | None = None,
               set: list[str] | None = None,  # the CLI flag is --set
               history_dir: str | None = None, json: bool = False) -> None:
    """Closed-loop concurrency ladder: steady load per level, total and per-request speed."""
    _bench_cli(["conc"], _target(url, model, tokenizer, profile, platform, history_dir, json),
               [("--pp", pp), ("--tg", tg), ("--concurrency", concurrency),
                ("--duration", duration), ("--max-num-seqs", max_num_seqs),
                ("--extra-body", extra_body), *_sets(set)])


@task(iterable=["param", "set"], help={
    **BENCH_HELP, "name": "itl-stall | tool-truncation | thinkoff | prefix-cache | multi-image",
    "param": "probe setting KEY=VALUE, repeatable (e.g. victims=3, max_choke=8)"})
def probe(c: Context, name: str, url: str | None = None, model: str | None = None,
          tokenizer: str | None = None, param: list[str] | None = None,
          profile: str | None = None, platform: str | None = None,
          set: list[str] | None = None,  # the CLI flag is --set
          history_dir: str | None = None, json: bool = False) -> None:
    """Run one regression probe; exit 0 pass, 1 fail, 2 inconclusive."""
    _bench_cli(["probe", name], _target(url, model, tokenizer, profile, platform, history_dir,
                                        json),
               [*[("--param", p) for p in param or []], *_sets(set)])


@task(iterable=["param", "set"], help={
    **BENCH_HELP, "mode": "smoke | stress | long", "workers": "stress: parallel workers",
    "requests": "stress: requests per worker", "max_tokens": "tokens per answer",
    "runs": "long: runs", "param": "other setting KEY=VALUE, e.g. context_tokens=30000"})
def stability(c: Context, mode: str, url: str | None = None, model: str | None = None,
              tokenizer: str | None = None, workers: int | None = None,
              requests: int | None = None, max_tokens: int | None = None,
              runs: int | None = None, param: list[str] | None = None,
              profile: str | None = None, platform: str | None = None,
              set: list[str] | None = None,  # the CLI flag is --set
              history_dir: str | None = None, json: bool = False) -> None:
    """Stability run with a pass/fail table; exit 0 pass, 1 fail, 2 inconclusive."""
    _bench_cli(["stability", mode], _target(url, model, tokenizer, profile, platform, history_dir,
                                            json),
               [("--workers", workers), ("--requests", requests), ("--max-tokens", max_tokens),
                ("--runs", runs), *[("--param", p) for p in param or []], *_sets(set)])


@task(iterable=["kind"], help={
    "kind": "bench | depth | conc | probe | stability, repeatable (default: all)",
    "last": "records per kind", "out": "write the markdown to this file",
    "png": "also draw PNG charts (next to --out, else generated/report/)",
    "history_dir": "history folder (default: benchmarks/)",
    "json": "print {markdown, charts} as JSON"})
def report(c: Context, kind: list[str] | None = None, last: int = 20, out: str | None = None,
           png: bool = False, history_dir: str | None = None, json: bool = False) -> None:
    """Markdown tables (and PNG charts) from the benchmark history."""
    _bench_cli(["report"], {"--history-dir": history_dir, "--json": json},
               [("--kind", kind), ("--last", last), ("--out", out), ("--png", png)])


# --- native runtime --------------------------------------------------------------------------

@task(help={
    **JSON_HELP,
    "engine": "engine to install (vllm)",
    "version": "engine version (default: NATIVE_ENGINE_VERSION, else VLLM_VERSION)",
    "wheels": "install offline from this folder of wheels (AMD's ROCm wheels, a prebuilt bundle)",
    "index_deps": "with --wheels: take dependencies missing from the folder from the package index",
    "python": "interpreter the environment is made from (default: the one running invoke)",
    "force": "replace an environment that is already installed",
    "dry_run": "print the commands instead of running them",
})
def install_engine(c: Context, engine: str = "vllm", version: str | None = None,
                   wheels: str | None = None, index_deps: bool = False, python: str | None = None,
                   force: bool = False, dry_run: bool = False, json: bool = False) -> None:
    """Create the native runtime's engine environment (.cache/engines/vllm-VERSION) with the pinned vLLM."""
    from pathlib import Path

    from vllmstack.runtime.native import install as engines

    project = _project()
    try:
        report = engines.install_engine(
            project, _runner(dry_run), engine=engine,
            version=version or engines.engine_version(_resolve(None, None, None)),
            wheels=Path(wheels).expanduser() if wheels else None, index_deps=index_deps,
            force=force, python=python or sys.executable, environ=os.environ,
            out=sys.stderr if json else sys.stdout, stream=not json)
    except engines.EngineInstallError as exc:
        raise Exit(exc.render(), code=1) from exc
    if json:
        _print_json(report.as_json())
    else:
        print(engines.render_install(report, project))

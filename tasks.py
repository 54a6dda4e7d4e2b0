"""invoke tasks: parse arguments, call one vllmstack function, render the result (README.md).

Every task is declared with `@stack_task`, which turns the stack's errors into `error: ...` /
`fix: ...` on stderr and exit code 1, and keeps `-h` meaning help."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from invoke import Context

from vllmstack.cli.common import (
    JSON_HELP,
    PROFILE_HELP,
    RUNNING_HELP,
    Opt,
    Sets,
    follow_here,
    make_runner,
    print_json,
    project_here,
    resolve_here,
)
from vllmstack.cli.engine_tasks import build, install_engine, rebuild  # noqa: F401
from vllmstack.cli.export_tasks import EXPORT_TARGET, export  # noqa: F401
from vllmstack.cli.fleet_tasks import bench_vs, burn, router  # noqa: F401 (invoke finds them here)
from vllmstack.cli.llamacpp_tasks import gguf_convert, gpu_check  # noqa: F401
from vllmstack.cli.maintenance_tasks import template_check, update_check  # noqa: F401
from vllmstack.cli.task import bench_task, exit_with, stack_task
from vllmstack.cli.tuning_tasks import calibrate_kv, tune  # noqa: F401
from vllmstack.cli.values import PATH, PORT, PROFILE, choice, whole
from vllmstack.config.engines.table import ENGINES

_project = project_here
ENGINE_NAMES = tuple(ENGINES)
_runner = make_runner
_resolve = resolve_here
_print_json = print_json


# --- profiles, config, check -----------------------------------------------------

@stack_task()
def profiles(c: Context) -> None:
    """List platforms and model profiles, one line each."""
    from vllmstack.config.profiles import list_profiles
    from vllmstack.config.view import render_profiles

    print(render_profiles(list_profiles(_project())))


@stack_task(iterable=["set"], help={**PROFILE_HELP, **JSON_HELP,
                                    "explain": "show which layer set each value",
                                    "vllm_args": "print the engine's exact argv (vllm serve; "
                                    "llama-server for ENGINE=llamacpp)"})
def config(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None,
           explain: bool = False, vllm_args: bool = False, json: bool = False) -> None:
    """Show the resolved settings; --explain shows where each came from; --vllm-args the argv."""
    from vllmstack.config import view as config_view

    print(config_view.render_config(_resolve(model, platform, set), explain=explain,
                                    vllm_args=vllm_args, as_json=json))


# --- development ------------------------------------------------------------------

@stack_task(help={"quick": "the unit tier only (two xdist workers): no Docker engine, no browser, "
                  "no real engine", "k": "pytest -k expression (both tiers)",
                  "slow": "also the tests too long for CI: vLLM's CPU source build (an hour on 2 cores)"})
def test(c: Context, quick: bool = False, k: str | None = None, slow: bool = False) -> None:
    """Provision, ruff, mypy, lint-imports, pytest (unit tier on 2 workers, then integration), timed."""
    from vllmstack.devtools.testsuite import run_test_suite

    exit_with(run_test_suite(_project(), _runner(False), quick=quick, keyword=k, slow=slow))


@stack_task(iterable=["set"], help={**PROFILE_HELP, **JSON_HELP, "verbose": "show info findings too",
                                    "deep": "also parse the argv with the pinned vLLM's own parser",
                                    "runtime": "check for this runtime (native, compose, compose-v1, "
                                    "podman; default RUNTIME)", "target": "also what does not "
                                    "translate to an export: a name `invoke export --to` takes"},
            values={"target": EXPORT_TARGET})
def check(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None, runtime: Opt = None,
          json: bool = False, deep: bool = False, verbose: bool = False, target: Opt = None) -> None:
    """Report every problem found before boot, each with the key, the file that set it and a fix."""
    from vllmstack.checks import registry as checks

    resolved = _resolve(model, platform, set)
    findings = checks.check_profile(_project(), resolved, os.environ, _runner(False), deep=deep,
                                    runtime=runtime)
    if target:  # `invoke export`'s findings too: what a cluster or a Quadlet unit cannot take
        from vllmstack.export.service import target_findings
        findings = target_findings(_project(), target, resolved, os.environ, _runner(False), findings)
    _print_json(checks.report_json(resolved, findings)) if json else print(
        checks.render_report(resolved, findings, verbose=verbose))
    exit_with(1 if any(f.severity == "error" for f in findings) else 0)


# --- serving lifecycle ---------------------------------------------------------------------

LIFECYCLE_HELP = {**PROFILE_HELP, "dry_run": "print the commands instead of running them",
                  "runtime": "compose | compose-v1 | podman | native (default: RUNTIME, else auto-detect)"}


def _lifecycle() -> Any:
    from vllmstack.serve import lifecycle  # deferred, as every import of a task: --list stays fast

    return lifecycle


def _stack(model: Opt, platform: Opt, sets: Sets, runtime: Opt, dry_run: bool = False,
           follow: bool = True) -> Any:
    """`follow`: the running stack's profile where no flag names one (all but `up`)."""
    resolved = (follow_here if follow else _resolve)(model, platform, sets)
    return _lifecycle().open_stack(_project(), resolved, os.environ, _runner(dry_run),
                                   runtime=runtime)


@stack_task(iterable=["set"], help={**PROFILE_HELP, **JSON_HELP, "runtime": LIFECYCLE_HELP["runtime"]})
def doctor(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None, runtime: Opt = None,
           json: bool = False) -> None:
    """This host's prerequisites (kernel, driver, devices, runtimes, disk, GPUs), each with a fix."""
    from vllmstack.checks import host

    report = host.run_doctor(_project(), _resolve(model, platform, set), os.environ, _runner(False),
                             runtime=runtime)
    _print_json(report.as_json()) if json else print(host.render_doctor(report))
    exit_with(1 if report.failed else 0)


@stack_task(iterable=["set"], help={**LIFECYCLE_HELP, "timeout": "seconds to wait for /health",
                                    "force": "start even when a guard refuses (loudly)",
                                    "stop_other": "stop the engine that holds the GPU first (this "
                                    "stack's, or an OTHER_ENGINE_SERVICE unit)",
                                    "no_dashboard": "do not start the dashboard service"})
def up(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None, runtime: Opt = None,
       timeout: float | None = None, force: bool = False, stop_other: bool = False,
       no_dashboard: bool = False, dry_run: bool = False) -> None:
    """Guards (one engine resident), render, start, wait for /health (diagnosing a crash), warm up."""
    lifecycle = _lifecycle()
    stack = _stack(model, platform, set, runtime, dry_run, follow=False)
    result = lifecycle.up(stack, timeout=timeout, force=force, dashboard=not no_dashboard,
                          dry_run=dry_run, stop_other=stop_other)
    if not dry_run:
        print(f"ready: {result.served_name} at {result.url}/v1")


@stack_task(iterable=["set"],
            help={**LIFECYCLE_HELP, **RUNNING_HELP,
                  "timeout": "seconds to wait for GPU memory release"})
def down(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None, runtime: Opt = None,
         timeout: float = 120.0, dry_run: bool = False) -> None:
    """Stop everything the stack started and wait until GPU memory is released."""
    _lifecycle().prepare_down(_project(), dry_run=dry_run)  # a damaged state.json is set aside
    _lifecycle().down(_stack(model, platform, set, runtime, dry_run), timeout=timeout, dry_run=dry_run)


@stack_task(iterable=["set"],
            help={**RUNNING_HELP, **JSON_HELP, "runtime": LIFECYCLE_HELP["runtime"]})
def status(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None,
           runtime: Opt = None, json: bool = False) -> None:
    """Containers (or processes), health, served model and KV cache usage."""
    lifecycle = _lifecycle()
    report = lifecycle.status(_stack(model, platform, set, runtime))
    _print_json(report) if json else print(lifecycle.render_status(report))


@stack_task(values={"log": PATH, "profile": PROFILE, "engine": choice(ENGINE_NAMES),
                    "history": whole(1, 10_000, "a number of boots", 10)}, help={
    **JSON_HELP, "runtime": LIFECYCLE_HELP["runtime"], "log": "a saved engine log to read instead",
    "profile": "the router's engine of this profile (default: the one `invoke up` started)",
    "engine": "--log: whose log, vllm or llamacpp (default: found from its lines)",
    "history": "the last N boots `up` recorded (results/boot_history.jsonl), one line each"})
def startup(c: Context, log: Opt = None, profile: Opt = None, engine: Opt = None,
            runtime: Opt = None, history: int = 0, json: bool = False) -> None:
    """The phases of the last boot (or a saved log's): seconds, share, cold or warm torch.compile."""
    from vllmstack.serve import startup as boot

    if history:
        records = boot.boot_history(_project(), history)
        _print_json(records.as_json()) if json else print(boot.render_history(records))
        return
    found = boot.read_startup(_project(), log=Path(log) if log else None, profile=profile,
                              engine=engine, default_stack=lambda: _stack(None, None, None, runtime))
    _print_json(found.as_json()) if json else print(boot.render_startup(found))


@stack_task(iterable=["set"], help={**RUNNING_HELP, "runtime": LIFECYCLE_HELP["runtime"],
                                    "follow": "keep following (default)", "service": "vllm or dashboard",
                                    "tail": "lines of history to show"})
def logs(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None, runtime: Opt = None,
         follow: bool = True, tail: int = 200, service: str = "vllm") -> None:
    """Follow the engine log."""
    stack = _stack(model, platform, set, runtime)
    exit_with(_lifecycle().logs(stack, follow=follow, tail=tail, service=service))


@stack_task(name="exec", help={"runtime": LIFECYCLE_HELP["runtime"]})
def exec_(c: Context, runtime: Opt = None) -> None:
    """Run a command in the engine container, the image's Python first on PATH: invoke exec -- CMD."""
    # The words after `--` as given: invoke's own remainder is one string, which loses quoting.
    argv = sys.argv
    command = argv[argv.index("--") + 1:] if "--" in argv else shlex.split(c.remainder)
    stack = _stack(None, None, None, runtime)
    exit_with(_lifecycle().exec_in_engine(stack, command, tty=sys.stdin.isatty()))


@stack_task(help={"runtime": LIFECYCLE_HELP["runtime"], "dry_run": LIFECYCLE_HELP["dry_run"],
                  "store": "also empty the build store the machine's checkouts share (README)"})
def clear_caches(c: Context, runtime: Opt = None, dry_run: bool = False, store: bool = False) -> None:
    """Delete the engine's compile caches (vLLM, Triton, Inductor, AITER) and temp files; keeps models."""
    _lifecycle().clear_caches(_stack(None, None, None, runtime, dry_run), dry_run=dry_run, store=store)


@stack_task(iterable=["set"], help={**PROFILE_HELP, "runtime": LIFECYCLE_HELP["runtime"]})
def dashboard_up(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None,
                 runtime: Opt = None) -> None:
    """Start the dashboard service alone (against the running engine)."""
    _lifecycle().dashboard_up(_stack(model, platform, set, runtime))


@stack_task(help={"runtime": LIFECYCLE_HELP["runtime"]})
def dashboard_down(c: Context, runtime: Opt = None) -> None:
    """Stop the dashboard service."""
    _lifecycle().dashboard_down(_stack(None, None, None, runtime))


# --- dashboard ---------------------------------------------------------------------------

@stack_task(iterable=["set"], values={"port": PORT.as_text()}, help={
    **PROFILE_HELP, "port": "port (default: DASHBOARD_PORT)",
    "host": "address to listen on (default: DASHBOARD_BIND, else 127.0.0.1)",
    "engine_url": "engine base URL (default: http://127.0.0.1:VLLM_PORT); any engine works",
    "tokenizer": "tokenizer for runs started from the page (default: VLLM_TOKENIZER)"})
def dashboard(c: Context, host: Opt = None, port: Opt = None, engine_url: Opt = None,
              tokenizer: Opt = None, model: Opt = None, platform: Opt = None,
              set: Sets = None) -> None:
    """Serve the dashboard in the foreground (development, or against any engine URL)."""
    from vllmstack.dashboard.__main__ import run, settings_for_stack

    settings = settings_for_stack(_project(), os.environ, model=model, platform=platform,
                                  sets=set or [], host=host, port=port, engine_url=engine_url,
                                  tokenizer=tokenizer)
    exit_with(run(settings, os.environ))


# --- build and patches ---------------------------------------------------------------------

PATCH_HELP = {"ref": "NAME=REF: check NAME (vllm, aiter, flash-attention) at this tag, branch or commit",
              "repo": "NAME=URL_OR_PATH: use this repository instead of <NAME>_REPO",
              "patches": "NAME=DIR: use this patch folder instead of patches/NAME"}

@stack_task(iterable=["ref", "repo", "patches"], help={**PATCH_HELP, **JSON_HELP})
def verify_patches(c: Context, ref: Sets = None, repo: Sets = None, patches: Sets = None,
                   json: bool = False) -> None:
    """Check every patch and overlay against the pinned (or given) refs; exit 1 if one fails."""
    from vllmstack.image import patches as patch_set

    report = patch_set.verify_patches(
        _project(), _resolve(None, None, None), _runner(False), environ=os.environ,
        refs=patch_set.parse_component_pairs(ref or [], "--ref"),
        repos=patch_set.parse_component_pairs(repo or [], "--repo"),
        patch_dirs=patch_set.parse_component_pairs(patches or [], "--patches"))
    _print_json(report.as_json()) if json else print(patch_set.render_report(report))
    exit_with(1 if report.failed else 0)


@stack_task(help={"file": "the earlier stack's env file to read",
                  "name": "write env/models/NAME.env from the model keys (never overwrites)",
                  "extends": "layer the written profile builds on, e.g. families/qwen3.6"})
def import_env(c: Context, file: str, name: Opt = None, extends: Opt = None) -> None:
    """Read a profile of the earlier just/compose stack and report what maps where."""
    from vllmstack.config import migrate

    mappings = migrate.map_env_file(source := Path(file))  # a folder or a FIFO is refused there
    print(migrate.render_mapping(mappings))
    if name:
        written = migrate.write_profile(_project(), name, source, mappings, extends)
        print(f"wrote {written}; next: invoke check --model {name}")


# --- benchmarks ---------------------------------------------------------------------------
# Each benchmark task is generated from its command's option declarations in
# vllmstack/bench/options.py and hands the options the user gave to the same `main()` that
# `python -m vllmstack.bench` and the dashboard run. Here --model is the served model name (the
# bench contract); --profile picks the model profile.


bench = bench_task("bench")
bench_depth = bench_task("bench-depth")
bench_conc = bench_task("bench-conc")
probe = bench_task("probe")
stability = bench_task("stability")
report = bench_task("report")


# --- native runtime and made models ---------------------------------------------------------

@stack_task(help={**JSON_HELP, "platform": "mark the environment this platform runs (default: .env's)"})
def engines(c: Context, platform: Opt = None, json: bool = False) -> None:
    """List the native runtime's engine environments with their vLLM and torch versions."""
    from vllmstack.runtime.native import install

    found, used = install.list_engines(_project()), install.engine_version(_resolve(None, platform, None))
    _print_json([e.as_json() for e in found]) if json else print(install.render_engines(found, used))


@stack_task(help={**JSON_HELP, "preset": "which model: tiny (a 2-layer Qwen3 for the cpu platform)",
                  "force": "make it again even when it is there", "minutes": "--trained: at most (20 min)",
                  "out": "write into this folder instead of the Hugging Face cache (e.g. MODELS_DIR/x)",
                  "trained": "train it on the bundled corpus (the engine's Python): tiny-qwen3-trained",
                  "python": "--trained: the Python with torch (default: the engine's)"})
def make_model(c: Context, preset: str = "tiny", out: Opt = None, force: bool = False,
               trained: bool = False, python: Opt = None, minutes: float = 20.0, json: bool = False) -> None:
    """Make a random-weight (or --trained) model with a real tokenizer and chat template."""
    from vllmstack.models import tiny
    from vllmstack.models.trained import make_trained

    where, resolved = Path(out).expanduser() if out else None, _resolve(None, None, None)
    made = (make_trained(_project(), resolved, _runner(False), os.environ, preset=preset, out=where,
                         force=force, python=python, max_minutes=minutes) if trained else
            tiny.make_for_stack(resolved, os.environ, preset, out=where, force=force))
    if made is None:
        return
    _print_json(made.as_json()) if json else print(tiny.render_made(made))

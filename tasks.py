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

from vllmstack.paths import Project
from vllmstack.profiles import ProfileError, Resolved, resolve
from vllmstack.runner import SubprocessRunner

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
    from vllmstack.config_view import render_profiles
    from vllmstack.profiles import list_profiles

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
    from vllmstack import config_view

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
    from vllmstack.devenv import run_test_suite

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
    from vllmstack import checks

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
    from vllmstack import lifecycle

    resolved = _resolve(model, platform, sets)
    try:
        return lifecycle.open_stack(_project(), resolved, os.environ, _runner(dry_run),
                                    runtime=runtime)
    except lifecycle.LifecycleError as exc:
        raise Exit(exc.render(), code=1) from exc


def _lifecycle_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from vllmstack import lifecycle

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
    from vllmstack import lifecycle

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
    from vllmstack import lifecycle

    stack = _stack(model, platform, set, runtime, dry_run)
    _lifecycle_call(lifecycle.down, stack, timeout=timeout, dry_run=dry_run)


@task(iterable=["set"], help={**PROFILE_HELP, **JSON_HELP, "runtime": LIFECYCLE_HELP["runtime"]})
def status(c: Context, model: str | None = None, platform: str | None = None,
           set: list[str] | None = None, runtime: str | None = None,
           json: bool = False) -> None:
    """Containers (or processes), health, served model and KV cache usage."""
    from vllmstack import lifecycle

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
    from vllmstack import lifecycle

    stack = _stack(model, platform, set, runtime)
    raise Exit(code=_lifecycle_call(lifecycle.logs, stack, follow=follow, tail=tail,
                                    service=service))


@task(name="exec", help={"runtime": LIFECYCLE_HELP["runtime"]})
def exec_(c: Context, runtime: str | None = None) -> None:
    """Run a command in the engine container, the image's Python first on PATH: invoke exec -- CMD."""
    from vllmstack import lifecycle

    command = _remainder() or shlex.split(c.remainder)
    stack = _stack(None, None, None, runtime)
    raise Exit(code=_lifecycle_call(lifecycle.exec_in_engine, stack, command,
                                    tty=sys.stdin.isatty()))


def _remainder() -> list[str]:
    """Words after `--`, as given (invoke's own remainder is one string, which loses quoting)."""
    argv = sys.argv
    return argv[argv.index("--") + 1:] if "--" in argv else []


@task(iterable=["set"], help={**PROFILE_HELP, "runtime": LIFECYCLE_HELP["runtime"]})
def dashboard_up(c: Context, model: str | None = None, platform: str | None = None,
                 set: list[str] | None = None, runtime: str | None = None) -> None:
    """Start the dashboard service alone (against the running engine)."""
    from vllmstack import lifecycle

    stack = _stack(model, platform, set, runtime)
    _lifecycle_call(lifecycle.dashboard_up, stack)


@task(help={"runtime": LIFECYCLE_HELP["runtime"]})
def dashboard_down(c: Context, runtime: str | None = None) -> None:
    """Stop the dashboard service."""
    from vllmstack import lifecycle

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
    from vllmstack import patches as patch_set

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
    from vllmstack import build as image_build

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

    from vllmstack import migrate

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

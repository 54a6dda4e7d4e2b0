"""invoke tasks: parse arguments, call one vllmstack function, render the result.

All logic lives in the vllmstack package; see README.md for the commands.
"""

from __future__ import annotations

import json
import os
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
    "json": "print JSON instead of text",
}


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
    help={**PROFILE_HELP, "explain": "show which layer set each value",
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
    help={**PROFILE_HELP, "deep": "also parse the argv with the pinned vLLM's own parser",
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

"""The developer test command: provision what the tests need, then ruff, mypy, the import
contracts (lint-imports) and pytest in two tiers, each step timed, ending with one summary line.

The unit tier (tests with none of the markers below) runs under pytest-xdist on two workers: CI
has two cores, and those tests share nothing but the CPU. The integration tier runs after it,
serially: it boots real engines, Docker containers and paced comparisons whose timings two tests
on two cores would skew."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.devtools.junit import merge
from vllmstack.devtools.summary import Timed, step_line, summary_line

PYTEST_NO_TESTS = 5

# Tests too long for CI's time (vLLM's CPU source build: an hour on 2 cores); `invoke test --slow`
# runs them too (pytest marker `source_build`).
SLOW_ONLY = "source_build"
# A test with any of these markers runs in the integration tier, one test at a time. `serial`:
# a quick test that cannot run beside another one; its mark says why (a comment next to it).
INTEGRATION_MARKERS = ("docker", "slow", "browser", "real_engine", "serial")
# CI's two cores; more workers than cores only add start-up time.
UNIT_WORKERS = 2
SLOWEST = 25  # pytest --durations: where the minutes of each tier went
# pytest's short summary: failures, errors and skips with their reasons (`-rs` alone would drop
# the failures and errors that pytest lists by default).
REPORT_CHARS = "-rfEs"
# Git-ignored (generated/), one file per tier; removed before its tier runs so that a tier that
# dies before pytest writes one is reported as such, not by a previous run's numbers.
REPORTS = Path("generated") / "test-results"


def lint_imports_argv(python: str | None = None) -> list[str]:
    """import-linter, run by `python` (default: this interpreter), against the contracts in
    pyproject.toml [tool.importlinter]. No cache: it would be written into the work tree."""
    main = "from importlinter.cli import lint_imports_command as main; main()"
    return [python or sys.executable, "-c", main, "--no-cache", "--no-logo"]


def static_steps(python: str) -> list[tuple[str, list[str]]]:
    return [
        ("ruff", [python, "-m", "ruff", "check", "vllmstack", "tests", "tasks.py", "engine-plugins"]),
        ("mypy", [python, "-m", "mypy"]),
        ("lint-imports", lint_imports_argv(python)),
    ]


@dataclass(frozen=True)
class Tier:
    name: str
    argv: list[str]
    report: Path  # its --junitxml file


def unit_expression() -> str:
    """Tests with none of the integration markers, and never the source build."""
    return " and ".join(f"not {marker}" for marker in (*INTEGRATION_MARKERS, SLOW_ONLY))


def integration_expression(*, slow: bool) -> str:
    """Every test the unit tier leaves out; the source build only with --slow."""
    if slow:
        return " or ".join((*INTEGRATION_MARKERS, SLOW_ONLY))
    return f"({' or '.join(INTEGRATION_MARKERS)}) and not {SLOW_ONLY}"


def tiers(root: Path, python: str, *, quick: bool = False, keyword: str | None = None,
          slow: bool = False) -> list[Tier]:
    """The pytest runs of `invoke test`: the unit tier under xdist, then (not with --quick) the
    integration tier serially. `-k` narrows both."""
    def tier(name: str, expression: str, parallel: list[str]) -> Tier:
        report = root / REPORTS / f"{name}.xml"
        argv = [python, "-m", "pytest", "-q", REPORT_CHARS, f"--durations={SLOWEST}", *parallel,
                "-m", expression, *(["-k", keyword] if keyword else []), f"--junitxml={report}"]
        return Tier(name, argv, report)

    found = [tier("unit", unit_expression(), ["-n", str(UNIT_WORKERS)])]
    if not quick:
        found.append(tier("integration", integration_expression(slow=slow), []))
    return found


@dataclass
class _Steps:
    """Runs each step through the runner and records how long it took."""

    runner: Runner
    root: Path
    clock: Callable[[], float]
    out: TextIO
    done: list[Timed]

    def run(self, name: str, group: str, argv: Sequence[str],
            env: Mapping[str, str] | None = None) -> Timed:
        start = self.clock()
        result = self.runner.run(argv, capture=False, cwd=self.root, env=env)
        step = Timed(name, group, self.clock() - start, result.returncode)
        self.done.append(step)
        print(step_line(step), file=self.out, flush=True)
        return step


def _pytest_code(ran: Sequence[Timed], keyword: str | None) -> tuple[int, Timed | None]:
    """The tiers' exit code and the first failing tier. No test collected (5) is a failure,
    except for a tier that `-k` left empty while another tier ran tests."""
    some_ran = any(step.returncode != PYTEST_NO_TESTS for step in ran)
    for step in ran:
        if step.returncode == PYTEST_NO_TESTS:
            if keyword and some_ran:
                continue
            print(f"pytest collected no tests in the {step.name} tier: that is a failure here",
                  file=sys.stderr)
            return 1, step
        if step.returncode != 0:
            return step.returncode, step
    return 0, None


def run_test_suite(
    project: Project, runner: Runner, *, quick: bool = False, keyword: str | None = None,
    slow: bool = False, clock: Callable[[], float] = time.monotonic, out: TextIO | None = None,
) -> int:
    """Return the exit code of the first failing step (0 when all pass); print each step's
    minutes as it ends and, last, one summary line."""
    out = out or sys.stdout
    start = clock()
    steps = _Steps(runner, project.root, clock, out, [])
    code, failure, reports = _run_steps(steps, project.root, quick=quick, keyword=keyword, slow=slow)
    counts, unread = merge(reports.values()) if reports else (None, [])
    unread_tiers = [name for name, path in reports.items() if path in unread]
    print(summary_line(clock() - start, steps.done, counts, unread_tiers, failure), file=out,
          flush=True)
    return code


def _run_steps(steps: _Steps, root: Path, *, quick: bool, keyword: str | None, slow: bool
               ) -> tuple[int, Timed | None, dict[str, Path]]:
    """The steps in order: the exit code, the failing step, each pytest tier's report."""
    py = sys.executable
    if not quick:
        # Docker engine, local base image, Chromium: installed and started when missing.
        setup = steps.run("provision", "provision", ["bash", str(root / "scripts" / "test-env.sh")])
        if setup.returncode != 0:
            print(f"test environment setup failed (exit {setup.returncode})", file=sys.stderr)
            return setup.returncode or 1, setup, {}
    for name, argv in static_steps(py):
        step = steps.run(name, "static", argv)
        if step.returncode != 0:
            return step.returncode, step, {}
    if importlib.util.find_spec("xdist") is None:  # else pytest's "unrecognized arguments: -n"
        print("error: pytest-xdist is not installed (the unit tier runs on two workers)\n"
              "fix: python3 -m pip install -e '.[dev]'", file=sys.stderr)
        return 1, Timed("pytest-xdist", "unit", 0.0, 1), {}
    env = {**os.environ, "VLLMSTACK_TEST_FULL": "0" if quick else "1"}
    ran, reports = [], {}
    for tier in tiers(root, py, quick=quick, keyword=keyword, slow=slow):
        tier.report.unlink(missing_ok=True)
        ran.append(steps.run(tier.name, tier.name, tier.argv, env=env))
        reports[tier.name] = tier.report
    code, failure = _pytest_code(ran, keyword)
    return code, failure, reports

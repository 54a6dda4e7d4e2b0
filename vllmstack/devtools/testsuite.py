"""The developer test command: provision what the tests need, then ruff, mypy, the import
contracts (lint-imports) and pytest."""

from __future__ import annotations

import os
import sys

from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner

PYTEST_NO_TESTS = 5


def lint_imports_argv(python: str | None = None) -> list[str]:
    """import-linter, run by `python` (default: this interpreter), against the contracts in
    pyproject.toml [tool.importlinter]. No cache: it would be written into the work tree."""
    main = "from importlinter.cli import lint_imports_command as main; main()"
    return [python or sys.executable, "-c", main, "--no-cache", "--no-logo"]


# Tests too long for CI's time (vLLM's CPU source build: an hour on 2 cores); `invoke test --slow`
# runs them too (pytest marker `source_build`).
SLOW_ONLY = "source_build"


def run_test_suite(
    project: Project, runner: Runner, *, quick: bool = False, keyword: str | None = None,
    slow: bool = False,
) -> int:
    """Return the exit code of the first failing step (0 when all pass)."""
    py = sys.executable
    if not quick:
        setup = project.root / "scripts" / "test-env.sh"
        # Docker engine, local base image, Chromium: installed and started when missing.
        result = runner.run(["bash", str(setup)], capture=False, cwd=project.root)
        if not result.ok:
            print(f"test environment setup failed (exit {result.returncode})", file=sys.stderr)
            return result.returncode or 1
    steps = [
        [py, "-m", "ruff", "check", "vllmstack", "tests", "tasks.py", "engine-plugins"],
        [py, "-m", "mypy"],
        lint_imports_argv(py),
    ]
    for argv in steps:
        result = runner.run(argv, capture=False, cwd=project.root)
        if not result.ok:
            return result.returncode
    pytest = [py, "-m", "pytest", "-q", "-rs"]
    deselect = ["not docker and not slow and not browser"] if quick else []
    if not slow:
        deselect.append(f"not {SLOW_ONLY}")
    pytest += ["-m", " and ".join(f"({expr})" for expr in deselect)] if deselect else []
    if keyword:
        pytest += ["-k", keyword]
    env = {**os.environ, "VLLMSTACK_TEST_FULL": "0" if quick else "1"}
    result = runner.run(pytest, capture=False, cwd=project.root, env=env)
    if result.returncode == PYTEST_NO_TESTS:
        print("pytest collected no tests: that is a failure here", file=sys.stderr)
        return 1
    return result.returncode

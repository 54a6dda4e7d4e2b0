"""One failure format (issue 23, item 5): every task, given a bad input, ends with exactly an
`error:` line and then a `fix:` line on stderr, and exit code 1 -- bench, probe, stability and
burn included, which printed `Error:` or `error:` without a fix.

Each input gets past invoke's parser (a value of the right kind) and fails in the task itself:
a profile that does not exist, a server that does not answer, a file that is not there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_tasks
from invoke.tasks import Task

from vllmstack.core.paths import Project

NOPE = "nope-xyz"
DEAD = ["--url", "http://127.0.0.1:9", "--model", "m", "--timeout", "5"]
# A bad input for each task that fails in the task, not in the parser.
BAD_INPUT: dict[str, list[str]] = {
    "config": ["--model", NOPE], "check": ["--model", NOPE], "doctor": ["--model", NOPE],
    "up": ["--model", NOPE, "--dry-run"], "down": ["--model", NOPE, "--dry-run"],
    "status": ["--model", NOPE], "logs": ["--model", NOPE], "dashboard-up": ["--model", NOPE],
    "dashboard": ["--model", NOPE], "build": ["--model", NOPE, "--dry-run"],
    "rebuild": ["--model", NOPE, "--dry-run"], "verify-patches": ["--ref", "nope=v1"],
    "import-env": ["/nonexistent/old.env"], "bench": DEAD, "bench-depth": DEAD,
    "bench-conc": DEAD, "probe": ["itl-stall", *DEAD], "stability": ["smoke", *DEAD],
    "report": ["--out", "/proc/nope/report.md"], "engines": ["--platform", NOPE],
    "install-engine": ["--engine", "llamacpp", "--backend", "bogus", "--dry-run"],
    "make-model": ["--preset", NOPE], "bench-vs": ["-t", f"vllm:{NOPE}"],
    "burn": ["--profiles", NOPE], "gguf-convert": ["/nonexistent/model"],
    "gpu-check": ["--model", NOPE], "exec": ["--runtime", "native"],
    "clear-caches": ["--dry-run"], "dashboard-down": [],
    "router": ["--profiles", NOPE, "--platform", "cpu"],
    "startup": ["--log", "/nonexistent/boot.log"],
}
# These take no profile option: .env names a platform that does not exist.
BAD_DOTENV = {"clear-caches", "dashboard-down"}
# Tasks no input makes fail without a machine to break (a listing; the test suite itself).
NO_BAD_INPUT = {"profiles", "test"}


TASKS = [t for t in vars(load_tasks()).values() if isinstance(t, Task)]
TASK_OPTIONS = {t.name.replace("_", "-"): tuple(f"--{a.name.replace('_', '-')}"
                                                for a in t.get_arguments()) for t in TASKS}
POSITIONALS = {t.name.replace("_", "-"): sum(a.positional for a in t.get_arguments())
               for t in TASKS}


def test_every_task_has_a_bad_input_here() -> None:
    # A task added later without --model (which gets an unknown profile below) needs a bad
    # input here, or a reason to be in NO_BAD_INPUT.
    missing = {n for n in TASK_OPTIONS if n not in BAD_INPUT and n not in NO_BAD_INPUT
               and "--model" not in TASK_OPTIONS[n]}
    assert not missing, f"give these tasks a bad input in BAD_INPUT: {sorted(missing)}"


def cases() -> list[tuple[str, list[str]]]:
    named = list(BAD_INPUT.items())
    # Every other task that takes a profile: an unknown one (tasks other helpers add).
    named += [(n, [*(["x"] * POSITIONALS[n]), "--model", NOPE]) for n in sorted(TASK_OPTIONS)
              if n not in BAD_INPUT and n not in NO_BAD_INPUT and "--model" in TASK_OPTIONS[n]]
    return named


@pytest.mark.parametrize(("task", "args"), cases(), ids=[name for name, _ in cases()])
def test_a_failing_task_ends_with_error_then_fix_and_exits_1(
        project: Project, tmp_path: Path, task: str, args: list[str]) -> None:
    environ = {**os.environ, "HOME": str(tmp_path)}  # nothing of this machine's user state
    if task in BAD_DOTENV:
        project.dotenv.write_text(f"PLATFORM={NOPE}\n")
    done = subprocess.run([sys.executable, "-m", "invoke", task, *args], cwd=project.root,
                          text=True, capture_output=True, timeout=120, env=environ)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.rstrip("\n").splitlines()
    assert len(lines) >= 2, done.stderr
    assert lines[-2].startswith("error: ") and lines[-1].startswith("fix:   "), done.stderr
    assert len(lines[-1]) > len("fix:   ") + 5
    assert "Traceback" not in done.stderr + done.stdout
    assert not any(line.startswith("Error:") for line in done.stderr.splitlines())

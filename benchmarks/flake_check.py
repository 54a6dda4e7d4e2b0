"""Run the tests that start and stop real processes many times, and print every failure.

Usage: python3 benchmarks/flake_check.py [--runs 20] [--quick] [-- PYTEST_ARGS...]

By default each run is the process tests (tests/test_native_runtime.py: real process groups, TERM
and KILL, keepers) and the native lifecycle tests (tests/integration/test_native_lifecycle.py: up,
status, down against the engine simulator). `--quick` runs the process tests only. Each run is
a separate pytest process; failures are read from its JUnit XML, so one flaky test shows up as
"2/20" with the message of its first failure. Exit status 1 when any run failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROCESS_TESTS = ["tests/test_native_runtime.py"]
LIFECYCLE_TESTS = ["tests/integration/test_native_lifecycle.py"]


def failures(report: Path) -> list[tuple[str, str]]:
    """(test id, first line of the failure) for each failed or erroring test case."""
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for problem in (*case.findall("failure"), *case.findall("error")):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            text = (problem.get("message") or problem.text or "").strip().splitlines()
            found.append((name, text[0][:200] if text else "(no message)"))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="the process tests only")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    files = PROCESS_TESTS + ([] if args.quick else LIFECYCLE_TESTS)
    counts: Counter[str] = Counter()
    first: dict[str, str] = {}
    failed_runs = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flake-check-") as tmp:
        for run in range(1, args.runs + 1):
            report = Path(tmp) / f"run-{run}.xml"
            begun = time.monotonic()
            result = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                 *files, *args.pytest_args], cwd=ROOT, capture_output=True, text=True, check=False,
                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
            found = failures(report) if report.is_file() else [("(pytest)", result.stdout[-300:])]
            if result.returncode != 0 and not found:
                found = [("(pytest)", f"exit {result.returncode}: {result.stdout.strip()[-300:]}")]
            for name, message in found:
                counts[name] += 1
                first.setdefault(name, f"run {run}: {message}")
            failed_runs += bool(found)
            verdict = "ok" if not found else "FAILED " + ", ".join(n.rsplit("::", 1)[-1] for n, _ in found)
            print(f"run {run:2d}/{args.runs}: {verdict} ({time.monotonic() - begun:.0f} s)", flush=True)
    passed = args.runs - failed_runs
    print(f"\n{passed}/{args.runs} runs passed of {' '.join(files)} "
          f"in {time.monotonic() - started:.0f} s")
    for name, count in counts.most_common():
        print(f"  {count}/{args.runs} {name}\n      {first[name]}")
    return 0 if failed_runs == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

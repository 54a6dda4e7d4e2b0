"""`invoke test` (vllmstack/devtools/testsuite.py): the argv of every step, the two pytest tiers
(xdist on the unit tier only), the minutes of each step and the one summary line, read from the
tiers' JUnit XML files."""

from __future__ import annotations

import io
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.devtools import testsuite
from vllmstack.devtools.junit import read_counts
from vllmstack.devtools.testsuite import integration_expression, run_test_suite, unit_expression

PY = sys.executable
UNIT_MARKS = "not docker and not slow and not browser and not real_engine and not serial and not source_build"
INTEGRATION_MARKS = "(docker or slow or browser or real_engine or serial) and not source_build"

# What pytest 9 with xdist 3.8 wrote (-n 2 --junitxml) for a file with two passes, a failure, a
# setup error, two skips with one reason, one with another and an xfail (failure texts cut).
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1" skipped="4" tests="8"
 time="11.293" timestamp="2026-12-03T13:03:21.908998+00:00" hostname="vm">
<testcase classname="test_a" name="test_ok" time="0.001" />
<testcase classname="test_a" name="test_fail" time="0.001"><failure message="assert False"
 >E   assert False
test_a.py:9: AssertionError</failure></testcase>
<testcase classname="test_a" name="test_ok2" time="0.001" />
<testcase classname="test_a" name="test_skip" time="0.001"><skipped type="pytest.skip"
 message="fp8 KV on vLLM's CPU build needs AVX-512"
 >/tmp/jt/test_a.py:11: fp8 KV on vLLM's CPU build needs AVX-512</skipped></testcase>
<testcase classname="test_a" name="test_skip2" time="0.003"><skipped type="pytest.skip"
 message="fp8 KV on vLLM's CPU build needs AVX-512"
 >/tmp/jt/test_a.py:12: fp8 KV on vLLM's CPU build needs AVX-512</skipped></testcase>
<testcase classname="test_a" name="test_skipif" time="0.000"><skipped type="pytest.skip"
 message="no Docker engine">/tmp/jt/test_a.py:13: no Docker engine</skipped></testcase>
<testcase classname="test_a" name="test_xf" time="0.001"><skipped type="pytest.xfail"
 message="known bug" /></testcase>
<testcase classname="test_a" name="test_err" time="0.001"><error
 message="failed on setup with &quot;RuntimeError: setup&quot;">E       RuntimeError: setup
test_a.py:5: RuntimeError</error></testcase>
</testsuite></testsuites>
"""
# The integration tier's: one pass, one skip.
JUNIT_INTEGRATION = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="0" failures="0" skipped="1" tests="2">
<testcase classname="test_b" name="test_boot" time="30.0" />
<testcase classname="test_b" name="test_gpu" time="0.0"><skipped type="pytest.skip"
 message="no Docker engine">/tmp/jt/test_b.py:3: no Docker engine</skipped></testcase>
</testsuite></testsuites>
"""


def suite(tmp_path: Path, runner: RecordingRunner, *, quick: bool = False, keyword: str | None = None,
          slow: bool = False, clock: Callable[[], float] = lambda: 0.0) -> tuple[int, list[str]]:
    """`invoke test`'s exit code and every line it printed (the steps' own output is the runner's)."""
    out = io.StringIO()
    code = run_test_suite(Project(tmp_path), runner, quick=quick, keyword=keyword, slow=slow,
                          clock=clock, out=out)
    return code, out.getvalue().splitlines()


def pytest_calls(runner: RecordingRunner) -> list[list[str]]:
    return [list(call) for call in runner.calls if call[1:3] == ("-m", "pytest")]


def marker_expression(call: list[str]) -> str:
    return call[call.index("-m", 3) + 1]  # the first -m is python's (-m pytest)


def report(tmp_path: Path, tier: str) -> str:
    return f"--junitxml={tmp_path / 'generated' / 'test-results' / f'{tier}.xml'}"


def writes(xml: str, *, code: int = 0, then: Callable[[], None] = lambda: None
           ) -> Callable[[tuple[str, ...]], Result]:
    """A pytest that writes `xml` where --junitxml says and exits `code`."""
    def answer(argv: tuple[str, ...]) -> Result:
        [path] = [a.removeprefix("--junitxml=") for a in argv if a.startswith("--junitxml=")]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(xml)
        then()
        return Result(argv, code)
    return answer


# --- the argv of each step -------------------------------------------------------------------

def test_a_full_run_provisions_checks_then_runs_the_unit_tier_on_two_workers_then_the_rest(
        tmp_path: Path) -> None:
    runner = RecordingRunner()
    code, _ = suite(tmp_path, runner)
    assert code == 0
    assert [list(c) for c in runner.calls] == [
        ["bash", str(tmp_path / "scripts" / "test-env.sh")],
        [PY, "-m", "ruff", "check", "vllmstack", "tests", "tasks.py", "engine-plugins"],
        [PY, "-m", "mypy"],
        testsuite.lint_imports_argv(PY),
        [PY, "-m", "pytest", "-q", "-rfEs", "--durations=25", "-n", "2", "-m", UNIT_MARKS,
         report(tmp_path, "unit")],
        [PY, "-m", "pytest", "-q", "-rfEs", "--durations=25", "-m", INTEGRATION_MARKS,
         report(tmp_path, "integration")],
    ]
    pytest_envs = runner.envs[-2:]
    assert all(env is not None and env["VLLMSTACK_TEST_FULL"] == "1" for env in pytest_envs)


def test_quick_runs_only_the_unit_tier_under_xdist_and_provisions_nothing(tmp_path: Path) -> None:
    runner = RecordingRunner()
    code, _ = suite(tmp_path, runner, quick=True)
    assert code == 0
    assert not any(call[0] == "bash" for call in runner.calls)
    assert pytest_calls(runner) == [[PY, "-m", "pytest", "-q", "-rfEs", "--durations=25", "-n", "2",
                                     "-m", UNIT_MARKS, report(tmp_path, "unit")]]
    assert runner.envs[-1] is not None and runner.envs[-1]["VLLMSTACK_TEST_FULL"] == "0"


def test_k_narrows_both_tiers_and_only_the_unit_tier_gets_workers(tmp_path: Path) -> None:
    runner = RecordingRunner()
    suite(tmp_path, runner, keyword="router and not sleep")
    unit, integration = pytest_calls(runner)
    for call in (unit, integration):
        assert call[call.index("-k") + 1] == "router and not sleep"
    assert unit[unit.index("-n") + 1] == "2"
    assert "-n" not in integration


def test_slow_adds_the_source_build_to_the_integration_tier_only(tmp_path: Path) -> None:
    runner = RecordingRunner()
    suite(tmp_path, runner, slow=True)
    unit, integration = pytest_calls(runner)
    assert marker_expression(unit) == UNIT_MARKS
    assert marker_expression(integration) == \
        "docker or slow or browser or real_engine or serial or source_build"
    quick = RecordingRunner()
    suite(tmp_path, quick, quick=True, slow=True)  # --quick wins: the source build needs Docker
    assert [marker_expression(c) for c in pytest_calls(quick)] == [UNIT_MARKS]


MARKERS = ("docker", "slow", "browser", "real_engine", "serial", "source_build")


def marked(marks: set[str]) -> Callable[..., bool]:
    """pytest's marker matcher for a test that carries `marks`."""
    def has(name: str, /, **_: object) -> bool:
        return name in marks
    return has


@pytest.mark.parametrize("slow", [False, True])
def test_the_tiers_split_the_tests_each_runs_once(slow: bool) -> None:
    """Every combination of markers: in exactly one tier, or none for the source build without
    --slow; an unmarked test in the unit tier."""
    unit, integration = Expression.compile(unit_expression()), Expression.compile(
        integration_expression(slow=slow))
    for n in range(len(MARKERS) + 1):
        for marks in itertools.combinations(MARKERS, n):
            tiers = [name for name, expr in (("unit", unit), ("integration", integration))
                     if expr.evaluate(marked(set(marks)))]
            if "source_build" in marks and not slow:
                assert tiers == [], marks
            elif marks:
                assert tiers == ["integration"], marks
            else:
                assert tiers == ["unit"], marks


# --- exit codes ------------------------------------------------------------------------------

def test_a_failing_unit_tier_is_the_exit_code_and_the_integration_tier_still_runs(
        tmp_path: Path) -> None:
    runner = RecordingRunner()
    runner.respond([PY, "-m", "pytest", "-q", "-rfEs", "--durations=25", "-n"], Result((), 1))
    code, lines = suite(tmp_path, runner)
    assert code == 1
    assert len(pytest_calls(runner)) == 2
    assert lines[-1].endswith("; first failure: unit (exit 1)")


def test_a_static_check_failure_stops_before_pytest(tmp_path: Path) -> None:
    runner = RecordingRunner()
    runner.respond([PY, "-m", "mypy"], Result((), 2))
    code, lines = suite(tmp_path, runner, quick=True)
    assert code == 2
    assert pytest_calls(runner) == []
    assert "; no tests ran; first failure: mypy (exit 2)" in lines[-1]


def test_a_failed_provisioning_stops_everything(tmp_path: Path) -> None:
    runner = RecordingRunner()
    runner.respond(["bash"], Result((), 3))
    code, lines = suite(tmp_path, runner)
    assert (code, len(runner.calls)) == (3, 1)
    assert lines[-1].endswith("; no tests ran; first failure: provision (exit 3)")


def test_no_tests_collected_fails_unless_k_left_only_one_tier_empty(tmp_path: Path) -> None:
    unit_prefix = [PY, "-m", "pytest", "-q", "-rfEs", "--durations=25", "-n"]
    runner = RecordingRunner()
    runner.respond(unit_prefix, Result((), 5))
    assert suite(tmp_path, runner)[0] == 1  # without -k an empty tier means a broken selection
    runner = RecordingRunner()
    runner.respond(unit_prefix, Result((), 5))
    assert suite(tmp_path, runner, keyword="docker_only")[0] == 0
    runner = RecordingRunner()
    runner.respond([PY, "-m", "pytest"], Result((), 5))
    code, lines = suite(tmp_path, runner, keyword="typo")
    assert code == 1 and lines[-1].endswith("; first failure: unit (exit 5)")
    runner = RecordingRunner()
    runner.respond([PY, "-m", "pytest"], Result((), 5))
    assert suite(tmp_path, runner, quick=True, keyword="typo")[0] == 1


# --- minutes and the summary line -----------------------------------------------------------

def test_read_counts_groups_skips_by_reason(tmp_path: Path) -> None:
    path = tmp_path / "unit.xml"
    path.write_text(JUNIT)
    counts = read_counts(path)
    assert (counts.tests, counts.passed, counts.failed, counts.errors, counts.skipped) == (8, 2, 1, 1, 4)
    assert counts.skip_reasons == {"fp8 KV on vLLM's CPU build needs AVX-512": 2,
                                   "no Docker engine": 1, "xfail: known bug": 1}


def test_each_step_prints_its_minutes_and_the_run_ends_with_one_summary_line(tmp_path: Path) -> None:
    now = [0.0]
    minutes = {"bash": 1.2, "ruff": 0.1, "mypy": 1.5, "importlinter": 0.3}

    def takes(step_minutes: float) -> Callable[[], None]:
        def advance() -> None:
            now[0] += step_minutes * 60
        return advance

    def step(argv: tuple[str, ...]) -> Result:
        name = next(key for key in minutes if any(key in word for word in argv))
        takes(minutes[name])()
        return Result(argv, 0)

    runner = RecordingRunner()
    runner.respond(["bash"], step)
    for _, argv in testsuite.static_steps(PY):
        runner.respond(argv, step)
    runner.respond([PY, "-m", "pytest", "-q", "-rfEs", "--durations=25", "-n"],
                   writes(JUNIT, code=1, then=takes(3.1)))
    runner.respond([PY, "-m", "pytest", "-q", "-rfEs", "--durations=25", "-m"],
                   writes(JUNIT_INTEGRATION, then=takes(25.2)))
    code, lines = suite(tmp_path, runner, clock=lambda: now[0])
    assert code == 1
    assert lines[:6] == ["invoke test: provision took 1.2 min (ok)", "invoke test: ruff took 0.1 min (ok)",
                         "invoke test: mypy took 1.5 min (ok)", "invoke test: lint-imports took 0.3 min (ok)",
                         "invoke test: unit took 3.1 min (exit 1)",
                         "invoke test: integration took 25.2 min (ok)"]
    assert lines[6:] == [
        "invoke test: 31.4 min (provision 1.2, static 1.9, unit 3.1, integration 25.2); "
        "10 tests: 3 passed, 1 failed, 1 error, 5 skipped "
        "(2 \"fp8 KV on vLLM's CPU build needs AVX-512\", 2 \"no Docker engine\", "
        "1 \"xfail: known bug\"); first failure: unit (exit 1)"]


def test_a_tier_without_a_report_is_named_and_a_stale_one_is_not_read(tmp_path: Path) -> None:
    stale = tmp_path / "generated" / "test-results" / "unit.xml"
    stale.parent.mkdir(parents=True)
    stale.write_text(JUNIT)  # a previous run's: the tier below dies before writing its own
    runner = RecordingRunner()
    runner.respond([PY, "-m", "pytest"], Result((), 2))
    code, lines = suite(tmp_path, runner, quick=True)
    assert code == 2
    assert lines[-1].endswith("; 0 tests: 0 passed, 0 failed, 0 errors, 0 skipped; "
                              "no JUnit report from unit; first failure: unit (exit 2)")
    assert not stale.exists()


def test_long_skip_reasons_are_shortened_to_keep_one_line(tmp_path: Path) -> None:
    reason = ("fp8 KV on vLLM's CPU build needs AVX-512 or AMX (avx512f, avx512vl, avx512bw,\n"
              "avx512dq; or amx_tile); this CPU has AVX2 (a CPU feature: no install provides it)")
    xml = JUNIT_INTEGRATION.replace("no Docker engine", reason)
    runner = RecordingRunner()
    runner.respond([PY, "-m", "pytest"], writes(xml))
    _, lines = suite(tmp_path, runner, quick=True)
    assert len(lines) == 5  # ruff, mypy, lint-imports, unit, and the summary: the reason's newline went
    assert lines[-1].endswith("1 skipped (1 \"fp8 KV on vLLM's CPU build needs AVX-512 or AMX "
                              "(avx512f, avx512vl,...\")")

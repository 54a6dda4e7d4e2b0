"""Every number a benchmark command takes is honoured or refused, never silently replaced.

`--runs 0`, `--duration 0` and `--margin 0` used to become the defaults. Now a bound is declared
with each option (vllmstack/bench/options.py) and checked where it is parsed; the probes' and
stability modes' `--param` settings are declared and checked the same way (bench/probes/params.py).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllmstack.bench import options
from vllmstack.bench.cli import _options, build_parser, main
from vllmstack.core.paths import Project

ROOT = Path(__file__).resolve().parents[1]
TARGET = ["--url", "http://127.0.0.1:9", "--model", "m"]


def run(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    out = io.StringIO()
    code = main(args, environ={}, project=Project(tmp_path), out=out)
    captured = capsys.readouterr()
    return code, out.getvalue() + captured.err + captured.out


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "--runs", "0"], "argument --runs: must be at least 1, got 0"),
    (["bench", "--pp", "512", "0"], "argument --pp: must be at least 1, got 0"),
    (["bench", "--tg", "-4"], "argument --tg: must be at least 1, got -4"),
    (["bench", "--timeout", "0"], "argument --timeout: must be more than 0, got 0"),
    (["bench", "--timeout", "nan"], "argument --timeout: must be a finite number, got 'nan'"),
    (["bench", "--max-num-seqs", "0"], "argument --max-num-seqs: must be at least 1, got 0"),
    (["depth", "--runs", "0"], "argument --runs: must be at least 1, got 0"),
    (["depth", "--margin", "-1"], "argument --margin: must be at least 0, got -1"),
    (["depth", "--depth", "0", "-1024"], "argument --depth: must be at least 0, got -1024"),
    (["conc", "--duration", "0"], "argument --duration: must be at least 0.1, got 0"),
    (["conc", "--duration", "1e-300"], "argument --duration: must be at least 0.1, got 1e-300"),
    (["bench", "--pp", "100000000"], "argument --pp: must be at most 1000000, got 100000000"),
    (["bench", "--pp", "1_000"], "argument --pp: must be a whole number, got '1_000'"),
    (["bench", "--timeout", "1e309"], "argument --timeout: must be a finite number"),
    (["conc", "--duration", "inf"], "argument --duration: must be a finite number, got 'inf'"),
    (["conc", "--concurrency", "0"], "argument --concurrency: must be at least 1, got 0"),
    (["probe", "itl-stall", "--timeout", "-1"], "argument --timeout: must be more than 0"),
    (["stability", "stress", "--workers", "0"], "argument --workers: must be at least 1, got 0"),
    (["stability", "stress", "--requests", "0"], "argument --requests: must be at least 1"),
    (["stability", "long", "--max-tokens", "0"], "argument --max-tokens: must be at least 1"),
    (["stability", "long", "--runs", "0"], "argument --runs: must be at least 1, got 0"),
    (["report", "--last", "0"], "argument --last: must be at least 1, got 0"),
    (["bench", "--runs", "two"], "argument --runs: must be a whole number, got 'two'"),
])
def test_out_of_range_numbers_are_refused_naming_the_flag(
        args: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    extra = TARGET if args[0] != "report" else []
    code, text = run([*args, *extra], tmp_path, capsys)
    assert code == 2
    assert message in text


@pytest.mark.parametrize(("args", "message", "fix"), [
    (["probe", "itl-stall", "-p", "victims=0"],
     "--param victims=0 for itl-stall: must be at least 1", None),
    (["probe", "itl-stall", "-p", "victims=true"],
     "--param victims=True for itl-stall: needs a whole number", None),
    (["probe", "itl-stall", "-p", "max_choke=abc"], "needs a number", None),
    (["probe", "prefix-cache", "-p", "min_reuse=0"], "must be more than 0", None),
    (["probe", "prefix-cache", "-p", "min_reuse=1.5"], "must be at most 1", None),
    (["probe", "itl-stall", "-p", "victim=3"], "--param victim: itl-stall has no such setting",
     "use one of: victims, bully_tokens"),
    (["stability", "smoke", "-p", "workers=2"], "smoke has no such setting",
     "smoke takes no --param"),
    (["stability", "long", "-p", "max_repeat_share=2"], "must be at most 1", None),
])
def test_probe_and_stability_settings_are_checked_before_anything_is_sent(
        args: list[str], message: str, fix: str | None, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run([*args, *TARGET], tmp_path, capsys)
    assert code == 2, text
    assert message in text
    if fix:
        assert fix in text
    assert "cannot reach" not in text  # refused before connecting


def test_legal_zeros_are_kept_not_replaced_by_defaults() -> None:
    parser = build_parser()
    depth = _options(parser.parse_args(["depth", "--margin", "0", "--depth", "0", "4096",
                                        "--seed", "0"]))
    assert (depth.margin, depth.depths, depth.seed) == (0, [0, 4096], 0)
    conc = _options(parser.parse_args(["conc", "--duration", "0.5", "--concurrency", "1"]))
    assert conc.duration_s == 0.5 and conc.concurrency == [1]


def test_every_request_making_task_offers_timeout() -> None:
    for name in ("bench", "bench-depth", "bench-conc", "probe", "stability"):
        cmd = options.command(name)
        assert "timeout" in [o.name for o in cmd.task_options], name
        assert "keep-alive comments, trickled bytes" in options.TIMEOUT.help
    assert "timeout" not in [o.name for o in options.command("report").options]


def test_invoke_refuses_a_zero_with_the_declared_bound_not_the_default() -> None:
    # tasks.py used to turn --runs 0 into the default; the value must arrive and be refused,
    # by the same declaration, in the tasks' error/fix format (exit 1).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT), "bench",
                           "--runs", "0", *TARGET], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 1
    error, fix = done.stderr.splitlines()[-2:]
    assert error == "error: --runs '0' must be at least 1, got 0"
    assert fix.startswith("fix:") and "--runs a whole number of at least 1" in fix

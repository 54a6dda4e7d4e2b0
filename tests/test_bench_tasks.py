"""The invoke tasks are thin: the documented command lines reach the same CLI entry."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_tasks
from invoke.tasks import Task
from simulator.fixture import run_simulator

from vllmstack.bench import options
from vllmstack.bench.cli import build_parser
from vllmstack.workload.selftest_tokenizer import train_corpus_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT), *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_benchmark_tasks_are_listed() -> None:
    listing = invoke("--list").stdout
    for name in ("bench", "bench-depth", "bench-conc", "probe", "stability", "report"):
        assert f"  {name} " in listing


def test_invoke_bench_json_contract(tmp_path: Path) -> None:
    tokenizer = train_corpus_tokenizer(tmp_path / "tokenizer.json")
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "10", "SIM_ITL_MS": "2",
           "SIM_TOKENIZER": str(tokenizer)}
    with run_simulator(env=env, argv=["--served-model-name", "sim"]) as sim:
        done = invoke("bench", "--url", sim.url, "--model", "sim", "--tokenizer", str(tokenizer),
                      "--pp", "512", "--tg", "32", "--runs", "2", "--json",
                      "--history-dir", str(tmp_path / "hist"))
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        (row,) = data["results"]
        assert (row["pp"], row["tg"], row["depth"], row["concurrency"]) == (512, 32, 0, 1)
        for key in ("ttft_ms", "tg_tps", "itl_ms"):
            assert {"mean", "p50", "p90", "p99"} <= set(row[key])
        assert {"mean", "std", "min", "max"} <= set(row["pp_tps"])
        failed = invoke("probe", "no-such-probe", "--url", sim.url, "--model", "sim")
        assert failed.returncode == 1
        error, fix = failed.stderr.splitlines()[-2:]
        assert error.startswith("error: NAME 'no-such-probe' is not one of depth-decay, itl-stall, ")
        assert fix.startswith("fix:")


@pytest.mark.parametrize("args", [["stability", "--help"], ["probe", "--help"],
                                  ["report", "--help"]])
def test_task_help_renders(args: list[str]) -> None:
    assert invoke(*args).returncode == 0


def subparser(name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser: argparse.ArgumentParser = sub.choices[name]
    return parser


BENCH_TASKS = ["bench", "bench-depth", "bench-conc", "probe", "stability", "report"]


@pytest.mark.parametrize("task_name", BENCH_TASKS)
def test_task_and_parser_list_the_same_options_and_defaults(task_name: str) -> None:
    cmd = options.command(task_name)
    task = next(t for t in vars(load_tasks()).values()
                if isinstance(t, Task) and t.name == task_name)
    task_args = {a.name: a for a in task.get_arguments()}
    actions = {a.dest: a for a in subparser(cmd.name)._actions if a.dest != "help"}
    # The task offers the parser's options except those declared for `python -m` only...
    assert set(actions) - set(task_args) == {o.name for o in cmd.options if not o.task}
    assert set(task_args) <= set(actions)
    for name, arg in task_args.items():
        # ...with the same help, which names the parser's default...
        assert arg.help == actions[name].help, name
        # ...and no default of its own: the task hands on only what the user gave.
        assert arg.default in (None, False, []), name
        assert "h" not in arg.nicknames  # -h is help
    for opt in cmd.options:
        declared = list(opt.default) if isinstance(opt.default, tuple) else opt.default
        assert actions[opt.name].default == (False if opt.flag else declared), opt.name
        if opt.default not in (None, False, (), "") and "default" not in opt.help:
            assert "(default: " in actions[opt.name].help, opt.name


def test_bench_depth_runs_default_is_what_the_task_always_ran() -> None:
    # The task passed --runs 2 explicitly while the parser said 3; 2 is what users got.
    assert build_parser().parse_args(["depth"]).runs == 2
    assert build_parser().parse_args(["bench-depth"]).runs == 2
    assert build_parser().parse_args(["bench"]).runs == 3
    assert "(default: 2)" in invoke("bench-depth", "--help").stdout


def test_task_hands_on_only_the_options_given() -> None:
    depth = options.command("bench-depth")
    given = {o.name: None for o in depth.task_options}
    given.update(json=False, pp=4096, depth=["0", "1024"], set=["A=1", "B=2"], runs=0)
    assert options.task_argv(depth, given) == [
        "depth", "--pp", "4096", "--runs=0", "--depth", "0", "1024",
        "--set=A=1", "--set=B=2"]
    probe = options.command("probe")
    assert options.task_argv(probe, {"name": "itl-stall", "param": ["victims=3"], "json": True,
                                     "url": ""}) == [
        "probe", "itl-stall", "--param=victims=3", "--json"]
    assert options.task_argv(options.command("report"), {"kind": []}) == ["report"]

"""Every option of every task arrives typed and checked (issue 22, item 4; issue 28's ranges).

Each task's options go through invoke's own parser with the values a hostile or careless user
gives: a negative, NaN, an infinity, a float beyond float64, a port beyond 65535, 0, a
300-character name, an empty string, other scripts' digits. Each one is either refused while
invoke parses, with exactly an `error:` and a `fix:` line (invoke prints them and exits 1), or
arrives as a value inside its option's declared range. A sample runs as a user runs it.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, load_tasks
from invoke.exceptions import ParseError
from invoke.parser.context import ParserContext
from invoke.parser.parser import Parser
from invoke.tasks import Task

from vllmstack.bench import options as bench_options
from vllmstack.bench.cli import build_parser
from vllmstack.cli.values import MAX_SECONDS, MAX_TEXT, declared, shown
from vllmstack.config.envfiles import NAME_MAX

EDGE_VALUES = ["-1", "nan", "inf", "-inf", "1e309", "70000", "0", "x" * 300, "", "٣", "1_000",
               "1e-300", "a\x00b"]
# The first positional value of the tasks that need one, so their options can be parsed at all:
# a value the task takes, or every case of its options is refused for the positional instead
# (issue 33: a placeholder KIND 'x' refused all of tune's; test_every_placeholder_is_taken).
POSITIONAL = {"probe": "itl-stall", "stability": "smoke", "import_env": "old.env",
              "gguf_convert": "/models/tiny", "tune": "moe"}
BENCH_TASKS = {cmd.task: cmd for cmd in bench_options.COMMANDS}
# Options whose value is a profile or layer name (the bench tasks' --model is a served name).
NAMES = {"model", "platform", "name", "extends"}
PATHS = {"file", "out", "model_dir", "wheels", "python", "tokenizer", "template"}


def all_tasks() -> dict[str, Task[Any]]:
    return {t.name: t for t in vars(load_tasks()).values() if isinstance(t, Task)}


TASKS = all_tasks()


def parse(task_name: str, argv: list[str], positional: bool = False) -> dict[str, Any]:
    """invoke's parser over a fresh copy of the task's arguments: {name: value}."""
    task = TASKS[task_name]
    context = ParserContext(name=task.name, aliases=task.aliases, args=task.get_arguments())
    needs = any(a.positional for a in task.get_arguments())
    first = [POSITIONAL[task_name]] if needs and not positional else []
    (parsed,) = Parser(contexts=[context]).parse_argv([task.name, *first, *argv])
    return {name.replace("-", "_"): arg.value for name, arg in parsed.args.items()}


def flag(opt: str) -> str:
    return f"-{opt}" if len(opt) == 1 else f"--{opt.replace('_', '-')}"


def options_of(task: Task[Any]) -> list[tuple[str, Any, bool]]:
    """(name, invoke kind, positional) of every option that takes a value."""
    return [(a.name or "", a.kind, a.positional) for a in task.get_arguments() if a.kind is not bool]


# A positional word that starts with "-" is a flag to invoke, as to any command line (a file of
# that name is given as ./-1): invoke's own "No idea what '-1' is!" answers it.
CASES = [(name, opt, positional, value) for name, task in sorted(TASKS.items())
         for opt, _, positional in options_of(task) for value in EDGE_VALUES
         if not (positional and value.startswith("-"))]


def test_every_option_of_every_task_declares_what_it_holds() -> None:
    undeclared = [f"{name} --{opt}" for name, task in TASKS.items()
                  for opt, _, _ in options_of(task)
                  if name not in BENCH_TASKS and not declared(opt, getattr(task, "values", {}))]
    assert not undeclared, "add a Value for these in vllmstack/cli/values.py (OPTIONS) or " \
                           "the task's stack_task(values=...): " + ", ".join(undeclared)
    assert len(TASKS) >= 30 and len(CASES) > 1000


def test_every_placeholder_is_taken() -> None:
    needing = {name for name, task in TASKS.items() if any(a.positional for a in task.get_arguments())}
    assert needing == set(POSITIONAL), "give each task with a positional argument a valid one"
    for name in sorted(needing):
        parse(name, [])  # ParseError: the placeholder itself is refused


def assert_refusal(message: str) -> None:
    lines = message.splitlines()
    assert len(lines) == 2, message
    assert lines[0].startswith("error: ") and lines[1].startswith("fix:"), message
    assert "Traceback" not in message and "\x00" not in message
    assert len(lines[0]) < 300  # a 300-character value is quoted cut short, not in full


def assert_names_the_option(message: str, opt: str, positional: bool, value: str) -> None:
    """The refusal is of the option under test and of its value, not of another argument."""
    label = opt.replace("_", "-").upper() if positional else flag(opt)  # as CheckedArgument says
    assert message.startswith(f"error: {label} {shown(value)} "), (opt, value, message)


def assert_in_range(task: str, opt: str, value: Any) -> None:
    if isinstance(value, list):
        for item in value:
            assert_in_range(task, opt, item)
        return
    if task in BENCH_TASKS:  # handed on as text: the bench parser must accept it the same way
        assert isinstance(value, str)
        cmd = BENCH_TASKS[task]
        given = {opt: [value] if opt in ("pp", "tg", "depth", "concurrency", "kind", "set", "param")
                 else value}
        if task in POSITIONAL and opt not in ("name", "mode"):
            given[next(o.name for o in cmd.options if o.positional)] = POSITIONAL[task]
        # The argv the task hands on, read by `python -m vllmstack.bench`'s parser.
        build_parser().parse_args(bench_options.task_argv(cmd, given))  # SystemExit: disagreed
        return
    if isinstance(value, float):
        assert math.isfinite(value) and 0 <= value <= MAX_SECONDS, (task, opt, value)
    elif isinstance(value, int) and not isinstance(value, bool):
        assert value >= 0, (task, opt, value)
        if opt == "port":
            assert 1 <= value <= 65535
    elif isinstance(value, str):
        assert len(value) <= MAX_TEXT and "\x00" not in value
        if opt in NAMES:
            assert value and all(len(p.encode()) <= NAME_MAX - 4 for p in value.split("/"))
        if opt in PATHS:
            assert value and all(len(p.encode()) <= NAME_MAX for p in value.split("/")), opt
        if opt == "target":  # ENGINE:PROFILE (bench-vs) or a Dockerfile stage (build)
            assert value and len(value.partition(":")[2].encode()) <= NAME_MAX - 4


@pytest.mark.parametrize(("task", "opt", "positional", "value"), CASES,
                         ids=[f"{t}-{o}-{v[:8]!r}" for t, o, _, v in CASES])
def test_an_edge_value_is_refused_in_the_format_or_arrives_in_range(
        task: str, opt: str, positional: bool, value: str) -> None:
    argv = [value] if positional else [flag(opt), value]
    try:
        parsed = parse(task, argv, positional)
    except ParseError as exc:
        assert_refusal(str(exc))
        assert_names_the_option(str(exc), opt, positional, value)
        return
    except SystemExit as exc:  # only the bench parser's agreement check can exit
        pytest.fail(f"{task} accepted {value!r} for {opt}, which its parser refuses ({exc})")
    assert_in_range(task, opt, parsed[opt])


@pytest.mark.parametrize(("task", "opt", "value"), [
    ("logs", "tail", "-1"), ("down", "timeout", "nan"), ("up", "timeout", "inf"),
    ("up", "timeout", "1e309"), ("down", "timeout", "-5"), ("dashboard", "port", "70000"),
    ("dashboard", "port", "0"), ("router", "port", "70000"), ("router", "ttl", "nan"),
    ("router", "load_timeout", "-1"), ("router", "drain_timeout", "inf"),
    ("check", "model", "m" * 300), ("config", "platform", "p" * 300), ("config", "set", "=V"),
    ("config", "set", "KEY"), ("bench", "pp", "100000000"), ("bench-conc", "duration", "1e-300"),
    ("bench", "timeout", "nan"), ("burn", "runs", "0"), ("burn", "warmup", "-1"),
    ("bench_vs", "ctx", "inf"), ("bench_vs", "concurrency", "0"), ("install_engine", "jobs", "-3"),
    ("gpu_check", "runtime", "bogus"), ("logs", "service", "x"), ("stability", "workers", "٣"),
    ("tune", "workers", "-1"), ("tune", "budget_min", "nan"), ("tune", "tp", "65"),
])
def test_a_bad_value_is_refused_before_the_task_runs(task: str, opt: str, value: str) -> None:
    with pytest.raises(ParseError) as caught:
        parse(task, [flag(opt), value])
    assert_refusal(str(caught.value))
    assert flag(opt) in str(caught.value)


def test_good_values_arrive_typed() -> None:
    assert parse("logs", ["--tail", "50"])["tail"] == 50
    assert parse("down", ["--timeout", "2.5"])["timeout"] == 2.5
    assert parse("up", ["--timeout", "90"])["timeout"] == 90.0  # declared without a default
    assert parse("router", ["--ttl", "600"])["ttl"] == 600.0  # the README's own example
    assert parse("router", ["--port", "8081", "--drain-timeout", "0"])["port"] == 8081
    assert parse("dashboard", ["--port", "8090"])["port"] == "8090"  # a text setting there
    assert parse("config", ["--set", "A=1", "--set", "B="])["set"] == ["A=1", "B="]
    assert parse("bench", ["--pp", "512", "--pp", "1024"])["pp"] == ["512", "1024"]
    assert parse("bench-conc", ["--duration", "0.5"])["duration"] == "0.5"
    assert parse("tune", ["--workers", "0"])["workers"] == 0  # compile as it times, no pool
    assert parse("tune", [])["workers"] is None  # left out: the plan's cores - 2


def invoke(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=cwd, text=True,
                          capture_output=True, check=False, timeout=120)


@pytest.mark.parametrize("args", [
    ["logs", "--tail", "abc"], ["down", "--timeout", "nan"], ["dashboard", "--port", "70000"],
    ["check", "--model", "x" * 300], ["config", "--set", "=V"], ["bench", "--pp", "-1"],
    ["router", "--ttl", "-1"], ["bench-vs", "--ctx", "1e309"], ["import-env", "y" * 300],
])
def test_as_a_user_runs_it_the_last_lines_are_error_and_fix_and_it_exits_1(
        args: list[str]) -> None:
    done = invoke(*args)
    assert done.returncode == 1, done
    lines = done.stderr.splitlines()
    assert lines[-2].startswith("error: ") and lines[-1].startswith("fix:"), done.stderr
    assert "Traceback" not in done.stderr


def test_help_still_shows_the_value_kinds() -> None:
    done = invoke("logs", "--help")
    assert done.returncode == 0 and "--tail=INT" in done.stdout
    assert invoke("dashboard", "--help").stdout.count("--port=STRING") == 1


def test_an_argparse_type_error_is_a_value_problem() -> None:
    # The bench options' own parse() raises argparse's error; the task turns it into the format.
    with pytest.raises(argparse.ArgumentTypeError, match="at most 1000000"):
        bench_options.PP.parse("1000001")

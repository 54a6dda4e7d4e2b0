"""invoke tasks the stack's way: one decorator from an error to an exit, `-h` is always help.

`tasks.py` declares every task with `stack_task`; the benchmark tasks are generated from their
option declarations (vllmstack/bench/options.py), so the options exist once.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

from invoke.context import Context
from invoke.exceptions import Exit, ParseError
from invoke.parser.argument import Argument
from invoke.tasks import Task

from vllmstack.bench import options as bench_options
from vllmstack.cli.values import Value, ValueProblemError, check_text, value_of
from vllmstack.core.errors import StackError


class CheckedArgument(Argument):
    """invoke's Argument, whose text becomes its value through the option's `Value`: a bad one is
    invoke's ParseError carrying `error:` / `fix:`, which invoke prints before it exits 1."""

    def __init__(self, value: Value, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checked = value

    def set_value(self, value: Any, cast: bool = True) -> None:
        # A positional takes `-h` as its value; the task body shows help for it (stack_task).
        if cast and not self.incrementable and not (self.positional and value in HELP_WORDS):
            name = self.names[0]
            flag = name.upper() if self.positional else (
                "-" if len(name) == 1 else "--") + name.replace("_", "-")
            try:
                value = self.checked.check(flag, value)
            except StackError as exc:
                raise ParseError(exc.render()) from None
            if self.kind is not list:  # checked and converted: invoke's cast would redo it
                self.raw_value, self._value = value, value
                return
        super().set_value(value, cast=cast)


class StackTask(Task[Any]):
    """invoke's Task, keeping `-h` for help and taking value kinds from a declaration."""

    def __init__(self, body: Callable[..., Any], *, kinds: dict[str, type] | None = None,
                 values: dict[str, Value] | None = None, **kwargs: Any) -> None:
        self.kinds = kinds or {}
        self.values = values or {}
        # invoke pops each help text as it builds the parser; `render_help` needs them later.
        self.help_texts: dict[str, str] = dict(kwargs.get("help") or {})
        super().__init__(body, **kwargs)

    def arg_opts(self, name: str, default: Any, taken_names: set[str]) -> dict[str, Any]:
        opts: dict[str, Any] = super().arg_opts(name, default, taken_names)
        # invoke gives each option the first free letter of its name as a short flag, which made
        # `invoke bench -h` mean --history-dir; -h is help on every task instead.
        opts["names"] = [n for n in opts["names"] if n != "h"]
        if name in self.kinds:  # an option defaulting to None would otherwise be parsed as text
            opts["kind"] = self.kinds[name]
        return opts

    def get_arguments(self, ignore_unknown_help: bool | None = None) -> list[Argument]:
        """invoke's arguments; each that takes a value is checked by its declared `Value` (one
        declared nowhere gets its kind's bare check, and tests/test_cli_values.py names it)."""
        out: list[Argument] = []
        for arg in super().get_arguments(ignore_unknown_help):
            if arg.kind is bool:  # a switch takes no value
                out.append(arg)
                continue
            value = value_of(arg.name or "", self.values, arg.kind)
            out.append(CheckedArgument(value, names=arg.names, kind=arg.kind, default=arg.default,
                                       help=arg.help, positional=arg.positional,
                                       optional=arg.optional, incrementable=arg.incrementable,
                                       attr_name=arg.attr_name))
        return out


def stack_task(*, errors: tuple[type[BaseException], ...] = (),
               **kwargs: Any) -> Callable[[Callable[..., Any]], StackTask]:
    """invoke's `@task(**kwargs)`; the stack's errors (and `errors`) exit 1 with their message."""
    caught: tuple[type[BaseException], ...] = (StackError, *errors)

    def wrap(fn: Callable[..., Any]) -> StackTask:
        @functools.wraps(fn)  # invoke reads the options from fn's signature through this
        def body(c: Context, *args: Any, **kw: Any) -> Any:
            # A task with a positional argument takes `-h` as its value (`invoke import-env -h`
            # looked for a file named -h); it is help there too.
            if HELP_WORDS & {v for v in (*args, *kw.values()) if isinstance(v, str)}:
                print(render_help(task))
                return None
            try:
                return fn(c, *args, **kw)
            except caught as exc:
                sys.stdout.flush()  # what the task printed comes before the error
                # One failure format: error, then fix, last (issue 23), also for an error that
                # names no fix of its own and for the plain errors a task lets through.
                cause = exc.cause if isinstance(exc, StackError) else str(exc)
                fix = exc.fix if isinstance(exc, StackError) and exc.fix else (
                    f"see `invoke {task.name.replace('_', '-')} --help`, and the lines above")
                details = exc.details if isinstance(exc, StackError) else []
                print(StackError(cause, fix, details).render(), file=sys.stderr)
                raise Exit(code=1) from exc

        task = StackTask(body, **kwargs)
        return task

    return wrap


HELP_WORDS = {"-h", "--help"}


def render_help(task: StackTask) -> str:
    """invoke's own help layout, for the tasks where invoke cannot print it (see above)."""
    args = task.get_arguments()
    positional = " ".join(f"[<{a.name}>]" for a in args if a.positional)
    lines = [f"Usage: inv[oke] [--core-opts] {task.name.replace('_', '-')} [--options] {positional}".rstrip(),
             "", "Docstring:", f"  {(task.__doc__ or '').strip()}", "", "Options:"]
    for arg in args:
        names = ", ".join(("-" if len(n) == 1 else "--") + n.replace("_", "-") for n in arg.names)
        lines.append(f"  {names:<28} {task.help_texts.get(arg.name or '', '')}".rstrip())
    return "\n".join(lines)


def exit_with(code: int) -> None:
    """End with a result's exit code (a failed check, a probe's verdict), printed output intact."""
    if code:
        raise Exit(code=code)


def bench_task(name: str) -> StackTask:
    """The invoke task of one bench command (bench, bench-depth, ..., report)."""
    cmd = bench_options.command(name)

    def body(c: Context, **values: Any) -> None:
        from vllmstack.bench.cli import run

        exit_with(run(bench_options.task_argv(cmd, values)))  # its StackError: stack_task's

    body.__signature__ = cmd.task_signature()  # type: ignore[attr-defined]  # invoke reads it
    body.__name__, body.__doc__ = cmd.task.replace("-", "_"), cmd.doc
    values = {opt.name: bench_value(opt) for opt in cmd.task_options if not opt.flag}
    return stack_task(name=cmd.task, values=values, **cmd.task_settings())(body)


def bench_value(opt: bench_options.Option) -> Value:
    """A bench option's Value: its own declaration (bounds, choices) checks the text, which the
    task then hands on as text to the same parser `python -m vllmstack.bench` uses."""

    def convert(text: str) -> Any:
        check_text(text)
        if opt.choices is not None and text not in opt.choices():
            raise ValueProblemError(f"is not one of {', '.join(opt.choices())}")
        try:
            return opt.parse(text)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueProblemError(str(exc)) from None

    example = str(opt.default[0] if isinstance(opt.default, tuple) and opt.default else
                  opt.default if opt.default not in (None, "") else "VALUE")
    if opt.choices is not None:
        example = next(iter(opt.choices()), example)
    return Value(opt.hint, example, convert, keep_text=True)

"""invoke tasks the stack's way: one decorator from an error to an exit, `-h` is always help.

`tasks.py` declares every task with `stack_task`; the benchmark tasks are generated from their
option declarations (vllmstack/bench/options.py), so the options exist once.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import Task

from vllmstack.bench import options as bench_options
from vllmstack.core.errors import StackError


class StackTask(Task[Any]):
    """invoke's Task, keeping `-h` for help and taking value kinds from a declaration."""

    def __init__(self, body: Callable[..., Any], *, kinds: dict[str, type] | None = None,
                 **kwargs: Any) -> None:
        self.kinds = kinds or {}
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
                print(exc.render() if isinstance(exc, StackError) else f"error: {exc}",
                      file=sys.stderr)
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
        from vllmstack.bench.cli import main

        exit_with(main(bench_options.task_argv(cmd, values)))

    body.__signature__ = cmd.task_signature()  # type: ignore[attr-defined]  # invoke reads it
    body.__name__, body.__doc__ = cmd.task.replace("-", "_"), cmd.doc
    return stack_task(name=cmd.task, **cmd.task_settings())(body)

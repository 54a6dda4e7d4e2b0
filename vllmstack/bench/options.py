"""Every option of the benchmark commands, declared once.

`python -m vllmstack.bench` (and so the dashboard) builds its argparse parser from these
declarations, and tasks.py builds the invoke tasks (`invoke bench`, `bench-depth`, `bench-conc`,
`probe`, `stability`, `report`) from the same ones. Declared twice, they had drifted (bench-depth's
--runs defaulted to 2 in the task and 3 in the parser); now an invoke task hands over only the
options the user gave, so every default lives here and nowhere else.

Some options exist only for `python -m vllmstack.bench` (`task=False`): the invoke tasks keep the
flags they always had.

Numbers are checked where they are parsed: every bound is declared here (`minimum`, `above`) and a
value outside it -- `--runs 0`, `--duration 0`, `--timeout nan`, `--margin -1` -- is an argparse
error naming the flag. Nothing is silently replaced by its default: an invoke task hands a 0 on
as 0, and 0 is either a legal value (`--margin 0`, `--depth 0`) or refused.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from vllmstack.bench.report.history import KINDS
from vllmstack.workload.ladders import DEFAULT_MARGIN

TARGET = "target (default: the running stack from the profile)"
WHOLE = re.compile(r"[+-]?[0-9]+")
# The longest prompt, answer or context depth a command builds: the dashboard's bound too. The
# server's own max_model_len is checked before any prompt is built; this bounds the memory of a
# server that reports none (--pp 100000000 grew the client to 21.8 GB).
MAX_TOKENS = 1_000_000
# A week: longer waits overflow an event loop's timer, and no measurement needs one.
MAX_SECONDS = 7 * 24 * 3600.0
MAX_STREAMS = 65536  # concurrent requests, workers, max_num_seqs
MAX_RUNS = 10_000


def param_pair(text: str) -> tuple[str, Any]:
    """KEY=VALUE of --param; the value is JSON when it parses as JSON (3, true), else text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text[:60]!r}")
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return key.replace("-", "_"), parsed


def _number(value: float) -> str:
    """1000000, not 1e+06: a bound as a person types it."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _probe_names() -> list[str]:
    # Deferred: the probes module is only needed to parse, not to list the invoke tasks.
    from vllmstack.bench.probes.probes import PROBES

    return sorted(PROBES)


def _stability_modes() -> Sequence[str]:
    from vllmstack.bench.probes.stability import MODES

    return MODES


@dataclass(frozen=True)
class Option:
    """One option of one command; `name` is the attribute, the flag is --name with dashes."""

    name: str
    help: str
    value_type: Callable[[str], Any] = str  # what argparse converts each value with
    default: Any = None
    # "values": one flag takes several values (`--pp 512 1024`); "flags": the flag repeats
    # (`--set A=1 --set B=2`). An invoke task repeats the flag either way and forwards the values.
    repeat: Literal["values", "flags"] | None = None
    flag: bool = False  # a switch: present or absent
    positional: bool = False
    choices: Callable[[], Sequence[str]] | None = None  # a function: some live in heavy modules
    short: str | None = None  # argparse only; invoke gives its tasks short flags of its own
    metavar: str | None = None
    group: str | None = None  # argparse help section
    task: bool = True  # False: `python -m vllmstack.bench` only, not offered by the invoke task
    task_single: bool = False  # the invoke task takes one value (the run uses only the first)
    minimum: float | None = None  # numbers: the smallest value allowed...
    above: bool = False  # ...or, when set, the value it must exceed
    maximum: float | None = None  # numbers: the largest value allowed

    def parse(self, text: str) -> Any:
        """argparse's type: convert, then refuse what is not finite or is out of bounds."""
        if self.value_type is int and not WHOLE.fullmatch(text.strip()):
            # int() also reads "1_000" and other scripts' digits; a person types 0-9.
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text[:60]!r}")
        try:
            value = self.value_type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text[:60]!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        low, high = self.minimum, self.maximum
        if low is not None and isinstance(value, int | float) and (
                value < low or (self.above and value == low)):
            need = "more than" if self.above else "at least"
            raise argparse.ArgumentTypeError(f"must be {need} {low:g}, got {text}")
        if high is not None and isinstance(value, int | float) and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {_number(high)}, got {text}")
        return value

    @property
    def hint(self) -> str:
        """What a value of this option is, for a fix line: "a whole number from 1 to 1000000"."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices())
        kind = ("a whole number" if self.value_type is int else
                "a number" if self.value_type is float else None)
        if kind is None:
            return "KEY=VALUE" if self.metavar == "KEY=VALUE" else "a value"
        parts = [kind]
        if self.minimum is not None:
            parts.append(f"{'above' if self.above else 'of at least'} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"at most {_number(self.maximum)}")
        return " ".join(parts[:2]) + (f", {parts[2]}" if len(parts) > 2 else "")

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def help_text(self) -> str:
        """The help both parsers print: the declared default is spelled out where it is a value."""
        if self.default in (None, False, (), "") or "default" in self.help:
            return self.help
        shown = self.default
        if isinstance(shown, tuple):
            shown = " ".join(map(str, shown))
        return f"{self.help} (default: {shown})"

    @property
    def task_kind(self) -> type:
        """What invoke parses the task's value as (the argparse type decides the rest)."""
        if self.flag:
            return bool
        if self.repeat and not self.task_single:
            return list
        if self.value_type is int:
            return int
        if self.value_type is float:
            return float
        return str


@dataclass(frozen=True)
class Command:
    """A `python -m vllmstack.bench` subcommand and the invoke task that runs it."""

    name: str
    task: str
    doc: str  # the task's docstring (`invoke --list`) and the subcommand's help
    options: tuple[Option, ...]
    aliases: tuple[str, ...] = ()

    @property
    def task_options(self) -> list[Option]:
        return [o for o in self.options if o.task]

    def task_signature(self) -> inspect.Signature:
        """The invoke task's parameters: the context, then every option, None unless given."""
        params = [inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        for opt in self.task_options:
            default = inspect.Parameter.empty if opt.positional else (False if opt.flag else None)
            params.append(inspect.Parameter(opt.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            default=default))
        return inspect.Signature(params)

    def task_settings(self) -> dict[str, Any]:
        """The invoke task's help, positional and iterable options, and value kinds."""
        kinds = {o.name: o.task_kind for o in self.task_options}
        return {
            "help": {o.name: o.help_text for o in self.task_options},
            "positional": [o.name for o in self.task_options if o.positional],
            "iterable": [name for name, kind in kinds.items() if kind is list],
            "kinds": {name: kind for name, kind in kinds.items() if kind in (int, float)},
        }


URL = Option("url", "OpenAI-compatible server root, e.g. http://127.0.0.1:8000 "
             "(default: the running stack)", group=TARGET)
MODEL = Option("model", "served model name (default: VLLM_SERVED_NAME of the profile)",
               group=TARGET)
TOKENIZER = Option("tokenizer", "tokenizer.json, model folder or cached HF id "
                   "(default: VLLM_TOKENIZER); never downloaded", group=TARGET)
API_KEY = Option("api_key", "Bearer token (default: $VLLM_API_KEY)", group=TARGET, task=False)
MAX_NUM_SEQS = Option("max_num_seqs", "the server's max_num_seqs: top of the concurrency "
                      "ladder, load of the probes (default: VLLM_MAX_NUM_SEQS)", value_type=int,
                      group=TARGET, task=False, minimum=1, maximum=MAX_STREAMS)
PROFILE = Option("profile", "model profile when targeting the stack (env/models/NAME.env)",
                 group=TARGET)
PLATFORM = Option("platform", "platform layer when targeting the stack", group=TARGET)
SET = Option("set", "profile override KEY=VALUE, repeatable", repeat="flags", default=(),
             metavar="KEY=VALUE", group=TARGET)
TIMEOUT = Option("timeout", "total seconds per request, start to last byte; a server that keeps "
                 "the connection busy (keep-alive comments, trickled bytes) cannot extend it",
                 value_type=float, default=600.0, group=TARGET, minimum=0, above=True,
                 maximum=MAX_SECONDS)
HISTORY_DIR = Option("history_dir", "history folder (default: results/)", value_type=Path)
NO_HISTORY = Option("no_history", "do not append to history", flag=True, task=False)
JSON = Option("json", "print one JSON document on stdout (progress goes to stderr)", flag=True)

PP = Option("pp", "prompt tokens, repeatable", value_type=int, default=(2048,), repeat="values",
            minimum=1, maximum=MAX_TOKENS)
TG = Option("tg", "generated tokens, repeatable", value_type=int, default=(128,), repeat="values",
            minimum=1, maximum=MAX_TOKENS)
# depth and conc measure one shape: they use the first value, and their tasks take one.
PP_ONE = replace(PP, help="prompt tokens", task_single=True)
TG_ONE = replace(TG, help="generated tokens", task_single=True)
RUNS = Option("runs", "measured runs per cell", value_type=int, default=3, minimum=1,
              maximum=MAX_RUNS)
NO_WARMUP = Option("no_warmup", "skip the warm-up request", flag=True, task=False)
EXTRA_BODY = Option("extra_body", "JSON object merged into every request", default="{}")
SEED = Option("seed", "prompt text position seed", value_type=int, default=0, task=False,
              minimum=0, maximum=2**63 - 1)
# At least 0.1 s: a shorter level sends nothing (--duration 1e-300 ran 0 requests and "passed").
DURATION = Option("duration", "closed-loop seconds per level", value_type=float, default=30.0,
                  minimum=0.1, maximum=MAX_SECONDS)
# Accepted by every run kind, so one option set starts any of them (the dashboard relies on it).
UNUSED_DURATION = replace(DURATION, help="used by conc only; accepted so every run kind takes "
                          "the same options", task=False)
PARAM = Option("param", "setting KEY=VALUE, repeatable", value_type=param_pair, repeat="flags",
               default=(), short="-p", metavar="KEY=VALUE")

TARGET_OPTIONS = (URL, MODEL, TOKENIZER, API_KEY, MAX_NUM_SEQS)
# --timeout comes last: invoke gives short flags in parameter order, and the flags the tasks had
# before it was offered there (-j for --json, ...) stay as they were.
PROFILE_OPTIONS = (PROFILE, PLATFORM, SET, HISTORY_DIR, NO_HISTORY, JSON, TIMEOUT)

# The order of each tuple is the order of the task's parameters, from which invoke derives the
# tasks' short flags (-u, -m, -t, ...): reordering would change them.
COMMANDS = (
    Command("bench", "bench",
            "pp/tg matrix at concurrency 1: TTFT, pp t/s, decode t/s, ITL p50/p90/p99, mean ± spread.",
            (*TARGET_OPTIONS, PP, TG, RUNS, NO_WARMUP, EXTRA_BODY, SEED, UNUSED_DURATION,
             *PROFILE_OPTIONS)),
    Command("depth", "bench-depth",
            "Decode and prefill speed over a context-depth ladder (powers of two up to the window).",
            (*TARGET_OPTIONS, PP_ONE, TG_ONE,
             # 2, not the 3 of bench: what `invoke bench-depth` has always run (each rung of a
             # long ladder re-fills a deep context).
             replace(RUNS, help="measured runs per depth", default=2),
             Option("depth", "explicit depth, repeatable (default: ladder from the live "
                    "max_model_len)", value_type=int, repeat="values", minimum=0,
                    maximum=MAX_TOKENS),
             Option("prefix_caching", "auto | on (two-phase, cache hit checked) | off (blended); "
                    "auto reads /metrics", default="auto", choices=lambda: ("auto", "on", "off")),
             Option("margin", "tokens kept free at the top of the window", value_type=int,
                    default=DEFAULT_MARGIN, minimum=0, maximum=MAX_TOKENS),
             NO_WARMUP, EXTRA_BODY, SEED, UNUSED_DURATION, *PROFILE_OPTIONS),
            aliases=("bench-depth",)),
    Command("conc", "bench-conc",
            "Closed-loop concurrency ladder: steady load per level, total and per-request speed.",
            (URL, MODEL, TOKENIZER, API_KEY, PP_ONE, TG_ONE,
             replace(RUNS, help="not used by conc (--duration sets the sample); accepted so every "
                     "run kind takes the same options", task=False),
             Option("concurrency", "explicit level, repeatable (default: ladder up to "
                    "max_num_seqs)", value_type=int, repeat="values", minimum=1,
                    maximum=MAX_STREAMS),
             DURATION, replace(MAX_NUM_SEQS, task=True), NO_WARMUP, EXTRA_BODY, SEED,
             *PROFILE_OPTIONS),
            aliases=("bench-conc",)),
    Command("probe", "probe", "Run one regression probe; exit 0 pass, 1 fail, 2 inconclusive.",
            (Option("name", "itl-stall | tool-truncation | thinkoff | prefix-cache | multi-image | "
                    "depth-decay",
                    positional=True, choices=_probe_names),
             *TARGET_OPTIONS,
             replace(PARAM, help="probe setting KEY=VALUE, repeatable (e.g. victims=3, "
                     "max_choke=8)"),
             *PROFILE_OPTIONS)),
    Command("stability", "stability",
            "Stability run with a pass/fail table; exit 0 pass, 1 fail, 2 inconclusive.",
            (Option("mode", "smoke | stress | long", positional=True, choices=_stability_modes),
             *TARGET_OPTIONS,
             Option("workers", "stress: parallel workers (default 2)", value_type=int,
                    minimum=1, maximum=MAX_STREAMS),
             Option("requests", "stress: requests per worker (default 200)", value_type=int,
                    minimum=1, maximum=1_000_000),
             Option("max_tokens", "tokens per answer", value_type=int, minimum=1,
                    maximum=MAX_TOKENS),
             Option("runs", "long: runs (default 3)", value_type=int, minimum=1,
                    maximum=MAX_RUNS),
             replace(PARAM, help="other setting KEY=VALUE, e.g. context_tokens=30000"),
             *PROFILE_OPTIONS)),
    Command("report", "report", "Markdown tables (and PNG charts) from the benchmark history.",
            (Option("kind", "bench | depth | conc | probe | stability, repeatable (default: all)",
                    default=KINDS, repeat="values", choices=lambda: KINDS),
             Option("last", "records per kind", value_type=int, default=20, minimum=1,
                    maximum=1_000_000),
             Option("out", "write the markdown to this file (charts next to it)", value_type=Path),
             Option("png", "also draw PNG charts (next to --out, else generated/report/)",
                    flag=True),
             HISTORY_DIR,
             replace(JSON, help="print {markdown, charts} as JSON"))),
)


def command(name: str) -> Command:
    """The command a subcommand name, one of its aliases or an invoke task name stands for."""
    for cmd in COMMANDS:
        if name in (cmd.name, cmd.task, *cmd.aliases):
            return cmd
    raise KeyError(f"unknown benchmark command {name!r}")


def add_arguments(parser: argparse.ArgumentParser, cmd: Command) -> None:
    """Declare `cmd`'s options on its argparse subparser."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for opt in cmd.options:
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if opt.group:
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group(opt.group)
            target = groups[opt.group]
        kwargs: dict[str, Any] = {"help": opt.help_text}
        if opt.choices is not None:
            kwargs["choices"] = list(opt.choices())
        if opt.positional:
            target.add_argument(opt.name, **kwargs)
            continue
        names = [opt.flag_name, *([opt.short] if opt.short else [])]
        if opt.flag:
            target.add_argument(*names, action="store_true", **kwargs)
            continue
        default = list(opt.default) if isinstance(opt.default, tuple) else opt.default
        checked = opt.value_type in (int, float) or opt.minimum is not None
        kwargs.update(type=_named(opt.parse, opt.value_type) if checked else opt.value_type,
                      default=default)
        if opt.metavar:
            kwargs["metavar"] = opt.metavar
        if opt.repeat == "values":
            kwargs["nargs"] = "+"
        elif opt.repeat == "flags":
            kwargs["action"] = "append"
        target.add_argument(*names, **kwargs)


def _named(parse: Callable[[str], Any], like: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, under the name argparse quotes for a value it cannot convert ("invalid int")."""

    def checked(text: str) -> Any:
        return parse(text)

    checked.__name__ = getattr(like, "__name__", "value")
    return checked


def task_argv(cmd: Command, values: Mapping[str, Any]) -> list[str]:
    """The `python -m vllmstack.bench` argv for an invoke task's values: only what the user gave.

    An option left out takes its declared default in the parser; a task never restates it.
    """
    argv = [cmd.name]
    for opt in cmd.task_options:
        value = values.get(opt.name)
        if value is None or value is False or value == "" or value == []:
            continue
        if opt.positional:
            argv.append(str(value))
        elif opt.flag:
            argv.append(opt.flag_name)
        elif opt.repeat == "flags":
            argv += [f"{opt.flag_name}={item}" for item in value]
        elif opt.repeat == "values":
            items = value if isinstance(value, list | tuple) else [value]
            argv += [opt.flag_name, *map(str, items)]
        else:  # one word, so a value that starts with "-" is not read as a flag
            argv.append(f"{opt.flag_name}={value}")
    return argv

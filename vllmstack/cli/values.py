"""What each task option may hold, checked as invoke parses the command line.

invoke converts an option's text with the option's `kind` (int, float, str), and a value that
does not convert escaped as a traceback (`invoke logs --tail abc`); a value that converts but
makes no sense (`--timeout nan`, `--port 70000`, a 300-character profile name) reached the task
and failed somewhere deep. Here every value-taking option of every task has one declared `Value`:
the text is converted and range-checked while invoke parses, and a bad one ends the command with
`error:` / `fix:` lines and exit 1 (invoke's ParseError, which its Program prints and exits 1 on)
before any task code runs.

`OPTIONS` declares the values by option name (`--model` is a profile name in every task that takes
it, `--timeout` a number of seconds, ...); a task whose option means something else passes its own
(`stack_task(values=...)`), and the benchmark tasks take theirs from their declarations in
bench/options.py. `tests/test_cli_values.py` fails on an option of any task that has none.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllmstack.config.envfiles import KEY_NAME, NAME_MAX, SUFFIX
from vllmstack.core.errors import StackError

# The longest wait any task accepts. A week covers a cold compile of the largest build; beyond
# about 24 days an event loop's timer overflows the kernel's millisecond timeout (OverflowError).
MAX_SECONDS = 7 * 24 * 3600.0
MAX_TEXT = 4096  # PATH_MAX: no option of the stack needs a longer text
SHOWN = 60  # characters of a refused value quoted in the error
# Whole numbers as a person types them: ASCII digits only. int() also takes "1_000", " 5 " and
# other scripts' digits ("٣"), which would pass a check and mean something else to the next tool.
WHOLE = re.compile(r"[+-]?[0-9]+")
NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class ValueProblemError(ValueError):
    """Why a text is not a value of its option (without the flag; `Value.check` adds it)."""


@dataclass(frozen=True)
class Value:
    """One option's values: `convert` turns the text into the value or raises ValueProblem."""

    what: str  # "a number of seconds above 0" -- the fix says "pass --x <what>"
    example: str
    convert: Callable[[str], Any]
    keep_text: bool = False  # checked, then handed on as the text it was (a task that forwards it)

    def check(self, flag: str, text: Any) -> Any:
        """The value of `text` given to `flag`; StackError (error: / fix:) when it is not one."""
        if not isinstance(text, str):  # invoke's own defaults, never the user's text
            return text
        try:
            value = self.convert(text)
        except ValueProblemError as exc:
            raise StackError(f"{flag} {shown(text)} {exc}",
                             f"pass {flag} {self.what}, e.g. {flag} {self.example}") from None
        return text if self.keep_text else value

    def as_text(self) -> Value:
        return replace(self, keep_text=True)


def shown(text: str) -> str:
    """A refused value as the error quotes it: escaped (no control character reaches the
    terminal) and cut to SHOWN characters, with its length when cut."""
    if len(text) <= SHOWN:
        return repr(text)
    return f"{text[:SHOWN]!r}... ({len(text)} characters)"


def check_text(text: str, *, empty: bool = True) -> str:
    if len(text) > MAX_TEXT:
        raise ValueProblemError(f"is longer than {MAX_TEXT} characters")
    if "\x00" in text:
        raise ValueProblemError("holds a NUL byte, which no command line or file name can carry")
    if not empty and not text.strip():
        raise ValueProblemError("is empty")
    return text


def text(what: str = "a text", example: str = "VALUE", *, empty: bool = True) -> Value:
    return Value(what, example, lambda t: check_text(t, empty=empty))


def seconds(*, zero: bool = False, zero_means: str = "") -> Value:
    """A finite number of seconds: above 0 (or 0 too, when 0 means something) up to MAX_SECONDS."""

    def convert(t: str) -> float:
        if not NUMBER.fullmatch(t.strip()):
            raise ValueProblemError("is not a number of seconds")
        number = float(t)
        if not math.isfinite(number):
            raise ValueProblemError("is not a finite number")
        if number < 0 or (number == 0 and not zero):
            raise ValueProblemError("is not above 0" if not zero else "is negative")
        if number > MAX_SECONDS:
            raise ValueProblemError(f"is more than a week ({MAX_SECONDS:g} s)")
        if 0 < number < 1e-3:
            raise ValueProblemError("is below a millisecond, shorter than anything can be timed")
        return number

    low = "0 " + zero_means + " or more" if zero else "above 0"
    return Value(f"a number of seconds, {low} (at most {MAX_SECONDS:g})".replace("  ", " "), "60",
                 convert)


def whole(low: int, high: int, what: str = "a whole number", example: int = 1) -> Value:
    def convert(t: str) -> int:
        if not WHOLE.fullmatch(t.strip()):
            raise ValueProblemError(f"is not {what} (digits 0-9 only)")
        number = int(t)
        if not low <= number <= high:
            raise ValueProblemError(f"is outside {low} to {high}")
        return number

    return Value(f"{what} from {low} to {high}", str(example), convert)


def layer(*, nested: bool) -> Value:
    """A platform or model profile name (`nested`: an EXTENDS layer such as families/qwen3).
    Only its length is checked here: the resolver refuses the rest (`..`, a path) with the
    names it has to offer."""

    def convert(t: str) -> str:
        longest = max(len(part.encode()) for part in check_text(t, empty=False).split("/"))
        if longest + len(SUFFIX) > NAME_MAX:
            raise ValueProblemError(f"is {longest} bytes long; a file name holds "
                               f"{NAME_MAX - len(SUFFIX)} at most")
        return t

    return Value("the name of a file in env/models/ or env/platforms/ without .env" if not nested
                 else "a layer below env/ without .env", "families/qwen3" if nested else "tiny",
                 convert)


def pair(key: re.Pattern[str] | None = None) -> Value:
    """NAME=VALUE (`--set`, `--ref`, ...); `key` the pattern the name must match."""

    def convert(t: str) -> str:
        name, sep, _ = check_text(t).partition("=")
        if not sep or not name.strip():
            raise ValueProblemError("is not NAME=VALUE")
        if key is not None and not key.fullmatch(name.strip()):
            raise ValueProblemError(f"names {name.strip()!r}, which is not a variable name")
        return t

    return Value("KEY=VALUE" if key is not None else "NAME=VALUE",
                 "VLLM_MAX_NUM_SEQS=4" if key is not None else "vllm=v0.32.0", convert)


def choice(words: Sequence[str]) -> Value:
    def convert(t: str) -> str:
        if t not in words:
            raise ValueProblemError(f"is not one of {', '.join(words)}")
        return t

    return Value(f"one of {', '.join(words)}", words[0], convert)


def _engine_profile(t: str) -> str:
    engine, sep, profile = check_text(t, empty=False).partition(":")
    if not sep or not engine or not profile:
        raise ValueProblemError("is not ENGINE:PROFILE")
    PROFILE.convert(profile)
    return t


SECONDS = seconds()
PORT = whole(1, 65535, "a port", 8080)
PROFILE = layer(nested=False)
def _path(t: str) -> str:
    check_text(t, empty=False)
    if any(len(part.encode()) > NAME_MAX for part in t.split("/")):
        # The file system refuses such a name (ENAMETOOLONG), which Path.is_file() raises.
        raise ValueProblemError(f"has a part longer than {NAME_MAX} bytes, which no file name holds")
    return t


PATH = Value("a path", "/path/to/it", _path)
WORD = text("a word", "auto")
ENGINE_PROFILE = Value("ENGINE:PROFILE", "vllm:tiny", _engine_profile)

def _minutes(t: str) -> float:
    if not NUMBER.fullmatch(t.strip()) or not 0 < (number := float(t)) <= 1440:  # NaN fails too
        raise ValueProblemError("is not a number of minutes above 0 and at most 1440")
    return number


# Every option name the tasks use, with what it holds. A task where a name means something else
# passes its own Value (stack_task(values=...)); the benchmark tasks use bench/options.py's.
OPTIONS: dict[str, Value] = {
    # the profile, its settings and where it runs
    "model": PROFILE, "platform": PROFILE, "set": pair(re.compile(KEY_NAME.pattern)),
    "runtime": choice(("auto", "native", "compose", "compose-v1", "podman")),  # RUNTIME's
    "name": PROFILE, "extends": layer(nested=True), "profiles": text("profiles, comma-separated",
                                                                     "tiny,tiny-gguf"),
    "target": text("a Dockerfile stage", "vllm-source", empty=False),
    # waits and counts
    "timeout": SECONDS, "ttl": seconds(zero=True, zero_means="(never)"),
    "load_timeout": SECONDS, "drain_timeout": seconds(zero=True, zero_means="(for ever)"),
    "tail": whole(0, 10_000_000, "a number of lines", 200),
    "jobs": whole(0, 4096, "a number of jobs", 8),
    "runs": whole(1, 1000, "a number of runs", 5), "warmup": whole(0, 1000, "a number of runs", 2),
    "max_tokens": whole(2, 1_000_000, "a number of tokens", 200),
    "ctx": whole(1, 1_000_000, "a number of tokens", 8000),
    "concurrency": whole(1, 4096, "a number of streams", 4),
    "minutes": Value("minutes above 0, at most 1440", "20", _minutes),
    # addresses
    "host": text("an address", "127.0.0.1", empty=False), "port": PORT,
    "engine_url": text("a URL", "http://127.0.0.1:8000", empty=False),
    "token": text("a token", "$(openssl rand -hex 32)", empty=False),
    # files and folders
    "file": PATH, "out": PATH, "model_dir": PATH, "wheels": PATH, "python": PATH,
    "tokenizer": PATH, "wheel": PATH, "from_image": text("an image", "localhost/vllm-cpu:src"),
    # words another layer checks against its own list, with its own error
    "service": choice(("vllm", "dashboard")), "engine": choice(("vllm", "llamacpp")),
    "backend": WORD, "version": WORD, "cuda_arch": WORD, "preset": WORD, "outtype": WORD,
    "pre_tokenizer": WORD,
    "k": text("a pytest -k expression", "router"),
    "ref": pair(), "repo": pair(), "patches": pair(),
    # template-check
    "template": PATH, "tool_parser": WORD, "kwargs": text("a JSON object", "'{\"enable_thinking\": false}'"),
}


def _finite(t: str) -> float:
    if not NUMBER.fullmatch(t.strip()) or not math.isfinite(number := float(t)):
        raise ValueProblemError("is not a finite number")
    return number


# For an option nobody declared yet (the test names it): at least no traceback and no NaN.
UNDECLARED: dict[type, Value] = {
    int: whole(-(2**63), 2**63 - 1), float: Value("a finite number", "1", _finite),
}


def value_of(name: str, own: dict[str, Value], kind: Any = str) -> Value:
    """The declared Value of option `name` (a task's own first), else the bare one of its kind."""
    return own.get(name) or OPTIONS.get(name) or UNDECLARED.get(kind) or text()


def declared(name: str, own: dict[str, Value]) -> bool:
    return name in own or name in OPTIONS

"""The one place where the stack starts other programs.

Every command is an argv list. Tasks get a runner and never call subprocess
themselves, so `--dry-run` prints exactly what would run and tests record argv
lists instead of starting processes.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandError(RuntimeError):
    """A command the stack needed failed; carries what it printed."""

    def __init__(self, result: Result, what: str = "") -> None:
        self.result = result
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        msg = f"{what or 'command'} failed (exit {result.returncode}): {shlex.join(mask_argv(result.argv))}"
        if tail:
            msg += "\n  " + "\n  ".join(tail)
        super().__init__(msg)


class Runner(Protocol):
    """Runs argv lists. `capture` returns output; `stream` lets it reach the terminal."""

    dry_run: bool

    def run(
        self,
        argv: Sequence[str],
        *,
        capture: bool = True,
        check: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        input_text: str | None = None,
        timeout: float | None = None,
        mutates: bool = True,
        merge_output: bool = False,
    ) -> Result: ...


def _check(result: Result, check: bool) -> Result:
    if check and not result.ok:
        raise CommandError(result)
    return result


@dataclass
class SubprocessRunner:
    """Runs commands for real. With dry_run, state-changing commands are only printed.

    Read-only queries (`mutates=False`, e.g. `docker ps`) still run in dry-run
    mode so that the printed plan reflects the real state of the machine.
    """

    dry_run: bool = False
    echo: bool = False
    out: TextIO = field(default_factory=lambda: sys.stdout)

    def run(
        self,
        argv: Sequence[str],
        *,
        capture: bool = True,
        check: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        input_text: str | None = None,
        timeout: float | None = None,
        mutates: bool = True,
        merge_output: bool = False,
    ) -> Result:
        argv = tuple(str(a) for a in argv)
        if self.dry_run and mutates:
            print(format_command(argv, cwd=cwd), file=self.out)
            return Result(argv, 0)
        if self.echo:
            print(f"+ {shlex.join(mask_argv(argv))}", file=sys.stderr)
        try:
            proc = subprocess.run(
                argv,
                stdout=subprocess.PIPE if capture else None,
                # Merged keeps the order of interleaved lines (container logs).
                stderr=(subprocess.STDOUT if merge_output else subprocess.PIPE) if capture else None,
                text=True,
                errors="replace",
                env=dict(env) if env is not None else None,
                cwd=cwd,
                input=input_text,
                timeout=timeout,
                check=False,
            )
        except FileNotFoundError:
            return _check(Result(argv, 127, "", f"{argv[0]}: command not found"), check)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return _check(Result(argv, 124, out, f"timed out after {timeout}s"), check)
        return _check(Result(argv, proc.returncode, proc.stdout or "", proc.stderr or ""), check)


Responder = Callable[[tuple[str, ...]], Result | None]


@dataclass
class RecordingRunner:
    """Test double: records every argv and answers from canned responses.

    `responses` maps an argv prefix to a Result (or a callable); the longest
    matching prefix wins. Unmatched commands succeed with empty output.
    """

    dry_run: bool = False
    calls: list[tuple[str, ...]] = field(default_factory=list)
    envs: list[dict[str, str] | None] = field(default_factory=list)
    responses: dict[tuple[str, ...], Result | Responder] = field(default_factory=dict)

    def respond(self, prefix: Sequence[str], result: Result | Responder) -> None:
        self.responses[tuple(prefix)] = result

    def run(
        self,
        argv: Sequence[str],
        *,
        capture: bool = True,
        check: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        input_text: str | None = None,
        timeout: float | None = None,
        mutates: bool = True,
        merge_output: bool = False,
    ) -> Result:
        key = tuple(str(a) for a in argv)
        self.calls.append(key)
        self.envs.append(dict(env) if env is not None else None)
        best: tuple[str, ...] | None = None
        for prefix in self.responses:
            if key[: len(prefix)] == prefix and (best is None or len(prefix) > len(best)):
                best = prefix
        if best is None:
            return Result(key, 0)
        answer = self.responses[best]
        result = answer(key) if callable(answer) else answer
        if result is None:
            result = Result(key, 0)
        return _check(Result(key, result.returncode, result.stdout, result.stderr), check)

    def commands(self) -> list[str]:
        return [shlex.join(c) for c in self.calls]


def format_command(argv: Sequence[str], *, cwd: Path | None = None) -> str:
    """A shell line a user can paste: `cd DIR && cmd args`, with secrets masked (mask_argv)."""
    line = shlex.join(mask_argv(argv))
    return f"cd {shlex.quote(str(cwd))} && {line}" if cwd is not None else line


# --- secrets: what `--dry-run`, logs and `invoke config` never print ---------------------------

MASK = "***"
# Name parts that mark a secret; whole parts only, so VLLM_MAX_BATCHED_TOKENS and VLLM_TOKENIZER
# (TOKENS, TOKENIZER) stay visible while HF_TOKEN, DASHBOARD_TOKEN and OPENAI_API_KEY do not.
_SECRET_PARTS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "APIKEY"}
_SECRET_PAIRS = {("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY"), ("AUTH", "KEY")}


def is_secret_name(name: str) -> bool:
    """Whether a setting, environment variable or --flag name holds a secret (HF_TOKEN,
    DASHBOARD_TOKEN, VLLM_API_KEY, --api-key, --hf-token, AWS_SECRET_ACCESS_KEY, ...)."""
    parts = [p for p in re.split(r"[^A-Z0-9]+", name.upper()) if p]
    return bool(_SECRET_PARTS & set(parts)) or any(pair in _SECRET_PAIRS
                                                   for pair in itertools.pairwise(parts))


def mask_argv(argv: Sequence[str]) -> list[str]:
    """argv with the value of every secret flag (`--api-key V`, `--hf-token=V`) and of every
    secret `KEY=V` word (`env HF_TOKEN=V ...`, `-e DASHBOARD_TOKEN=V`) replaced by ***."""
    out: list[str] = []
    hide_next = False
    for word in (str(a) for a in argv):
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        name, sep, _ = word.partition("=")
        if word.startswith("-") and is_secret_name(name):
            if sep:
                out.append(f"{name}={MASK}")
            else:
                out.append(word)
                hide_next = True
            continue
        if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) and is_secret_name(name):
            out.append(f"{name}={MASK}")
            continue
        out.append(word)
    return out


def mask_text(text: str, secrets: Sequence[str]) -> str:
    """`text` with every occurrence of each secret value replaced by ***. Values shorter than
    4 characters are left alone: masking every "1" would garble the text and hide nothing."""
    for secret in sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text

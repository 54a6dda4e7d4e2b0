"""Small file helpers every layer shares: atomic writes created with their mode, the one env-file
encoding, and reading a file's tail."""

from __future__ import annotations

import json
import os
import re
import unicodedata
from pathlib import Path
from typing import Any

from vllmstack.core.findings import Finding

# Files that can hold a token (rendered env files, the override, state records) are created
# readable by their owner only.
PRIVATE = 0o600


def write_text(path: Path, text: str, mode: int = PRIVATE) -> None:
    """Write `text` (UTF-8) atomically, so a reader in another process never sees half a file.

    The temporary file is created with `mode` (never chmod-ed afterwards), so a file that can
    hold a token is never readable by others, not even for a moment.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # an old temp file would keep its own (possibly wider) mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
        handle.write(text)
    tmp.replace(path)


def write_json(path: Path, data: Any, mode: int = 0o644) -> None:
    """Write `data` as JSON atomically, created with `mode` (see write_text)."""
    write_text(path, json.dumps(data, indent=2) + "\n", mode)


# --- env files: one encoding that Compose v1, Compose v2 and podman-compose all read back exactly
#
# Compose v1 and podman-compose read env files with python-dotenv, Compose v2 with compose-go's
# dotenv. They agree on a single-quoted value as long as it holds no ' (python-dotenv and
# compose-go end the value there, and disagree on \'), no \ (python-dotenv turns \\ into \,
# compose-go keeps both), no $ (python-dotenv interpolates ${X} even in single quotes, and some
# compose v2 releases double a literal $) and no control character (python-dotenv reads with
# universal newlines, so \r becomes \n; a newline would start a line of its own), and it must be
# text (a lone surrogate is how Python carries bytes of argv or the environment that are not
# UTF-8). Such a value is refused, never escaped: no escape means the same thing to all three.
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BARE = re.compile(r"[A-Za-z0-9._/:,+@-]+")  # no quotes needed in any of the three parsers


class EnvValueError(ValueError):
    """A value an env file cannot carry exactly; the message says which character and why."""


def env_value_problem(value: str) -> str | None:
    """Why `value` cannot be written into an env file exactly, or None when it can."""
    for char in value:
        if char == "'":
            return "contains a single quote (')"
        if char == "\\":
            return "contains a backslash (\\)"
        if char == "$":
            return "contains a $, which Compose would interpolate"
        if unicodedata.category(char) == "Cs":  # how Python keeps undecodable bytes of argv/env
            return "contains bytes that are not UTF-8"
        if unicodedata.category(char) == "Cc":
            what = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab"}.get(
                char, f"the control character U+{ord(char):04X}")
            return f"contains {what}"
    return None


def env_line(key: str, value: str) -> str:
    """`KEY=value` for an env file: bare when only safe characters, else in single quotes.

    Raises EnvValueError for a key that is not a variable name or a value env_value_problem
    refuses."""
    if not ENV_KEY.fullmatch(key):
        raise EnvValueError(f"{key!r} is not a variable name (letters, digits, _)")
    problem = env_value_problem(value)
    if problem:
        raise EnvValueError(f"{key}: its value {problem}")
    return f"{key}={value}" if _BARE.fullmatch(value) else f"{key}='{value}'"


def decode_env_bytes(data: bytes, display: str) -> tuple[str, list[Finding]]:
    """The text of an env file; each line with bytes that are not UTF-8 becomes a finding and an
    empty line (so the line numbers of the rest stay right)."""
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM, as editors on Windows write it
    try:
        return data.decode("utf-8"), []
    except UnicodeDecodeError:
        pass
    out: list[str] = []
    problems: list[Finding] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            out.append("")
            problems.append(Finding(
                "error", "not-utf8",
                f"line {lineno} of {display} has a byte that is not UTF-8 (0x{raw[exc.start]:02x} "
                f"at column {exc.start + 1}); the line is ignored",
                source=f"{display}:{lineno}",
                fix="save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or retype the line"))
    return "\n".join(out), problems


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines of a file, reading only its end."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            pos = handle.tell()
            data = b""
            while pos > 0 and data.count(b"\n") <= count:
                step = min(65536, pos)
                pos -= step
                handle.seek(pos)
                data = handle.read(step) + data
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-count:] if count > 0 else []

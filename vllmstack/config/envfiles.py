"""The env files the profiles are made of: their names, where they may live, how one is read.

A layer is named by a path below env/ (`models/tiny`, `families/qwen3`); the file it names is read
line by line with the line numbers every finding quotes. A name that leaves env/, a file name
longer than the file system takes, and a file that is a symlink out of the project are refused
before anything is read: nothing of a file elsewhere (its lines echoed in a finding) reaches the
user.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dotenv.parser import parse_stream

from vllmstack.core.files import decode_env_bytes
from vllmstack.core.findings import Finding

# NAME_MAX of every Linux file system, for the file a name becomes (NAME.env).
NAME_MAX = 255
SUFFIX = ".env"


@dataclass(frozen=True)
class Line:
    key: str
    value: str
    line: int


# A layer name is a path below env/ made of plain names: never absolute, never `..`, nothing a
# generated file's comment or a label could misread.
LAYER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
KEY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def layer_name_problem(name: str, *, nested: bool = True) -> str | None:
    """Why `name` cannot name a layer inside env/ (None when it can). `nested=False` for a
    platform or model name, which is one file name in its folder."""
    if name.startswith("/"):
        return "is an absolute path; layers are named relative to env/"
    if ".." in name.split("/"):
        return "contains '..'; layers are named inside env/ only"
    if not LAYER_NAME.fullmatch(name) or any(part.endswith(".") for part in name.split("/")):
        return "is not a layer name (letters, digits, '.', '_', '-', folders joined by '/')"
    if not nested and "/" in name:
        return "names a folder; platforms and model profiles are single names"
    longest = max(len(part.encode()) for part in name.split("/"))
    if longest + len(SUFFIX) > NAME_MAX:
        # The file system refuses the name (ENAMETOOLONG), which escaped as a traceback.
        return f"has a part of {longest} bytes; a file name holds {NAME_MAX - len(SUFFIX)} at most"
    return None


def layer_file_problem(root: Path, path: Path) -> str | None:
    """Why the layer file `path` of the project at `root` must not be read (None: it may): a
    symlink that leads out of the project (a profile shared as a link to /etc/... would have its
    lines echoed by every finding), or something that is not a regular file (a FIFO would hang)."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        return None
    anchors = {root.resolve(), (root / "env").resolve()}  # env/ itself may be a link, on purpose
    if not any(real == a or a in real.parents for a in anchors):
        return f"is a symlink to {real}, outside the project"
    if not os.path.isfile(real):
        return "is not a regular file"
    return None


def read_env_file(path: Path, display: str) -> tuple[list[Line], list[Finding]]:
    """Parse one dotenv file keeping line numbers; duplicates, syntax errors, bytes that are not
    UTF-8 and keys that are not variable names become findings."""
    lines: list[Line] = []
    seen: dict[str, int] = {}
    text, problems = decode_env_bytes(path.read_bytes(), display)
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # as python-dotenv's own reading does
    for binding in parse_stream(io.StringIO(text)):
        # python-dotenv counts from the blank lines it skipped before the binding: skip them too.
        original = binding.original.string
        lineno = binding.original.line + original[:len(original) - len(original.lstrip())].count("\n")
        where = f"{display}:{lineno}"
        if binding.error:
            problems.append(
                Finding(
                    "error", "syntax", f"cannot parse {binding.original.string.strip()!r}",
                    source=where, fix="write KEY=VALUE, quote values with spaces or #",
                )
            )
            continue
        if binding.key is None:
            continue
        if binding.value is None:
            problems.append(
                Finding(
                    "error", "syntax", f"{binding.key} has no '=' and no value", key=binding.key,
                    source=where, fix=f"write {binding.key}=VALUE (or {binding.key}= for empty)",
                )
            )
            continue
        if not KEY_NAME.fullmatch(binding.key):
            problems.append(
                Finding(
                    "error", "bad-key",
                    f"{binding.key!r} ({where}) is not a variable name; the line is ignored",
                    source=where, fix="keys are letters, digits and _ (not starting with a digit)",
                )
            )
            continue
        if binding.key in seen:
            problems.append(
                Finding(
                    "error", "duplicate-key",
                    f"{binding.key} is set twice in {display} (lines {seen[binding.key]} and "
                    f"{lineno}); the later one would silently win",
                    key=binding.key, source=where, fix="delete one of the two lines",
                )
            )
        seen[binding.key] = lineno
        lines.append(Line(binding.key, binding.value, lineno))
    return lines, problems

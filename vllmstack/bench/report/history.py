"""Benchmark history: one JSON-lines file per kind, appended atomically under a lock.

Several writers share these files (the CLI, the dashboard, parallel runs), so every mutation takes
an exclusive `fcntl.flock` on a sidecar `.lock` file. Appends are one `os.write` of one complete
line on an `O_APPEND` descriptor; rewrites (delete, clear, rotation) go through a temp file and
`os.replace`, so a reader never sees half a file. Readers do not lock: a torn line (a writer killed
mid-write, a disk filled up) is skipped and counted, never fatal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.core.errors import StackError
from vllmstack.core.files import parse_json

SCHEMA_VERSION: int = 1
KINDS = ("bench", "depth", "conc", "probe", "stability")
# Kinds that bring profiles up and down themselves and write their own markdown tables when they
# run (`bench-vs`, `burn`); `invoke report` renders KINDS.
PROFILE_RUN_KINDS = ("bench-vs", "burn")

DEFAULT_MAX_BYTES = 4_000_000


class HistoryError(StackError, ValueError):
    """A history file or record that cannot be used; the message names the file and the fix."""


def history_path(folder: Path, kind: str) -> Path:
    if kind not in KINDS + PROFILE_RUN_KINDS:
        raise HistoryError(f"unknown history kind {kind!r}; known kinds: "
                           f"{', '.join(KINDS + PROFILE_RUN_KINDS)}")
    return folder / f"{kind}_history.jsonl"


def rotated_path(path: Path) -> Path:
    """Where the previous generation goes when `path` outgrows its size bound."""
    return path.with_suffix(".jsonl.1")


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the exclusive lock that serialises every writer of `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        # Closing the descriptor releases the flock as well; unlock first to be explicit.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def stamp_record(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of `record` with `id`, `ts` and `schema_version` filled in where missing."""
    out = dict(record)
    out.setdefault("id", uuid.uuid4().hex)
    out.setdefault("ts", time.time())
    out.setdefault("schema_version", SCHEMA_VERSION)
    return out


def encode_record(record: dict[str, Any]) -> bytes:
    try:
        text = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise HistoryError(f"history record cannot be stored as JSON: {exc}") from exc
    return (text + "\n").encode("utf-8")


def append_record(
    path: Path, record: dict[str, Any], *, max_bytes: int = DEFAULT_MAX_BYTES
) -> dict[str, Any]:
    """Append one record (stamped with id/ts/schema_version) and return what was stored."""
    stored = stamp_record(record)
    line = encode_record(stored)
    with locked(path):
        size = path.stat().st_size if path.exists() else 0
        if size and size + len(line) > max_bytes:
            # Keep one previous generation: history stays bounded, the recent past stays readable.
            os.replace(path, rotated_path(path))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
            while written < len(line):  # rare short write (signals, huge records): finish it
                written += os.write(fd, line[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
    return stored


# Rotation keeps a file near DEFAULT_MAX_BYTES; one far larger was not grown by the stack, and
# only its newest part is read (reading never costs more memory than this).
READ_MAX_BYTES = 64 * 1024 * 1024


@dataclass
class ReadResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    skipped_lines: list[int] = field(default_factory=list)
    # Each record's line exactly as stored: a rewrite keeps the records it does not touch
    # byte for byte (one holding NaN, which no writer of today can encode, included).
    lines: list[bytes] = field(default_factory=list)


def read_file(path: Path) -> ReadResult:
    """Every record in `path`, oldest first, plus the count and line numbers of unusable lines.

    Never raises for what the file holds: a line that is not a JSON object (torn, garbage, not
    UTF-8, nested too deeply to read) is skipped and counted. NaN and infinities are read (old
    records may hold them; the dashboard shows them as missing). An unreadable file is empty."""
    result = ReadResult()
    try:
        # Non-blocking, and regular files only: a FIFO in its place must not hang the reader.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return result
    try:
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return result
            size = os.fstat(fd).st_size
            if size > READ_MAX_BYTES:
                handle.seek(size - READ_MAX_BYTES)
                handle.readline()  # the first, cut line is not a record
                result.skipped += 1
            data = handle.read(READ_MAX_BYTES)
    except OSError:
        return result
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            value = parse_json(raw, allow_nan=True)
        except ValueError:
            value = None
        if isinstance(value, dict):
            result.records.append(value)
            result.lines.append(raw)
        else:
            result.skipped += 1
            result.skipped_lines.append(number)
    return result


def read_records(path: Path, *, include_rotated: bool = False) -> list[dict[str, Any]]:
    """Records oldest first; torn or garbage lines are skipped (see `read_file` for the count)."""
    records: list[dict[str, Any]] = []
    if include_rotated:
        records.extend(read_file(rotated_path(path)).records)
    records.extend(read_file(path).records)
    return records


def record_matches(record: dict[str, Any], record_id: str) -> bool:
    """Whether `record` has the id a URL or command line names (text: an id stored as a number
    is found by its digits, as the listing shows it)."""
    return "id" in record and str(record["id"]) == record_id


def delete_record(path: Path, record_id: str) -> bool:
    """Remove the record with this id (from the current or rotated file); True when found."""
    with locked(path):
        for candidate in (path, rotated_path(path)):
            if not candidate.exists():
                continue
            content = read_file(candidate)
            kept = [line for record, line in zip(content.records, content.lines, strict=True)
                    if not record_matches(record, record_id)]
            if len(kept) != len(content.records):
                # Garbage lines are dropped by the rewrite too: they could never be read anyway.
                # The others are kept as stored, not re-encoded.
                rewrite_lines_locked(candidate, kept)
                return True
    return False


def rewrite_lines_locked(path: Path, lines: list[bytes]) -> None:
    """Replace the file's content with these stored lines, atomically; the caller holds the lock."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            for line in lines:
                handle.write(line + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def clear(path: Path) -> int:
    """Remove every record (current and rotated generation); returns how many were removed."""
    removed = 0
    with locked(path):
        if path.exists():
            removed += len(read_file(path).records)
            rewrite_lines_locked(path, [])
        old = rotated_path(path)
        if old.exists():
            removed += len(read_file(old).records)
            old.unlink()
    return removed

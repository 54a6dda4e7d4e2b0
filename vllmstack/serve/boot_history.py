"""results/boot_history.jsonl: every boot `up` waited for, one JSON line each.

`up` (and so the router's loads, `bench-vs` and `burn`, which boot through it) appends the boot's
phases with the profile, engine slot and time; `invoke startup --history N` reads the last N back.
The file sits with the benchmark history in the git-ignored results/ folder and follows its
rules: one complete line per `os.write` on an O_APPEND descriptor under the sidecar `.lock` that
every history writer takes, rotated to `.1` past a size bound, and a torn line (a writer killed
mid-write, a full disk) is skipped when read, never fatal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.core.files import FileWriteError, parse_json, tail_lines
from vllmstack.core.paths import Project, results_folder
from vllmstack.runtime.compile_cache import HISTORY_FILE
from vllmstack.serve.boot_phases import Boot

# A boot is 2 to 4 KB; past this the file moves to .1 (the one generation kept).
MAX_BYTES = 4_000_000
RECORD_VERSION = 1


@dataclass(frozen=True)
class BootRecord:
    """One line of the history: which engine booted which profile, when, and its phases."""

    recorded: float  # epoch seconds it was written (the boot became healthy just before)
    profile: str
    slot: str  # the engine's name in the checkout ("" for the default engine)
    boot: Boot
    # What its compile cache depends on (runtime.compile_cache.compile_key): `check` finds the
    # boots of a profile's key to say whether the next one will hit the cache.
    compile_key: str = ""


def history_path(project: Project) -> Path:
    return project.results / HISTORY_FILE


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """The lock every history writer of `path` takes (bench.report.history's sidecar)."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing it releases the flock


def append_boot(project: Project, record: BootRecord) -> Path:
    """Append `record` (FileWriteError naming the file when it cannot be written)."""
    line = json.dumps({"version": RECORD_VERSION, "recorded": round(record.recorded, 3),
                       "profile": record.profile, "slot": record.slot,
                       "compile_key": record.compile_key, "boot": record.boot.as_json()},
                      separators=(",", ":")) + "\n"
    path = history_path(project)
    try:
        results_folder(project)
        with _locked(path):
            if path.exists() and path.stat().st_size + len(line) > MAX_BYTES:
                os.replace(path, path.with_suffix(".jsonl.1"))
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
    except OSError as exc:
        raise FileWriteError(path, exc) from exc
    return path


def read_boots(project: Project, limit: int) -> tuple[list[BootRecord], int]:
    """The last `limit` boots, oldest first, and how many lines could not be read (torn, or
    written by a newer version)."""
    return read_boots_in(project.results, limit)


def read_boots_in(folder: Path, limit: int) -> tuple[list[BootRecord], int]:
    """`read_boots` of the history in `folder` (the dashboard's history folder is results/)."""
    records: list[BootRecord] = []
    skipped = 0
    for text in tail_lines(folder / HISTORY_FILE, limit):
        record = _record_of(text)
        if record is None:
            skipped += 1
        else:
            records.append(record)
    return records, skipped


def _record_of(text: str) -> BootRecord | None:
    try:
        data: Any = parse_json(text)
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            return None
        recorded, profile, slot = data.get("recorded"), data.get("profile"), data.get("slot", "")
        key = data.get("compile_key", "")
        if isinstance(recorded, bool) or not isinstance(recorded, int | float) \
                or not isinstance(profile, str) or not isinstance(slot, str) \
                or not isinstance(key, str):
            return None
        return BootRecord(float(recorded), profile, slot, Boot.from_json(data.get("boot")), key)
    except ValueError:
        return None

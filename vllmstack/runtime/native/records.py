"""The engine record under generated/native/: which process is the native engine.

engine.json holds the pid (= process group = session), its start time (field 22 of
/proc/PID/stat), the boot id, a marker (the checkout's id and a random part), the checkout it was
started from and the keeper's pid; see `procs` for how a record is matched against the live
process table.

Ownership is proven, never assumed: a record is this checkout's only when its marker starts with
this checkout's id (a copy of the checkout, `cp -a A B`, has another id, since the id is derived
from the path, so A's record copied into B is not B's), and a process is the recorded one only
when its pid and start time match AND it carries the marker itself (procs.ProcTable.carries). A
hand-written record naming some other live process, or a record copied from another checkout,
is reported with its pid and left alone.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from vllmstack.core.checkout import checkout_id, engine_dir
from vllmstack.core.files import JsonFileError, read_json_file
from vllmstack.core.paths import Project

FOLDER = "native"
MARKER_VAR = "VLLMSTACK_ENGINE_ID"
# An engine record is a few hundred bytes (its argv can be long): anything far larger is not one.
RECORD_MAX_BYTES = 1_000_000


# pid_t's range: a larger "pid" is not a process (and would overflow kill(2)).
PID_MAX_LIMIT = 2**31 - 1


def _int(value: Any) -> int:
    """A JSON integer (never a bool, float or text): the record's numbers are the keeper's ints."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


@dataclass
class EngineRecord:
    """What the keeper wrote about the engine it started (generated/native/engine.json)."""

    pid: int
    start_ticks: int
    boot_id: str
    marker: str
    argv: list[str]
    log: str
    started: float
    keeper_pid: int | None = None
    keeper_start_ticks: int | None = None
    root: str = ""  # the checkout that started it (to name it when another checkout finds it)

    @classmethod
    def from_json(cls, data: Any) -> EngineRecord | None:
        if not isinstance(data, dict):
            return None
        try:
            argv = data.get("argv") or []
            started = data.get("started") or 0.0
            if not isinstance(data["marker"], str) or not isinstance(argv, list) \
                    or isinstance(started, bool) or not isinstance(started, (int, float)):
                return None
            keeper = data.get("keeper_pid")
            keeper_start = data.get("keeper_start_ticks")
            record = cls(
                pid=_int(data["pid"]), start_ticks=_int(data["start_ticks"]),
                boot_id=str(data.get("boot_id") or ""), marker=data["marker"],
                argv=[str(a) for a in argv], log=str(data.get("log") or ""),
                started=float(started),
                keeper_pid=_int(keeper) if keeper else None,
                keeper_start_ticks=_int(keeper_start) if keeper_start is not None else None,
                root=str(data.get("root") or ""))
        except (KeyError, TypeError, ValueError):
            return None
        # pid 0/1 or negative would make killpg hit our own group or everything: never accept it.
        if not (1 < record.pid <= PID_MAX_LIMIT) or record.start_ticks < 0 or not record.marker:
            return None
        if record.keeper_pid is not None and not 1 < record.keeper_pid <= PID_MAX_LIMIT:
            record.keeper_pid = None
        return record


def native_folder(project: Project, name: str = "") -> Path:
    """generated/native for the default engine; generated/engines/NAME/native for a named one
    (the router runs one engine per profile: each has its own record, log and sockets)."""
    return engine_dir(project.generated, name) / FOLDER


def origin_of(record: EngineRecord, project: Project) -> str:
    """Who wrote another checkout's record, for the line that names what was left alone."""
    if record.root and record.root != str(project.root.resolve()):
        return f"the checkout at {record.root}"
    return "another checkout (or written by hand)"


class Loaded(NamedTuple):
    """A record as read: the record (None: none, damaged or not this checkout's), why it cannot
    be used ("" when there is simply none), and the record itself when it is another
    checkout's (what `down` then names and leaves alone)."""

    record: EngineRecord | None
    problem: str
    foreign: EngineRecord | None = None


def read_record(project: Project, name: str = "") -> EngineRecord | None:
    return load_record(project, name).record


def load_record(project: Project, name: str = "") -> Loaded:
    return load_record_file(project, native_folder(project, name) / "engine.json", "engine",
                            marker_prefix(project, name))


def load_record_file(project: Project, path: Path, what: str, prefix: str) -> Loaded:
    """A process record (the engine's or the dashboard's) that is this checkout's. A record whose
    marker does not start with `prefix` was written by another checkout (this one is a copy of
    it) or by hand: it is never used, and the reason names its pid so the user can decide."""
    shown = f"the {what} record {path}"
    try:
        data = read_json_file(path, shown, max_bytes=RECORD_MAX_BYTES)
    except JsonFileError as exc:
        return Loaded(None, exc.cause)
    if data is None:
        return Loaded(None, "")
    record = EngineRecord.from_json(data)
    if record is None:
        return Loaded(None, f"{shown} lacks a usable pid, start time or marker")
    if not record.marker.startswith(prefix):
        return Loaded(None, f"{shown} was written by {origin_of(record, project)}, not by this "
                            f"one (its marker does not start with this checkout's {prefix!r})",
                      record)
    return Loaded(record, "")


def marker_prefix(project: Project, name: str = "") -> str:
    """Every engine this checkout starts carries VLLMSTACK_ENGINE_ID=<prefix><random>, so its
    processes are found even when no record names them (a damaged engine.json). A named engine's
    prefix is `<id>@NAME@`: `@` is in no engine name, so neither the default engine's search
    (`<id>-`) nor another name's ever matches it."""
    checkout = checkout_id(project.root)
    return f"{checkout}@{name}@" if name else f"{checkout}-"


def of_checkout(project: Project, marker: str) -> bool:
    """Whether a marker is any engine's of this checkout, the default one or a named one."""
    checkout = checkout_id(project.root)
    return marker.startswith((f"{checkout}-", f"{checkout}@"))


def new_marker(project: Project, name: str = "") -> str:
    return marker_prefix(project, name) + secrets.token_hex(12)


def dashboard_marker_prefix(project: Project) -> str:
    """The dashboard's marker: this checkout's id too, behind a word that keeps the engine's
    search for unrecorded engines (which looks for `marker_prefix`) from taking it for one."""
    return f"dashboard-{checkout_id(project.root)}-"

"""The engine record under generated/native/: which process is the native engine.

engine.json holds the pid (= process group = session), its start time (field 22 of
/proc/PID/stat), the boot id, a marker (the checkout's id and a random part) and the keeper's
pid; see `procs` for how a record is matched against the live process table.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.core.checkout import checkout_id
from vllmstack.core.paths import Project

FOLDER = "native"
MARKER_VAR = "VLLMSTACK_ENGINE_ID"


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

    @classmethod
    def from_json(cls, data: Any) -> EngineRecord | None:
        try:
            record = cls(
                pid=int(data["pid"]), start_ticks=int(data["start_ticks"]),
                boot_id=str(data.get("boot_id") or ""), marker=str(data["marker"]),
                argv=[str(a) for a in data.get("argv") or []], log=str(data.get("log") or ""),
                started=float(data.get("started") or 0.0),
                keeper_pid=int(data["keeper_pid"]) if data.get("keeper_pid") else None,
                keeper_start_ticks=(int(data["keeper_start_ticks"])
                                    if data.get("keeper_start_ticks") is not None else None))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        # pid 0/1 or negative would make killpg hit our own group or everything: never accept it.
        return record if record.pid > 1 and record.marker else None


def native_folder(project: Project) -> Path:
    return project.generated / FOLDER


def read_record(project: Project) -> EngineRecord | None:
    return load_record(project)[0]


def load_record(project: Project) -> tuple[EngineRecord | None, str]:
    """(the record, why it cannot be used): ("" when there is simply none)."""
    path = native_folder(project) / "engine.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"the engine record {path} cannot be read ({exc.strerror or exc})"
    try:
        record = EngineRecord.from_json(json.loads(text))
    except ValueError as exc:
        return None, f"the engine record {path} is not valid JSON ({exc})"
    if record is None:
        return None, f"the engine record {path} lacks a usable pid, start time or marker"
    return record, ""


def marker_prefix(project: Project) -> str:
    """Every engine this checkout starts carries VLLMSTACK_ENGINE_ID=<prefix><random>, so its
    processes are found even when no record names them (a damaged engine.json)."""
    return f"{checkout_id(project.root)}-"


def new_marker(project: Project) -> str:
    return marker_prefix(project) + secrets.token_hex(12)


def launch_marker(project: Project) -> str | None:
    """The marker in launch.json (written before the engine starts): the way to an engine
    started before markers carried the checkout's prefix."""
    try:
        data = json.loads((native_folder(project) / "launch.json").read_text())
        marker = data["marker"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return marker if isinstance(marker, str) and marker else None

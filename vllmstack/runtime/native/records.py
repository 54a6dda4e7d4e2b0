"""The engine record under generated/native/: which process is the native engine.

engine.json holds the pid (= process group = session), its start time (field 22 of
/proc/PID/stat), the boot id, a random marker and the keeper's pid; see `procs` for how a
record is matched against the live process table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    try:
        data = json.loads((native_folder(project) / "engine.json").read_text())
    except (OSError, ValueError):
        return None
    return EngineRecord.from_json(data)

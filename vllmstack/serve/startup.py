"""`invoke startup`: the phases of the last boot, or of a saved engine log, and how `up` keeps them.

`up` measures every boot it waits for (serve.boot_phases, with the launch, /health and warm-up
times it took) and records it three times: in the engine's state file (generated/state.json, or a
named engine's generated/engines/NAME/state.json), which `status` reads while the engine runs; in
boot.json beside it, which `down` leaves, so the last boot can still be read after it; and as a
line of results/boot_history.jsonl (serve.boot_history), one per boot. A boot still under way (a
state file without phases) is read from the engine's log as far as it goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllmstack.config.engines.table import engine_of
from vllmstack.core.checkout import engine_dir, engine_names
from vllmstack.core.checkout import engine_name as slot_of  # a profile's engine slot
from vllmstack.core.errors import StackError
from vllmstack.core.files import (
    FileWriteError,
    JsonFileError,
    file_head,
    read_json_file,
    tail_lines,
    write_json,
)
from vllmstack.core.paths import Project
from vllmstack.core.runner import mask_text
from vllmstack.runtime.compile_cache import compile_key
from vllmstack.serve.boot_history import BootRecord, append_boot, read_boots
from vllmstack.serve.boot_markers import COMPILE, DIALECTS, OTHER
from vllmstack.serve.boot_phases import Boot, measure_boot
from vllmstack.serve.engines import named_stack
from vllmstack.serve.stack import Stack
from vllmstack.serve.state import StateError, read_state, write_state

BOOT_FILE = "boot.json"
# How much of an engine's log a boot is read from: a TP boot with tracebacks runs to thousands.
BOOT_LOG_LINES = 20_000
SAVED_NOTE = ("a saved log starts at its first line: the process's start and imports before it are "
              "not in it (`invoke up` measures them, as `starting`)")
# The phases a one-line summary names (the longest first).
SUMMARY_PHASES = 3


class StartupError(StackError):
    """No boot to show, or a record of one that cannot be read."""


@dataclass(frozen=True)
class Startup:
    """A boot and where it was read from."""

    boot: Boot
    source: str  # "generated/state.json", "generated/boot.json", "the engine's log", a log file
    profile: str | None = None
    running: bool = False  # its engine has a state file: `up` started it and no `down` since

    def as_json(self) -> dict[str, Any]:
        return {"source": self.source, "profile": self.profile, "running": self.running,
                **self.boot.as_json(), "agrees": self.boot.agrees}


def boot_path(project: Project, slot: str = "") -> Path:
    return engine_dir(project.generated, slot) / BOOT_FILE


def record_boot(project: Project, slot: str, boot: Boot, profile: str) -> None:
    """boot.json: the last boot of this engine, kept after `down` (FileWriteError on failure)."""
    write_json(boot_path(project, slot), {"profile": profile, "recorded": time.time(),
                                          "boot": boot.as_json()})


def measure_up_boot(stack: Stack, launched: float | None, ready: float,
                    warmup_s: float) -> Boot | None:
    """`up`'s record of the boot it waited for: its phases from the engine's log, in the state
    file and boot.json. Never fails `up` (the engine serves either way): a log that cannot be
    read or a record that cannot be written is a note, and what was measured is still returned."""
    try:
        lines = stack.engine.log_lines(BOOT_LOG_LINES)
    except StackError as exc:
        print(f"note: the boot's phases were not measured: {exc.cause}", file=stack.out)
        return None
    secrets = stack.resolved.secrets()  # vLLM logs its non-default args, an --api-key among them
    boot = measure_boot([mask_text(line, secrets) for line in lines] if secrets else lines,
                        launched=launched, ready=ready, warmup_s=warmup_s,
                        engine=engine_of(stack.resolved))
    try:
        state = read_state(stack.project, stack.slot)
        if state is not None:
            write_state(stack.project, {**state, "boot": boot.as_json()}, stack.slot)
        record_boot(stack.project, stack.slot, boot, stack.resolved.profile)
        argv = state.get("argv") if state is not None else None
        key = compile_key(stack.resolved, [str(a) for a in argv]) if isinstance(argv, list) else ""
        append_boot(stack.project, BootRecord(time.time(), stack.resolved.profile, stack.slot, boot,
                                              key))
    except (StateError, FileWriteError) as exc:
        print(f"note: the boot's phases were not recorded: {exc.cause}", file=stack.out)
    return boot


def engine_slot(project: Project, profile: str | None) -> str:
    """The engine a profile's boot is read from: the router's named engine for it when the
    checkout has one, else the default engine (`invoke up`)."""
    slot = slot_of(profile) if profile else ""
    return slot if slot and slot in engine_names(project.generated) else ""


def read_startup(project: Project, *, log: Path | None = None, profile: str | None = None,
                 engine: str | None = None, default_stack: Callable[[], Stack]) -> Startup:
    """`invoke startup`: the boot in a saved log (`log`, `engine`: whose), else the last boot of
    `profile`'s engine (the router's named one; default: the engine `invoke up` started), whose
    runtime (`default_stack`, opened only when needed) gives the log of a boot under way."""
    if log is not None:
        return saved_startup(log, engine)
    slot = engine_slot(project, profile)

    def engine_log() -> Sequence[str]:
        stack = default_stack()
        return (named_stack(stack, slot) if slot else stack).engine.log_lines(BOOT_LOG_LINES)

    found = last_startup(project, slot, log_lines=engine_log)
    if profile and found.profile and found.profile != profile:
        raise StartupError(f"no boot of {profile} is recorded: the last one ({found.source}) is "
                           f"{found.profile}'s", "`invoke startup --history 20` lists the boots "
                           "recorded; `invoke up --model PROFILE` (or the router) records one")
    return found


def last_startup(project: Project, slot: str = "", *,
                 log_lines: Callable[[], Sequence[str]] | None = None) -> Startup:
    """The engine's last boot: what `up` recorded in its state file; a boot under way from its
    log (`log_lines`, the runtime's); after `down`, boot.json. StartupError when there is none."""
    where = str(engine_dir(Path("generated"), slot))
    state = read_state(project, slot)
    if state is not None:
        profile = state.get("profile") if isinstance(state.get("profile"), str) else None
        if "boot" in state:
            return Startup(_boot_of(state["boot"], f"{where}/state.json"),
                           f"{where}/state.json", profile, running=True)
        if log_lines is not None:
            started = state.get("launched", state.get("started"))
            boot = measure_boot(log_lines(), launched=float(started) if started else None,
                                engine=str(state.get("engine") or "") or None)
            return Startup(boot, "the engine's log (its boot is not recorded yet: still booting?)",
                           profile, running=True)
    try:
        record = read_json_file(boot_path(project, slot), f"{where}/{BOOT_FILE}")
    except JsonFileError as exc:
        raise StartupError(exc.cause, exc.fix) from exc
    if record is None:
        raise StartupError(f"no boot is recorded in {where}: `invoke up` records each boot it "
                           "waits for", "`invoke up` first, or `invoke startup --log FILE` for a "
                           "saved engine log")
    profile = record.get("profile") if isinstance(record.get("profile"), str) else None
    return Startup(_boot_of(record.get("boot"), f"{where}/{BOOT_FILE}"), f"{where}/{BOOT_FILE}",
                   profile)


def saved_startup(path: Path, engine: str | None = None) -> Startup:
    """The last boot in a saved engine log (`engine`: whose; found from its stamps when None)."""
    if file_head(path, 0) is None:  # a folder or a FIFO is refused there, never read
        raise StartupError(f"{path} does not exist", "name a saved engine log: `invoke logs "
                           "--no-follow --tail 20000 > engine.log` saves the running one")
    boot = measure_boot(tail_lines(path, BOOT_LOG_LINES), engine=engine)
    dialect = DIALECTS.get(boot.engine or "")
    if dialect is not None and not dialect.process_clock:  # llama-server's count from its start
        boot = replace(boot, notes=(*boot.notes, SAVED_NOTE))
    return Startup(boot, str(path))


def _boot_of(data: Any, where: str) -> Boot:
    try:
        return Boot.from_json(data)
    except ValueError as exc:
        raise StartupError(f"the boot recorded in {where} {exc}",
                           f"move {where} aside; the next `invoke up` records a new one") from exc


@dataclass(frozen=True)
class History:
    """The last boots of results/boot_history.jsonl, oldest first."""

    records: tuple[BootRecord, ...]
    skipped: int  # lines that could not be read (torn, or a newer version's)

    def as_json(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "boots": [
            {"recorded": r.recorded, "profile": r.profile, "slot": r.slot,
             "compile_key": r.compile_key, **r.boot.as_json()}
            for r in self.records]}


def boot_history(project: Project, count: int) -> History:
    """`invoke startup --history N`: the last `count` boots `up` recorded."""
    records, skipped = read_boots(project, count)
    return History(tuple(records), skipped)


# --- rendering ---------------------------------------------------------------------------------


def marker_of(boot: Boot, name: str) -> str:
    """What the table says beside a phase: torch.compile's cache, or the engine's own figure."""
    if name == COMPILE and boot.compile:
        return f"{boot.compile} ({'cache hit' if boot.compile == 'warm' else 'compiled: cache miss'})"
    return ""


def render_startup(startup: Startup) -> str:
    boot = startup.boot
    head = (f"boot of {startup.profile}" if startup.profile else "boot") + (
        f" ({boot.engine})" if boot.engine else "")
    if boot.launched:
        head += time.strftime(", launched %Y-%m-%d %H:%M:%S", time.localtime(boot.launched))
    lines = [f"{head}: {boot.wall_s:.1f} s, {_kind(boot)}; from {startup.source}",
             f"{'phase':<22} {'seconds':>8} {'share':>7}  marker"]
    for phase in boot.phases:
        share = phase.seconds / boot.wall_s * 100 if boot.wall_s > 0 else 0.0
        said = f"vLLM logged {phase.logged_s:g} s" if phase.logged_s is not None else ""
        marker = "; ".join(m for m in (marker_of(boot, phase.name), said) if m)
        lines.append(f"{phase.name:<22} {phase.seconds:8.1f} {share:6.1f} %  {marker}".rstrip())
    share = boot.sum_s / boot.wall_s * 100 if boot.wall_s > 0 else 100.0
    lines.append(f"sum {boot.sum_s:.1f} s of {boot.wall_s:.1f} s wall ({share:.1f} %"
                 + ("" if boot.agrees else ", more than 5 % apart") + ")")
    lines += [f"note: {note}" for note in boot.notes]
    return "\n".join(lines)


def summary_line(boot: Boot, *, wall: bool = True) -> str:
    """One line for `up` and `status` (`wall`: leading with the wall time, and naming the
    command that shows the rest): cold or warm, the longest phases."""
    longest = sorted((p for p in boot.phases if p.name != OTHER), key=lambda p: -p.seconds)
    named = ", ".join(f"{p.name} {p.seconds:.1f} s" for p in longest[:SUMMARY_PHASES])
    text = _kind(boot) + (f"; longest: {named}" if named else "")
    return f"{boot.wall_s:.1f} s, {text} (invoke startup)" if wall else text


def boot_summary(data: Any) -> str:
    """`summary_line` of a recorded boot (`status`); never raises on a damaged record."""
    try:
        return summary_line(Boot.from_json(data))
    except ValueError:
        return "recorded, but not readable (`invoke startup` says why)"


def _kind(boot: Boot) -> str:
    what = {"cold": "cold (torch.compile compiled)", "warm": "warm (torch.compile cache hit)"}
    compiled = boot.seconds_of(COMPILE) > 0  # vLLM's CPU build without AOT says neither
    text = what.get(boot.compile or "", "torch.compile, its cache not logged" if compiled
                    else "no torch.compile")
    return text if boot.complete else text + ", incomplete"


def render_history(history: History) -> str:
    if not history.records:
        return ("no boot is recorded in results/boot_history.jsonl yet: `invoke up` adds one for "
                "each boot it waits for")
    lines = [f"{'recorded':<19}  {'profile':<24} {'wall':>7}  boot"]
    for record in history.records:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.recorded))
        name = record.profile + (f" ({record.slot})" if record.slot else "")
        lines.append(f"{when:<19}  {name:<24} {record.boot.wall_s:6.1f}s  "
                     + summary_line(record.boot, wall=False))
    if history.skipped:
        lines.append(f"note: {history.skipped} line(s) could not be read (torn by a killed writer, "
                     "or written by a newer version) and are left out")
    return "\n".join(lines)

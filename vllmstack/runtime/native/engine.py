"""The native runtime: the engine as a supervised process group on the host, no containers.

`invoke up --runtime native` runs the argv and environment the container would get (only the
bind address and the chat-template folder differ) as a process group in its own session. A
small keeper (`python -m vllmstack.runtime.native.keeper keep SPEC`, started through the Runner,
which returns as soon as the engine is launched) starts the engine, records it and waits for it, so a later
`invoke status`/`down` from another process finds it and learns its exit code.

Files under generated/native/:
  launch.json       what to run: argv, the environment added to the caller's, the log path
  engine.json       the record: pid (= process group = session), its start time (field 22 of
                    /proc/PID/stat), the boot id, the marker (this checkout's id and a random
                    part), the keeper's pid
  engine.exit.json  the exit code, written by the keeper when the engine ends
  engine.log        everything the engine printed (engine.log.1: the run before)

A named engine (`slot`: the router runs one per profile, several at once) keeps the same files
in generated/engines/NAME/native/ and carries a marker of its own (records.marker_prefix), so
starting, stopping or finding one never touches another; only the default engine ("") has the
dashboard beside it.

Which processes are the engine's is `procs`' business (the leader, its group, and the marker
VLLMSTACK_ENGINE_ID in the environment). Because the marker starts with the checkout's id, an
engine no record names (engine.json damaged, or overwritten) is found too: `status` shows it,
`up` will not start a second one beside it, and `down` ends it instead of printing "stopped"
over a live engine. Nothing else is ever signalled: a record copied from another checkout, or one
naming a process that does not carry its marker, is reported with the pid and left alone
(`remove` returns those lines, so `down` can say why a port still answers).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vllmstack.config.profiles import Resolved
from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core.files import (
    FileWriteError,
    JsonFileError,
    read_json_file,
    remove_file,
    tail_lines,
    write_json,
)
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime.base import MISSING, Beside, EngineState
from vllmstack.runtime.native.beside import native_beside
from vllmstack.runtime.native.command import (
    IPC_DIR,
    NativeCommand,
    clear_sockets,
    install_hint,
    native_serve_command,
)
from vllmstack.runtime.native.dashboard import NativeDashboard
from vllmstack.runtime.native.keeper import keeper_failure
from vllmstack.runtime.native.procs import (
    DEFAULT_GRACE_S,
    EngineGroup,
    NativeError,
    ProcTable,
    human_age,
    marked_engines,
)
from vllmstack.runtime.native.records import (
    MARKER_VAR,
    EngineRecord,
    load_record,
    marker_prefix,
    native_folder,
    new_marker,
    origin_of,
)

# The keeper writes the exit code a moment after the engine ends; state() waits this long for it.
EXIT_WAIT_S = 2.0
# `python -m vllmstack.runtime.native.keeper` runs from here, so it imports this very package
# whatever the caller's PYTHONPATH or working folder (the engine's working folder is the project).
PACKAGE_PARENT = Path(__file__).resolve().parents[3]
KEEPER_MODULE = "vllmstack.runtime.native.keeper"


@dataclass
class NativeEngine:
    """The engine as a host process group started by a keeper (EngineRuntime)."""

    project: Project
    runner: Runner
    resolved: Resolved | None = None
    environ: Mapping[str, str] = field(default_factory=dict)
    table: ProcTable = field(default_factory=ProcTable)
    grace: float = DEFAULT_GRACE_S
    out: TextIO = field(default_factory=lambda: sys.stdout)
    python: str = field(default_factory=lambda: sys.executable)
    device_root: Path = Path("/")
    can_open: Callable[[Path], bool] = field(
        default_factory=lambda: lambda path: os.access(path, os.R_OK | os.W_OK))
    name: str = "native"
    slot: str = ""  # the engine's name in the checkout; "" is `invoke up`'s default engine
    prepared: ServeCommand | None = None  # the argv `up` checked and records (see prepare)

    @classmethod
    def for_stack(cls, project: Project, resolved: Resolved, environ: Mapping[str, str],
                  runner: Runner, slot: str = "") -> NativeEngine:
        grace = resolved.get("NATIVE_STOP_GRACE") or ""
        return cls(project, runner, resolved, environ,
                   grace=float(grace) if grace.strip().isdigit() else DEFAULT_GRACE_S, slot=slot)

    @property
    def flavour(self) -> str:
        return "native"

    @property
    def folder(self) -> Path:
        return native_folder(self.project, self.slot)

    @property
    def record_path(self) -> Path:
        return self.folder / "engine.json"

    @property
    def exit_path(self) -> Path:
        return self.folder / "engine.exit.json"

    @property
    def spec_path(self) -> Path:
        return self.folder / "launch.json"

    @property
    def log_path(self) -> Path:
        return self.folder / "engine.log"

    def read_record(self) -> EngineRecord | None:
        return load_record(self.project, self.slot).record

    def unrecorded(self, record: EngineRecord | None = None) -> list[EngineRecord]:
        """This checkout's engines that `record` does not name, found by their marker: one
        whose record was damaged, or overwritten by an `up` of a version without the lock."""
        prefix = marker_prefix(self.project, self.slot)
        skip = record.marker if record is not None else None
        return marked_engines(self.table, lambda marker: marker != skip and marker.startswith(prefix))

    def command(self) -> NativeCommand:
        if self.resolved is None:
            raise NativeError("no profile was resolved, so there is nothing to start")
        return native_serve_command(self.project, self.resolved, self.environ, folder=self.folder,
                                    command=self.prepared)

    # -- EngineRuntime ----------------------------------------------------------------------------

    def prepare(self, command: ServeCommand, *, dry_run: bool) -> list[str]:
        # No image or files; `start` runs `command`: the argv `check` built, which `up` records.
        self.prepared = command
        return []

    def beside(self, command: ServeCommand) -> Beside:
        if self.resolved is None:
            raise NativeError("no profile was resolved, so there is no engine to run beside")
        return native_beside(self.project, self.resolved, self.environ, self.runner)

    def start(self) -> None:
        """Launch the engine through the keeper; returns once it runs (not once it is healthy)."""
        command = self.command()
        previous = self.read_record()
        if previous is not None:
            # Like compose's --force-recreate: whatever ran before goes first.
            self._end(previous, forget=True)
        self._end_unrecorded(previous)
        try:
            self._check_devices()
            self._check_executable(command)
        except NativeError as exc:
            if not self.runner.dry_run:
                raise
            print(f"(dry run) note: {exc}; fix: {exc.fix}", file=self.out)
        for note in command.notes:
            print(f"note: {note}", file=self.out)
        marker = new_marker(self.project, self.slot)
        spec = {"argv": command.argv, "env": {**command.env, MARKER_VAR: marker},
                "cwd": str(self.project.root), "root": str(self.project.root.resolve()),
                "log": str(self.log_path),
                "record": str(self.record_path), "exit": str(self.exit_path), "marker": marker,
                "grace": self.grace}
        keeper = [self.python, "-m", KEEPER_MODULE, "keep", str(self.spec_path)]
        if self.runner.dry_run:
            print(f"(dry run) the native engine would run: {command.shell()}", file=self.out)
            self.runner.run(keeper, cwd=PACKAGE_PARENT)
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            clear_sockets(self.folder / IPC_DIR)  # left by an engine that crashed: none runs now
            for folder in command.cache_dirs:
                folder.mkdir(parents=True, exist_ok=True)
            if self.log_path.exists():
                self.log_path.replace(self.log_path.with_name("engine.log.1"))
            self.exit_path.unlink(missing_ok=True)
            # 0600: the added environment can hold tokens (ENGINE_ENV).
            write_json(self.spec_path, spec, mode=0o600)
        except FileWriteError:
            raise
        except OSError as exc:  # a folder that cannot be made: named, never a traceback
            raise FileWriteError(Path(exc.filename or self.folder), exc) from exc
        result = self.runner.run(keeper, env=dict(self.environ), cwd=PACKAGE_PARENT, timeout=60)
        if not result.ok:
            raise keeper_failure("the native engine", result.stdout, result.stderr,
                                 result.returncode,
                                 "check NATIVE_ENGINE_COMMAND / the engine environment "
                                 "(invoke install-engine), and the log generated/native/engine.log")

    def state(self) -> EngineState:
        record, problem, _ = load_record(self.project, self.slot)
        if record is None:
            found = [p.pid for r in self.unrecorded() for p in EngineGroup(r, self.table).find()]
            if not found:
                return MISSING
            # Running, as far as `up` (refuse a second engine) and `down` (end it) are concerned.
            return EngineState(True, True, "running", details={
                "pids": sorted(found), "record": problem or "no engine record names it"})
        details: dict[str, Any] = {"pid": record.pid, "log": record.log, "started": record.started}
        status = self.table.identify(record)
        if status == "alive":
            return EngineState(True, True, "running", details=details)
        if status in ("reused", "rebooted", "unmarked"):
            details["stale"] = self._stale_reason(record, status)
            return EngineState(True, False, "stale", details=details)
        code = self._exit_code(record)
        leftovers = [p.pid for p in EngineGroup(record, self.table).find()]
        if leftovers:
            details["leftover_pids"] = leftovers
        if disk_full(self.folder):
            # Its log could not be written: the likeliest reason it died, and one its log
            # cannot show (serve.watch says so instead of "no known error signature").
            details["disk_full"] = str(self.folder)
        if code is None:
            return EngineState(True, False, "dead", details=details)
        return EngineState(True, False, "exited", exit_code=code, details=details)

    def log_lines(self, tail: int = 400) -> list[str]:
        return tail_lines(self.log_path, tail)

    def log_command(self, *, tail: int, follow: bool, service: str = "vllm") -> list[str] | None:
        """`invoke logs` for the native runtime: tail(1) on the engine's or the dashboard's log."""
        logs = {"vllm": self.log_path, "dashboard": self.dashboard().log_path}
        if service not in logs:
            return None
        return ["tail", "-n", str(tail), *(["-F"] if follow else []), str(logs[service])]

    def exec_command(self, command: Sequence[str], *, tty: bool) -> list[str]:
        raise NativeError("exec runs inside the engine container; the native runtime has none",
                          "run the command directly (the engine venv is under .cache/engines/)")

    def dashboard(self) -> NativeDashboard:
        return NativeDashboard(self.project, self.runner, self.environ, out=self.out,
                               python=self.python, table=self.table)

    def dashboard_up(self) -> None:
        """The dashboard as a recorded host process (runtime.native.dashboard); `down` ends it."""
        if self.resolved is None:
            raise NativeError("no profile was resolved, so the dashboard has no engine to show")
        self.dashboard().up(self.resolved, f"http://127.0.0.1:{self.resolved.get_int('VLLM_PORT')}")

    def dashboard_down(self) -> None:
        for line in self.dashboard().down():
            print(line, file=self.out)

    def stop(self) -> None:
        """Used after a failed start, where the failure itself is the message: never raises."""
        record = self.read_record()
        try:
            if record is not None:
                self._end(record, forget=False)
            # An `up` stopped (SIGTERM, a full disk) before the keeper's record was written:
            # the engine is still this checkout's by its marker.
            self._end_unrecorded(record)
        except NativeError as exc:
            print(f"warning: {exc} (fix: {exc.fix})", file=self.out)

    def remove(self) -> list[str]:
        """End this checkout's engine and dashboard; returns what was found but left alone
        (processes that are not this checkout's), each line naming a pid."""
        # Like compose's `down`: the side-car goes with the default engine (never with a named
        # one, which the router stops while the user's dashboard runs).
        left = [] if self.slot else self.dashboard().down()
        record, problem, foreign = load_record(self.project, self.slot)
        if foreign is not None:
            left += self._foreign(foreign, problem)
        elif problem:
            print(f"warning: {problem}; looking for the engine by the {MARKER_VAR} marker in "
                  "its processes' environment instead", file=self.out)
        # A NativeError here (a process survived SIGKILL) makes `down` fail loudly: it is a
        # StackError, so the caller shows its cause and fix as they are.
        if record is not None:
            left += self._end(record, forget=True)
        # Every engine of this checkout, the recorded one included: a record whose start time is
        # wrong ("reused") left its engine unsignalled above, and its marker still finds it.
        self._end_unrecorded(None)
        if not self.runner.dry_run:
            clear_sockets(self.folder / IPC_DIR)  # the engine has ended: its sockets are stale
            if record is None:
                self._forget()
        return left

    def _foreign(self, record: EngineRecord, problem: str) -> list[str]:
        """Another checkout's record (this one is a copy): named, never used or signalled."""
        proc = self.table.get(record.pid)
        running = proc is not None and not proc.zombie and proc.start_ticks == record.start_ticks
        if not self.runner.dry_run:
            self._forget()  # a copy's record: it never named anything of this checkout
        if not running:
            print(f"note: {problem}; its engine has ended: record ignored", file=self.out)
            return []
        return [f"left alone: pid {record.pid}, the native engine of {origin_of(record, self.project)}"
                f" (its record came here with a copy of that checkout): "
                f"{self.table.cmdline(record.pid)[:100]}"]

    def members(self) -> list[dict[str, Any]]:
        record = self.read_record()
        engine = ([m for r in self.unrecorded() for m in self._members(r, unrecorded=True)]
                  if record is None else self._members(record))
        return engine + ([] if self.slot else self._dashboard_member())

    def _dashboard_member(self) -> list[dict[str, Any]]:
        """The dashboard side-car, as compose lists its container: `down` ends it too."""
        dashboard = self.dashboard().running()
        if dashboard is None:
            return []
        age = human_age(time.time() - dashboard.started)
        return [{"name": f"dashboard (pid {dashboard.pid})", "service": "dashboard",
                 "state": "running", "status": f"Up {age}, dashboard", "pid": dashboard.pid,
                 "image": dashboard.argv[0] if dashboard.argv else ""}]

    def _members(self, record: EngineRecord, *, unrecorded: bool = False) -> list[dict[str, Any]]:
        leader = self.table.is_alive(record)
        note = (" (no engine record names it: `invoke down` ends it)" if unrecorded else
                "" if leader else f" (its engine, pid {record.pid}, has exited)")
        out = []
        for proc in sorted(EngineGroup(record, self.table).find(), key=lambda p: p.pid):
            age = human_age(time.time() - self.table.started_at(proc))
            role = "engine" if proc.pid == record.pid else "engine child"
            out.append({
                "name": f"{proc.comm} (pid {proc.pid})",
                "service": "vllm",
                "state": "running" if leader else "leftover",
                "status": f"Up {age}, {role}{note}",
                "image": record.argv[0] if record.argv else "",
                "pid": proc.pid,
            })
        return out

    # -- helpers ----------------------------------------------------------------------------------

    def _check_devices(self) -> None:
        """A container gets the GPU device nodes through group_add; a host process needs the
        user to be in their groups, and vLLM's own error for that comes late and says little."""
        if self.resolved is None or self.resolved.get("GPU_VENDOR") != "amd":
            return
        blocked = [node for node in (self.device_root / "dev/kfd", *sorted(
            (self.device_root / "dev/dri").glob("renderD*")))
            if node.exists() and not self.can_open(node)]
        if blocked:
            raise NativeError(
                f"you may not open {', '.join(str(p) for p in blocked)}, so the engine cannot "
                "reach the GPU", "sudo usermod -aG render,video $USER, then log in again")

    def _check_executable(self, command: NativeCommand) -> None:
        exe = command.argv[0]
        if command.problem is not None:
            raise NativeError(*command.problem)
        search = command.env.get("PATH") or self.environ.get("PATH") or os.defpath
        if os.sep in exe:
            path = Path(exe) if Path(exe).is_absolute() else self.project.root / exe
            found = path.is_file() and os.access(path, os.X_OK)
        else:
            found = shutil.which(exe, path=search) is not None
        if found:
            return
        if command.install_fix is not None:
            raise NativeError(f"{command.version} is not installed: {exe} does not exist",
                              command.install_fix)
        if command.venv is not None:
            raise NativeError(
                f"the native engine for vLLM {command.version} is not installed: {exe} does not exist",
                install_hint(command.version))
        source = self.resolved.source("NATIVE_ENGINE_COMMAND") if self.resolved else None
        raise NativeError(f"NATIVE_ENGINE_COMMAND starts with {exe!r}, which is not an executable "
                          f"here (set at {source or '?'})",
                          "fix NATIVE_ENGINE_COMMAND, or unset it to run the install-engine environment")

    def _stale_reason(self, record: EngineRecord, status: str) -> str:
        if status == "rebooted":
            return f"the recorded engine (pid {record.pid}) ran before the last reboot"
        other = self.table.cmdline(record.pid) or "?"
        if status == "unmarked":
            return (f"pid {record.pid} has the recorded start time but does not carry the record's "
                    f"{MARKER_VAR} marker, so it is not an engine this checkout started: "
                    f"{other[:120]}")
        return f"pid {record.pid} is no longer the engine (start time differs): it is now {other[:120]}"

    def _exit_code(self, record: EngineRecord) -> int | None:
        deadline = time.monotonic() + EXIT_WAIT_S
        while True:
            code = read_exit_code(self.exit_path, record)
            if code is not None:
                return code
            # The keeper reaps the engine and writes the code a moment later; without a keeper
            # (killed, or another boot) there will never be one.
            if time.monotonic() > deadline or not self.table.keeper_alive(record):
                return None
            time.sleep(0.05)

    def _end(self, record: EngineRecord, *, forget: bool) -> list[str]:
        """End the recorded engine's processes; returns the left-alone line of a recorded pid
        that is not the engine (it does not carry the marker)."""
        status = self.table.identify(record)
        left = []
        if status in ("reused", "rebooted", "unmarked"):
            print(f"stale native engine record: {self._stale_reason(record, status)}; not signalled"
                  + ("; record cleared" if forget and not self.runner.dry_run else ""), file=self.out)
        if status == "unmarked":
            left.append(f"left alone: pid {record.pid} ({self.table.cmdline(record.pid)[:100]}): "
                        f"the engine record names it, but it does not carry the {MARKER_VAR} "
                        "marker the record holds")
        group = EngineGroup(record, self.table)
        if self.runner.dry_run:
            pids = sorted(p.pid for p in group.find())
            if pids:
                print(f"(dry run) would send SIGTERM to the native engine's processes {pids}, then "
                      f"SIGKILL after {self.grace:g} s", file=self.out)
            return left
        count, seconds, killed = group.end(self.grace)
        if count:
            what = (f"the native engine (pid {record.pid})" if status == "alive" else
                    f"leftover process(es) of the exited engine (pid {record.pid})")
            how = f"SIGKILL after the {self.grace:g} s grace" if killed else "SIGTERM"
            print(f"stopped {what}: {count} process(es) ended in {seconds:.1f} s ({how})",
                  file=self.out)
        elif status == "exited" and forget:
            code = self._exit_code(record)
            print(f"the native engine (pid {record.pid}) had already exited"
                  + (f" with code {code}" if code is not None else "") + "; record cleared",
                  file=self.out)
        if forget:
            self._forget()
        return left

    def _end_unrecorded(self, record: EngineRecord | None) -> None:
        """End this checkout's engines that `record` does not name (see `unrecorded`)."""
        for other in self.unrecorded(record):
            group = EngineGroup(other, self.table)
            if self.runner.dry_run:
                pids = sorted(p.pid for p in group.find())
                print(f"(dry run) would end the unrecorded native engine processes {pids} "
                      f"({MARKER_VAR}={other.marker})", file=self.out)
                continue
            count, seconds, killed = group.end(self.grace)
            if count:
                how = f"SIGKILL after the {self.grace:g} s grace" if killed else "SIGTERM"
                print(f"stopped a native engine of this checkout that no record named (pid "
                      f"{other.pid}, found by {MARKER_VAR}): {count} process(es) ended in "
                      f"{seconds:.1f} s ({how})", file=self.out)

    def _forget(self) -> None:
        for path in (self.record_path, self.exit_path, self.spec_path):
            remove_file(path)


def read_exit_code(path: Path, record: EngineRecord) -> int | None:
    """The exit code the keeper wrote for this very engine (pid and marker), else None."""
    try:
        data = read_json_file(path, expect_object=False)
    except JsonFileError:
        return None
    if not isinstance(data, dict) or data.get("pid") != record.pid \
            or data.get("marker") != record.marker:
        return None
    code = data.get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) else None



# Less free space than this, where the engine writes its log, counts as a full disk.
DISK_FULL_BYTES = 1024 * 1024


def disk_full(folder: Path) -> bool:
    """Whether the file system holding `folder` has (almost) no space left for this user."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < DISK_FULL_BYTES


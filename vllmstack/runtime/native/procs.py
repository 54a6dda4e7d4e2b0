"""The host process table as the native runtime sees it: /proc parsing, signalling, ending a group.

Which processes are the engine's: the leader (pid and start time match the record, same boot,
AND it carries the record's marker itself), everything in its process group or session while
that leader lives, and every process whose environment carries the record's marker
(VLLMSTACK_ENGINE_ID). The marker is what finds an EngineCore left behind after the API server
died (a known vLLM failure that keeps GPU memory held): its group leader is gone, but it
inherited the environment. A recorded pid whose start time differs from the record belongs to
another program now, and one whose start time matches but that does not carry the marker (a
hand-made record, say) was never the engine: both are reported, never signalled.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vllmstack.core.errors import StackError
from vllmstack.runtime.native.records import MARKER_VAR, EngineRecord

DEFAULT_GRACE_S = 30.0  # compose.yaml's stop_grace_period, so both runtimes stop alike
KILL_WAIT_S = 10.0
POLL_S = 0.1
# How long a recorded engine may look blank while it execs (ELF loading: milliseconds).
EXEC_WAIT_S = 0.5
EXEC_POLL_S = 0.01


class NativeError(StackError):
    """The native engine cannot be started or stopped as asked; `fix` says what to do."""


@dataclass(frozen=True)
class Proc:
    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int
    start_ticks: int  # clock ticks after boot: with the pid, what tells a process from a reused pid

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X", "x")


def parse_stat(text: str) -> Proc | None:
    """/proc/PID/stat; the command name may hold spaces and parentheses, so split at the last ')'."""
    head, sep, tail = text.rpartition(")")
    pid_text, _, comm = head.partition(" (")
    fields = tail.split()
    if not sep or len(fields) < 20:
        return None
    try:
        return Proc(int(pid_text), comm, fields[0], int(fields[1]), int(fields[2]), int(fields[3]),
                    int(fields[19]))
    except ValueError:
        return None



@dataclass
class ProcTable:
    """Reads /proc. `root` is swappable so the parsing can be tested on a fake tree."""

    root: Path = Path("/proc")

    def get(self, pid: int) -> Proc | None:
        try:
            text = (self.root / str(pid) / "stat").read_text(errors="replace")
        except OSError:
            return None
        return parse_stat(text)

    def each(self) -> Iterator[Proc]:
        try:
            entries = [e.name for e in self.root.iterdir() if e.name.isdigit()]
        except OSError:
            return
        for name in entries:
            proc = self.get(int(name))
            if proc is not None:
                yield proc

    def has_env(self, pid: int, entry: bytes) -> bool:
        try:
            data = (self.root / str(pid) / "environ").read_bytes()
        except OSError:  # gone, or another user's process: not ours either way
            return False
        return entry in data.split(b"\0")

    def env_value(self, pid: int, name: str) -> str | None:
        """The value of `name` in a process's environment (None: unset, or not ours to read)."""
        try:
            data = (self.root / str(pid) / "environ").read_bytes()
        except OSError:
            return None
        key = name.encode() + b"="
        for entry in data.split(b"\0"):
            if entry.startswith(key):
                return entry[len(key):].decode(errors="replace")
        return None

    def carries(self, pid: int, marker: str) -> bool:
        """The process itself says it is the one `marker` names: VLLMSTACK_ENGINE_ID=marker in
        its environment (as the keeper starts it), or that word on its command line (an engine
        started through `env VLLMSTACK_ENGINE_ID=...`). What a record claims is not enough."""
        entry = f"{MARKER_VAR}={marker}"
        if self.has_env(pid, entry.encode()):
            return True
        try:
            raw = (self.root / str(pid) / "cmdline").read_bytes()
        except OSError:
            return False
        return entry.encode() in raw.split(b"\0")

    def cmdline(self, pid: int) -> str:
        try:
            raw = (self.root / str(pid) / "cmdline").read_bytes()
        except OSError:
            return ""
        return shlex.join(part.decode(errors="replace") for part in raw.split(b"\0") if part)

    def boot_id(self) -> str:
        try:
            return (self.root / "sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            return ""

    def boot_time(self) -> float:
        try:
            for line in (self.root / "stat").read_text().splitlines():
                if line.startswith("btime "):
                    return float(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return 0.0

    def started_at(self, proc: Proc) -> float:
        """Wall-clock start time of a process."""
        return self.boot_time() + proc.start_ticks / os.sysconf("SC_CLK_TCK")

    def identify(self, record: EngineRecord) -> str:
        """alive | exited | reused (the pid is another program now) | rebooted | unmarked (pid
        and start time match, but the process does not carry the record's marker: not ours)."""
        boot = self.boot_id()
        if record.boot_id and boot and record.boot_id != boot:
            return "rebooted"
        proc = self.get(record.pid)
        if proc is None:
            return "exited"
        if proc.start_ticks != record.start_ticks:
            return "reused"
        if proc.zombie:
            return "exited"
        deadline = time.monotonic() + EXEC_WAIT_S
        while not self.carries(record.pid, record.marker):
            # Inside an execve (a wrapper that execs the engine, right after the launch) the
            # new image shows an empty environment and command line for a moment: asked then,
            # `up` took its own engine for a stranger's and ended it. Ask again, briefly.
            if not self.mid_exec(record.pid) or time.monotonic() >= deadline:
                return "unmarked" if self.get(record.pid) is not None else "exited"
            time.sleep(EXEC_POLL_S)
        return "alive"

    def mid_exec(self, pid: int) -> bool:
        """Both the environment and the command line read back empty: an image being set up
        (or a kernel thread, whose start time never matches a record)."""
        try:
            return not any((self.root / str(pid) / name).read_bytes() for name in ("environ",
                                                                                   "cmdline"))
        except OSError:
            return False

    def is_alive(self, record: EngineRecord) -> bool:
        return self.identify(record) == "alive"

    def keeper_alive(self, record: EngineRecord) -> bool:
        if record.keeper_pid is None:
            return False
        proc = self.get(record.keeper_pid)
        # The keeper's environment is the caller's: it carries no marker; the pid and start time
        # only decide whether to wait a moment for an exit code, never whom to signal.
        return proc is not None and not proc.zombie and proc.start_ticks == record.keeper_start_ticks


def send_signal(table: ProcTable, proc: Proc, sig: int) -> None:
    """Signal `proc` only if it is still the same process (pidfd: no pid-reuse race)."""
    try:
        fd: int | None = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return
    except OSError:  # kernels before 5.3: check, then kill (a tiny race, as everywhere else)
        fd = None
    try:
        now = table.get(proc.pid)
        if now is None or now.start_ticks != proc.start_ticks:
            return
        if fd is None:
            os.kill(proc.pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        pass
    finally:
        if fd is not None:
            os.close(fd)


@dataclass
class EngineGroup:
    """The processes of one recorded engine: find them, end them (TERM, grace, KILL), verify."""

    record: EngineRecord
    table: ProcTable

    def find(self) -> list[Proc]:
        if self.table.identify(self.record) == "rebooted":
            return []
        # Alive means proven: the leader carries the marker, not only the recorded pid and time.
        leader_alive = self.table.is_alive(self.record)
        found = []
        for proc in self.table.each():
            # Nothing that started before the engine can be its child (cheap, and it skips
            # most of the table before the environment is read).
            if proc.zombie or proc.start_ticks < self.record.start_ticks:
                continue
            in_group = proc.pgid == self.record.pid or proc.sid == self.record.pid
            # While the leader lives its pid cannot be reused, so its group and session are ours.
            if (leader_alive and in_group) or self.table.carries(proc.pid, self.record.marker):
                found.append(proc)
        return found

    def _alive(self, tracked: dict[int, Proc]) -> dict[int, Proc]:
        for proc in self.find():
            tracked.setdefault(proc.pid, proc)
        alive = {}
        for pid, proc in tracked.items():
            now = self.table.get(pid)
            if now is not None and not now.zombie and now.start_ticks == proc.start_ticks:
                alive[pid] = proc
        return alive

    def _signal(self, alive: dict[int, Proc], sig: int) -> None:
        if self.table.is_alive(self.record):
            # The group as a whole also reaches a child forked a moment ago.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.record.pid, sig)
        for proc in alive.values():
            # A process we may not signal is reported below as a survivor.
            with contextlib.suppress(PermissionError):
                send_signal(self.table, proc, sig)

    def end(self, grace: float, *, sleep: Callable[[float], None] = time.sleep) -> tuple[int, float, bool]:
        """SIGTERM everything, SIGKILL what is left after `grace` s; (count, seconds, killed).

        Raises NativeError naming the processes that survive SIGKILL.
        """
        tracked = {proc.pid: proc for proc in self.find()}
        if not tracked:
            return 0, 0.0, False
        count = len(tracked)
        started = time.monotonic()
        alive = self._alive(tracked)
        self._signal(alive, signal.SIGTERM)
        killed = False
        for sig, wait in ((None, grace), (signal.SIGKILL, KILL_WAIT_S)):
            if sig is not None and alive:
                killed = True
                self._signal(alive, sig)
            deadline = time.monotonic() + wait
            while alive and time.monotonic() < deadline:
                sleep(POLL_S)
                alive = self._alive(tracked)
            if not alive:
                break
        count = max(count, len(tracked))
        if alive:
            what = ", ".join(f"{p.pid} ({p.comm})" for p in alive.values())
            raise NativeError(f"process(es) {what} of the native engine survived SIGKILL",
                              "they are stuck in the kernel, usually in the GPU driver (see dmesg); "
                              "a reboot frees them")
        return count, time.monotonic() - started, killed


def marked_engines(table: ProcTable, belongs: Callable[[str], bool]) -> list[EngineRecord]:
    """Engines found by the marker in their environment alone, one record per marker that
    `belongs` accepts: what `down` ends when no record (or a damaged one) names them.

    Each record's leader is its oldest marked process."""
    groups: dict[str, list[Proc]] = {}
    for proc in table.each():
        if proc.zombie:
            continue
        marker = table.env_value(proc.pid, MARKER_VAR)
        if marker and belongs(marker):
            groups.setdefault(marker, []).append(proc)
    boot = table.boot_id()
    found = []
    for marker, members in sorted(groups.items()):
        # The oldest: the engine's leader while it lives (its children start after it), and a
        # start time no other member precedes (EngineGroup.find skips older processes).
        leader = min(members, key=lambda p: (p.start_ticks, p.pid))
        found.append(EngineRecord(pid=leader.pid, start_ticks=leader.start_ticks, boot_id=boot,
                                  marker=marker, argv=[], log="", started=0.0))
    return found


def human_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


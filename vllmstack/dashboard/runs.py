"""Benchmark runs started from the dashboard: one at a time, cancellable as a whole.

A run is a subprocess (normally `python -m vllmstack.bench KIND ...`, which appends
its own history record). This module holds a live process handle — streamed
output, a process group to signal — which the blocking `Runner.run` protocol does
not offer, so it uses `subprocess.Popen` directly; the argv comes from an
injectable builder, so tests start a tiny fake command instead.

One lock covers every kind: the check "is anything running?" and the claim
"now this runs" happen under the same `threading.Lock`, so of two starts sent
together exactly one wins and the other answers "busy" at once.

The running benchmark is also recorded in a file (`record_path`: pid, start time, and a marker
its environment carries, VLLMSTACK_RUN_ID). A run lives in its own session, so a dashboard that
is SIGKILLed leaves it running; the next dashboard finds it there (the process must match the
pid, the start time AND carry the marker), shows it as running, refuses a second run beside it,
and can cancel it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.core.errors import StackError
from vllmstack.core.files import JsonFileError, read_json_file, write_json
from vllmstack.runtime.native.procs import ProcTable

RUN_KINDS = ("bench", "depth", "conc")
RUN_RECORD_FILE = ".dashboard-run.json"
RUN_MARKER_VAR = "VLLMSTACK_RUN_ID"
ADOPTED_POLL_S = 0.5

# Wall-clock limits per kind: a depth or concurrency ladder on a big model takes long.
DEFAULT_TIMEOUTS = {"bench": 1800.0, "depth": 7200.0, "conc": 7200.0}

CommandBuilder = Callable[[str, Mapping[str, Any]], Sequence[str]]


class RunError(StackError, RuntimeError):
    """A run could not be started (bad options, engine not reachable); the message says why."""


class RunBusyError(RunError):
    def __init__(self, active: str) -> None:
        self.active = active
        super().__init__(f"a {active} run is in progress; cancel it or wait until it ends")


class RunNotActiveError(RunError):
    def __init__(self, kind: str) -> None:
        super().__init__(f"no {kind} run is in progress")


@dataclass
class RunState:
    kind: str
    status: str = "idle"  # idle, starting, running, finished, failed, cancelled, timeout
    argv: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    started_at: float | None = None
    ended_at: float | None = None
    returncode: int | None = None
    pid: int | None = None
    message: str | None = None
    log_limit: int = 16_000
    _log: deque[str] = field(default_factory=deque)
    _log_chars: int = 0
    _dropped: int = 0

    @property
    def running(self) -> bool:
        return self.status in ("starting", "running")

    def append(self, line: str) -> None:
        self._log.append(line)
        self._log_chars += len(line)
        # Keep the tail: the end of a long run's output is what explains how it ended.
        while self._log_chars > self.log_limit and len(self._log) > 1:
            self._log_chars -= len(self._log.popleft())
            self._dropped += 1

    def as_dict(self) -> dict[str, Any]:
        end = self.ended_at if self.ended_at is not None else time.time()
        log = "".join(self._log)
        if self._dropped:
            log = f"[... {self._dropped} earlier lines not kept ...]\n" + log
        return {
            "kind": self.kind,
            "status": self.status,
            "running": self.running,
            "argv": list(self.argv),
            "options": dict(self.options),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "elapsed": None if self.started_at is None else round(end - self.started_at, 3),
            "returncode": self.returncode,
            "pid": self.pid,
            "message": self.message,
            "log": log,
        }


@dataclass
class _Live:
    proc: subprocess.Popen[str]
    done: threading.Event
    cancel_requested: bool = False
    timed_out: bool = False


class RunManager:
    """Starts, watches and cancels runs; at most one run of any kind at a time."""

    def __init__(
        self,
        build_command: CommandBuilder,
        *,
        timeouts: Mapping[str, float] | None = None,
        grace_s: float = 5.0,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        log_limit: int = 16_000,
        on_end: Callable[[RunState], None] | None = None,
        record_path: Path | None = None,
        table: ProcTable | None = None,
    ) -> None:
        self._build = build_command
        self._timeouts = dict(DEFAULT_TIMEOUTS, **(timeouts or {}))
        self._grace = grace_s
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self._on_end = on_end
        self._lock = threading.Lock()
        self._active: str | None = None
        self._live: _Live | None = None
        self._pending_cancel = False
        self._states = {kind: RunState(kind, log_limit=log_limit) for kind in RUN_KINDS}
        self._record_path = record_path
        self._table = table or ProcTable()
        # A run an earlier dashboard started and left behind: (pid, start ticks, marker).
        self._adopted: tuple[int, int, str] | None = None
        self._adopted_cancelled = False  # its end is then "cancelled", whoever sees it first
        self._adopt()

    @property
    def active(self) -> str | None:
        return self._active

    def state(self, kind: str) -> dict[str, Any]:
        self._check_kind(kind)
        with self._lock:
            return self._states[kind].as_dict()

    def states(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {kind: state.as_dict() for kind, state in self._states.items()}

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in RUN_KINDS:
            raise RunError(f"unknown run kind {kind!r}; known kinds: {', '.join(RUN_KINDS)}")

    def start(self, kind: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Claim the lock, build the command, start it. Raises RunBusyError at once when taken."""
        self._check_kind(kind)
        with self._lock:
            if self._active is not None:
                raise RunBusyError(self._active)
            self._active = kind
            self._pending_cancel = False
            state = RunState(kind, status="starting", options=dict(options or {}),
                             started_at=time.time(), log_limit=self._states[kind].log_limit)
            self._states[kind] = state
        try:
            # Building may ask the engine for its model name: done after the claim, so a
            # second start never waits for it.
            argv = [str(a) for a in self._build(kind, options or {})]
            with self._lock:
                if self._pending_cancel:
                    raise RunError("cancelled before it started")
                state.argv = argv
                marker = secrets.token_hex(16)
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    bufsize=1,
                    env={**(self._env if self._env is not None else os.environ),
                         RUN_MARKER_VAR: marker},
                    cwd=self._cwd,
                    # Its own session and process group: cancel signals the whole tree.
                    start_new_session=True,
                )
                self._record(kind, proc.pid, marker, argv)
                live = _Live(proc, threading.Event())
                self._live = live
                state.pid = proc.pid
                state.status = "running"
                state.append(f"$ {' '.join(argv)}\n")
        except BaseException as exc:
            with self._lock:
                cancelled = self._pending_cancel
                state.status = "cancelled" if cancelled else "failed"
                state.message = str(exc) if not isinstance(exc, OSError) else (
                    f"cannot start {state.argv[:1] or kind}: {exc}")
                state.ended_at = time.time()
                self._active = None
                self._live = None
            if isinstance(exc, RunError) and cancelled:
                return self.state(kind)
            if isinstance(exc, OSError):
                raise RunError(state.message or str(exc)) from exc
            raise
        threading.Thread(target=self._watch, args=(state, live), daemon=True,
                         name=f"run-{kind}").start()
        return self.state(kind)

    def _watch(self, state: RunState, live: _Live) -> None:
        proc = live.proc
        reader = threading.Thread(target=self._read, args=(state, proc), daemon=True)
        reader.start()
        timeout = self._timeouts.get(state.kind)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            live.timed_out = True
            with self._lock:
                state.append(f"[timeout after {timeout:.0f} s: stopping the run]\n")
            self._stop_group(proc)
        # Anything the run left behind in its group (a grandchild holding our pipe) goes too.
        _signal_group(proc.pid, signal.SIGKILL)
        reader.join(timeout=5)
        self._forget_record()
        with self._lock:
            state.returncode = proc.returncode
            state.ended_at = time.time()
            if live.cancel_requested:
                state.status = "cancelled"
                state.append("[cancelled]\n")
            elif live.timed_out:
                state.status = "timeout"
            elif proc.returncode == 0:
                state.status = "finished"
            else:
                state.status = "failed"
                state.message = f"exited with code {proc.returncode}"
            self._active = None
            self._live = None
        live.done.set()
        if self._on_end is not None:
            self._on_end(state)

    def _read(self, state: RunState, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                with self._lock:
                    state.append(line if line.endswith("\n") else line + "\n")

    def _stop_group(self, proc: subprocess.Popen[str]) -> None:
        """SIGTERM the whole group, then SIGKILL what is still alive after the grace period."""
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=self._grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()

    def cancel(self, kind: str, wait: float | None = None) -> dict[str, Any]:
        """End the active run of `kind` and everything it started; returns its final state."""
        self._check_kind(kind)
        with self._lock:
            if self._active != kind:
                raise RunNotActiveError(kind)
            adopted, live = self._adopted, self._live
            if adopted is None:
                if live is None:
                    # Still building its command: stop it before it starts.
                    self._pending_cancel = True
                    return self._states[kind].as_dict()
                live.cancel_requested = True
                self._states[kind].append("[cancel requested: SIGTERM to the run's process group]\n")
        if adopted is not None:
            self._stop_adopted(kind, adopted)
            return self.state(kind)
        assert live is not None
        self._stop_group(live.proc)
        live.done.wait(timeout=wait if wait is not None else self._grace + 10)
        return self.state(kind)

    # -- the record of the running benchmark, and a run left by an earlier dashboard -------------

    def _record(self, kind: str, pid: int, marker: str, argv: list[str]) -> None:
        proc = self._table.get(pid)
        if self._record_path is None or proc is None:
            return
        with contextlib.suppress(OSError):  # unrecorded, it still runs and is watched here
            write_json(self._record_path, {"pid": pid, "start_ticks": proc.start_ticks,
                                           "marker": marker, "kind": kind, "argv": argv,
                                           "started": time.time()}, mode=0o600)

    def _forget_record(self) -> None:
        if self._record_path is not None:
            with contextlib.suppress(OSError):
                self._record_path.unlink(missing_ok=True)

    def _same(self, pid: int, start: int, marker: str) -> bool:
        """The recorded run is still that very process: pid, start time and its own marker."""
        proc = self._table.get(pid)
        return (proc is not None and not proc.zombie and proc.start_ticks == start
                and self._table.has_env(pid, f"{RUN_MARKER_VAR}={marker}".encode()))

    def _alive(self, pid: int, start: int) -> bool:
        proc = self._table.get(pid)
        return proc is not None and not proc.zombie and proc.start_ticks == start

    def _adopt(self) -> None:
        """Find a run an earlier dashboard left running (killed, it could not end it)."""
        if self._record_path is None:
            return
        try:
            data = read_json_file(self._record_path, "the dashboard's run record")
        except JsonFileError:
            data = None  # damaged: it names nothing that can be proven
        found = _recorded_run(data)
        if found is None or not self._same(*found[:3]):
            self._forget_record()
            return
        pid, start, marker, kind, argv, started = found
        state = RunState(kind, status="running", argv=argv, started_at=started, pid=pid,
                         log_limit=self._states[kind].log_limit,
                         message=f"started by an earlier dashboard that has ended (run pid {pid}); "
                                 "its output is not shown here; cancel stops it")
        state.append(f"[a {kind} run left by an earlier dashboard is still running (pid {pid})]\n")
        self._states[kind] = state
        self._active, self._adopted = kind, (pid, start, marker)
        threading.Thread(target=self._watch_adopted, args=(kind, (pid, start, marker)),
                         daemon=True, name=f"adopted-{kind}").start()

    def _watch_adopted(self, kind: str, adopted: tuple[int, int, str]) -> None:
        while self._same(*adopted):
            time.sleep(ADOPTED_POLL_S)
        self._end_adopted(kind, adopted, "ended")

    def _end_adopted(self, kind: str, adopted: tuple[int, int, str], status: str) -> None:
        with self._lock:
            if self._adopted != adopted:
                return
            state = self._states[kind]
            status = "cancelled" if self._adopted_cancelled else status
            state.status, state.ended_at = status, time.time()
            state.append(f"[{status}]\n")
            self._active, self._adopted = None, None
        self._forget_record()

    def _stop_adopted(self, kind: str, adopted: tuple[int, int, str]) -> None:
        pid = adopted[0]
        with self._lock:
            self._adopted_cancelled = True
            self._states[kind].append("[cancel requested: SIGTERM to the run's process group]\n")
        for sig, wait in ((signal.SIGTERM, self._grace), (signal.SIGKILL, 5.0)):
            if not self._same(*adopted):
                break
            _signal_group(pid, sig)  # it leads its own group (start_new_session)
            deadline = time.monotonic() + wait
            # Waited for by pid and start time, not the marker: an exiting process's environ
            # reads empty before it is gone, and "cancelled" must mean it has ended.
            while self._alive(pid, adopted[1]) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._end_adopted(kind, adopted, "cancelled")

    def shutdown(self) -> None:
        """Cancel whatever runs (the dashboard is stopping: leave no orphaned load behind)."""
        active = self._active
        if active is not None:
            with contextlib.suppress(RunError):
                self.cancel(active)


def _recorded_run(data: Any) -> tuple[int, int, str, str, list[str], float] | None:
    """(pid, start ticks, marker, kind, argv, started) from a run record, or None."""
    if not isinstance(data, dict):
        return None
    pid, start, marker, kind = (data.get(k) for k in ("pid", "start_ticks", "marker", "kind"))
    argv, started = data.get("argv"), data.get("started")
    if not (isinstance(pid, int) and isinstance(start, int) and not isinstance(pid, bool)
            and not isinstance(start, bool) and 1 < pid < 2**31 and isinstance(marker, str)
            and marker and kind in RUN_KINDS):
        return None
    return (pid, start, marker, str(kind),
            [str(a) for a in argv] if isinstance(argv, list) else [],
            float(started) if isinstance(started, (int, float)) else time.time())


def _signal_group(pid: int, sig: signal.Signals) -> None:
    # With start_new_session the child leads its own group, so its pid is the group id.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def bench_command(
    *,
    python: str,
    engine_url: str,
    history_dir: Path,
    model: Callable[[], str],
    tokenizer: str | None = None,
    max_num_seqs: int | None = None,
) -> CommandBuilder:
    """The real builder: `python -m vllmstack.bench KIND --url ... --json` plus the options.

    `max_num_seqs` (the engine's limit, from the profile) sizes the concurrency ladder unless
    the page asks for another top.
    """

    def build(kind: str, options: Mapping[str, Any]) -> list[str]:
        argv = [python, "-m", "vllmstack.bench", kind, "--url", engine_url, "--model", model()]
        if tokenizer:
            argv += ["--tokenizer", tokenizer]
        argv += ["--history-dir", str(history_dir)]
        for name in ("pp", "tg", "runs", "duration"):
            value = options.get(name)
            if value is not None:
                argv += [f"--{name}", str(value)]
        seqs = options.get("max_num_seqs") or max_num_seqs
        if seqs:
            argv += ["--max-num-seqs", str(seqs)]
        argv.append("--json")
        return argv

    return build

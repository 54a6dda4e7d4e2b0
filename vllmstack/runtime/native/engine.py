"""The native runtime: the engine as a supervised process group on the host, no containers.

`invoke up --runtime native` runs the argv and environment the container would get (only the
bind address and the chat-template folder differ) as a process group in its own session. A
small keeper (`python -m vllmstack.runtime.native.engine keep SPEC`, started through the Runner, which returns
as soon as the engine is launched) starts the engine, records it and waits for it, so a later
`invoke status`/`down` from another process finds it and learns its exit code.

Files under generated/native/:
  launch.json       what to run: argv, the environment added to the caller's, the log path
  engine.json       the record: pid (= process group = session), its start time (field 22 of
                    /proc/PID/stat), the boot id, a random marker, the keeper's pid
  engine.exit.json  the exit code, written by the keeper when the engine ends
  engine.log        everything the engine printed (engine.log.1: the run before)

Which processes are the engine's: the leader (pid and start time match the record, same boot),
everything in its process group or session while the leader lives, and every process whose
environment carries the record's marker (VLLMSTACK_ENGINE_ID). The marker is what finds an
EngineCore left behind after the API server died (a known vLLM failure that keeps GPU memory
held): its group leader is gone, but it inherited the environment. A recorded pid whose start
time differs from the record belongs to another program now: it is reported, never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vllmstack.config.profiles import Resolved
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime.base import MISSING, EngineState
from vllmstack.runtime.native import install as engines

FOLDER = "native"
MARKER_VAR = "VLLMSTACK_ENGINE_ID"
DEFAULT_GRACE_S = 30.0  # compose.yaml's stop_grace_period, so both runtimes stop alike
KILL_WAIT_S = 10.0
# The keeper writes the exit code a moment after the engine ends; state() waits this long for it.
EXIT_WAIT_S = 2.0
POLL_S = 0.1
# `python -m vllmstack.runtime.native.engine` runs from here, so it imports this very package whatever the
# caller's PYTHONPATH or working folder (the engine's own working folder is the project root).
PACKAGE_PARENT = Path(__file__).resolve().parents[3]


class NativeError(RuntimeError):
    """The native engine cannot be started or stopped as asked; `fix` says what to do."""

    def __init__(self, cause: str, fix: str | None = None) -> None:
        super().__init__(cause)
        self.fix = fix


# --- the process table ---------------------------------------------------------------------------


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
        """alive | exited | reused (the pid is another program now) | rebooted."""
        boot = self.boot_id()
        if record.boot_id and boot and record.boot_id != boot:
            return "rebooted"
        proc = self.get(record.pid)
        if proc is None:
            return "exited"
        if proc.start_ticks != record.start_ticks:
            return "reused"
        return "exited" if proc.zombie else "alive"

    def is_alive(self, record: EngineRecord) -> bool:
        return self.identify(record) == "alive"

    def keeper_alive(self, record: EngineRecord) -> bool:
        if record.keeper_pid is None:
            return False
        proc = self.get(record.keeper_pid)
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
        leader_alive = self.table.is_alive(self.record)
        entry = f"{MARKER_VAR}={self.record.marker}".encode()
        found = []
        for proc in self.table.each():
            # Nothing that started before the engine can be its child (cheap, and it skips
            # most of the table before the environment is read).
            if proc.zombie or proc.start_ticks < self.record.start_ticks:
                continue
            in_group = proc.pgid == self.record.pid or proc.sid == self.record.pid
            # While the leader lives its pid cannot be reused, so its group and session are ours.
            if (leader_alive and in_group) or self.table.has_env(proc.pid, entry):
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


# --- the command ---------------------------------------------------------------------------------


@dataclass
class NativeCommand:
    argv: list[str]
    env: dict[str, str]  # set on top of the caller's environment
    version: str
    venv: Path | None  # the install-engine environment, when that is what runs
    cache_dirs: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        return shlex.join(["env", *(f"{k}={v}" for k, v in sorted(self.env.items())), *self.argv])


def native_serve_command(project: Project, resolved: Resolved,
                         environ: Mapping[str, str]) -> NativeCommand:
    """The argv and environment of the native engine: the container's, with host paths."""
    from vllmstack.config.schema import load_schema
    from vllmstack.config.vllm_args import ArgvError, build_serve_argv
    from vllmstack.runtime.compose import FP8_CONFIG_DIR, engine_environment, stack_paths

    version = engines.engine_version(resolved)
    try:
        # The container binds 0.0.0.0 and publishes VLLM_BIND; a host process binds it itself.
        serve = build_serve_argv(resolved, host=resolved.get("VLLM_BIND") or "127.0.0.1",
                                 chat_template_dir=str((project.root / "chat-templates").resolve()))
    except ArgvError as exc:
        raise NativeError(str(exc), "fix the value named above (`invoke check` shows them all)") from exc
    try:
        prefix = shlex.split(resolved.get("NATIVE_ENGINE_COMMAND") or "")
    except ValueError as exc:
        raise NativeError(f"NATIVE_ENGINE_COMMAND is not valid shell words ({exc}) at "
                          f"{resolved.source('NATIVE_ENGINE_COMMAND')}", "fix its quoting") from exc
    venv: Path | None = None
    if not prefix:
        if not version:
            raise NativeError("no engine version for the native runtime",
                              "set VLLM_VERSION (or NATIVE_ENGINE_VERSION) in .env")
        venv = engines.engine_dir(project, version)
        prefix = [str(venv / "bin" / "vllm")]
    paths = stack_paths(resolved, environ)
    # Compile caches per engine version: a host venv has other torch/Triton/AITER builds than the
    # image, and AITER's JIT modules are not keyed by version. Models are shared with containers.
    cache = paths.engine_cache / "native" / f"vllm-{version or 'custom'}"
    cache_dirs = [paths.hf_cache, cache / "vllm", cache / "triton", cache / "torchinductor",
                  cache / "aiter" / "jit"]
    env = {
        "HF_HOME": str(paths.hf_cache),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
        "AITER_JIT_DIR": str(cache / "aiter" / "jit"),
        "VLLM_TUNED_CONFIG_FOLDER": str((project.root / "fused_moe_configs").resolve()),
        # User-site packages (~/.local) would shadow the environment's own.
        "PYTHONNOUSERSITE": "1",
    }
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        # vLLM and torch start helpers (ninja, the compiler driver) by name.
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{environ.get('PATH') or os.defpath}"
    env.update(engine_environment(resolved, load_schema()))
    notes = _unapplied_files(project, resolved, FP8_CONFIG_DIR)
    return NativeCommand([*prefix, *serve.argv[1:]], env, version, venv, cache_dirs, notes)


def _unapplied_files(project: Project, resolved: Resolved, fp8_dir: str) -> list[str]:
    """What containers get mounted into vLLM's package that a host process cannot get."""
    from vllmstack.image import patches

    notes = []
    try:
        overlays = patches.load_overlays(project)
    except patches.PatchError:
        overlays = []  # `invoke check` reports the malformed manifest
    for overlay in overlays:
        notes.append(f"overlay {overlay.name} ({overlay.target}) is not applied: the native runtime runs "
                     "the installed vLLM as it is (install a build that contains it)")
    device = resolved.get("GPU_DEVICE_NAME") or ""
    tuned = [p for p in sorted((project.root / "fp8_configs").glob("*.json"))
             if device and f"device_name={device}," in p.name]
    if tuned:
        notes.append(f"{len(tuned)} tuned fp8 GEMM config(s) for {device} are not applied natively "
                     f"(containers mount them into vllm/{fp8_dir})")
    return notes


# --- the runtime ---------------------------------------------------------------------------------


def native_folder(project: Project) -> Path:
    return project.generated / FOLDER


def read_record(project: Project) -> EngineRecord | None:
    try:
        data = json.loads((native_folder(project) / "engine.json").read_text())
    except (OSError, ValueError):
        return None
    return EngineRecord.from_json(data)


def write_json(path: Path, data: Any, mode: int = 0o644) -> None:
    """Atomically, so a reader in another process never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines of a file, reading only its end."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            pos = handle.tell()
            data = b""
            while pos > 0 and data.count(b"\n") <= count:
                step = min(65536, pos)
                pos -= step
                handle.seek(pos)
                data = handle.read(step) + data
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-count:] if count > 0 else []


def human_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


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

    @classmethod
    def for_stack(cls, project: Project, resolved: Resolved, environ: Mapping[str, str],
                  runner: Runner) -> NativeEngine:
        grace = resolved.get("NATIVE_STOP_GRACE") or ""
        return cls(project, runner, resolved, environ,
                   grace=float(grace) if grace.strip().isdigit() else DEFAULT_GRACE_S)

    @property
    def flavour(self) -> str:
        return "native"

    @property
    def folder(self) -> Path:
        return native_folder(self.project)

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
        return read_record(self.project)

    def command(self) -> NativeCommand:
        if self.resolved is None:
            raise NativeError("no profile was resolved, so there is nothing to start")
        return native_serve_command(self.project, self.resolved, self.environ)

    # -- EngineRuntime ----------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the engine through the keeper; returns once it runs (not once it is healthy)."""
        command = self.command()
        previous = self.read_record()
        if previous is not None:
            # Like compose's --force-recreate: whatever ran before goes first.
            self._end(previous, forget=True)
        try:
            self._check_devices()
            self._check_executable(command)
        except NativeError as exc:
            if not self.runner.dry_run:
                raise
            print(f"(dry run) note: {exc}; fix: {exc.fix}", file=self.out)
        for note in command.notes:
            print(f"note: {note}", file=self.out)
        marker = secrets.token_hex(16)
        spec = {"argv": command.argv, "env": {**command.env, MARKER_VAR: marker},
                "cwd": str(self.project.root), "log": str(self.log_path),
                "record": str(self.record_path), "exit": str(self.exit_path), "marker": marker,
                "grace": self.grace}
        keeper = [self.python, "-m", "vllmstack.runtime.native.engine", "keep", str(self.spec_path)]
        if self.runner.dry_run:
            print(f"(dry run) the native engine would run: {command.shell()}", file=self.out)
            self.runner.run(keeper, cwd=PACKAGE_PARENT)
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        for folder in command.cache_dirs:
            folder.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists():
            self.log_path.replace(self.log_path.with_name("engine.log.1"))
        self.exit_path.unlink(missing_ok=True)
        # 0600: the added environment can hold tokens (ENGINE_ENV).
        write_json(self.spec_path, spec, mode=0o600)
        result = self.runner.run(keeper, env=dict(self.environ), cwd=PACKAGE_PARENT, timeout=60)
        if not result.ok:
            why = (result.stderr or result.stdout).strip()[-1500:] or f"exit {result.returncode}"
            raise NativeError(f"the native engine did not start: {why}",
                              "check NATIVE_ENGINE_COMMAND / the engine environment "
                              "(invoke install-engine), and the log generated/native/engine.log")

    def state(self) -> EngineState:
        record = self.read_record()
        if record is None:
            return MISSING
        details: dict[str, Any] = {"pid": record.pid, "log": record.log, "started": record.started}
        status = self.table.identify(record)
        if status == "alive":
            return EngineState(True, True, "running", details=details)
        if status in ("reused", "rebooted"):
            details["stale"] = self._stale_reason(record, status)
            return EngineState(True, False, "stale", details=details)
        code = self._exit_code(record)
        leftovers = [p.pid for p in EngineGroup(record, self.table).find()]
        if leftovers:
            details["leftover_pids"] = leftovers
        if code is None:
            return EngineState(True, False, "dead", details=details)
        return EngineState(True, False, "exited", exit_code=code, details=details)

    def log_lines(self, tail: int = 400) -> list[str]:
        return tail_lines(self.log_path, tail)

    def log_command(self, *, tail: int, follow: bool) -> list[str]:
        """`invoke logs` for the native runtime: tail(1) on the log file."""
        return ["tail", "-n", str(tail), *(["-F"] if follow else []), str(self.log_path)]

    def stop(self) -> None:
        """Used after a failed start, where the failure itself is the message: never raises."""
        record = self.read_record()
        if record is None:
            return
        try:
            self._end(record, forget=False)
        except NativeError as exc:
            print(f"warning: {exc} (fix: {exc.fix})", file=self.out)

    def remove(self) -> None:
        record = self.read_record()
        if record is None:
            if not self.runner.dry_run:
                # An unreadable record is no evidence of anything running; drop the rest.
                self._forget()
            return
        try:
            self._end(record, forget=True)
        except NativeError as exc:
            # `down` must fail loudly when a process survives, in the caller's own terms (the
            # lifecycle is imported by then; the keeper never gets here).
            from vllmstack.serve.lifecycle import LifecycleError

            raise LifecycleError(str(exc), exc.fix) from exc

    def members(self) -> list[dict[str, Any]]:
        record = self.read_record()
        if record is None:
            return []
        leader = self.table.is_alive(record)
        out = []
        for proc in sorted(EngineGroup(record, self.table).find(), key=lambda p: p.pid):
            age = human_age(time.time() - self.table.started_at(proc))
            role = "engine" if proc.pid == record.pid else "engine child"
            out.append({
                "name": f"{proc.comm} (pid {proc.pid})",
                "service": "vllm",
                "state": "running" if leader else "leftover",
                "status": f"Up {age}, {role}" + ("" if leader else f" (its engine, pid {record.pid}, "
                                                                   "has exited)"),
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
        search = command.env.get("PATH") or self.environ.get("PATH") or os.defpath
        if os.sep in exe:
            path = Path(exe) if Path(exe).is_absolute() else self.project.root / exe
            found = path.is_file() and os.access(path, os.X_OK)
        else:
            found = shutil.which(exe, path=search) is not None
        if found:
            return
        if command.venv is not None:
            raise NativeError(
                f"the native engine for vLLM {command.version} is not installed: {exe} does not exist",
                f"invoke install-engine --version {command.version} (add --wheels DIR for AMD's "
                "ROCm wheels)")
        source = self.resolved.source("NATIVE_ENGINE_COMMAND") if self.resolved else None
        raise NativeError(f"NATIVE_ENGINE_COMMAND starts with {exe!r}, which is not an executable "
                          f"here (set at {source or '?'})",
                          "fix NATIVE_ENGINE_COMMAND, or unset it to run the install-engine environment")

    def _stale_reason(self, record: EngineRecord, status: str) -> str:
        if status == "rebooted":
            return f"the recorded engine (pid {record.pid}) ran before the last reboot"
        other = self.table.cmdline(record.pid) or "?"
        return f"pid {record.pid} is no longer the engine (start time differs): it is now {other[:120]}"

    def _exit_code(self, record: EngineRecord) -> int | None:
        deadline = time.monotonic() + EXIT_WAIT_S
        while True:
            try:
                data = json.loads(self.exit_path.read_text())
                if data.get("pid") == record.pid and data.get("marker") == record.marker:
                    return int(data["code"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
            # The keeper reaps the engine and writes the code a moment later; without a keeper
            # (killed, or another boot) there will never be one.
            if time.monotonic() > deadline or not self.table.keeper_alive(record):
                return None
            time.sleep(0.05)

    def _end(self, record: EngineRecord, *, forget: bool) -> None:
        status = self.table.identify(record)
        if status in ("reused", "rebooted"):
            print(f"stale native engine record: {self._stale_reason(record, status)}; not signalled"
                  + ("; record cleared" if forget and not self.runner.dry_run else ""), file=self.out)
        group = EngineGroup(record, self.table)
        if self.runner.dry_run:
            pids = sorted(p.pid for p in group.find())
            if pids:
                print(f"(dry run) would send SIGTERM to the native engine's processes {pids}, then "
                      f"SIGKILL after {self.grace:g} s", file=self.out)
            return
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

    def _forget(self) -> None:
        for path in (self.record_path, self.exit_path, self.spec_path):
            path.unlink(missing_ok=True)


# --- the keeper (python -m vllmstack.runtime.native.engine keep SPEC) -----------------------------------------


def keep(spec_path: Path) -> int:
    """Start the engine detached, report its pid on stdout and return; a forked keeper waits."""
    try:
        spec = json.loads(spec_path.read_text())
    except (OSError, ValueError) as exc:
        print(f"cannot read the launch spec {spec_path}: {exc}", file=sys.stderr)
        return 2
    read_end, write_end = os.pipe()
    if os.fork():
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            text = pipe.read()
        try:
            report = json.loads(text)
        except ValueError:
            report = {"error": "the keeper ended before it started the engine"}
        if "error" in report:
            print(report["error"], file=sys.stderr)
            return 1
        print(json.dumps(report))
        return 0
    os.close(read_end)
    # Its own session: neither a closed terminal nor Ctrl-C in `invoke up` reaches it.
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        # The Runner reads our stdout to the end; holding it would keep `invoke up` waiting.
        os.dup2(devnull, fd)
    try:
        run_keeper(spec, write_end)
    finally:
        os._exit(0)


def _report(fd: int, data: dict[str, Any]) -> None:
    with os.fdopen(fd, "w") as pipe:
        pipe.write(json.dumps(data))


def run_keeper(spec: dict[str, Any], report_fd: int) -> None:
    table = ProcTable()
    argv = [str(a) for a in spec["argv"]]
    log_path = Path(spec["log"])
    try:
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **spec["env"]}, cwd=spec["cwd"],
                # Its own session and process group: `down` ends the group as one.
                start_new_session=True, close_fds=True)
    except OSError as exc:
        _report(report_fd, {"error": f"could not run {argv[0]}: {exc.strerror or exc}"})
        return
    engine, me = table.get(proc.pid), table.get(os.getpid())
    record = EngineRecord(
        pid=proc.pid, start_ticks=engine.start_ticks if engine else 0, boot_id=table.boot_id(),
        marker=str(spec["marker"]), argv=argv, log=str(log_path), started=time.time(),
        keeper_pid=os.getpid(), keeper_start_ticks=me.start_ticks if me else None)
    try:
        write_json(Path(spec["record"]), asdict(record))
    except OSError as exc:
        # An engine nobody can find later must not keep running.
        proc.kill()
        proc.wait()
        _report(report_fd, {"error": f"could not write the engine record {spec['record']}: {exc}"})
        return
    _report(report_fd, {"pid": proc.pid, "log": str(log_path)})
    returncode = proc.wait()
    # As a shell or Docker reports it: 128 + signal number for a signalled process.
    code = 128 - returncode if returncode < 0 else returncode
    write_json(Path(spec["exit"]), {"pid": proc.pid, "marker": record.marker, "code": code,
                                    "ended": time.time()})
    # A container's processes all end with its main process; so do these. Otherwise an
    # EngineCore whose API server died keeps its GPU memory until someone finds it.
    try:
        EngineGroup(record, table).end(float(spec.get("grace") or DEFAULT_GRACE_S))
    except NativeError as exc:
        with log_path.open("a") as log:
            log.write(f"vllmstack keeper: {exc}\n")


def main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "keep":
        return keep(Path(argv[1]))
    print("usage: python -m vllmstack.runtime.native.engine keep SPEC.json  (started by `invoke up --runtime native`)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

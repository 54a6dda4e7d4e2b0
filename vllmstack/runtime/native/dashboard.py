"""The dashboard as a host process beside the native engine (`invoke up --runtime native`).

Started like the engine: the keeper (`python -m vllmstack.runtime.native.keeper keep SPEC`)
runs `python -m vllmstack.dashboard ...` in its own session and records its pid and start time,
so `invoke down` (another process, later) finds exactly that process and ends it, and the next
`invoke up` starts it again if it died. The token travels in the environment, never in argv.
As for the engine (records.py), the record must be this checkout's (its marker starts with
`dashboard-<checkout id>-`) and the process must carry that marker itself; anything else is
named and left alone.

Files under generated/native/:
  dashboard-launch.json   what to run (0600: the environment can hold DASHBOARD_TOKEN)
  dashboard.json          the record (pid, start time, boot id, marker, keeper)
  dashboard.exit.json     its exit code, written by the keeper
  dashboard.log           everything it printed
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from vllmstack.config.profiles import Resolved
from vllmstack.core.files import FileWriteError, remove_file, tail_lines, write_json
from vllmstack.core.paths import Project, results_folder
from vllmstack.core.runner import Runner
from vllmstack.observe.health import health_status, port_answers
from vllmstack.runtime.native.keeper import keeper_failure
from vllmstack.runtime.native.procs import EngineGroup, NativeError, ProcTable
from vllmstack.runtime.native.records import (
    MARKER_VAR,
    EngineRecord,
    dashboard_marker_prefix,
    load_record_file,
    native_folder,
    origin_of,
)

# Where this very package lives: the keeper and the dashboard import it from there, whatever the
# caller's working folder (the same rule as the engine's keeper in native.engine).
PACKAGE_PARENT = Path(__file__).resolve().parents[3]
KEEPER_MODULE = "vllmstack.runtime.native.keeper"
# The dashboard answers /api/health within a second or two of starting; an import error ends it
# sooner. Beyond this it is reported as not started.
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
POLL_S = 0.2


@dataclass
class NativeDashboard:
    """Start, find and stop the native dashboard process."""

    project: Project
    runner: Runner
    environ: Mapping[str, str] = field(default_factory=dict)
    out: TextIO = field(default_factory=lambda: sys.stdout)
    python: str = field(default_factory=lambda: sys.executable)
    table: ProcTable = field(default_factory=ProcTable)
    health: Callable[[str], int | None] = health_status
    port_busy: Callable[[str, int], bool] = port_answers
    sleep: Callable[[float], None] = time.sleep
    start_timeout: float = START_TIMEOUT_S

    @property
    def folder(self) -> Path:
        return native_folder(self.project)

    @property
    def record_path(self) -> Path:
        return self.folder / "dashboard.json"

    @property
    def exit_path(self) -> Path:
        return self.folder / "dashboard.exit.json"

    @property
    def spec_path(self) -> Path:
        return self.folder / "dashboard-launch.json"

    @property
    def log_path(self) -> Path:
        return self.folder / "dashboard.log"

    def record(self) -> EngineRecord | None:
        """This checkout's dashboard record; None when there is none, or it is damaged or
        another checkout's (`down` names those)."""
        return load_record_file(self.project, self.record_path, "dashboard",
                                dashboard_marker_prefix(self.project)).record

    def running(self) -> EngineRecord | None:
        record = self.record()
        return record if record is not None and self.table.is_alive(record) else None

    def argv(self, resolved: Resolved, engine_url: str) -> list[str]:
        argv = [self.python, "-m", "vllmstack.dashboard",
                "--host", resolved.get_str("DASHBOARD_BIND"),
                "--port", resolved.get_str("DASHBOARD_PORT"),
                "--engine-url", engine_url,
                "--history-dir", str(results_folder(self.project)),
                "--state-dir", str(self.folder)]
        tokenizer = resolved.get_raw("VLLM_TOKENIZER") or resolved.get_raw("VLLM_MODEL")
        if tokenizer:
            argv += ["--tokenizer", tokenizer]
        if resolved.get_raw("VLLM_MAX_NUM_SEQS").strip().isdigit():
            argv += ["--max-num-seqs", resolved.get_raw("VLLM_MAX_NUM_SEQS").strip()]
        return argv

    def up(self, resolved: Resolved, engine_url: str) -> None:
        """Start the dashboard unless it runs; returns once it answers /api/health."""
        bind, port = resolved.get_str("DASHBOARD_BIND"), resolved.get_int("DASHBOARD_PORT")
        page = f"http://{'localhost' if bind in ('127.0.0.1', '0.0.0.0') else bind}:{port}"
        alive = self.running()
        if alive is not None:
            print(f"dashboard at {page} (already running: native process, pid {alive.pid})",
                  file=self.out)
            return
        argv = self.argv(resolved, engine_url)
        keeper = [self.python, "-m", KEEPER_MODULE, "keep", str(self.spec_path)]
        if self.runner.dry_run:
            print(f"(dry run) the native dashboard would run: {' '.join(argv)}", file=self.out)
            self.runner.run(keeper, cwd=PACKAGE_PARENT)
            return
        probe_host = "127.0.0.1" if bind == "0.0.0.0" else bind
        if self.port_busy(probe_host, port):
            raise NativeError(f"port {port} (DASHBOARD_PORT) is taken by another program",
                              "stop it (a compose dashboard: `invoke dashboard-down --runtime "
                              "compose`), or set DASHBOARD_PORT to a free port")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if self.log_path.exists():
                self.log_path.replace(self.log_path.with_name("dashboard.log.1"))
        except OSError as exc:
            raise FileWriteError(Path(exc.filename or self.folder), exc) from exc
        self._forget()
        # Not the checkout's engine prefix (records.marker_prefix): the engine's search for
        # unrecorded engines must never take the dashboard for one.
        marker = dashboard_marker_prefix(self.project) + secrets.token_hex(12)
        env = {MARKER_VAR: marker, "PYTHONUNBUFFERED": "1"}
        token = resolved.get_str("DASHBOARD_TOKEN")
        if token:
            env["DASHBOARD_TOKEN"] = token
        # The router card reads the router's /v1/health, which wants the router's token too.
        router_token = resolved.get_str("ROUTER_TOKEN")
        if router_token:
            env["ROUTER_TOKEN"] = router_token
        spec = {"argv": argv, "env": env, "cwd": str(PACKAGE_PARENT),
                "root": str(self.project.root.resolve()), "log": str(self.log_path),
                "record": str(self.record_path), "exit": str(self.exit_path), "marker": marker,
                "grace": STOP_GRACE_S}
        write_json(self.spec_path, spec, mode=0o600)
        result = self.runner.run(keeper, env=dict(self.environ), cwd=PACKAGE_PARENT, timeout=60)
        if not result.ok:
            raise keeper_failure("the native dashboard", result.stdout, result.stderr,
                                 result.returncode, f"read {self._rel(self.log_path)} "
                                 "(`invoke logs --service dashboard`)")
        self._wait_healthy(f"http://{probe_host}:{port}")
        record = self.record()
        print(f"dashboard at {page} (native process, pid {record.pid if record else '?'}; log "
              f"{self._rel(self.log_path)})", file=self.out)

    def _wait_healthy(self, url: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.health(url + "/api") == 200:
                return
            record = self.record()
            if record is not None and not self.table.is_alive(record):
                tail = [line for line in tail_lines(self.log_path, 12) if line.strip()]
                self._forget()
                missing = any("No module named" in line for line in tail)
                raise NativeError(
                    "the native dashboard exited at once: " + (tail[-1] if tail else "no output"),
                    "install the dashboard's packages into this Python: pip install -e "
                    "'.[dashboard,bench]'" if missing else
                    f"read {self._rel(self.log_path)} (`invoke logs --service dashboard`)",
                    details=["--- dashboard log ---", *tail] if tail else ())
            self.sleep(POLL_S)
        self.down(quiet=True)
        raise NativeError(f"the native dashboard did not answer {url}/api/health within "
                          f"{self.start_timeout:.0f} s; stopped it",
                          f"read {self._rel(self.log_path)} (`invoke logs --service dashboard`)")

    def down(self, *, quiet: bool = False) -> list[str]:
        """End the dashboard's processes (TERM, then KILL after a short grace) and its record;
        returns what was found but left alone (a record that is not this checkout's, or whose
        process does not carry its marker), each line naming the pid."""
        record, problem, foreign = load_record_file(self.project, self.record_path, "dashboard",
                                                    dashboard_marker_prefix(self.project))
        if record is None:
            left = []
            if foreign is not None and self._runs(foreign):
                left.append(f"left alone: pid {foreign.pid}, the dashboard of "
                            f"{origin_of(foreign, self.project)} (its record came here with a copy "
                            f"of that checkout): {self.table.cmdline(foreign.pid)[:100]}")
            elif problem and not quiet:
                print(f"note: {problem}; ignored", file=self.out)
            if problem and not self.runner.dry_run:
                self._forget()
            return left
        left = []
        if self.table.identify(record) == "unmarked":
            left.append(f"left alone: pid {record.pid} ({self.table.cmdline(record.pid)[:100]}): "
                        f"the dashboard record names it, but it does not carry the record's "
                        f"{MARKER_VAR} marker")
        group = EngineGroup(record, self.table)
        if self.runner.dry_run:
            pids = sorted(p.pid for p in group.find())
            if pids:
                print(f"(dry run) would stop the native dashboard's processes {pids}", file=self.out)
            return left
        count, seconds, _ = group.end(STOP_GRACE_S)
        if count and not quiet:
            print(f"stopped the native dashboard (pid {record.pid}) in {seconds:.1f} s",
                  file=self.out)
        self._forget()
        return left

    def _runs(self, record: EngineRecord) -> bool:
        proc = self.table.get(record.pid)
        return proc is not None and not proc.zombie and proc.start_ticks == record.start_ticks

    def _forget(self) -> None:
        for path in (self.record_path, self.exit_path, self.spec_path):
            remove_file(path)

    def _rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.project.root))
        except ValueError:
            return str(path)

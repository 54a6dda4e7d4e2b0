"""The keeper: `python -m vllmstack.runtime.native.keeper keep SPEC` starts the engine detached.

It is started through the Runner, which returns as soon as the engine is launched; a forked
keeper then waits for the engine, so a later `invoke status`/`down` from another process finds
it (engine.json) and learns its exit code (engine.exit.json).

The exit file is made (EXIT_SLOT bytes) before the engine starts and overwritten in place when
it ends: an engine that dies because the disk filled up (its log could not be written) still
has its exit code recorded, since rewriting bytes a file already has needs no free space. Before,
that death read as "exited with code None", and a `*.exit.json.tmp` was left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllmstack.core.files import parse_json, write_fix, write_json
from vllmstack.runtime.native.procs import DEFAULT_GRACE_S, EngineGroup, NativeError, ProcTable
from vllmstack.runtime.native.records import EngineRecord


def keep(spec_path: Path) -> int:
    """Start the engine detached, report its pid on stdout and return; a forked keeper waits."""
    try:
        spec = parse_json(spec_path.read_bytes())
        if not isinstance(spec, dict):
            raise ValueError("not a JSON object")
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
            print(json.dumps(report))  # errno and file, for the caller's fix
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


# Room for {"pid": ..., "marker": ..., "code": ..., "ended": ...} with a 60-character marker.
EXIT_SLOT = 512


def reserve_exit(path: Path) -> int:
    """Create the exit file at its full size now, while there is room; returns its descriptor."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        # Real bytes, not a hole: a sparse file would need blocks when it is written later.
        written = os.pwrite(fd, b"{}".ljust(EXIT_SLOT), 0)
        if written != EXIT_SLOT:
            raise OSError(28, "No space left on device")
        os.fsync(fd)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def record_exit(fd: int, data: dict[str, Any]) -> None:
    """Overwrite the reserved exit file in place: no new space needed (see the module doc)."""
    text = json.dumps(data).encode()
    if len(text) > EXIT_SLOT:  # a marker longer than any the stack makes: keep what identifies
        text = json.dumps({k: data[k] for k in ("pid", "code", "ended")}).encode()
    os.pwrite(fd, text.ljust(EXIT_SLOT), 0)


def run_keeper(spec: dict[str, Any], report_fd: int) -> None:
    table = ProcTable()
    argv = [str(a) for a in spec["argv"]]
    log_path = Path(spec["log"])
    try:
        exit_fd = reserve_exit(Path(spec["exit"]))
    except OSError as exc:
        _report(report_fd, {"error": f"could not write {spec['exit']}: {exc.strerror or exc} "
                                     "(nothing was started)", "errno": exc.errno,
                            "file": spec["exit"]})
        return
    try:
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **spec["env"]}, cwd=spec["cwd"],
                # Its own session and process group: `down` ends the group as one.
                start_new_session=True, close_fds=True)
    except OSError as exc:
        os.close(exit_fd)
        Path(spec["exit"]).unlink(missing_ok=True)
        _report(report_fd, {"error": f"could not run {argv[0]}: {exc.strerror or exc}"})
        return
    engine, me = table.get(proc.pid), table.get(os.getpid())
    record = EngineRecord(
        pid=proc.pid, start_ticks=engine.start_ticks if engine else 0, boot_id=table.boot_id(),
        marker=str(spec["marker"]), argv=argv, log=str(log_path), started=time.time(),
        keeper_pid=os.getpid(), keeper_start_ticks=me.start_ticks if me else None,
        root=str(spec.get("root") or ""))
    try:
        write_json(Path(spec["record"]), asdict(record), mode=0o600)  # the argv may hold --api-key
    except OSError as exc:
        # An engine nobody can find later must not keep running; nor may its group.
        proc.kill()
        proc.wait()
        with contextlib.suppress(NativeError):
            EngineGroup(record, table).end(1.0)
        os.close(exit_fd)
        Path(spec["exit"]).unlink(missing_ok=True)
        reason = exc.strerror or str(exc)
        _report(report_fd, {"error": f"could not write the engine record {spec['record']}: "
                                     f"{reason}; the engine it had started was stopped",
                            "errno": exc.errno, "file": spec["record"]})
        return
    _report(report_fd, {"pid": proc.pid, "log": str(log_path)})
    returncode = proc.wait()
    # As a shell or Docker reports it: 128 + signal number for a signalled process.
    code = 128 - returncode if returncode < 0 else returncode
    try:
        record_exit(exit_fd, {"pid": proc.pid, "marker": record.marker, "code": code,
                              "ended": time.time()})
    except OSError:
        pass  # the file is gone or its disk failed: `status` then says the code is unknown
    finally:
        os.close(exit_fd)
    # A container's processes all end with its main process; so do these. Otherwise an
    # EngineCore whose API server died keeps its GPU memory until someone finds it.
    try:
        EngineGroup(record, table).end(float(spec.get("grace") or DEFAULT_GRACE_S))
    except NativeError as exc:
        with contextlib.suppress(OSError), log_path.open("a") as log:
            log.write(f"vllmstack keeper: {exc}\n")


def keeper_failure(what: str, stdout: str, stderr: str, returncode: int, fix: str) -> NativeError:
    """The keeper's refusal (`keep` exited 1) as an error for the user: a write it could not
    make (its JSON report on stdout names the errno and the file) gets that file's fix, anything
    else `fix`."""
    report: Any = None
    last = stdout.strip().splitlines()[-1:]
    if last:
        try:
            report = parse_json(last[0])
        except ValueError:
            report = None
    if isinstance(report, dict) and isinstance(report.get("error"), str):
        code, path = report.get("errno"), report.get("file")
        if isinstance(code, int) and isinstance(path, str):
            return NativeError(f"{what} did not start: {report['error']}", write_fix(code, Path(path)))
        return NativeError(f"{what} did not start: {report['error']}", fix)
    text = (stderr or stdout).strip()[-1500:] or f"exit {returncode}"
    return NativeError(f"{what} did not start: {text}", fix)


def main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "keep":
        return keep(Path(argv[1]))
    print("usage: python -m vllmstack.runtime.native.keeper keep SPEC.json  "
          "(started by `invoke up --runtime native`)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""The keeper: `python -m vllmstack.runtime.native.keeper keep SPEC` starts the engine detached.

It is started through the Runner, which returns as soon as the engine is launched; a forked
keeper then waits for the engine, so a later `invoke status`/`down` from another process finds
it (engine.json) and learns its exit code (engine.exit.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllmstack.core.files import write_json
from vllmstack.runtime.native.procs import DEFAULT_GRACE_S, EngineGroup, NativeError, ProcTable
from vllmstack.runtime.native.records import EngineRecord


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
        write_json(Path(spec["record"]), asdict(record), mode=0o600)  # the argv may hold --api-key
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
    print("usage: python -m vllmstack.runtime.native.keeper keep SPEC.json  "
          "(started by `invoke up --runtime native`)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

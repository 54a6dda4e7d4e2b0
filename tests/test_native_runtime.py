"""The native runtime: its argv and environment match the container's, its process records are
read safely, and real process groups are started, watched and ended without leftovers."""

from __future__ import annotations

import io
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllmstack.config.engines.table import engine_of
from vllmstack.config.profiles import list_profiles, resolve
from vllmstack.config.schema import load_schema
from vllmstack.config.vllm_args import build_serve_argv
from vllmstack.core.files import tail_lines
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, SubprocessRunner
from vllmstack.runtime.base import MISSING
from vllmstack.runtime.engine_env import engine_environment
from vllmstack.runtime.native import engine, procs
from vllmstack.runtime.native.command import native_serve_command
from vllmstack.runtime.native.engine import NativeEngine
from vllmstack.runtime.native.procs import NativeError, ProcTable, parse_stat
from vllmstack.runtime.native.records import MARKER_VAR, EngineRecord, marker_prefix

# --- /proc parsing on a fake tree ------------------------------------------------------------------


def stat_line(pid: int, comm: str = "python3", state: str = "S", pgid: int = 0, sid: int = 0,
              start: int = 1000) -> str:
    # Fields 3..22 of proc(5); field 22 is the start time in clock ticks.
    rest = [state, "1", str(pgid or pid), str(sid or pid)] + ["0"] * 15 + [str(start)] + ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(rest)


def fake_proc(root: Path, pid: int, *, environ: dict[str, str] | None = None, **kw: object) -> None:
    folder = root / str(pid)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stat").write_text(stat_line(pid, **kw))  # type: ignore[arg-type]
    (folder / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in (environ or {}).items()))
    (folder / "cmdline").write_bytes(b"sleep\x0060\x00")


def test_parse_stat_takes_the_name_up_to_the_last_parenthesis() -> None:
    proc = parse_stat(stat_line(42, comm="vllm (Engine) x)", pgid=40, sid=39, start=777))
    assert proc is not None
    assert (proc.pid, proc.comm, proc.pgid, proc.sid, proc.start_ticks) == (
        42, "vllm (Engine) x)", 40, 39, 777)
    assert parse_stat("garbage") is None
    assert parse_stat("12 (x) S 1 2") is None


def record(pid: int = 4242, start: int = 1000, boot: str = "boot-a", **kw: object) -> EngineRecord:
    data = {"pid": pid, "start_ticks": start, "boot_id": boot, "marker": "m" * 32,
            "argv": ["vllm", "serve", "x"], "log": "/tmp/x.log", "started": 1.0, **kw}
    parsed = EngineRecord.from_json(data)
    assert parsed is not None
    return parsed


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    (root / "sys/kernel/random").mkdir(parents=True)
    (root / "sys/kernel/random/boot_id").write_text("boot-a\n")
    (root / "stat").write_text("cpu 1 2 3\nbtime 1700000000\n")
    return root


def test_an_engine_caught_inside_its_exec_is_still_the_engine(proc_root: Path) -> None:
    """A wrapper that execs the engine: for a moment the new image reads back with an empty
    environment and command line. `up` asked then, called its own engine a stranger's and ended
    it (seen in CI: 'does not carry the record's marker ... : ?'). It asks again instead."""
    table = ProcTable(proc_root)
    fake_proc(proc_root, 4242, start=1000)
    folder = proc_root / "4242"
    (folder / "cmdline").write_bytes(b"")  # mid-exec: both blank

    def finish_exec() -> None:
        time.sleep(0.05)
        (folder / "environ").write_bytes(f"{MARKER_VAR}={'m' * 32}".encode())
        (folder / "cmdline").write_bytes(b"vllm\0serve\0")

    finisher = threading.Thread(target=finish_exec)
    finisher.start()
    try:
        assert table.identify(record()) == "alive"
    finally:
        finisher.join()


def test_a_blank_process_that_stays_blank_is_not_the_engine(
        proc_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = ProcTable(proc_root)
    fake_proc(proc_root, 4242, start=1000)
    (proc_root / "4242" / "cmdline").write_bytes(b"")
    naps: list[float] = []
    monkeypatch.setattr(procs.time, "sleep", naps.append)
    clock = itertools.count(0.0, 0.1)  # each look at the clock 0.1 s later: the wait runs out
    monkeypatch.setattr(procs.time, "monotonic", lambda: next(clock))
    assert table.identify(record()) == "unmarked"
    assert naps  # it asked again before deciding
    # A process with a command line but no marker is a stranger at once: no wait.
    naps.clear()
    (proc_root / "4242" / "cmdline").write_bytes(b"sleep\x0060\x00")
    assert table.identify(record()) == "unmarked" and naps == []
    # One that exits while it is waited on has exited.
    (proc_root / "4242" / "cmdline").write_bytes(b"")
    monkeypatch.setattr(procs.time, "sleep", lambda _s: shutil.rmtree(proc_root / "4242"))
    assert table.identify(record()) == "exited"


def test_identify_tells_alive_exited_reused_rebooted_unmarked_and_zombie(proc_root: Path) -> None:
    table = ProcTable(proc_root)
    assert table.identify(record()) == "exited"
    # The recorded pid and start time, but not the record's marker: not the engine.
    fake_proc(proc_root, 4242, start=1000)
    assert table.identify(record()) == "unmarked" and not table.is_alive(record())
    fake_proc(proc_root, 4242, start=1000, environ={MARKER_VAR: "m" * 32})
    assert table.identify(record()) == "alive"
    assert table.identify(record(start=999)) == "reused"
    fake_proc(proc_root, 4242, start=1000, state="Z", environ={MARKER_VAR: "m" * 32})
    assert table.identify(record()) == "exited"
    (proc_root / "sys/kernel/random/boot_id").write_text("boot-b\n")
    assert table.identify(record()) == "rebooted"


def test_a_record_with_a_dangerous_pid_or_no_marker_is_rejected() -> None:
    base = {"start_ticks": 1, "marker": "abc", "argv": []}
    for pid in (0, 1, -5, "x"):
        assert EngineRecord.from_json({**base, "pid": pid}) is None
    assert EngineRecord.from_json({"pid": 100, "start_ticks": 1, "marker": ""}) is None
    assert EngineRecord.from_json(["not", "a", "dict"]) is None
    assert EngineRecord.from_json({**base, "pid": 100}) is not None


def test_group_members_are_the_group_while_the_leader_lives_then_only_marked_ones(
        proc_root: Path) -> None:
    marker = {MARKER_VAR: "m" * 32}
    fake_proc(proc_root, 4242, start=1000, environ=marker)          # the leader
    fake_proc(proc_root, 4250, start=1005, pgid=4242, sid=4242)     # a worker without the marker
    fake_proc(proc_root, 4260, start=1006, pgid=4260, environ=marker)  # escaped its group
    fake_proc(proc_root, 4270, start=900, pgid=4242)                # older than the engine
    fake_proc(proc_root, 4280, start=1010)                          # unrelated
    fake_proc(proc_root, 4290, start=1011, environ=marker, state="Z")  # zombie: holds nothing
    group = procs.EngineGroup(record(), ProcTable(proc_root))
    assert sorted(p.pid for p in group.find()) == [4242, 4250, 4260]
    # The leader's pid is reused: its group is somebody else's now; only the marker counts.
    fake_proc(proc_root, 4242, start=2000)
    assert sorted(p.pid for p in group.find()) == [4260]


def test_tail_lines_reads_the_end_of_a_long_log(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("".join(f"line {i}\n" for i in range(50000)))
    assert tail_lines(log, 3) == ["line 49997", "line 49998", "line 49999"]
    assert tail_lines(tmp_path / "missing.log", 3) == []


# --- the command is the container's ------------------------------------------------------------------


def shipped_pairs(shipped: Project) -> list[tuple[str, str]]:
    """Every shipped vLLM profile on its platforms (ENGINE=llamacpp ones run llama-server)."""
    pairs = []
    for profile in list_profiles(shipped):
        if profile.kind == "model" and engine_of(resolve(shipped, model=profile.name)) == "vllm":
            pairs += [(profile.name, platform) for platform in profile.platforms or ("2xr9700",)]
    return pairs


def test_native_argv_and_environment_match_the_container_for_every_shipped_profile(
        shipped: Project, tmp_path: Path) -> None:
    environ = {"HOME": str(tmp_path), "PATH": "/usr/bin"}
    schema = load_schema()
    pairs = shipped_pairs(shipped)
    assert len(pairs) >= 5
    for model, platform in pairs:
        resolved = resolve(shipped, platform=platform, model=model, environ=environ)
        container = build_serve_argv(resolved).argv
        command = native_serve_command(shipped, resolved, environ)
        # The cpu platform runs vLLM's CPU build (NATIVE_ENGINE_VERSION), the others the pin.
        version = resolved.get("NATIVE_ENGINE_VERSION") or resolved.get("VLLM_VERSION")
        assert command.argv[0] == str(shipped.cache / "engines" / f"vllm-{version}" / "bin" / "vllm")
        expected = list(container[1:])
        expected[expected.index("--host") + 1] = resolved.get("VLLM_BIND") or "127.0.0.1"
        if "--chat-template" in expected:
            i = expected.index("--chat-template") + 1
            expected[i] = expected[i].replace("/app/chat-templates",
                                              str((shipped.root / "chat-templates").resolve()))
            assert Path(expected[i]).is_file(), (model, platform, expected[i])
        assert command.argv[1:] == expected, (model, platform)
        # Every variable the container gets from the profile, the process gets too.
        container_env = engine_environment(resolved, schema)
        assert {k: command.env[k] for k in container_env} == container_env, (model, platform)
        assert command.env["PYTHONNOUSERSITE"] == "1"
        assert command.env["PATH"].startswith(str(command.venv / "bin"))  # type: ignore[operator]


def test_engine_command_and_version_settings(project: Project, tmp_path: Path) -> None:
    environ = {"HOME": str(tmp_path)}
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=environ, overrides=[
        "NATIVE_ENGINE_COMMAND=python3 /x/server.py", "NATIVE_ENGINE_VERSION=0.30.2",
        "VLLM_BIND=0.0.0.0"])
    command = native_serve_command(project, resolved, environ)
    assert command.argv[:4] == ["python3", "/x/server.py", "serve", "Qwen/Qwen3-0.6B"]
    assert command.argv[command.argv.index("--host") + 1] == "0.0.0.0"
    assert command.venv is None and "VIRTUAL_ENV" not in command.env
    assert "vllm-0.30.2" in command.env["VLLM_CACHE_ROOT"]
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=environ,
                       overrides=["NATIVE_ENGINE_VERSION=0.30.2"])
    assert native_serve_command(project, resolved, environ).argv[0].endswith(
        ".cache/engines/vllm-0.30.2/bin/vllm")


# --- start, watch, stop real processes -------------------------------------------------------------


def make_engine(project: Project, tmp_path: Path, script: str, *sets: str,
                grace: float = 5.0, dry_run: bool = False) -> tuple[NativeEngine, io.StringIO]:
    path = tmp_path / "engine.py"
    path.write_text(script)
    environ = {**os.environ, "HOME": str(tmp_path / "home")}
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=environ, overrides=[
        f"NATIVE_ENGINE_COMMAND={shlex.quote(sys.executable)} {shlex.quote(str(path))}", *sets])
    out = io.StringIO()
    runner = RecordingRunner(dry_run=True) if dry_run else SubprocessRunner()
    engine = NativeEngine.for_stack(project, resolved, environ, runner)
    engine.out, engine.grace = out, grace
    return engine, out


def wait_for(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def gone(pid: int, start: int) -> bool:
    proc = ProcTable().get(pid)
    return proc is None or proc.zombie or proc.start_ticks != start


SLEEPER = """
import os, sys, time
print("engine up", os.getpid(), flush=True)
time.sleep(120)
"""

# A leader with one child, like the API server and its EngineCore; the child's pid and start
# time go to CHILD_FILE. CHILD_IGNORES_TERM makes the child ignore SIGTERM, LEADER_EXIT makes the
# leader exit (with that code) while the child stays behind. CHILD_FILE is written only once the
# child says (through a pipe) that its signal disposition is set: before, a test could send TERM
# to a child that did not ignore it yet, and TERM won (3 failures in 15 runs).
WITH_CHILD = """
import os, signal, sys, time
ready_r, ready_w = os.pipe()
child = os.fork()
if child == 0:
    os.close(ready_r)
    if os.environ.get("CHILD_IGNORES_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.write(ready_w, b"1")
    os.close(ready_w)
    time.sleep(120)
    os._exit(0)
os.close(ready_w)
os.read(ready_r, 1)
with open(os.environ["CHILD_FILE"], "w") as f:
    f.write(open(f"/proc/{child}/stat").read().rpartition(")")[2].split()[19] + f" {child}")
print("leader up", flush=True)
if os.environ.get("LEADER_EXIT"):
    sys.exit(int(os.environ["LEADER_EXIT"]))
time.sleep(120)
"""


@pytest.fixture
def cleanup() -> Iterator[list[NativeEngine]]:
    engines: list[NativeEngine] = []
    yield engines
    for started in engines:
        started.grace = 0.5
        started.remove()


def child_of(path: Path) -> tuple[int, int]:
    wait_for(lambda: path.is_file() and path.read_text().strip().count(" ") == 1)
    start, pid = path.read_text().split()
    return int(pid), int(start)


def test_start_state_members_log_and_remove_a_real_process(
        project: Project, tmp_path: Path, cleanup: list[NativeEngine]) -> None:
    engine, out = make_engine(project, tmp_path, SLEEPER)
    cleanup.append(engine)
    assert engine.state() == MISSING
    engine.start()
    state = engine.state()
    assert state.running and state.status == "running"
    pid = state.details["pid"]
    wait_for(lambda: any("engine up" in line for line in engine.log_lines(10)))
    [member] = engine.members()
    assert member["pid"] == pid and member["service"] == "vllm" and member["state"] == "running"
    # The engine is its own session and group, not in ours: a closed terminal does not end it.
    proc = ProcTable().get(pid)
    assert proc is not None and proc.pgid == pid and proc.sid == pid
    assert os.getpgid(pid) != os.getpgid(0)
    # A second NativeEngine (another `invoke` process) sees the same engine from the record.
    other_out = io.StringIO()
    other = NativeEngine(project, SubprocessRunner(), None, {}, out=other_out)
    assert other.state().running and other.state().details["pid"] == pid
    start = proc.start_ticks
    other.remove()
    assert gone(pid, start)
    assert "stopped the native engine" in other_out.getvalue()
    assert engine.state() == MISSING
    assert not (project.generated / "native" / "engine.json").exists()
    # The log stays readable after down.
    assert any("engine up" in line for line in engine.log_lines(10))
    assert "note: overlay" in out.getvalue()  # what containers get that a host process cannot


def test_exit_code_is_recorded_for_a_later_process(project: Project, tmp_path: Path,
                                                   cleanup: list[NativeEngine]) -> None:
    engine, _ = make_engine(project, tmp_path, "import sys; print('bye', flush=True); sys.exit(3)")
    cleanup.append(engine)
    engine.start()
    wait_for(lambda: not engine.state().running)
    state = NativeEngine(project, SubprocessRunner()).state()
    assert (state.status, state.exit_code, state.running) == ("exited", 3, False)


def test_a_leftover_child_of_a_dead_leader_is_ended_by_the_keeper(
        project: Project, tmp_path: Path, cleanup: list[NativeEngine]) -> None:
    child_file = tmp_path / "child"
    engine, _ = make_engine(project, tmp_path, WITH_CHILD,
                            f"ENGINE_ENV=CHILD_FILE={child_file} LEADER_EXIT=1",
                            "NATIVE_STOP_GRACE=2")
    cleanup.append(engine)
    engine.start()
    pid, start = child_of(child_file)
    # The leader exits with 1; its "EngineCore" has no group leader any more, but it is found by
    # the marker in its environment and ended, as a container's processes end with its main one.
    wait_for(lambda: gone(pid, start), timeout=10)
    state = engine.state()
    assert state.status == "exited" and state.exit_code == 1
    assert "leftover_pids" not in state.details


def test_down_escalates_to_sigkill_and_leaves_no_group_member(
        project: Project, tmp_path: Path, cleanup: list[NativeEngine]) -> None:
    child_file = tmp_path / "child"
    engine, out = make_engine(project, tmp_path, WITH_CHILD,
                              f"ENGINE_ENV=CHILD_FILE={child_file} CHILD_IGNORES_TERM=1")
    cleanup.append(engine)
    # The keeper ends what is left of the group when the leader dies, after the grace it was
    # started with: started with 5 s, it cannot SIGKILL the child before `down` (0.5 s) does,
    # which made this test report "(SIGTERM)" now and then on a loaded machine.
    engine.start()
    engine.grace = 0.5
    child, child_start = child_of(child_file)
    leader = engine.state().details["pid"]
    assert sorted(m["pid"] for m in engine.members()) == sorted([leader, child])
    engine.remove()
    assert gone(child, child_start)
    assert "2 process(es)" in out.getvalue() and "SIGKILL after the 0.5 s grace" in out.getvalue()
    assert procs.EngineGroup(record(pid=leader, start=0), ProcTable()).find() == []


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of another program, leading its own group, as a reused pid would be."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def write_record(project: Project, **data: object) -> None:
    """An engine record as this checkout's keeper writes it (its marker has the checkout's id)."""
    folder = project.generated / "native"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "engine.json").write_text(json.dumps(
        {"marker": marker_prefix(project) + "0" * 24, "argv": ["vllm"], "log": "", "started": 0.0,
         "boot_id": ProcTable().boot_id(), **data}))


def test_a_reused_pid_is_reported_never_signalled_and_the_record_cleared(
        project: Project, bystander: subprocess.Popen[bytes]) -> None:
    proc = ProcTable().get(bystander.pid)
    assert proc is not None
    write_record(project, pid=bystander.pid, start_ticks=proc.start_ticks - 1)
    out = io.StringIO()
    engine = NativeEngine(project, SubprocessRunner(), out=out)
    state = engine.state()
    assert (state.status, state.running) == ("stale", False)
    assert "start time differs" in state.details["stale"] and "sleep 60" in state.details["stale"]
    assert engine.members() == []
    engine.remove()
    assert bystander.poll() is None  # still alive: never signalled, nor its group
    assert "stale native engine record" in out.getvalue() and "not signalled" in out.getvalue()
    assert "record cleared" in out.getvalue()
    assert engine.state() == MISSING


def test_a_dead_pid_is_reported_and_cleared(project: Project) -> None:
    write_record(project, pid=int(Path("/proc/sys/kernel/pid_max").read_text()) + 1, start_ticks=5)
    out = io.StringIO()
    engine = NativeEngine(project, SubprocessRunner(), out=out)
    assert engine.state().status == "dead"
    engine.remove()
    assert "had already exited; record cleared" in out.getvalue()
    assert engine.state() == MISSING


def test_missing_engine_environment_names_install_engine(project: Project, tmp_path: Path) -> None:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ={"HOME": str(tmp_path)})
    engine = NativeEngine.for_stack(project, resolved, {"HOME": str(tmp_path)}, SubprocessRunner())
    with pytest.raises(NativeError) as err:
        engine.start()
    assert "not installed" in str(err.value) and ".cache/engines/vllm-" in str(err.value)
    assert err.value.fix is not None and "invoke install-engine --version" in err.value.fix
    bad = resolve(project, platform="cpu", model="qwen3-0.6b", environ={"HOME": str(tmp_path)},
                  overrides=["NATIVE_ENGINE_COMMAND=no-such-engine-here --x"])
    engine = NativeEngine.for_stack(project, bad, {"PATH": "/usr/bin"}, SubprocessRunner())
    with pytest.raises(NativeError) as err:
        engine.start()
    assert "'no-such-engine-here'" in str(err.value) and "--set" in str(err.value)


def test_dry_run_prints_the_engine_command_and_starts_nothing(project: Project,
                                                               tmp_path: Path) -> None:
    engine, out = make_engine(project, tmp_path, SLEEPER, dry_run=True)
    engine.start()
    text = out.getvalue()
    assert "(dry run) the native engine would run: env " in text
    assert "serve Qwen/Qwen3-0.6B" in text and "VLLMSTACK_ENGINE_ID" not in text
    runner = engine.runner
    assert isinstance(runner, RecordingRunner)
    assert runner.calls and runner.calls[-1][1:4] == ("-m", "vllmstack.runtime.native.keeper", "keep")
    assert not (project.generated / "native").exists()


def test_the_stop_grace_setting_is_used(project: Project, tmp_path: Path) -> None:
    engine, _ = make_engine(project, tmp_path, SLEEPER, "NATIVE_STOP_GRACE=7")
    fresh = NativeEngine.for_stack(project, engine.resolved, {}, SubprocessRunner())  # type: ignore[arg-type]
    assert fresh.grace == 7.0 and fresh.name == "native" and fresh.flavour == "native"


def test_keeper_reports_an_engine_that_cannot_run(project: Project, tmp_path: Path) -> None:
    folder = project.generated / "native"
    folder.mkdir(parents=True)
    spec = folder / "launch.json"
    spec.write_text(json.dumps({"argv": [str(tmp_path / "not-executable")], "env": {},
                                "cwd": str(project.root), "log": str(folder / "engine.log"),
                                "record": str(folder / "engine.json"),
                                "exit": str(folder / "engine.exit.json"), "marker": "x" * 32}))
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    result = subprocess.run([sys.executable, "-m", "vllmstack.runtime.native.keeper", "keep", str(spec)],
                            capture_output=True, text=True, timeout=30, cwd=engine.PACKAGE_PARENT,
                            check=False)
    assert result.returncode == 1
    assert "could not run" in result.stderr and "Permission denied" in result.stderr
    assert not (folder / "engine.json").exists()


def test_signals_go_only_to_the_same_process(bystander: subprocess.Popen[bytes]) -> None:
    table = ProcTable()
    proc = table.get(bystander.pid)
    assert proc is not None
    older = procs.Proc(proc.pid, proc.comm, proc.state, proc.ppid, proc.pgid, proc.sid,
                        proc.start_ticks - 1)
    procs.send_signal(table, older, signal.SIGKILL)
    time.sleep(0.1)
    assert bystander.poll() is None
    procs.send_signal(table, proc, signal.SIGKILL)
    assert bystander.wait(timeout=5) == -signal.SIGKILL


def test_down_fails_loudly_when_a_process_survives_sigkill(
        project: Project, proc_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A process stuck in the kernel ignores even SIGKILL; a fake table keeps reporting it. Its pid
    # is above pid_max, so no signal can reach a real process.
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 10
    fake_proc(proc_root, pid, start=1000, state="D",
              environ={MARKER_VAR: marker_prefix(project) + "0" * 24})
    write_record(project, pid=pid, start_ticks=1000, boot_id="boot-a")
    monkeypatch.setattr(procs, "KILL_WAIT_S", 0.2)
    out = io.StringIO()
    engine = NativeEngine(project, SubprocessRunner(), table=ProcTable(proc_root), grace=0.2, out=out)
    with pytest.raises(NativeError) as err:
        engine.remove()
    assert f"process(es) {pid} (python3) of the native engine survived SIGKILL" in err.value.cause
    assert err.value.fix is not None and "reboot" in err.value.fix
    assert (project.generated / "native" / "engine.json").is_file()  # still known: not forgotten
    engine.stop()  # after a failed start: a warning, not a second error
    assert "warning:" in out.getvalue() and "survived SIGKILL" in out.getvalue()


def test_dry_run_without_an_installed_engine_is_a_note(project: Project, tmp_path: Path) -> None:
    environ = {"HOME": str(tmp_path)}
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=environ)
    engine = NativeEngine.for_stack(project, resolved, environ, RecordingRunner(dry_run=True))
    out = engine.out = io.StringIO()
    engine.start()
    text = out.getvalue()
    # The cpu platform runs vLLM's CPU build (its NATIVE_ENGINE_VERSION), installed by that version.
    assert "(dry run) note: the native engine for vLLM 0.32.0+cpu is not installed" in text
    assert "fix: invoke install-engine --version 0.32.0+cpu" in text


def test_gpu_device_nodes_the_user_cannot_open_are_named_with_the_group_fix(
        project: Project, tmp_path: Path) -> None:
    for node in ("dev/kfd", "dev/dri/renderD128", "dev/dri/renderD129"):
        (tmp_path / node).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / node).write_text("")
    environ = {"HOME": str(tmp_path)}
    resolved = resolve(project, platform="r9700", model="qwen3-0.6b", environ=environ)
    engine = NativeEngine.for_stack(project, resolved, environ, SubprocessRunner())
    engine.device_root = tmp_path
    engine.can_open = lambda path: path.name == "renderD129"
    with pytest.raises(NativeError) as err:
        engine.start()
    assert f"{tmp_path}/dev/kfd, {tmp_path}/dev/dri/renderD128" in str(err.value)
    assert err.value.fix == "sudo usermod -aG render,video $USER, then log in again"
    engine.can_open = lambda path: True
    with pytest.raises(NativeError) as err:
        engine.start()
    assert "is not installed" in str(err.value)  # past the device check

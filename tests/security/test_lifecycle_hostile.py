"""Hostile pass over ownership, the lifecycle and the stack's own files (issue 28, items 1, 4, 5).

Black-box where it matters: `invoke up/status/down` in throwaway checkouts whose native engine is
the engine simulator (tests/helpers.simulator_project), no Docker. The rules under test:

* `down` stops only what this checkout provably started: the record must carry this checkout's
  marker and the process must carry it too. A copy of a running checkout (`cp -a A B`), a
  hand-made record naming another live process, a lock file naming some pid: named, left alone.
* every file the stack reads back (state.json, the engine and dashboard records, the exit file,
  the launch spec, the lock file, router.json) turns whatever it holds (100k-deep nesting, NaN,
  a list, a FIFO, a folder, huge) into a named error or "nothing here", never a traceback.
* a full or read-only disk during `up` is an error line naming the file; the engine `up`
  started is stopped, no temporary file is left, a death of the engine is diagnosed.
* `down` during a booting `up` stops it; `up` after a killed `up` waits for the engine it left;
  a record with a wrong start time needs one `down`.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, free_port, simulator_project, wait_for

from vllmstack.core.checkout import checkout_id, lock_holder, stack_lock
from vllmstack.core.files import (
    FileWriteError,
    JsonFileError,
    parse_json,
    read_json_file,
    write_text,
)
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner
from vllmstack.observe.health import health_status
from vllmstack.runtime.native.engine import NativeEngine, read_exit_code
from vllmstack.runtime.native.procs import ProcTable, marked_engines
from vllmstack.runtime.native.records import (
    MARKER_VAR,
    EngineRecord,
    dashboard_marker_prefix,
    load_record,
    marker_prefix,
)
from vllmstack.serve.interruption import stop_booting_up
from vllmstack.serve.running import running_selection
from vllmstack.serve.state import (
    StateError,
    foreign_state,
    read_state,
    set_aside_damaged,
    write_state,
)

DEEP = "[" * 100_000  # json.loads raises RecursionError on it (not a ValueError)
BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def alive(pid: int, start: int) -> bool:
    proc = ProcTable().get(pid)
    return proc is not None and not proc.zombie and proc.start_ticks == start


def marked(root: Path) -> list[int]:
    """Live processes that carry an engine or dashboard marker of the checkout at `root`."""
    ids = (f"{MARKER_VAR}={checkout_id(root)}-".encode(),
           f"{MARKER_VAR}=dashboard-{checkout_id(root)}-".encode())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(ids) for e in env) and alive(int(entry.name), start_ticks(int(entry.name))):
            found.append(int(entry.name))
    return found


class Checkout:
    """One throwaway checkout whose engine is the simulator; `invoke` runs in it."""

    def __init__(self, root: Path, home: Path) -> None:
        self.root, self.home = root, home

    @property
    def generated(self) -> Path:
        return self.root / "generated"

    def env(self) -> dict[str, str]:
        return {**os.environ, "HOME": str(self.home)}

    def invoke(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=self.root,
                              env=self.env(), text=True, capture_output=True, timeout=timeout,
                              check=False)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=self.root,
                                env=self.env(), text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)

    def setting(self, key: str) -> str:
        for line in (self.root / ".env").read_text().splitlines():
            if line.startswith(key + "="):
                return line.split("=", 1)[1]
        raise KeyError(key)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.setting('VLLM_PORT')}"

    def record(self, name: str = "engine") -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.generated / "native" / f"{name}.json").read_text())
        return data


def no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr


def error_lines(result: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 2 and lines[-1].startswith("fix:"), result.stdout + result.stderr
    return lines[-2], lines[-1]


@pytest.fixture
def made(tmp_path: Path) -> Iterator[list[Checkout]]:
    """Checkouts made by a test; each is brought down at the end (by its own `down`)."""
    checkouts: list[Checkout] = []
    yield checkouts
    for checkout in reversed(checkouts):
        if checkout.root.is_dir():
            checkout.invoke("down", "--timeout", "5")


@pytest.fixture
def checkout(tmp_path: Path, made: list[Checkout]) -> Checkout:
    home = tmp_path / "home"
    home.mkdir()
    root = simulator_project(tmp_path / "A", {"sim": "SIM_BOOT_SECONDS=0.3",
                                              "slow": "SIM_BOOT_SECONDS=60",
                                              "boot4": "SIM_BOOT_SECONDS=4"},
                             port=free_port(),
                             settings={"MODEL_PROFILE": "sim", "DASHBOARD_PORT": str(free_port())})
    made.append(Checkout(root, home))
    return made[-1]


def copy_of(source: Checkout, dest: Path, made: list[Checkout], **settings: str) -> Checkout:
    """`cp -a` of a checkout, as a user makes one; `settings` replace lines of its .env."""
    subprocess.run(["cp", "-a", str(source.root), str(dest)], check=True)
    if settings:
        text = (dest / ".env").read_text().splitlines()
        kept = [line for line in text if line.split("=", 1)[0] not in settings]
        (dest / ".env").write_text("\n".join([*kept, *(f"{k}={v}" for k, v in settings.items())])
                                   + "\n")
    made.insert(0, Checkout(dest, source.home))  # brought down before its source
    return made[0]


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated live process, leading its own group, that nothing may signal."""
    proc = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


# --- 1. ownership: a copied checkout, hand-made records ---------------------------------------------


@pytest.mark.slow  # two ups, four downs: about 15 s
def test_down_in_a_copy_of_a_running_checkout_leaves_its_engine_and_dashboard_alone(
        checkout: Checkout, tmp_path: Path, made: list[Checkout]) -> None:
    up = checkout.invoke("up")
    assert up.returncode == 0, up.stdout + up.stderr
    engine, dashboard = checkout.record("engine"), checkout.record("dashboard")
    starts = {pid: start_ticks(pid) for pid in (engine["pid"], dashboard["pid"])}
    # The copy on the same ports: its `down` must not reach A; the port still answering is
    # explained by what it left alone.
    same = copy_of(checkout, tmp_path / "B", made)
    down = same.invoke("down")
    no_traceback(down)
    assert all(alive(pid, start) for pid, start in starts.items())
    assert health_status(checkout.url) == 200
    assert f"left alone: pid {engine['pid']}, the native engine of the checkout at " \
           f"{checkout.root.resolve()}" in down.stdout
    assert f"left alone: pid {dashboard['pid']}, the dashboard of the checkout at" in down.stdout
    assert "stopped the native" not in down.stdout
    assert down.returncode == 1 and "served by a process this checkout did not start" in down.stderr
    # Its status does not claim A's engine either.
    status = json.loads(same.invoke("status", "--json").stdout)
    assert status["running"] is False and status["containers"] == []
    # A copy with its own ports: `down` succeeds, and still says what it left alone.
    own = copy_of(checkout, tmp_path / "C", made, VLLM_PORT=str(free_port()),
                  DASHBOARD_PORT=str(free_port()))
    down = own.invoke("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"left alone: pid {engine['pid']}" in down.stdout and "stopped" in down.stdout
    assert all(alive(pid, start) for pid, start in starts.items())
    # A copy runs an engine of its own beside A's, and each `down` stops only its own.
    assert own.invoke("up", "--no-dashboard").returncode == 0
    mine = own.record("engine")
    assert mine["marker"].startswith(checkout_id(own.root) + "-")
    assert own.invoke("down").returncode == 0
    assert not alive(mine["pid"], mine["start_ticks"])
    assert all(alive(pid, start) for pid, start in starts.items())
    # A's own `down` still stops both of its processes.
    down = checkout.invoke("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(alive(pid, start) for pid, start in starts.items())
    assert marked(checkout.root) == []


@pytest.mark.parametrize("which", ["engine", "dashboard"])
@pytest.mark.parametrize("marker", ["this-checkout", "another-checkout"])
def test_a_hand_made_record_naming_an_unrelated_process_never_signals_it(
        checkout: Checkout, bystander: subprocess.Popen[bytes], which: str, marker: str) -> None:
    project = Project(checkout.root)
    prefix = marker_prefix(project) if which == "engine" else dashboard_marker_prefix(project)
    # The strongest forgery: the bystander's exact pid and start time, with this checkout's marker.
    record = {"pid": bystander.pid, "start_ticks": start_ticks(bystander.pid), "boot_id": BOOT_ID,
              "marker": (prefix if marker == "this-checkout" else "0badc0de-") + "a" * 24,
              "argv": ["vllm", "serve"], "log": "", "started": 0}
    folder = checkout.generated / "native"
    folder.mkdir(parents=True)
    (folder / f"{which}.json").write_text(json.dumps(record))
    down = checkout.invoke("down")
    no_traceback(down)
    assert down.returncode == 0, down.stdout + down.stderr
    assert bystander.poll() is None  # not signalled, nor its group
    assert f"left alone: pid {bystander.pid}" in down.stdout
    assert not (folder / f"{which}.json").exists()  # the forged record is not kept either


def test_a_record_naming_pid_1_or_our_own_group_or_a_huge_pid_is_no_record(
        project: Project) -> None:
    for pid in (0, 1, -1, -os.getpgid(0), 2**31, 2**63, True, 1.5, "4242", None):
        data = {"pid": pid, "start_ticks": 1, "marker": marker_prefix(project) + "x"}
        assert EngineRecord.from_json(data) is None, pid
    for start in (-1, "1", 1.0, None, True):
        data = {"pid": 4242, "start_ticks": start, "marker": marker_prefix(project) + "x"}
        assert EngineRecord.from_json(data) is None, start
    for marker in ("", 5, ["x"], {"m": 1}, None):
        assert EngineRecord.from_json({"pid": 4242, "start_ticks": 1, "marker": marker}) is None
    for junk in ([], "x", 5, None, {"argv": {"a": 1}, "pid": 4242, "start_ticks": 1, "marker": "m"}):
        assert EngineRecord.from_json(junk) is None, junk


def test_a_marker_is_matched_whole_in_the_environment_or_the_command_line(
        tmp_path: Path) -> None:
    root = tmp_path / "proc"
    folder = root / "4242"
    folder.mkdir(parents=True)
    table = ProcTable(root)
    (folder / "environ").write_bytes(f"{MARKER_VAR}=abcdef\0PATH=/bin".encode())
    (folder / "cmdline").write_bytes(b"vllm\0serve\0")
    assert table.carries(4242, "abcdef")
    assert not table.carries(4242, "abc")  # a prefix of the marker is not the marker
    assert not table.carries(4242, "abcdefg")
    (folder / "environ").write_bytes(b"OTHER=1")
    (folder / "cmdline").write_bytes(f"env\0{MARKER_VAR}=abcdef\0vllm\0".encode())
    assert table.carries(4242, "abcdef")
    (folder / "cmdline").write_bytes(f"echo {MARKER_VAR}=abcdef".encode())  # one word, not it
    assert not table.carries(4242, "abcdef")
    assert not table.carries(4343, "abcdef")  # no such process


def test_engines_of_another_checkout_are_not_this_checkouts_unrecorded_ones(
        project: Project, tmp_path: Path) -> None:
    marks = (marker_prefix(project) + "1" * 24, "0badc0de-" + "2" * 24,
             dashboard_marker_prefix(project) + "3" * 24)
    ours, theirs, dash = procs = [subprocess.Popen(["sleep", "60"], env={MARKER_VAR: mark})
                                  for mark in marks]
    try:
        # Until its exec, a child shows this process's environment, without its marker.
        wait_for(lambda: all(ProcTable().carries(proc.pid, mark)
                             for proc, mark in zip(procs, marks, strict=True)),
                 what="the three processes' exec")
        engine = NativeEngine(project, SubprocessRunner(), out=io.StringIO())
        found = {r.pid for r in engine.unrecorded()}
        assert ours.pid in found and theirs.pid not in found and dash.pid not in found
        everything = {r.pid for r in marked_engines(ProcTable(), lambda m: True)}
        assert {ours.pid, theirs.pid, dash.pid} <= everything
        engine.grace = 1
        engine.remove()
        assert ours.wait(timeout=10) is not None
        assert theirs.poll() is None and dash.poll() is None
    finally:
        for proc in (ours, theirs, dash):
            proc.kill()
            proc.wait()


def test_a_lock_file_naming_a_pid_that_holds_nothing_is_not_believed(
        project: Project, bystander: subprocess.Popen[bytes]) -> None:
    # Written as a killed `up` leaves it, or by hand: `down` must not SIGTERM that pid.
    project.generated.mkdir()
    (project.generated / "stack.lock").write_text(json.dumps(
        {"pid": bystander.pid, "command": "up", "since": 0, "stoppable": True}))
    assert lock_holder(project.generated) is None
    assert stop_booting_up(project, io.StringIO()) is False
    assert bystander.poll() is None


def test_down_never_signals_a_lock_holder_that_is_not_a_stoppable_up(project: Project) -> None:
    # A router loading a profile holds the lock as "up" from another thread: not stoppable.
    hold = ("import sys, time\nfrom pathlib import Path\nfrom vllmstack.core.checkout import "
            "stack_lock\nwith stack_lock(Path(sys.argv[1]), 'up', stoppable=False):\n"
            "    print('held', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", hold, str(project.generated)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        holder = lock_holder(project.generated)
        assert holder is not None and (holder.pid, holder.command, holder.stoppable) == (
            proc.pid, "up", False)
        assert stop_booting_up(project, io.StringIO()) is False
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


# --- 3. the stack's own files, whatever they hold ---------------------------------------------------

HOSTILE_JSON = {
    "deep": DEEP,
    "deep-object": '{"a":' * 50_000,
    "nan": '{"pid": NaN, "start_ticks": 1}',
    "infinity": '{"started": Infinity}',
    "list": "[1, 2, 3]",
    "string": '"engine"',
    "cut": '{"pid": 12',
    "binary": "\udcff\udcfe\0\0",
    "empty": "",
}


def write_hostile(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "binary":
        path.write_bytes(b"\xff\xfe\x00\x00garbage")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_text(HOSTILE_JSON[kind])


KINDS = [*HOSTILE_JSON, "fifo", "folder"]


@pytest.mark.parametrize("kind", KINDS)
def test_read_json_file_turns_any_content_into_a_named_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.json"
    write_hostile(path, kind)
    started = time.monotonic()
    with pytest.raises(JsonFileError) as err:
        read_json_file(path, "the test record")
    assert time.monotonic() - started < 5  # a FIFO never blocks the reader
    assert err.value.cause.startswith("the test record ") and err.value.fix
    assert err.value.path == path and err.value.reason


def test_read_json_file_bounds_what_it_reads(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with big.open("wb") as handle:
        handle.truncate(2 * 1024 * 1024)  # a sparse 2 MB of zero bytes
    with pytest.raises(JsonFileError, match="larger than 1000 bytes"):
        read_json_file(big, max_bytes=1000)
    link = tmp_path / "link.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(JsonFileError, match="not a regular file"):
        read_json_file(link)
    assert read_json_file(tmp_path / "missing.json") is None
    assert parse_json('{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_json("[" * 65 + "]" * 65)


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_engine_or_dashboard_record_is_a_reason_never_an_exception(
        project: Project, kind: str) -> None:
    folder = project.generated / "native"
    for name in ("engine.json", "dashboard.json"):
        write_hostile(folder / name, kind)
    loaded = load_record(project)
    assert loaded.record is None and loaded.problem.startswith("the engine record ")
    engine = NativeEngine(project, SubprocessRunner(), out=io.StringIO())
    assert engine.state().running is False
    assert engine.members() == []
    assert engine.dashboard().running() is None
    assert engine.remove() == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_state_file_is_a_state_error_and_down_sets_it_aside(
        project: Project, kind: str) -> None:
    write_hostile(project.generated / "state.json", kind)
    with pytest.raises(StateError) as err:
        read_state(project)
    assert err.value.cause.startswith("generated/state.json ")
    assert foreign_state(project) is None
    warning = set_aside_damaged(project)
    assert warning is not None and "set aside as generated/state.json.damaged-" in warning
    assert read_state(project) is None
    [aside] = project.generated.glob("state.json.damaged-*")
    assert aside.exists()  # renamed, never deleted


def test_a_hostile_exit_file_lock_file_or_router_file_means_nothing_is_known(
        project: Project) -> None:
    record = EngineRecord(pid=4242, start_ticks=1, boot_id="", marker="m", argv=[], log="",
                          started=0)
    exit_file = project.generated / "native" / "engine.exit.json"
    for kind in KINDS:
        for path in (exit_file, project.generated / "stack.lock", project.generated / "router.json"):
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
            write_hostile(path, kind)
        assert read_exit_code(exit_file, record) is None, kind
        assert lock_holder(project.generated) is None, kind
        assert running_selection(project) is None, kind
    exit_file.rmdir()  # the last kind was a folder
    exit_file.write_text(json.dumps({"pid": 4242, "marker": "m", "code": True}))
    assert read_exit_code(exit_file, record) is None  # a bool is not an exit code
    exit_file.write_text(json.dumps({"pid": 4242, "marker": "m", "code": 3}) + " " * 400)
    assert read_exit_code(exit_file, record) == 3  # the reserved slot's padding is fine


@pytest.mark.parametrize("kind", KINDS)
def test_install_records_and_doctor_read_hostile_files_as_nothing(project: Project,
                                                                  tmp_path: Path, kind: str) -> None:
    from vllmstack.checks.host.doctor import previous_up
    from vllmstack.runtime.native import install, llamacpp_build

    folder = tmp_path / "engine"
    write_hostile(folder / install.MANIFEST, kind)
    write_hostile(folder / llamacpp_build.BUILD_INFO, kind)
    write_hostile(project.generated / "state.json", kind)
    assert install.read_manifest(folder) is None
    assert llamacpp_build.read_build_info(folder) is None
    assert previous_up(project) == {}


def test_the_keeper_refuses_a_hostile_launch_spec(project: Project) -> None:
    spec = project.generated / "native" / "launch.json"
    for content in (DEEP, "[]", '{"argv": NaN}'):
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(content)
        done = subprocess.run([sys.executable, "-m", "vllmstack.runtime.native.keeper", "keep",
                               str(spec)], capture_output=True, text=True, timeout=30, cwd=ROOT,
                              check=False)
        assert done.returncode == 2 and "cannot read the launch spec" in done.stderr, content
        assert "Traceback" not in done.stderr


@pytest.mark.slow  # an up, status and down with a damaged record: about 6 s
@pytest.mark.parametrize("damage", ["deep", "nan", "list"])
def test_down_still_stops_the_engine_when_its_record_is_hostile(
        checkout: Checkout, damage: str) -> None:
    up = checkout.invoke("up", "--no-dashboard")
    assert up.returncode == 0, up.stdout + up.stderr
    record = checkout.record()
    write_hostile(checkout.generated / "native" / "engine.json.new", damage)
    (checkout.generated / "native" / "engine.json.new").replace(
        checkout.generated / "native" / "engine.json")
    status = checkout.invoke("status", "--json")
    no_traceback(status)
    assert json.loads(status.stdout)["running"] is True  # found by its marker
    down = checkout.invoke("down")
    no_traceback(down)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "warning: the engine record" in down.stdout
    assert "stopped a native engine of this checkout that no record named" in down.stdout
    assert not alive(record["pid"], record["start_ticks"])
    assert health_status(checkout.url) is None


@pytest.mark.parametrize("damage", ["deep", "nan", "list", "binary"])
def test_status_and_down_on_a_hostile_state_file(checkout: Checkout, damage: str) -> None:
    write_hostile(checkout.generated / "state.json", damage)
    status = checkout.invoke("status")
    no_traceback(status)
    cause, fix = error_lines(status)
    assert cause.startswith("error: generated/state.json ") and "move it aside" in fix
    down = checkout.invoke("down")
    no_traceback(down)
    assert down.returncode == 0 and down.stdout.startswith("warning: generated/state.json")
    assert list(checkout.generated.glob("state.json.damaged-*"))


def test_a_hostile_router_file_does_not_break_status(checkout: Checkout) -> None:
    write_hostile(checkout.generated / "router.json", "deep")
    status = checkout.invoke("status", "--json")
    no_traceback(status)
    assert status.returncode == 0 and json.loads(status.stdout)["running"] is False


def test_a_copied_state_file_is_ignored_and_a_legacy_one_is_recognised(
        project: Project, tmp_path: Path) -> None:
    write_state(project, {"runtime": "compose", "compose_project": "vllmstack-aaaaaaaa",
                          "profile": "p", "platform": "cpu"})
    assert read_state(project) is not None  # this checkout's (it records the id)
    assert foreign_state(project) is None
    copy = Project(tmp_path / "copy")
    shutil.copytree(project.root, copy.root)
    assert read_state(copy) is None
    assert f"written by the checkout at {project.root.resolve()}" in (foreign_state(copy) or "")
    # From before the checkout was recorded: a derived project name of another path tells.
    (copy.generated / "state.json").write_text(json.dumps(
        {"runtime": "compose", "compose_project": "vllmstack-0123abcd"}))
    assert read_state(copy) is None and "vllmstack-0123abcd" in (foreign_state(copy) or "")
    (copy.generated / "state.json").write_text(json.dumps(
        {"runtime": "compose", "compose_project": "mine"}))  # set by the user: still trusted
    assert read_state(copy) == {"runtime": "compose", "compose_project": "mine"}


# --- 4. writes that fail ----------------------------------------------------------------------------


def test_a_failed_write_names_the_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "missing-folder" / "state.json"
    with pytest.raises(FileWriteError) as err:
        write_text(target, "{}")
    assert err.value.cause.startswith(f"cannot write {target}: ")
    assert isinstance(err.value, OSError) and err.value.fix
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.fixture
def tiny_disk(checkout: Checkout) -> Iterator[Path]:
    """generated/ on a 256 KiB tmpfs (root only: CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs the tests as root)")
    folder = checkout.generated
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        checkout.invoke("down", "--timeout", "5")
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path, leave_pages: int) -> None:
    """Fill the file system of `folder`, then give back `leave_pages` pages of 4 KiB."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                if os.write(fd, b"\1" * 4096) < 4096:
                    break
            except OSError:
                break
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave_pages * 4096))
    finally:
        os.close(fd)


@pytest.mark.slow  # ten `up`s against a disk that fills at each step in turn: about 30 s
def test_up_with_generated_on_a_full_disk_names_the_file_and_leaves_nothing_running(
        checkout: Checkout, tiny_disk: Path) -> None:
    named: set[str] = set()
    diagnosed = False
    for pages in range(10):
        (tiny_disk / "filler").unlink(missing_ok=True)
        for leftover in ("state.json", "stack.lock"):
            (tiny_disk / leftover).unlink(missing_ok=True)
        shutil.rmtree(tiny_disk / "native", ignore_errors=True)
        fill(tiny_disk, pages)
        up = checkout.invoke("up", "--no-dashboard")
        no_traceback(up)
        if up.returncode == 0:
            assert checkout.invoke("down").returncode == 0
            continue
        cause, fix = error_lines(up)
        assert "No space left on device" in cause or "is full" in cause, (pages, cause)
        assert fix.startswith("fix:   free space"), (pages, fix)
        for name in ("stack.lock", "launch.json", "engine.exit.json", "engine.json", "state.json"):
            if f"/{name}:" in cause:
                named.add(name)
        diagnosed = diagnosed or "is full, so the engine could not write its log" in cause
        if "state.json" in cause:
            assert "the engine this `up` started was stopped" in cause
        # Whatever failed: nothing of this checkout keeps running, no temporary file is left.
        assert marked(checkout.root) == [], (pages, cause)
        assert not [p for p in tiny_disk.rglob("*") if p.name.endswith(".tmp")], pages
        assert health_status(checkout.url) is None
    # Each step of `up` that writes was hit once: the lock, the records, the state file.
    assert {"stack.lock", "engine.json", "state.json"} <= named, named
    assert diagnosed  # the engine that died writing its log is said to have, not "code None"


def test_up_on_a_read_only_generated_folder_says_so(checkout: Checkout, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a read-only mount needs root (CI runs the tests as root)")
    checkout.generated.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs",
                           str(checkout.generated)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        up = checkout.invoke("up", "--no-dashboard")
        no_traceback(up)
        cause, fix = error_lines(up)
        assert "stack.lock: Read-only file system" in cause and "read-only file system" in fix
    finally:
        subprocess.run(["umount", "-l", str(checkout.generated)], check=False)


# --- 5. the lifecycle's minors ----------------------------------------------------------------------


@pytest.mark.slow  # a boot interrupted: about 8 s
def test_down_during_a_booting_up_stops_it_and_its_engine(checkout: Checkout) -> None:
    up = checkout.popen("up", "--model", "slow", "--no-dashboard")
    try:
        wait_for(lambda: (checkout.generated / "native" / "engine.json").is_file(), timeout=30,
                 what="the booting engine's record")
        record = checkout.record()
        started = time.monotonic()
        down = checkout.invoke("down")
        assert down.returncode == 0, down.stdout + down.stderr
        assert time.monotonic() - started < 30
        assert f"`invoke up` (pid {up.pid}) is still starting the engine: stopping it" in down.stdout
        out, _ = up.communicate(timeout=30)
    finally:
        up.kill()
    assert up.returncode == 1
    assert "error: `invoke up` was stopped by SIGTERM" in out and "Traceback" not in out
    assert not alive(record["pid"], record["start_ticks"])
    assert marked(checkout.root) == []


@pytest.mark.slow  # a boot, a kill, a second up: about 10 s
def test_up_after_a_killed_up_waits_for_the_engine_it_left(checkout: Checkout) -> None:
    up = checkout.popen("up", "--model", "boot4", "--no-dashboard")
    wait_for(lambda: (checkout.generated / "state.json").is_file(), timeout=30,
             what="the stack's state file")
    up.send_signal(signal.SIGKILL)
    up.wait(timeout=10)
    again = checkout.invoke("up", "--model", "boot4", "--no-dashboard")
    no_traceback(again)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already starting with this very command" in again.stdout
    assert "another command" not in again.stdout + again.stderr
    assert len(marked(checkout.root)) == 1  # still one engine, not a second beside it


@pytest.mark.slow
def test_an_engine_of_this_checkout_with_no_recorded_command_is_named_as_such(
        checkout: Checkout) -> None:
    up = checkout.invoke("up", "--no-dashboard")
    assert up.returncode == 0, up.stdout + up.stderr
    (checkout.generated / "state.json").unlink()  # as an `up` killed before it wrote it
    again = checkout.invoke("up", "--no-dashboard", "--set", "VLLM_SERVED_NAME=other")
    assert again.returncode == 1
    assert "does not say with which command" in again.stdout + again.stderr
    assert "another command" not in again.stdout + again.stderr


@pytest.mark.slow
def test_a_record_with_a_wrong_start_time_needs_one_down(checkout: Checkout) -> None:
    up = checkout.invoke("up", "--no-dashboard")
    assert up.returncode == 0, up.stdout + up.stderr
    path = checkout.generated / "native" / "engine.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "start_ticks": record["start_ticks"] + 7}))
    down = checkout.invoke("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stale native engine record" in down.stdout
    assert not alive(record["pid"], record["start_ticks"])
    assert health_status(checkout.url) is None


def test_a_stack_lock_that_cannot_be_made_is_a_named_error(tmp_path: Path) -> None:
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    with pytest.raises(FileWriteError, match=r"cannot write .*stack\.lock"), \
            stack_lock(blocked / "generated", "up"):
        pass


"""`invoke up/status/logs/down --runtime native` for real, with the engine simulator as the engine.

The engine command is a wrapper that first forks a sleeping child (as vLLM's API server starts
its EngineCore) and then becomes the simulator, so "no process of the group is left" is tested
on a group of two processes, not one.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, copy_project, free_port, write_dotenv

from vllmstack.core.checkout import checkout_id
from vllmstack.observe.health import health_status

SIMULATOR = ROOT / "tests" / "simulator" / "server.py"
WRAPPER = """
import os, sys, time
child = os.fork()
if child == 0:  # the "EngineCore": sleeps until it is ended
    time.sleep(600)
    os._exit(0)
start = open(f"/proc/{child}/stat").read().rpartition(")")[2].split()[19]
with open(os.path.join(os.path.dirname(__file__), "child"), "w") as f:
    f.write(f"{child} {start}")
os.execv(sys.executable, [sys.executable, SIMULATOR, *sys.argv[1:]])
"""
STATUS_KEYS = {"runtime", "running", "healthy", "model", "max_model_len", "url", "profile",
               "platform", "argv", "state", "restarts", "containers", "kv_cache_usage",
               "requests_running", "requests_waiting", "selected", "engines", "boot"}



def gone(pid: int, start: int) -> bool:
    """Ended (a zombie holds nothing: orphans are reaped by whatever pid 1 is, or not at all)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    fields = text.rpartition(")")[2].split()
    return fields[0] in ("Z", "X") or int(fields[19]) != start


def processes_with(marker: str) -> list[int]:
    needle = f"VLLMSTACK_ENGINE_ID={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ours = needle in (entry / "environ").read_bytes().split(b"\0")
            if ours and not gone(int(entry.name), _start(entry)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _start(entry: Path) -> int:
    return int((entry / "stat").read_text().rpartition(")")[2].split()[19])


class Stack:
    def __init__(self, root: Path, home: Path, port: int) -> None:
        self.root, self.home, self.port = root, home, port

    def invoke(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HOME": str(self.home)}
        return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=self.root, env=env,
                              text=True, capture_output=True, timeout=timeout, check=False)

    def up(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.invoke("up", "--platform", "cpu", "--model", "qwen3-0.6b", "--no-dashboard",
                           *extra)

    def status(self) -> dict[str, object]:
        result = self.invoke("status", "--json")
        assert result.returncode == 0, result.stderr
        data: dict[str, object] = json.loads(result.stdout)
        return data

    def record(self) -> dict[str, object] | None:
        path = self.root / "generated" / "native" / "engine.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def child(self) -> tuple[int, int]:
        pid, start = (self.root / "child").read_text().split()
        return int(pid), int(start)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    root = copy_project(tmp_path / "stack")
    wrapper = root / "engine-wrapper.py"
    wrapper.write_text(f"SIMULATOR = {str(SIMULATOR)!r}\n" + WRAPPER)
    port = free_port()
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(wrapper))}"
    write_dotenv(root, {"VLLM_PORT": str(port), "OTHER_ENGINE_PORTS": "", "RUNTIME": "native",
                        "NATIVE_ENGINE_COMMAND": f"'{command}'", "NATIVE_STOP_GRACE": "3"})
    home = tmp_path / "home"
    home.mkdir()
    stack = Stack(root, home, port)
    yield stack
    stack.invoke("down", "--timeout", "5")


@pytest.mark.slow  # six invoke runs and a boot: about 8 s
def test_healthy_boot_status_logs_and_down_leave_no_process(stack: Stack) -> None:
    result = stack.up("--set", "ENGINE_ENV=SIM_BOOT_SECONDS=1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "healthy after" in result.stdout and "warm-up answered" in result.stdout
    assert "native" in result.stdout
    status = stack.status()
    assert set(status) == STATUS_KEYS  # the same shape as for compose
    assert (status["runtime"], status["running"], status["healthy"]) == ("native", True, True)
    assert status["model"] == "qwen3-0.6b" and status["kv_cache_usage"] is not None
    record = stack.record()
    assert record is not None
    leader = int(record["pid"])  # type: ignore[call-overload]
    child, child_start = stack.child()
    members = status["containers"]
    assert isinstance(members, list)
    assert sorted(m["pid"] for m in members) == sorted([leader, child])
    assert {m["service"] for m in members} == {"vllm"}
    # What `up` recorded and `status` shows is the process's own command line, word for word:
    # the argv `check` built for the native placement is handed to the keeper, not rebuilt.
    # The wrapper's forked child keeps the command line the keeper started; the leader then
    # exec'd the simulator with the same arguments.
    recorded = json.loads((stack.root / "generated" / "state.json").read_text())["argv"]
    started, leader_now = (
        [word.decode() for word in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
        for pid in (child, leader))
    assert started == recorded and leader_now[2:] == recorded[2:]
    assert recorded[:3] == [sys.executable, str(stack.root / "engine-wrapper.py"), "serve"]
    assert status["argv"] == recorded
    # Same command again: nothing to do, nothing restarted.
    again = stack.up("--set", "ENGINE_ENV=SIM_BOOT_SECONDS=1")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert stack.record() == record
    logs = stack.invoke("logs", "--no-follow", "--tail", "500")
    assert logs.returncode == 0 and "Application startup complete" in logs.stdout
    down = stack.invoke("down")
    assert down.returncode == 0, down.stderr
    assert "stopped the native engine" in down.stdout and "2 process(es)" in down.stdout
    assert gone(child, child_start) and gone(leader, int(record["start_ticks"]))  # type: ignore[call-overload]
    assert processes_with(str(record["marker"])) == []
    assert stack.record() is None
    after = stack.status()
    assert (after["running"], after["healthy"], after["state"]) == (False, False, "missing")


def test_crash_at_boot_is_diagnosed_and_its_enginecore_does_not_survive(stack: Stack) -> None:
    result = stack.up("--set", "ENGINE_ENV=SIM_FAULT=crash-at-boot SIM_BOOT_SECONDS=0.5")
    assert result.returncode == 1
    tail = (result.stdout + result.stderr).strip().splitlines()
    assert "exited with code 1" in tail[-2] and "out of memory for the KV cache" in tail[-2]
    assert tail[-1].startswith("fix:")
    assert "No available memory for the cache blocks" in result.stderr
    assert "Traceback" not in result.stdout
    child, child_start = stack.child()
    assert gone(child, child_start)  # the leader died; its child was ended with it
    status = stack.status()
    assert (status["state"], status["running"], status["containers"]) == ("exited", False, [])
    down = stack.invoke("down")
    assert down.returncode == 0 and "had already exited with code 1; record cleared" in down.stdout


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_a_stale_pid_record_is_never_signalled_and_is_cleaned_up(
        stack: Stack, bystander: subprocess.Popen[bytes]) -> None:
    start = _start(Path(f"/proc/{bystander.pid}"))
    folder = stack.root / "generated" / "native"
    folder.mkdir(parents=True)
    stale = {"pid": bystander.pid, "start_ticks": start - 100,
             "marker": f"{checkout_id(stack.root)}-" + "f" * 24,
             "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
             "argv": ["vllm", "serve"], "log": "", "started": 0}
    (folder / "engine.json").write_text(json.dumps(stale))
    status = stack.status()
    assert (status["state"], status["running"], status["containers"]) == ("stale", False, [])
    down = stack.invoke("down")
    assert down.returncode == 0, down.stderr
    assert "stale native engine record" in down.stdout and "not signalled" in down.stdout
    assert bystander.poll() is None and stack.record() is None
    # `up` over a stale record starts normally and leaves the other program alone too.
    (folder / "engine.json").write_text(json.dumps(stale))
    result = stack.up("--set", "ENGINE_ENV=SIM_BOOT_SECONDS=0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stale native engine record" in result.stdout
    assert bystander.poll() is None


def test_without_an_installed_engine_up_says_how_to_install_it(stack: Stack) -> None:
    result = stack.up("--set", "NATIVE_ENGINE_COMMAND=")
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    # The cpu platform runs vLLM's CPU build: its version, and no AMD wheel advice.
    assert "the native engine for vLLM 0.32.0+cpu is not installed" in lines[-2]
    assert lines[-1] == "fix:   invoke install-engine --version 0.32.0+cpu"
    assert stack.record() is None


# --- one stack, one engine: the lock, and records that cannot be read -------------------------------

def live_markers(root: Path) -> dict[str, list[int]]:
    """Live processes carrying this checkout's engine marker, by marker."""
    prefix = f"VLLMSTACK_ENGINE_ID={checkout_id(root)}-".encode()
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            marked = [e for e in (entry / "environ").read_bytes().split(b"\0")
                      if e.startswith(prefix)]
            if marked and not gone(int(entry.name), _start(entry)):
                found.setdefault(marked[0].decode().split("=", 1)[1], []).append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow  # two boots at once, then a down: about 15 s
def test_two_ups_at_once_give_one_engine_and_down_stops_it(stack: Stack) -> None:
    env = {**os.environ, "HOME": str(stack.home)}
    argv = [sys.executable, "-m", "invoke", "up", "--platform", "cpu", "--model", "qwen3-0.6b",
            "--no-dashboard", "--set", "ENGINE_ENV=SIM_BOOT_SECONDS=3"]
    ups = [subprocess.Popen(argv, cwd=stack.root, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [up.communicate(timeout=180) for up in ups]
    texts = [out + err for out, err in outputs]
    waited = [i for i, text in enumerate(texts) if "which holds the stack lock" in text]
    assert len(waited) == 1, texts  # exactly one of them found the other at work
    second, first = waited[0], 1 - waited[0]
    assert ups[first].returncode == 0 and "healthy after" in texts[first], texts[first]
    # It says what it waited for: the other `up`, by pid.
    assert f"for `invoke up` (pid {ups[first].pid}" in texts[second], texts[second]
    if ups[second].returncode == 0:  # the first was up within the wait: nothing left to do
        assert "the stack lock is free" in texts[second] and "nothing to do" in texts[second]
    else:  # the first was still booting: refused, naming it
        assert f"`invoke up` (pid {ups[first].pid}" in texts[second].splitlines()[-2]
    markers = live_markers(stack.root)
    record = stack.record()
    assert record is not None and list(markers) == [record["marker"]], markers
    assert stack.status()["healthy"] is True
    down = stack.invoke("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped the native engine" in down.stdout
    assert live_markers(stack.root) == {}
    assert health_status(f"http://127.0.0.1:{stack.port}") is None


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "record-and-launch-spec-gone-to-garbage"])
def test_down_finds_an_engine_whose_record_is_damaged(stack: Stack, damage: str) -> None:
    result = stack.up("--set", "ENGINE_ENV=SIM_BOOT_SECONDS=0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    folder = stack.root / "generated" / "native"
    record = folder / "engine.json"
    marker = str(json.loads(record.read_text())["marker"])
    text = record.read_text()
    record.write_text(text[: len(text) // 2])  # cut short, as by a full disk
    if damage != "truncated":
        (folder / "launch.json").write_text("\0garbage")
    url = f"http://127.0.0.1:{stack.port}"
    assert health_status(url) == 200
    # status sees the engine by its marker, so `up` will not start a second one beside it.
    status = stack.status()
    assert (status["running"], status["healthy"]) == (True, True)
    assert len(status["containers"]) == 2  # type: ignore[arg-type]
    again = stack.up("--set", "VLLM_SERVED_NAME=another")  # another command: refused
    assert again.returncode == 1 and "already runs" in again.stdout + again.stderr
    assert list(live_markers(stack.root)) == [marker]
    down = stack.invoke("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "warning: the engine record" in down.stdout and "is not valid JSON" in down.stdout
    assert "stopped a native engine of this checkout that no record named" in down.stdout
    assert "2 process(es)" in down.stdout
    assert health_status(url) is None
    assert processes_with(marker) == []
    assert not record.exists()


@pytest.fixture
def foreign_server(stack: Stack) -> Iterator[subprocess.Popen[bytes]]:
    """Another program answering HTTP on the stack's port."""
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(stack.port), "--bind",
                             "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=stack.home)
    deadline = time.monotonic() + 20
    while health_status(f"http://127.0.0.1:{stack.port}") is None:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    yield proc
    proc.kill()
    proc.wait()


def test_down_never_says_stopped_while_the_port_still_answers(
        stack: Stack, foreign_server: subprocess.Popen[bytes]) -> None:
    folder = stack.root / "generated" / "native"
    folder.mkdir(parents=True)
    (folder / "engine.json").write_text('{"pid": 12')
    down = stack.invoke("down")
    assert down.returncode == 1
    assert not [line for line in down.stdout.splitlines() if line.startswith("stopped")]
    lines = down.stderr.strip().splitlines()
    assert f"http://127.0.0.1:{stack.port} still answers after the native runtime stopped" in lines[-2]
    assert "SimpleHTTP" in lines[-2]
    assert f"port {stack.port}" in lines[-1] and lines[-1].startswith("fix:")
    assert foreign_server.poll() is None  # never signalled: it carries no marker of ours

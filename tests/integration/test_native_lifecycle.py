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
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, copy_project, free_port, write_dotenv

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
               "platform", "state", "restarts", "containers", "kv_cache_usage",
               "requests_running", "requests_waiting"}



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
    stale = {"pid": bystander.pid, "start_ticks": start - 100, "marker": "f" * 32,
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
    assert "the native engine for vLLM 0.31.0 is not installed" in lines[-2]
    assert lines[-1] == ("fix:   invoke install-engine --version 0.31.0 (add --wheels DIR for AMD's "
                         "ROCm wheels)")
    assert stack.record() is None

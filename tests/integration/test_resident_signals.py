"""`invoke bench-vs` and `invoke burn`, signalled mid-run, take down the engine they started
(issue 22 #8: SIGTERM left it running; SIGHUP, a closed terminal, too).

Each command runs as a user runs it (`python -m invoke ...` in a project whose profiles run the
engine simulator natively). Once the simulator answers, the command gets the signal; it must end
within the lifecycle's stop grace, say so in the error/fix format, and leave no engine process
(read from /proc, not from what the command says) and no state behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bench_vs import Sims

from vllmstack.serve.state import read_state


@pytest.fixture
def sims(tmp_path: Path, tokenizer_file: Path) -> Sims:
    return Sims(tmp_path, tokenizer_file, {"sim-a": "cpu"}, only=True)


def answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


def engine_pids(port: int) -> list[int]:
    """Processes whose command line is the simulator on `port` (the engine the command started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"server.py" in a for a in argv) and str(port).encode() in argv:
            found.append(int(entry.name))
    return found


def run_and_signal(sims: Sims, args: list[str], signum: int) -> subprocess.CompletedProcess[str]:
    port = sims.ports["sim-a"]
    proc = subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=sims.root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=sims.environ,
                            start_new_session=True)  # a signal for it alone, as a terminal's
    try:
        deadline = time.monotonic() + 60
        while not answers(port):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the engine never came up"
            time.sleep(0.1)
        time.sleep(1.0)  # measuring now
        assert engine_pids(port), "the simulator runs under another command line"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def assert_nothing_left(sims: Sims, done: subprocess.CompletedProcess[str], command: str,
                        signum: int) -> None:
    port = sims.ports["sim-a"]
    assert done.returncode == 1, done
    error, fix = done.stderr.splitlines()[-2:]
    assert error == (f"error: {command} stopped by {signal.Signals(signum).name}: the profile it "
                     "had up was taken down and nothing was recorded")
    assert fix.startswith("fix:")
    assert "Traceback" not in done.stderr
    assert not answers(port) and engine_pids(port) == []
    assert read_state(sims.project) is None


@pytest.mark.slow  # an engine brought up and signalled: about 8 s each
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT],
                         ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_bench_vs_signalled_takes_its_engine_down(sims: Sims, signum: int) -> None:
    done = run_and_signal(sims, ["bench-vs", "-t", "vllm:sim-a", "--platform", "cpu"], signum)
    assert_nothing_left(sims, done, "bench-vs", signum)
    assert not (sims.project.root / "results" / "bench-vs_history.jsonl").exists()


@pytest.mark.slow
def test_bench_vs_signalled_while_its_engine_boots_takes_it_down(sims: Sims) -> None:
    env_file = sims.root / "env" / "models" / "sim-a.env"
    env_file.write_text(env_file.read_text().replace("SIM_BOOT_SECONDS=0.3", "SIM_BOOT_SECONDS=30"))
    port = sims.ports["sim-a"]
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "bench-vs", "-t", "vllm:sim-a",
                             "--platform", "cpu"], cwd=sims.root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=sims.environ,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not engine_pids(port):  # started, not yet answering: `up` waits for /health
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.0)
        assert not answers(port)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert_nothing_left(sims, done, "bench-vs", signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_burn_signalled_takes_its_engine_down(sims: Sims, signum: int) -> None:
    done = run_and_signal(sims, ["burn", "--profiles", "sim-a", "--runs", "200", "--platform",
                                 "cpu"], signum)
    assert_nothing_left(sims, done, "burn", signum)

"""Start the engine simulator as a local process for a test, and always stop it afterwards.

    with run_simulator(env={"SIM_ITL_MS": "5"}, argv=["--served-model-name", "tiny"]) as sim:
        requests.get(f"{sim.url}/v1/models")

This is a test fixture: it starts a long-running server and kills it, which the stack's
`Runner` (run a command to completion) is not made for, so it uses subprocess directly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SERVER = Path(__file__).resolve().with_name("server.py")


class SimulatorError(RuntimeError):
    """The simulator did not come up (it exited, or /health never answered 200)."""


@dataclass
class SimProcess:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_exit(self, timeout: float) -> int:
        """Wait for the process to end by itself; returns its exit code."""
        return self.proc.wait(timeout=timeout)

    def wait_for_log(self, needle: str, timeout: float = 10.0) -> str:
        """Wait until `needle` appears in the log; returns the log text."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_text()
            if needle in text:
                return text
            time.sleep(0.05)
        raise SimulatorError(f"{needle!r} not in the simulator log after {timeout} s:\n"
                             + self.log_text()[-2000:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def health_status(url: str, timeout: float = 1.0) -> int | None:
    """HTTP status of GET /health, or None when nothing answers (connection refused)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def wait_healthy(sim: SimProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sim.proc.poll() is not None:
            raise SimulatorError(f"simulator exited with {sim.proc.returncode} before it was "
                                 f"healthy; log {sim.log_path}:\n{sim.log_text()[-2000:]}")
        if health_status(sim.url, timeout=0.5) == 200:
            return
        time.sleep(0.05)
    raise SimulatorError(f"simulator /health not 200 after {timeout} s; log {sim.log_path}:\n"
                         f"{sim.log_text()[-2000:]}")


@contextlib.contextmanager
def run_simulator(
    env: Mapping[str, str] | None = None,
    argv: Sequence[str] | None = None,
    port: int | None = None,
    *,
    wait: bool = True,
    timeout: float = 30.0,
    log_dir: Path | None = None,
) -> Iterator[SimProcess]:
    """Run server.py on a free local port; wait for /health 200 unless `wait` is False.

    `env` adds SIM_* settings (SIM_* from the caller's environment are dropped so tests are
    sealed); `argv` is passed as the `vllm serve` command line, with `--host 127.0.0.1` and
    `--port` added after it.
    """
    chosen = port or free_port()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SIM_")}
    child_env.update(env or {})
    child_env["PYTHONUNBUFFERED"] = "1"
    folder = Path(tempfile.mkdtemp(prefix="engine-sim-", dir=log_dir))
    log_path = folder / "engine.log"
    command = [sys.executable, str(SERVER), *(argv or []), "--host", "127.0.0.1",
               "--port", str(chosen)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                start_new_session=True)
    sim = SimProcess(url=f"http://127.0.0.1:{chosen}", port=chosen, proc=proc,
                     log_path=log_path)
    try:
        if wait:
            wait_healthy(sim, timeout)
        yield sim
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; only this process (its own session)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=grace)

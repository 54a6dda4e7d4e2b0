"""Start the engine simulator as a local process for a test, and always stop it afterwards.

    with run_simulator(env={"SIM_ITL_MS": "5"}, argv=["--served-model-name", "tiny"]) as sim:
        requests.get(f"{sim.url}/v1/models")

This is a test fixture: it starts a long-running server and kills it, which the stack's
`Runner` (run a command to completion) is not made for, so it uses subprocess directly.

The engine log lives in a temporary folder that is removed when the block ends (read it inside
the block); when the block fails, the log's tail is added to the exception as a note.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from helpers import free_port

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


def sim_env(tokenizer: Path, *, ttft_ms: float, prefill_tps: float, itl_ms: float,
            **extra: str) -> dict[str, str]:
    """SIM_* settings for known pacing: no boot delay, first token after `ttft_ms` plus the
    prompt at `prefill_tps`, then a step every `itl_ms`; prompt tokens counted with `tokenizer`.
    `extra` adds or overrides SIM_* keys."""
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": str(ttft_ms),
           "SIM_PREFILL_TPS": str(prefill_tps), "SIM_ITL_MS": str(itl_ms),
           "SIM_TOKENIZER": str(tokenizer)}
    env.update(extra)
    return env


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
    `--port` added after it. The log folder is made under `log_dir` and kept there when it is
    given; otherwise it is a temporary folder, removed on exit.
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
    failure: Exception | None = None
    try:
        if wait:
            wait_healthy(sim, timeout)
        yield sim
    except Exception as exc:
        failure = exc
        raise
    finally:
        stop_process(proc)
        if failure is not None and not isinstance(failure, SimulatorError):  # those quote it
            with contextlib.suppress(OSError):
                failure.add_note(f"simulator log (tail):\n{sim.log_text()[-2000:]}")
        if log_dir is None:
            shutil.rmtree(folder, ignore_errors=True)


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

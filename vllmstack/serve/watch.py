"""Waiting for the engine: the boot phase, the live progress line, crash detection, warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

import requests

from vllmstack.observe.health import health_status
from vllmstack.runtime.base import EngineRuntime, EngineState
from vllmstack.serve import diagnosis
from vllmstack.serve.stack import LifecycleError

POLL_S = 0.5

PHASES: tuple[tuple[str, str], ...] = (
    ("Application startup complete", "serving"),
    ("Starting vLLM server", "starting API server"),
    ("Capturing CUDA graph", "capturing graphs"),
    ("Graph capturing finished", "starting API server"),
    ("torch.compile", "compiling"),
    ("Compiling", "compiling"),
    ("KV cache", "allocating KV cache"),
    ("profil", "profiling memory"),
    ("Loading weights took", "profiling memory"),
    ("Loading safetensors", "loading weights"),
    ("Loading model", "loading weights"),
    ("Starting to load model", "loading weights"),
    ("Initializing a V1 LLM engine", "initialising engine"),
    ("non-default args", "parsing arguments"),
)


def phase_of(lines: Sequence[str]) -> str:
    for line in reversed(lines[-60:]):
        for needle, phase in PHASES:
            if needle in line:
                return phase
    return "starting"


@dataclass
class Progress:
    """One live line (rewritten in place on a terminal, a line per change elsewhere)."""

    out: TextIO
    tty: bool
    last_text: str = ""
    last_print: float = 0.0

    def show(self, elapsed: float, phase: str, last_line: str) -> None:
        line = last_line.strip()
        text = f"[{elapsed:6.1f}s] {phase:<20} {line[-90:]}"
        if self.tty:
            self.out.write("\r" + text[:150].ljust(150))
            self.out.flush()
            return
        now = time.monotonic()
        if phase != self.last_text or now - self.last_print > 15:
            self.out.write(text[:200] + "\n")
            self.out.flush()
            self.last_text, self.last_print = phase, now

    def done(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def wait_until_healthy(
    engine: EngineRuntime,
    url: str,
    timeout: float,
    progress: Progress,
    *,
    health: Callable[[str], int | None] = health_status,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Return seconds until /health said 200. Raise LifecycleError with a diagnosis otherwise.

    Never waits blindly: every poll looks at the engine's state first, so an exit or a restart
    is caught within one poll interval, not at the timeout.
    """
    start = clock()
    first = engine.state()
    restarts = first.restart_count
    lines: list[str] = []
    try:
        while True:
            elapsed = clock() - start
            state = engine.state()
            lines = engine.log_lines(200)
            if not state.running or state.restart_count > restarts or state.status == "restarting":
                raise _engine_died(engine, state, elapsed)
            status = health(url)
            if status == 200:
                return elapsed
            if status == 503:
                raise _engine_died(engine, state, elapsed, health_503=True)
            progress.show(elapsed, phase_of(lines), lines[-1] if lines else "")
            if elapsed > timeout:
                tail = engine.log_lines(30)
                raise LifecycleError(
                    f"the engine did not become healthy within {timeout:.0f} s "
                    f"(last phase: {phase_of(lines)})",
                    "raise --timeout (first boots compile kernels for minutes), or read the log "
                    "tail above for a hang",
                    details=["--- last log lines ---", *tail])
            sleep(POLL_S)
    finally:
        progress.done()


def _engine_died(engine: EngineRuntime, state: EngineState, elapsed: float,
                 health_503: bool = False) -> LifecycleError:
    lines = engine.log_lines(2000)
    found = diagnosis.diagnose(lines, state.exit_code)
    if health_503:
        what = "the engine died after its API server came up (/health answered 503)"
    elif state.status == "restarting" or state.restart_count:
        what = f"the engine died and is crash-looping (restarted {state.restart_count} time(s))"
    else:
        what = f"the engine exited with code {state.exit_code}"
    details = ["--- last log lines ---", *lines[-15:], "--- diagnosis ---"]
    if found.line:
        details.append(f"log line {found.line_number}: {found.line.strip()}")
    return LifecycleError(f"{what} after {elapsed:.1f} s: {found.cause}", found.fix, details)


# --- warm-up -------------------------------------------------------------------------------


def warm_up(url: str, served_name: str, timeout: float = 300.0) -> float:
    """One short chat completion, so the first real request does not pay for lazy init."""
    start = time.monotonic()
    try:
        response = requests.post(url + "/v1/chat/completions", timeout=timeout, json={
            "model": served_name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        })
    except requests.RequestException as exc:
        raise LifecycleError(f"the warm-up request failed: {exc}",
                             "the engine is up but does not answer; see `invoke logs`") from exc
    if not response.ok:
        raise LifecycleError(
            f"the warm-up request got HTTP {response.status_code}: {response.text[:300]}",
            "check VLLM_SERVED_NAME and the engine log (`invoke logs`)")
    return time.monotonic() - start

"""Waiting for the engine: the boot phase, the live progress line, crash detection, warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

import requests

from vllmstack.core.runner import mask_text
from vllmstack.observe.health import health_status
from vllmstack.runtime.base import EngineRuntime, EngineState
from vllmstack.serve import diagnosis
from vllmstack.serve.boot_markers import live_phase
from vllmstack.serve.stack import LifecycleError

POLL_S = 0.5
# A boot whose log stood still this long at the timeout hung rather than worked slowly.
HANG_SILENCE_S = 120.0

def phase_of(lines: Sequence[str], default: str = "starting") -> str:
    """The boot phase the newest telling line names; `default` (the phase so far) when none does,
    e.g. while a long traceback fills the tail."""
    for line in reversed(lines):
        phase = live_phase(line)  # the table `invoke startup` measures the boot's phases with
        if phase is not None:
            return phase
    return default


# Lines that say nothing on their own: traceback carets, blank lines.
FILLER = frozenset(" ^~")
# Without a new log line, a plain (non-terminal) output repeats the status this often, as a
# heartbeat that says how long nothing has happened; a new line prints at most this often.
HEARTBEAT_S = 60.0
MIN_GAP_S = 15.0
TTY_WIDTH = 150
PLAIN_WIDTH = 200


def newest_line(lines: Sequence[str]) -> str:
    """The newest log line that says something, without vLLM's process prefix and log header."""
    for line in reversed(lines):
        parsed = diagnosis.split_line(line)
        if parsed.text and not set(parsed.text) <= FILLER:
            short = parsed.process.removeprefix("Worker_") if parsed.process else None
            return f"{short}: {parsed.text}" if short and short != "APIServer" else parsed.text
    return ""


def cut_at_word(text: str, width: int) -> str:
    """`text` in at most `width` characters, cut at a word boundary with an ellipsis."""
    if len(text) <= width:
        return text
    head = text[: width - 1]
    space = head.rfind(" ")
    if space > width // 2:
        head = head[:space]
    return head.rstrip(" ,;:") + "…"


@dataclass
class Progress:
    """The boot's live status: phase, time in that phase, and the newest distinct log line.

    On a terminal it is one line rewritten in place. Elsewhere (CI, a log file) a line is written
    when the phase changes, when a new log line appeared (at most every MIN_GAP_S), or as a
    heartbeat after HEARTBEAT_S without one: never the same line twice.
    """

    out: TextIO
    tty: bool
    phase: str = ""
    phase_since: float = 0.0
    shown_line: str = ""
    last_print: float = -HEARTBEAT_S  # elapsed seconds at the last plain line

    def show(self, elapsed: float, phase: str, lines: Sequence[str]) -> None:
        if phase != self.phase:
            self.phase, self.phase_since = phase, elapsed
            changed_phase = True
        else:
            changed_phase = False
        line = newest_line(lines)
        head = f"[{elapsed:6.1f}s] {phase} ({elapsed - self.phase_since:.0f} s)"
        if self.tty:
            text = head + (f"  {line}" if line else "")
            self.out.write("\r" + cut_at_word(text, TTY_WIDTH).ljust(TTY_WIDTH))
            self.out.flush()
            return
        now = elapsed
        new_line = line != self.shown_line
        if changed_phase or (new_line and now - self.last_print >= MIN_GAP_S):
            text = head + (f"  {line}" if line and new_line else "")
        elif now - self.last_print >= HEARTBEAT_S:
            text = head + f"  (no new log line for {now - self.last_print:.0f} s)"
        else:
            return
        self.out.write(cut_at_word(text, PLAIN_WIDTH) + "\n")
        self.out.flush()
        self.shown_line, self.last_print = line, now

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
    vendor: str | None = None,
    secrets: Sequence[str] = (),
    loading_503: bool = False,
    tensor_parallel: int = 1,
    backend: str | None = None,
) -> float:
    """Return seconds until /health said 200. Raise LifecycleError with a diagnosis otherwise.

    `vendor` (GPU_VENDOR) picks the diagnosis' vendor-specific fixes, and `backend`
    (ATTENTION_BACKEND) is never offered as one. Every log line shown is
    masked with `secrets` (vLLM logs its non-default args, an --api-key among them).
    `loading_503`: the engine answers 503 while it loads (llama-server does); vLLM answers only
    once loaded, so there a 503 means its engine core died.

    Never waits blindly: every poll looks at the engine's state first, so an exit or a restart
    is caught within one poll interval, not at the timeout.
    """
    start = clock()
    first = engine.state()
    restarts = first.restart_count
    lines: list[str] = []
    changed_at = 0.0
    try:
        while True:
            elapsed = clock() - start
            state = engine.state()
            previous, lines = lines, _masked(engine.log_lines(200), secrets)
            if lines != previous:
                changed_at = elapsed
            if not state.running or state.restart_count > restarts or state.status == "restarting":
                raise _engine_died(engine, state, elapsed, vendor=vendor, secrets=secrets,
                                   backend=backend)
            status = health(url)
            if status == 200:
                return elapsed
            if status == 503 and not loading_503:
                raise _engine_died(engine, state, elapsed, health_503=True, vendor=vendor,
                                   secrets=secrets, backend=backend)
            progress.show(elapsed, phase_of(lines, progress.phase or "starting"), lines)
            if elapsed > timeout:
                tail = _masked(engine.log_lines(30), secrets)
                raise LifecycleError(
                    f"the engine did not become healthy within {timeout:.0f} s "
                    f"(last phase: {progress.phase or phase_of(lines)})"
                    + hang_hint(elapsed - changed_at, vendor, tensor_parallel),
                    "raise --timeout (first boots compile kernels for minutes), or read the log "
                    "tail above for a hang",
                    details=["--- last log lines ---", *tail])
            sleep(POLL_S)
    finally:
        progress.done()


def hang_hint(silent_s: float, vendor: str | None, tensor_parallel: int) -> str:
    """A running engine that stopped logging is not a crash: on AMD at TP >= 2 the known cause is
    RCCL's LL-protocol deadlock on gfx12 (ROCm/rocm-systems#5480, vllm-project/vllm#40980)."""
    if silent_s < HANG_SILENCE_S or vendor != "amd" or tensor_parallel < 2:
        return ""
    return (f"; no log line for {silent_s:.0f} s: a TP all-reduce hang on gfx1201 looks like this "
            "(NCCL_PROTO=Simple, ROCm/rocm-systems#5480)")


# How much of a dead engine's log the diagnosis reads (a TP boot failure can log thousands of
# traceback lines: 2,300 for a real 2-GPU hybrid with a missing flashinfer).
DIAGNOSIS_LINES = 5000


def _masked(lines: list[str], secrets: Sequence[str]) -> list[str]:
    return [mask_text(line, secrets) for line in lines] if secrets else lines


def _engine_died(engine: EngineRuntime, state: EngineState, elapsed: float,
                 health_503: bool = False, vendor: str | None = None,
                 secrets: Sequence[str] = (), backend: str | None = None) -> LifecycleError:
    lines = _masked(engine.log_lines(DIAGNOSIS_LINES), secrets)
    found = diagnosis.diagnose(lines, state.exit_code, vendor, backend)
    full = state.details.get("disk_full")
    if full and found.code == "unknown":
        # The log holds nothing because nothing more could be written to it.
        found = diagnosis.Diagnosis(
            "disk-full", f"the file system holding {full} is full, so the engine could not write "
            "its log (and died of it, or its error is missing from the log)",
            f"free space there (df -h {full}), then `invoke up` again", None, None)
    if health_503:
        what = "the engine died after its API server came up (/health answered 503)"
    elif state.status == "restarting" or state.restart_count:
        what = f"the engine died and is crash-looping (restarted {state.restart_count} time(s))"
    elif state.exit_code is None:
        what = "the engine ended (its exit code was not recorded)"
    else:
        what = f"the engine exited with code {state.exit_code}"
    details = ["--- last log lines ---", *lines[-15:], "--- diagnosis ---"]
    if found.line and found.line_number:
        # Numbered from the log's start only when the whole log was read.
        where = (f"log line {found.line_number}" if len(lines) < DIAGNOSIS_LINES else
                 f"{len(lines) - found.line_number + 1} lines from the end of the log")
        details.append(f"{where}: {found.line.strip()}")
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

"""One profile resident at a time, for the commands that measure several (`bench-vs`, `burn`).

Each profile is brought up and taken down through the stack's own lifecycle (`serve.lifecycle`:
checks, guards, crash diagnosis, `down` waiting for the GPU memory to drain), so the second
engine never starts while the first holds the card. What both commands need around that lives
here: the start and stop steps with their diagnosis line, whether a load was cold (the engine's
compile caches were empty, or it wrote new files to them while starting), the GPU memory read
while the engine runs, and a tokenizer that asks a running llama-server (its `/tokenize` is exact
for the GGUF's vocabulary, which no tokenizer.json on disk is guaranteed to be).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TextIO

import requests

from vllmstack.bench.client.client import RequestResult
from vllmstack.bench.runs.session import Session
from vllmstack.config.engines.table import kind_named
from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.observe.health import health_status
from vllmstack.runtime.engine_env import stack_paths
from vllmstack.runtime.gpu import GIB, GpuProbe, total_used
from vllmstack.serve import lifecycle
from vllmstack.serve.stack import Stack
from vllmstack.serve.state import read_state
from vllmstack.workload.prompts import TokenizerError


@dataclass
class ResidentResult:
    """A run over profiles brought up one at a time: its record (one row per profile) and the
    files it wrote."""

    record: dict[str, Any]
    written: list[Path]

    @property
    def rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.record["rows"]
        return rows


# Folders under the engine cache that are not compile caches (the container's HOME).
NOT_COMPILE_CACHES = ("home",)
VRAM_INTERVAL_S = 2.0
NO_GPU = "n/a (no GPU)"


class ResidentError(StackError):
    """The stack cannot host a measured run now (something already runs); says what to do."""


def one_line(text: str, limit: int = 300) -> str:
    """A diagnosis as one table cell: whitespace collapsed, `|` escaped, bounded."""
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def diagnosis(exc: StackError) -> str:
    """The one line a row carries: the error's cause, plus its first finding when it has findings
    rather than a log tail (a profile refused by its checks names only their count otherwise)."""
    details = [d for d in exc.details if d.strip()]
    if details and not details[0].startswith("---"):
        return one_line(f"{exc.cause}: {details[0]}")
    return one_line(exc.cause)


def ensure_idle(project: Project) -> None:
    """Refuse while the stack already serves something: these commands bring every profile up and
    down themselves, and must not take down (or measure) an engine someone else started."""
    state = read_state(project) or {}
    url = state.get("url")
    if isinstance(url, str) and health_status(url) is not None:
        raise ResidentError(
            f"the stack already runs profile {state.get('profile', '?')} at {url}; this command "
            "brings each profile up and down itself, one at a time",
            "`invoke down` first (then run it again)")


def compile_cache_files(resolved: Resolved, environ: Mapping[str, str]) -> int:
    """Files in the engine's compile caches (vLLM, Triton, Inductor, AITER JIT; native and
    container layouts alike: everything under the engine cache folder but its HOME)."""
    root = stack_paths(resolved, environ).engine_cache
    count = 0
    try:
        tops = [p for p in root.iterdir() if p.name not in NOT_COMPILE_CACHES]
    except OSError:
        return 0
    for top in tops:
        if top.is_file():
            count += 1
            continue
        # A cache folder another user owns is skipped, not fatal: it is the count that matters.
        for _, _, files in os.walk(top, onerror=lambda _exc: None):
            count += len(files)
    return count


def load_kind(before: int, after: int) -> str:
    """cold: the compile caches were empty, or the engine compiled what they lacked (new files);
    warm: it found everything it needed there."""
    return "cold" if before == 0 or after > before else "warm"


@dataclass
class Started:
    """A profile that `up` brought to healthy."""

    stack: Stack
    boot_s: float
    load_kind: str
    cache_files: tuple[int, int]  # before and after `up`
    baseline_bytes: int | None  # GPU memory in use before `up` (None: no GPU to read)
    boot: dict[str, Any] | None = None  # its phases as `up` measured them (serve.boot_phases)


def open_profile(project: Project, resolved: Resolved, environ: Mapping[str, str],
                 runner: Runner, *, runtime: str | None, out: TextIO) -> Stack:
    return lifecycle.open_stack(project, resolved, environ, runner, runtime=runtime, out=out)


def start(stack: Stack, *, timeout: float | None = None) -> Started:
    """`up` without the dashboard. A failure is the lifecycle's StackError, whose cause is the
    diagnosis (the caller then takes down whatever did start: `needs_down`)."""
    before = compile_cache_files(stack.resolved, stack.environ)
    baseline = total_used(stack.probe.memory())
    result = lifecycle.up(stack, timeout=timeout, dashboard=False)
    after = compile_cache_files(stack.resolved, stack.environ)
    return Started(stack, result.boot_seconds, load_kind(before, after), (before, after),
                   baseline, result.boot.as_json() if result.boot is not None else None)


def needs_down(stack: Stack) -> bool:
    """Whether anything of this stack is left to take down (a start that failed after launching
    leaves a stopped process or container and the state file)."""
    return read_state(stack.project) is not None or stack.engine.state().exists


def take_down(stack: Stack, spec: str, notes: list[str]) -> str | None:
    """`down` (which waits until the engine's GPU memory has drained) when anything of `spec`
    started. Returns why no other profile may start when it did not stop (None: it stopped).
    A signal that arrives meanwhile waits until `down` is done (`stop_on_signals`)."""
    with _deferred_signals():
        try:
            if needs_down(stack):
                lifecycle.down(stack)
        except StackError as exc:
            notes.append(f"did not stop: {one_line(exc.cause)}")
            return (f"the previous profile ({spec}) did not stop: {one_line(exc.cause)}; nothing "
                    "else was started")
    return None


# --- signals: the engine a command started is taken down however the command ends ---------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """SIGTERM, SIGHUP (the terminal closed) or SIGINT ended a command that brings profiles up
    and down. Raised in the main thread where it was, so the `finally` that takes the profile
    down runs. A KeyboardInterrupt, not a plain BaseException: asyncio re-raises only that (and
    SystemExit) from its callbacks; any other exception raised where the signal landed inside a
    transport's `data_received` was logged as a fatal error on that connection and swallowed, and
    `burn` then waited with its engine up (CI, stop 30). No `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _Guard:
    installed: bool = False
    depth: int = 0  # inside `down`: a signal waits until it is done
    pending: int | None = None


_GUARD = _Guard()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While a command runs, STOP_SIGNALS raise Interrupted instead of ending the process where it
    stands: Python's default for SIGTERM and SIGHUP ends it without running a `finally`, which
    left the engine `up` had started running (issue 22 #8). Main thread only (signals are)."""
    if threading.current_thread() is not threading.main_thread() or _GUARD.installed:
        yield
        return

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        if _GUARD.depth:
            _GUARD.pending = signum
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # plain code (starting, waiting for /health): raise where it is
            raise Interrupted(signum) from None
        # Inside a running event loop the handler may land in any task, leaving that task
        # holding the exception ("Task exception was never retrieved" at exit), or in asyncio's
        # own bookkeeping. Raised from a callback of its own instead, it leaves the loop at the
        # next turn; asyncio.run then cancels every task cleanly. `_threadsafe`: it wakes a
        # loop that is waiting in select() for a server that is slow to answer.
        loop.call_soon_threadsafe(_raise_interrupted, signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    _GUARD.installed, _GUARD.pending = True, None
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _GUARD.installed = False


def _raise_interrupted(signum: int) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _deferred_signals() -> Iterator[None]:
    _GUARD.depth += 1
    try:
        yield
    finally:
        _GUARD.depth -= 1
    if not _GUARD.depth and _GUARD.pending is not None and _GUARD.installed:
        signum, _GUARD.pending = _GUARD.pending, None
        raise Interrupted(signum)


def keep_alive(engine: str) -> bool:
    """Whether to reuse connections to this engine (its kind's `keep_alive`: llama-server loses
    a request sent on a connection that carried a streamed answer). One connection per request
    costs a localhost connect, 0.18 ms median on the 2-core test machine, inside its TTFT."""
    return kind_named(engine).keep_alive


# --- GPU memory while the engine runs ------------------------------------------------------------


class VramSampler:
    """Reads the GPU's used memory now and then while a measurement runs (off the event loop)."""

    def __init__(self, probe: GpuProbe, interval_s: float = VRAM_INTERVAL_S) -> None:
        self.probe = probe
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> None:
        used = total_used(await asyncio.to_thread(self.probe.memory))
        if used is not None:
            self.samples.append(used)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sample()

    async def __aenter__(self) -> VramSampler:
        await self.sample()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):  # a probe failing at the end loses one sample
            await self.sample()

    def record(self, baseline: int | None) -> dict[str, Any]:
        """Peak in use while measured, and the engine's share (peak minus before `up`)."""
        if not self.samples:
            return {"available": False}
        peak = max(self.samples)
        return {"available": True, "peak_bytes": peak, "baseline_bytes": baseline,
                "engine_bytes": peak - baseline if baseline is not None else None,
                "samples": len(self.samples)}


def vram_text(vram: Mapping[str, Any] | None) -> str:
    if not vram or not vram.get("available"):
        return NO_GPU
    engine = vram.get("engine_bytes")
    peak = vram.get("peak_bytes") or 0
    if isinstance(engine, int):
        return f"{engine / GIB:.1f} GiB"
    return f"{peak / GIB:.1f} GiB in use"


# --- llama-server's own tokenizer ----------------------------------------------------------------


@dataclass
class _Encoding:
    ids: list[int]


@dataclass
class ServerTokenizer:
    """`encode(...).ids` and `decode(ids)` through a running llama-server (POST /tokenize and
    /detokenize), the interface PromptBuilder uses. Blocking: prompts are built before timing."""

    url: str
    api_key: str | None = None
    timeout_s: float = 30.0
    _http: requests.Session = field(default_factory=requests.Session, repr=False)

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            response = self._http.post(self.url + path, json=body, headers=headers,
                                       timeout=self.timeout_s)
            response.raise_for_status()
            return response.json()
        except (requests.RequestException, ValueError) as exc:
            raise TokenizerError(f"llama-server's {path} at {self.url} failed: {exc}",
                                 "is the server up and a llama-server? (`invoke status`)") from exc

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        data = self._post("/tokenize", {"content": text, "add_special": add_special_tokens})
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise TokenizerError(f"{self.url}/tokenize did not answer a list of token ids")
        return _Encoding(tokens)

    def decode(self, ids: Sequence[int]) -> str:
        data = self._post("/detokenize", {"tokens": list(ids)})
        content = data.get("content") if isinstance(data, dict) else None
        if not isinstance(content, str):
            raise TokenizerError(f"{self.url}/detokenize did not answer a text")
        return content


# --- results -------------------------------------------------------------------------------------


@dataclass
class CollectingSession(Session):
    """A bench session that keeps every request's result (for the server's own timings)."""

    collected: list[RequestResult] = field(default_factory=list)

    async def send(self, messages: list[dict[str, Any]], max_tokens: int) -> RequestResult:
        result = await super().send(messages, max_tokens)
        self.collected.append(result)
        return result


def server_timings(results: Sequence[RequestResult]) -> dict[str, float] | None:
    """Mean of llama-server's prompt_per_second and predicted_per_second over the successful
    requests that carried them; None when the server sends no timings (vLLM)."""
    out: dict[str, float] = {}
    for key in ("prompt_per_second", "predicted_per_second"):
        values = [float(t[key]) for r in results if r.ok and (t := r.server_timings)
                  and isinstance(t.get(key), int | float) and not isinstance(t.get(key), bool)]
        if values:
            out[key] = statistics.fmean(values)
    return out or None


def today(ts: float | None = None) -> str:
    return time.strftime("%Y-%m-%d", time.localtime(ts))


def stamp(ts: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def append_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(text)

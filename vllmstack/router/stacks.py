"""Loads and unloads through the serving lifecycle, exactly as `invoke up` / `invoke down` do.

What a lifecycle call prints (checks' warnings, the boot progress, the diagnosis) goes to the
model's own log, generated/router/<profile>.log, and line by line, named, to the router's log.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import io
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO, cast

from vllmstack.config.profiles import Resolved, Setting
from vllmstack.core.errors import StackError
from vllmstack.core.files import remove_file, write_text
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.observe.health import health_status, is_sleeping
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.plan import ALL, KV
from vllmstack.router.states import Adopted, Loaded, Slept
from vllmstack.router.upstream import Upstream, UpstreamError
from vllmstack.runtime.engine_env import engine_env_words
from vllmstack.runtime.gpu import GpuMemory, GpuProbe, NoGpuProbe, probe_for, total_used
from vllmstack.serve import lifecycle
from vllmstack.serve.stack import Stack
from vllmstack.serve.state import StateError, read_state, state_path

ROUTER_DIR = "router"
# `down` waits this long for the GPU memory to be released (as `invoke down` does by default).
DOWN_TIMEOUT_S = 120.0
# Level 1 only: weights to host RAM, KV cache dropped. Level 2 drops the weights too, and after
# a level-2 wake vLLM does not reload speculative-decoding (MTP) drafts (vLLM #52479).
SLEEP_LEVEL = 1
SLEEP_FLAG = "--enable-sleep-mode"
DEV_MODE = "VLLM_SERVER_DEV_MODE=1"  # what exposes /sleep and /wake_up (loopback only)
# A first sleep pins host buffers for the weights: 41 s for a 27B on an H200.
SLEEP_TIMEOUT_S = 600.0
# How much longer than that the worker thread waits for the event loop to run the call.
LOOP_WAIT_S = 10.0
# How long a load cut short by the router's stop waits for that stop to say how it ended.
ABORT_WAIT_S = 120.0
# The engine plugin behind ROUTER_SLEEP_FREES=kv (a sys.path entry: the package and its
# .dist-info, whose entry point vLLM loads in every process it starts).
PLUGIN_DIR = "engine-plugins"
FREES_ENV = "VLLMSTACK_SLEEP_FREES"
# Where the plugin reads, at each sleep, what that sleep frees ("kv", or "all": vLLM's own level
# 1), written by the router before it sends /sleep: the engine's environment is fixed at its
# start, and /sleep takes no more than its level.
FREES_FILE_ENV = "VLLMSTACK_SLEEP_FREES_FILE"


class LineLog(io.TextIOBase):
    """A text sink for a lifecycle call: every write goes to the model's log file at once, and
    each complete line to `say`, prefixed with the model's name (and to `keep`, when given).
    A log file that cannot be written (a full disk) is dropped, said once: a load or a stop
    never fails for its log (issue 35)."""

    def __init__(self, path: Path, say: Callable[[str], None], prefix: str,
                 keep: list[str] | None = None) -> None:
        super().__init__()
        self._say, self._prefix, self._partial, self._keep = say, prefix, "", keep
        self._lock = threading.Lock()
        self._path = path
        self._file: TextIO | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        except OSError as exc:
            self._lost(exc)

    def _lost(self, exc: OSError) -> None:
        self._say(f"{self._prefix}warning: cannot write {self._path}: {exc.strerror or exc}; "
                  "this model's log goes to the router's log only")
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        self._file = None

    def write(self, text: str) -> int:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.write(text)
                    self._file.flush()
                except OSError as exc:
                    self._lost(exc)
            *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if self._keep is not None:
                self._keep.append(line)
            self._say(f"{self._prefix}{line}")
        return len(text)

    def isatty(self) -> bool:
        return False  # the progress display prints plain lines, never carriage returns

    def close(self) -> None:
        if self._partial:
            self._say(f"{self._prefix}{self._partial}")
            self._partial = ""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        super().close()


class StackLifecycle:
    """engines.Lifecycle over serve.lifecycle: load = `up` (no dashboard side-car: the
    dashboard follows one engine, not a router), unload = `down`, each on the entry's own
    engine (`Entry.slot`; "" where one engine runs at a time); sleep and wake through vLLM's
    dev-mode endpoints, with the card's used memory read around every sleep by the probe `up`'s
    guards use."""

    def __init__(self, project: Project, environ: Mapping[str, str], runner: Runner, *,
                 say: Callable[[str], None], runtime: str | None = None,
                 catalog: Catalog | None = None) -> None:
        self.project, self.environ, self.runner = project, environ, runner
        self.say, self.runtime = say, runtime
        entries = list(catalog.entries.values()) if catalog is not None else []
        # The pool's engines: starting one never counts the others as another engine.
        self.siblings = frozenset(e.slot for e in entries if e.slot)
        # Loads the router cut short as it stops (abort): when it is done, and what the stop
        # printed; such a load is reported as the router's stop, never diagnosed as a crash.
        self.aborts: dict[str, tuple[threading.Event, list[str]]] = {}
        # The router's pooled client and its event loop (attach): /sleep and /wake_up go out
        # on it from the worker thread a Lifecycle call runs in.
        self._client: tuple[Upstream, asyncio.AbstractEventLoop] | None = None
        first = entries[0].resolved if entries else None
        self.probe: GpuProbe = NoGpuProbe() if first is None else probe_for(
            first.get_str("GPU_VENDOR"), runner, unified_memory=first.get_bool("UNIFIED_MEMORY"),
            standin=first.get_str("GPU_MEMORY_DIR"))

    def attach(self, upstream: Upstream, loop: asyncio.AbstractEventLoop) -> None:
        """Send /sleep and /wake_up through the router's own client (service._serve, on `loop`):
        its kept-alive connections, and no proxy from the environment (it ignores HTTP_PROXY,
        which `requests` sent these loopback calls to)."""
        self._client = (upstream, loop)

    def log_path(self, entry: Entry) -> Path:
        return self.project.generated / ROUTER_DIR / f"{entry.profile}.log"

    @contextmanager
    def stack(self, entry: Entry, resolved: Resolved | None = None,
              keep: list[str] | None = None) -> Iterator[Stack]:
        out = LineLog(self.log_path(entry), self.say, f"[{entry.id}] ", keep)
        try:
            yield lifecycle.open_stack(self.project, resolved or entry.resolved, self.environ,
                                       self.runner, runtime=self.runtime, out=cast(TextIO, out),
                                       probe=self.probe, slot=entry.slot, siblings=self.siblings)
        finally:
            out.close()

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = ALL) -> Loaded:
        kv = frees == KV and sleep_mode
        if kv:
            self._say_frees(entry, KV)
        else:  # a file left by a kv start before would tell the next sleep to send `frees`
            with contextlib.suppress(OSError):
                remove_file(self.frees_path(entry))
        resolved = with_start_options(entry.resolved, util, sleep_mode,
                                      plugins=self.project.root / PLUGIN_DIR if kv else None,
                                      inherited=self.environ.get("PYTHONPATH", ""),
                                      frees_file=self.frees_path(entry) if kv else None)
        self.aborts.pop(entry.id, None)
        began = time.monotonic()
        with self.stack(entry, resolved) as stack:
            try:
                result = lifecycle.up(stack, dashboard=False)
            except StackError as exc:
                cut = self._cut_short(entry, time.monotonic() - began)
                # the evidence (log lines) and the diagnosis; or that the router stopped it
                print((cut or exc).render(), file=stack.out)
                self._end_started(entry, stack)
                if cut is not None:
                    raise cut from exc
                raise
            return Loaded(result.url, result.boot_seconds, result.warmup_seconds or 0.0)

    def _cut_short(self, entry: Entry, seconds: float) -> StackError | None:
        """A load the router's stop cut short (abort) ends as that, not as a crash: the engine
        the router SIGKILLed after its grace exited with 137, and the diagnosis blamed a
        warning in its log (issue 35). None for a load nobody stopped."""
        aborted = self.aborts.get(entry.id)
        if aborted is None:
            return None
        done, lines = aborted
        done.wait(ABORT_WAIT_S)  # the stop's own line says how the engine ended
        how = next((line for line in reversed(lines) if line.startswith("stopped")), None)
        return StackError(
            f"the load of {entry.id} was cut short after {seconds:.1f} s: stopped by the router, "
            "which is stopping" + (f" ({how})" if how else ""),
            "nothing to fix: the router stops its engines when it stops; start it again to serve")

    def _end_started(self, entry: Entry, stack: Stack) -> None:
        """A load that failed after its engine started (the warm-up request failed): end that
        engine, or every later load would be refused while it holds the GPU. An engine that
        `up` did not start for this profile (another profile's, a user's) is never touched."""
        try:
            state = read_state(self.project, entry.slot) or {}
        except StateError:
            return
        if state.get("profile") != entry.profile:
            return
        if stack.engine.state().running:
            try:
                lifecycle.down(stack, timeout=DOWN_TIMEOUT_S)
            except StackError as exc:
                print(f"the failed load's engine did not stop: {exc.render()}", file=stack.out)
        elif entry.slot:
            # `up` stopped it (a boot that timed out or died, a load cut short): its state file
            # would show it in `invoke status` as "not answering" (issue 35). Its log stays.
            with contextlib.suppress(OSError):
                remove_file(state_path(self.project, entry.slot))

    def unload(self, entry: Entry) -> None:
        with self.stack(entry) as stack:
            try:
                lifecycle.down(stack, timeout=DOWN_TIMEOUT_S)
            except StackError as exc:
                print(exc.render(), file=stack.out)
                raise

    def abort(self, entry: Entry) -> None:
        done, lines = threading.Event(), list[str]()
        self.aborts[entry.id] = (done, lines)
        try:
            with self.stack(entry, keep=lines) as stack:
                stack.engine.stop()
        finally:
            done.set()

    def kill(self, entry: Entry) -> None:
        """The stop ran past ROUTER_STOP_TIMEOUT: the engine's stop without a grace (SIGTERM
        and at once SIGKILL to its process group), whatever its `down` is still waiting for."""
        values = {**entry.resolved.values,
                  "NATIVE_STOP_GRACE": Setting("NATIVE_STOP_GRACE", "0", "--set")}
        with self.stack(entry, dataclasses.replace(entry.resolved, values=values)) as stack:
            stack.engine.stop()

    def frees_path(self, entry: Entry) -> Path:
        return self.project.generated / ROUTER_DIR / f"{entry.profile}.sleep-frees"

    def _last_frees(self, entry: Entry) -> str | None:
        """What its last sleep was told to free (kv, all), from the file the router writes
        before each sleep; None for an engine started without the plugin."""
        try:
            words = self.frees_path(entry).read_text(encoding="utf-8")[:64].split()
        except OSError:
            return None
        return words[0] if words and words[0] in (KV, ALL) else None

    def _say_frees(self, entry: Entry, frees: str) -> None:
        path = self.frees_path(entry)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, f"{frees}\n", 0o644)

    def sleep(self, entry: Entry, frees: str = ALL) -> Slept:
        """POST /sleep?level=1 (never level 2: after a level-2 wake vLLM does not reload MTP
        drafts, vLLM #52479), the cards' used memory read right before and after. An engine
        started with the plugin is told first what this sleep frees (`frees`: kv, or all)."""
        if self.frees_path(entry).exists():
            self._say_frees(entry, frees)
        before = total_used(self.probe.memory())
        began = time.monotonic()
        self._post(entry, f"/sleep?level={SLEEP_LEVEL}", "sleep")
        seconds = time.monotonic() - began
        return Slept(seconds, before, total_used(self.probe.memory()))

    def wake(self, entry: Entry) -> float:
        began = time.monotonic()
        self._post(entry, "/wake_up", "wake up")
        return time.monotonic() - began

    def memory(self) -> list[GpuMemory] | None:
        return self.probe.memory()

    def _post(self, entry: Entry, path: str, what: str) -> None:
        """POST `path` on the router's client: run on its event loop, waited for here (a worker
        thread; from the loop's own thread it would wait for itself)."""
        if self._client is None:
            raise RuntimeError("StackLifecycle.attach was not called: no HTTP client for "
                               f"POST {path}")
        upstream, loop = self._client
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None  # no loop runs in this thread: a worker thread, as it should be
        if running is loop:
            raise RuntimeError(f"POST {path} called on the router's event loop: it would block")
        failed = f"see its log (generated/router/{entry.profile}.log)"
        calling = upstream.post_bare(entry.url + path, SLEEP_TIMEOUT_S)
        try:
            future = asyncio.run_coroutine_threadsafe(calling, loop)
        except RuntimeError as exc:  # the loop is closed: the router is gone
            calling.close()
            raise StackError(f"the engine of {entry.id} did not {what}: {exc}", failed) from exc
        try:
            status, body = future.result(SLEEP_TIMEOUT_S + LOOP_WAIT_S)
        except UpstreamError as exc:
            raise StackError(f"the engine of {entry.id} did not {what}: {exc}", failed) from exc
        except (TimeoutError, concurrent.futures.CancelledError) as exc:
            future.cancel()  # the router is stopping (its loop cancelled the call) or stalled
            raise StackError(f"the engine of {entry.id} did not {what}: the call was cut off "
                             f"({type(exc).__name__})", failed) from exc
        if status != 200:
            raise StackError(
                f"the engine of {entry.id} answered {status} to POST {path}: "
                f"{body[:200].decode('utf-8', 'replace')}",
                "sleep mode needs vLLM's --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (the "
                "router sets both in sleep mode) on a platform vLLM sleeps on (CUDA, ROCm)")

    def adoptable(self, catalog: Catalog) -> list[Adopted]:
        """Engines of the catalog's profiles that run and answer /health with 200, each as its
        state file records it (on its own engine; where one engine runs at a time, the one
        generated/state.json names), awake or asleep."""
        found: list[Adopted] = []
        for entry in catalog.entries.values():
            try:
                state = read_state(self.project, entry.slot) or {}
            except StateError as exc:
                self.say(f"warning: {entry.id} not adopted: {exc.cause}")
                continue
            if state.get("profile") != entry.profile or state.get("platform") != catalog.platform:
                if state and not entry.slot:
                    self.say(f"not adopting the engine of generated/state.json (profile "
                             f"{state.get('profile')} on {state.get('platform')}): not one of "
                             "the router's profiles; a load will refuse while it runs")
                continue
            with self.stack(entry) as stack:
                if stack.engine.state().running and health_status(entry.url) == 200:
                    sleeping = is_sleeping(entry.url)
                    found.append(Adopted(entry, entry.url, sleeping is True,
                                         recorded_util(state), sleeping is not None,
                                         self._last_frees(entry)))
        return found


def with_start_options(resolved: Resolved, util: float | None, sleep_mode: bool, *,
                       plugins: Path | None = None, inherited: str = "",
                       frees_file: Path | None = None) -> Resolved:
    """The profile as the router starts it: at the share of the card its plan leaves
    (VLLM_GPU_MEM_UTIL), and in sleep mode with vLLM's --enable-sleep-mode and
    VLLM_SERVER_DEV_MODE=1 (its /sleep and /wake_up; the engine listens on loopback only, see
    catalog); with `plugins` (ROUTER_SLEEP_FREES=kv) its sleep frees only the KV cache: the
    plugin folder goes first on the engine's PYTHONPATH (before the profile's own, or the
    caller's, `inherited`, which it would otherwise replace) and VLLMSTACK_SLEEP_FREES=kv turns it
    on; `frees_file` is where it reads what each sleep frees (a kv-released engine deepened to
    level 1 backs its weights up). As --set overrides: state.json records them, so `status`
    resolves the same."""
    values = dict(resolved.values)

    def put(key: str, value: str) -> None:
        values[key] = Setting(key, value, "--set")

    if util is not None:
        put("VLLM_GPU_MEM_UTIL", f"{util:g}")
    if sleep_mode:
        extra = resolved.get_str("VLLM_EXTRA_ARGS")
        if SLEEP_FLAG not in extra.split():
            put("VLLM_EXTRA_ARGS", f"{extra} {SLEEP_FLAG}".strip())
        env = resolved.get_str("ENGINE_ENV")
        words = [] if DEV_MODE in env.split() else [DEV_MODE]
        if plugins is not None:
            given = engine_env_words(env)[0]
            paths = [str(plugins), *(p for p in (given.get("PYTHONPATH") or inherited).split(":")
                                     if p and p != str(plugins))]
            words += [f"{FREES_ENV}=kv", shlex.quote("PYTHONPATH=" + ":".join(paths))]
            if frees_file is not None:
                words.append(shlex.quote(f"{FREES_FILE_ENV}={frees_file}"))
        if words:
            put("ENGINE_ENV", " ".join([env, *words]).strip())
    return dataclasses.replace(resolved, values=values)


def recorded_util(state: Mapping[str, object]) -> float | None:
    """The VLLM_GPU_MEM_UTIL an engine was started with, from its state's overrides."""
    sets = state.get("sets")
    for word in sets if isinstance(sets, list) else []:
        key, _, value = str(word).partition("=")
        if key == "VLLM_GPU_MEM_UTIL":
            try:
                return float(value)
            except ValueError:
                return None
    return None

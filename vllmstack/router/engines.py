"""The resident engine: one at a time, loaded on demand, unloaded when idle.

A load is `invoke up` for that profile (serve.lifecycle.up: checks, guards, boot watch, crash
diagnosis, warm-up); an unload is `invoke down` (which waits until the GPU memory is released),
so a swap never has two engines resident. Both block, so they run in a worker thread while the
event loop keeps serving.

Scheduling: a request for the resident, ready model goes straight through unless a swap is
queued. Every other request queues on one FIFO lock; its holder starts the switch as a task of
its own, so a request that gives up (its load timeout, or its client left) never cancels a load
half way. A swap first waits for the requests still streaming from the old engine. A load that
fails leaves the model `failed` with the diagnosis (the StackError's cause and fix); the waiting
requests get it, and the next request for that model tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllmstack.core.errors import StackError
from vllmstack.router.catalog import Catalog, Entry

UNLOADED, LOADING, READY, FAILED, UNLOADING = "unloaded", "loading", "ready", "failed", "unloading"
RECENT_SWAPS = 20
IDLE_POLL_S = 0.5
# A swap waits this long for the old model's requests before it cuts them: long enough for any
# ordinary answer (32k tokens at 60 t/s is under 10 minutes), short of holding the router for ever.
DRAIN_TIMEOUT_S = 600.0


class RouterBusyError(StackError):
    """A request waited longer than its load timeout for its model."""


class LoadFailedError(StackError):
    """The model could not be loaded; cause and fix are the diagnosis."""


@dataclass(frozen=True)
class Loaded:
    """A load's outcome: where the engine answers, and how long its boot and warm-up took."""

    url: str
    boot_s: float = 0.0  # start to /health 200 (the engine's own start)
    warmup_s: float = 0.0


class Lifecycle(Protocol):
    """How the manager loads and unloads (serve.lifecycle for real; a fake in unit tests).
    Every method blocks and is called from a worker thread."""

    def load(self, entry: Entry) -> Loaded:
        """Start the engine (as `invoke up`); once healthy and warm. StackError on failure."""

    def unload(self, entry: Entry) -> None:
        """Stop it (as `invoke down`), returning once its memory is released."""

    def abort(self, entry: Entry) -> None:
        """Cut a boot short (the router is stopping): the load then fails at once."""

    def adoptable(self, catalog: Catalog) -> Entry | None:
        """A healthy engine of one of the catalog's profiles that is already running."""


@dataclass
class ModelStatus:
    state: str = UNLOADED
    error: dict[str, str] | None = None  # {"cause", "fix"} of the last failure
    since: float = field(default_factory=time.time)


@dataclass
class Swap:
    """One switch: the old engine's stop time, the new one's start, and the whole."""

    unloaded: str | None
    loaded: str | None
    stop_s: float
    start_s: float
    total_s: float
    ok: bool
    reason: str  # "request", "unload", "idle"
    at: float = field(default_factory=time.time)
    error: str | None = None
    boot_s: float = 0.0  # of start_s: the engine's boot to /health 200
    warmup_s: float = 0.0  # of start_s: the warm-up request

    def as_dict(self) -> dict[str, Any]:
        return {"unloaded": self.unloaded, "loaded": self.loaded, "stop_s": round(self.stop_s, 3),
                "start_s": round(self.start_s, 3), "boot_s": round(self.boot_s, 3),
                "warmup_s": round(self.warmup_s, 3), "total_s": round(self.total_s, 3),
                "ok": self.ok, "reason": self.reason, "at": self.at, "error": self.error}


class EngineManager:
    """The one resident engine and the queue in front of it (all methods on the event loop)."""

    def __init__(self, catalog: Catalog, lifecycle: Lifecycle, *,
                 say: Callable[[str], None] = lambda line: None,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        self.catalog = catalog
        # How long a swap or an unload waits for the requests on the old model (0: for ever);
        # then it cuts them, so one stream that never ends cannot hold every other model off.
        self.drain_timeout = drain_timeout
        self._holders: set[Callable[[], None]] = set()  # cut() of each request in flight
        self.lifecycle = lifecycle
        self.say = say
        self.on_change = on_change
        self.clock = clock
        self.status: dict[str, ModelStatus] = {e: ModelStatus() for e in catalog.entries}
        self.resident: Entry | None = None  # loaded or loading; `url` once ready
        self.url: str | None = None
        self.adopted = False
        self.swaps: deque[Swap] = deque(maxlen=RECENT_SWAPS)
        self.inflight = 0
        self.waiting = 0
        self.last_used = clock()
        self.closing = False
        self._lock = asyncio.Lock()
        self._drained = asyncio.Event()
        self._drained.set()
        self._task: asyncio.Task[None] | None = None  # the switch under way (load/unload)
        # Finished loads per model: a request that saw one end in failure while it waited gets
        # that failure; only a request arriving after it tries again.
        self._attempts: dict[str, int] = {}

    # --- state --------------------------------------------------------------------------------

    def ready(self, entry: Entry) -> bool:
        return self.resident is entry and self.status[entry.id].state == READY

    def _set(self, entry: Entry, state: str, error: StackError | None = None) -> None:
        status = self.status[entry.id]
        status.state, status.since = state, time.time()
        status.error = None if error is None else {"cause": error.cause, "fix": error.fix or ""}
        self.on_change()

    def snapshot(self) -> dict[str, Any]:
        """What /v1/health, router.json and the dashboard show."""
        resident = self.resident
        state = self.status[resident.id].state if resident else UNLOADED
        return {
            "status": "ok",
            "loaded": resident.id if resident else None,
            "state": state,
            "profile": resident.profile if resident else None,
            "engine_url": self.url if state == READY else None,
            "adopted": self.adopted,
            "queue": self.waiting,
            "inflight": self.inflight,
            "idle_s": round(self.clock() - self.last_used, 1) if self.inflight == 0 else 0.0,
            "models": {k: {"state": v.state, "error": v.error} for k, v in self.status.items()},
            "swaps": [s.as_dict() for s in self.swaps],
        }

    async def adopt(self) -> Entry | None:
        """At start: take over a healthy engine of one of our profiles that already runs."""
        entry = await asyncio.to_thread(self.lifecycle.adoptable, self.catalog)
        if entry is not None:
            self.resident, self.url, self.adopted = entry, entry.url, True
            self.last_used = self.clock()
            self._set(entry, READY)
            self.say(f"adopted the running engine of profile {entry.profile} ({entry.id}) at {entry.url}")
        return entry

    # --- requests -----------------------------------------------------------------------------

    async def acquire(self, entry: Entry, timeout: float) -> str:
        """Wait until `entry` is the resident, ready model (loading it if needed) and count the
        caller as one request on it; its URL. Pair with release(). RouterBusyError after
        `timeout` seconds, LoadFailedError when the load failed."""
        if self.ready(entry) and not self._lock.locked() and not self.closing:
            return self._grant()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seen = self._attempts.get(entry.id, 0)
        self.waiting += 1  # until granted or refused: what the dashboard shows as the queue
        try:
            try:
                await asyncio.wait_for(self._lock.acquire(), timeout)
            except TimeoutError:
                raise self._busy(entry, timeout) from None
            try:
                return await self._turn(entry, seen, deadline, timeout)
            finally:
                self._lock.release()
        finally:
            self.waiting -= 1

    async def _turn(self, entry: Entry, seen: int, deadline: float, timeout: float) -> str:
        """Holding the lock: wait for the switch under way, start ours if needed, then grant."""
        loop = asyncio.get_running_loop()
        while True:
            if self.closing:
                raise LoadFailedError("the router is stopping",
                                      "send the request again once the router runs")
            if self._task is not None and not self._task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(self._task), deadline - loop.time())
                except TimeoutError:
                    raise self._busy(entry, timeout) from None
            if self.ready(entry):
                return self._grant()
            if self._attempts.get(entry.id, 0) > seen:
                error = self.status[entry.id].error or {}
                raise LoadFailedError(error.get("cause", f"{entry.id} did not load"),
                                      error.get("fix") or None)
            self._start(self._switch(entry, "request"))

    def _grant(self) -> str:
        self.inflight += 1
        self._drained.clear()
        self.last_used = self.clock()
        assert self.url is not None
        return self.url

    def hold(self, cut: Callable[[], None]) -> None:
        """Register how to cut a granted request short (its client connection's abort)."""
        self._holders.add(cut)

    def unhold(self, cut: Callable[[], None]) -> None:
        self._holders.discard(cut)

    async def _drain(self, old: Entry) -> None:
        """Wait for the requests on `old` to finish; past drain_timeout, cut them."""
        if not self.inflight:
            return
        self.say(f"waiting for {self.inflight} request(s) on {old.id} to finish")
        try:
            await asyncio.wait_for(self._drained.wait(), self.drain_timeout or None)
        except TimeoutError:
            self.say(f"{self.inflight} request(s) on {old.id} still running after "
                     f"{self.drain_timeout:g} s (--drain-timeout): cutting them")
            for cut in list(self._holders):
                cut()
            await self._drained.wait()

    def release(self) -> None:
        self.inflight -= 1
        self.last_used = self.clock()
        if self.inflight == 0:
            self._drained.set()

    def _busy(self, entry: Entry, timeout: float) -> RouterBusyError:
        doing = self.status[self.resident.id].state if self.resident else "idle"
        return RouterBusyError(
            f"{entry.id} was not ready within the load timeout ({timeout:.0f} s); the router is "
            f"{doing}{' ' + self.resident.id if self.resident else ''} with {self.waiting} request(s) "
            "queued", "send the request again later (the load goes on), or raise the load timeout")

    def engine_gone(self, entry: Entry, why: str) -> None:
        """A forward found the resident engine not answering: it crashed after it was ready.
        The next request unloads what is left of it and loads it again."""
        if self.resident is entry and self.status[entry.id].state == READY:
            self.say(f"{entry.id}: the engine at {self.url} stopped answering ({why})")
            self._set(entry, FAILED, StackError(
                f"the engine of {entry.id} stopped answering at {self.url} ({why})",
                f"see its log (invoke logs, or generated/router/{entry.profile}.log); the next "
                "request loads it again"))

    # --- the lifecycle API --------------------------------------------------------------------

    async def load(self, entry: Entry, timeout: float) -> None:
        await self.acquire(entry, timeout)
        self.release()

    async def unload(self, timeout: float, reason: str = "unload") -> Entry | None:
        """Unload the resident model (after its requests finish); what was unloaded."""
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout)
        except TimeoutError:
            raise RouterBusyError(f"the router is busy loading; nothing was unloaded within "
                                  f"{timeout:.0f} s", "try again once the load is done") from None
        try:
            if self._task is not None and not self._task.done():
                await asyncio.shield(self._task)
            resident = self.resident
            if resident is not None:
                self._start(self._switch(None, reason))
                assert self._task is not None
                await asyncio.shield(self._task)
            return resident
        finally:
            self._lock.release()

    def _start(self, coro: Any) -> None:
        self._task = asyncio.get_running_loop().create_task(coro)

    async def _switch(self, entry: Entry | None, reason: str) -> None:
        """Unload the resident (after its requests drain), then load `entry` (None: only unload)."""
        old, start = self.resident, self.clock()
        stop_s = start_s = 0.0
        try:
            if old is not None:
                await self._drain(old)
                self._set(old, UNLOADING)
                self.say(f"unloading {old.id} ({old.profile})")
                try:
                    await asyncio.to_thread(self.lifecycle.unload, old)
                except StackError as exc:
                    self._set(old, FAILED, exc)
                    raise StackError(f"{old.id} could not be unloaded first: {exc.cause}",
                                     exc.fix) from exc
                stop_s = self.clock() - start
                self.resident, self.url, self.adopted = None, None, False
                self._set(old, UNLOADED)
            if entry is None:
                self.swaps.append(Swap(old.id if old else None, None, stop_s, 0.0,
                                       self.clock() - start, True, reason))
                return
            self.resident, self.url = entry, None
            self._set(entry, LOADING)
            self.say(f"loading {entry.id} ({entry.profile}, {entry.engine})")
            began = self.clock()
            try:
                loaded = await asyncio.to_thread(self.lifecycle.load, entry)
            finally:
                start_s = self.clock() - began
            self.url, self.last_used = loaded.url, self.clock()
            self._set(entry, READY)
            self.say(f"{entry.id} is ready at {loaded.url} (start {start_s:.1f} s, stop of the "
                     f"previous {stop_s:.1f} s)")
            self.swaps.append(Swap(old.id if old else None, entry.id, stop_s, start_s,
                                   self.clock() - start, True, reason, boot_s=loaded.boot_s,
                                   warmup_s=loaded.warmup_s))
        except Exception as exc:
            if entry is not None:
                self._attempts[entry.id] = self._attempts.get(entry.id, 0) + 1
            error = exc if isinstance(exc, StackError) else StackError(
                f"{type(exc).__name__}: {exc}", "see the router's log; this is a bug of the router")
            if entry is not None:
                if self.resident is entry:
                    self.resident, self.url = None, None
                self._set(entry, FAILED, error)
            self.say(f"{'loading ' + entry.id if entry else 'unloading'} failed: {error.cause}"
                     + (f"\n  fix: {error.fix}" if error.fix else ""))
            self.swaps.append(Swap(old.id if old else None, entry.id if entry else None, stop_s,
                                   start_s, self.clock() - start, False, reason, error=error.cause))
        finally:
            self.on_change()

    # --- idle unload and stop -----------------------------------------------------------------

    async def idle_loop(self) -> None:
        """Unload the resident model once it has had no request for its TTL (0: never). The
        clock starts when it is ready and restarts at every request's start and end, so a long
        load or a long stream is never cut by it."""
        while True:
            await asyncio.sleep(IDLE_POLL_S)
            entry = self.resident
            if (entry is None or not entry.ttl or not self.ready(entry) or self.inflight
                    or self._lock.locked() or self.clock() - self.last_used < entry.ttl):
                continue
            async with self._lock:
                if (self.ready(entry) and not self.inflight
                        and self.clock() - self.last_used >= entry.ttl):
                    self.say(f"{entry.id} idle for {entry.ttl:g} s: unloading")
                    self._start(self._switch(None, "idle"))
                    assert self._task is not None
                    await asyncio.shield(self._task)

    async def shutdown(self) -> None:
        """Stop the engine the router started or adopted (a boot in progress is cut short)."""
        self.closing = True
        task = self._task
        if task is not None and not task.done():
            loading = self.resident
            if loading is not None and self.status[loading.id].state == LOADING:
                self.say(f"stopping: cutting the load of {loading.id} short")
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.lifecycle.abort, loading)
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        resident = self.resident
        if resident is None:
            return
        self._set(resident, UNLOADING)
        self.say(f"stopping: unloading {resident.id}")
        try:
            await asyncio.to_thread(self.lifecycle.unload, resident)
        except StackError as exc:
            self._set(resident, FAILED, exc)
            raise
        self.resident, self.url = None, None
        self._set(resident, UNLOADED)

"""The resident engine: one at a time, loaded on demand, unloaded when idle, watched while idle.

A load is `invoke up` for that profile (serve.lifecycle.up: checks, guards, boot watch, crash
diagnosis, warm-up); an unload is `invoke down` (which waits until the GPU memory is released),
so a swap never has two engines resident. Both block, so they run in a worker thread while the
event loop keeps serving. Nothing here speaks HTTP: the HTTP layer (server, upstream) asks for
an engine with acquire/release, reports how each forward went, and hands in `probe` (the
engine's /health) and a `cut` per request.

Scheduling, resident first within a bound: a request for the resident, ready model is served at
once, even while requests for other models wait, until the oldest of those has waited
ROUTER_SWAP_WAIT (the swap is due: requests for the resident then queue behind it) or the
resident has had no request for ROUTER_SWAP_GRACE. Then the swap to the oldest waiter's model
starts, as a task of its own (a request that gives up, its load timeout or its client gone,
never cancels a load half way): it waits for the requests still running on the old engine (cut
after the drain timeout, each ending with an error event), unloads, loads. A load that fails
leaves the model `failed` with the diagnosis (the StackError's cause and fix); the requests that
waited for it get it, and the next request for that model tries again.

Health: an idle resident engine's /health is checked every ROUTER_HEALTH_INTERVAL in the
background, and before a request is forwarded after such a pause, so a dead engine is loaded
again instead of answering 502. A run of ROUTER_ERROR_RUN answers of 500 or above marks it
failed (checked, then loaded again); a forward that got no usable answer is followed by a
probe, and only an engine that fails it is loaded again (one malformed answer is not a dead
engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from vllmstack.core.errors import StackError
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.limits import Limits
from vllmstack.router.states import (
    FAILED,
    LOADING,
    READY,
    UNLOADED,
    UNLOADING,
    Lifecycle,
    Loaded,
    LoadFailedError,
    ModelStatus,
    RouterBusyError,
    Swap,
)

__all__ = ["DRAIN_TIMEOUT_S", "EngineManager", "Lifecycle", "LoadFailedError", "Loaded",
           "RouterBusyError"]

RECENT_SWAPS = 20
IDLE_POLL_S = 0.5
# A swap waits this long for the old model's requests before it cuts them: long enough for any
# ordinary answer (32k tokens at 60 t/s is under 10 minutes), short of holding the router for ever.
DRAIN_TIMEOUT_S = 600.0


Probe = Callable[[str], Coroutine[Any, Any, bool]]  # whether the engine at a URL answers /health
Cut = Callable[[str], None]  # end one request in flight now, saying why


@dataclass(eq=False)
class Waiter:
    """A request queued for its model: its future gets the engine's URL once granted."""

    entry: Entry
    arrived: float
    seen: int  # failed loads of its model that had finished when it arrived
    granted: asyncio.Future[str]


class EngineManager:
    """The one resident engine and the queue in front of it (all methods on the event loop)."""

    def __init__(self, catalog: Catalog, lifecycle: Lifecycle, *,
                 say: Callable[[str], None] = lambda line: None,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 drain_timeout: float = DRAIN_TIMEOUT_S, limits: Limits | None = None,
                 probe: Probe | None = None) -> None:
        self.catalog = catalog
        # How long a swap or an unload waits for the requests on the old model (0: for ever);
        # then it cuts them, so one stream that never ends cannot hold every other model off.
        self.drain_timeout = drain_timeout
        self.limits = limits or Limits()
        self.probe = probe
        self._holders: set[Cut] = set()  # cut() of each request in flight
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
        self.last_used = clock()  # the idle TTL's clock: a request's start or end, a load's end
        self._last_request = -math.inf  # a client request's start or end: the swap grace's clock
        self.closing = False
        self._queue: list[Waiter] = []
        self._drained = asyncio.Event()
        self._drained.set()
        self._task: asyncio.Task[None] | None = None  # the switch under way (load/unload)
        self._timer: asyncio.TimerHandle | None = None  # when a held-back swap is looked at again
        # Finished loads per model: a request that saw one end in failure while it waited gets
        # that failure; only a request arriving after it tries again.
        self._attempts: dict[str, int] = {}
        self._last_ok = clock()  # the engine's last answer (a forward's or a probe's)
        self._errors = 0  # its answers of 500 or above in a row
        self._probing: asyncio.Task[bool] | None = None

    # --- state --------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def ready(self, entry: Entry) -> bool:
        return self.resident is entry and self.status[entry.id].state == READY

    def switching(self) -> bool:
        return self._task is not None and not self._task.done()

    def _due(self, arrived: float) -> bool:
        """A request for another model that came before `arrived` has waited its bound: requests
        for the resident arriving after it queue behind it."""
        now = self.clock()
        return any(not self.ready(w.entry) and w.arrived <= arrived
                   and now - w.arrived >= self.limits.swap_wait for w in self._queue)

    def servable(self, entry: Entry, arrived: float | None = None) -> bool:
        return (self.ready(entry) and not self.closing and not self.switching()
                and not self._due(self.clock() if arrived is None else arrived))

    def _failed_since(self, waiter: Waiter) -> bool:
        return self._attempts.get(waiter.entry.id, 0) > waiter.seen

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
            self.last_used = self._last_ok = self.clock()
            self._set(entry, READY)
            self.say(f"adopted the running engine of profile {entry.profile} ({entry.id}) at {entry.url}")
        return entry

    # --- requests -----------------------------------------------------------------------------

    async def acquire(self, entry: Entry, timeout: float) -> str:
        """Wait until `entry` is the resident, ready model (loading it if needed) and count the
        caller as one request on it; its URL. Pair with release(). RouterBusyError after
        `timeout` seconds, LoadFailedError when the load failed."""
        if self.servable(entry) and await self._fresh(entry) and self.servable(entry):
            return self._grant()
        loop = asyncio.get_running_loop()
        waiter = Waiter(entry, self.clock(), self._attempts.get(entry.id, 0), loop.create_future())
        self._queue.append(waiter)  # until granted or refused: what the dashboard shows as the queue
        self._schedule()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.granted), timeout)
        except BaseException as exc:
            if waiter.granted.done() and not waiter.granted.cancelled() \
                    and waiter.granted.exception() is None:
                self.release()  # granted just as it gave up (its client left, its timeout)
            waiter.granted.cancel()
            if isinstance(exc, TimeoutError):
                raise self._busy(entry, timeout) from None
            raise
        finally:
            if waiter in self._queue:
                self._queue.remove(waiter)
                self._schedule()

    def _grant(self) -> str:
        self.inflight += 1
        self._drained.clear()
        self.last_used = self._last_request = self.clock()
        assert self.url is not None
        return self.url

    def release(self) -> None:
        self.inflight -= 1
        self.last_used = self._last_request = self.clock()
        if self.inflight == 0:
            self._drained.set()
            if self._queue:
                self._schedule()  # a swap held back for the resident's requests may go now

    def hold(self, cut: Cut) -> None:
        """Register how to cut a granted request short (its stream ends with an error)."""
        self._holders.add(cut)

    def unhold(self, cut: Cut) -> None:
        self._holders.discard(cut)

    def cut_all(self, reason: str) -> int:
        """Cut every request in flight now; how many."""
        holders = list(self._holders)
        for cut in holders:
            cut(reason)
        return len(holders)

    def _schedule(self) -> None:
        """Grant the waiters that can go (or give them their failure); start the swap the
        queue needs, or look again when the resident's bound or grace is up."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for waiter in list(self._queue):
            if waiter.granted.done():
                self._queue.remove(waiter)
            elif self.closing:
                waiter.granted.set_exception(LoadFailedError(
                    "the router is stopping", "send the request again once the router runs"))
            elif self._failed_since(waiter):
                error = self.status[waiter.entry.id].error or {}
                waiter.granted.set_exception(LoadFailedError(
                    error.get("cause", f"{waiter.entry.id} did not load"), error.get("fix") or None))
            elif self.servable(waiter.entry, waiter.arrived):
                waiter.granted.set_result(self._grant())
            else:
                continue
            if waiter in self._queue:
                self._queue.remove(waiter)
        if self.closing or self.switching() or not self._queue:
            return  # a switch's end schedules again
        oldest = min(self._queue, key=lambda w: w.arrived)
        resident = self.resident
        if resident is not None and self.ready(resident):
            now = self.clock()
            due = oldest.arrived + self.limits.swap_wait
            idle = self._last_request + self.limits.swap_grace if self.inflight == 0 else math.inf
            if now < min(due, idle):
                self._timer = asyncio.get_running_loop().call_later(min(due, idle) - now,
                                                                    self._schedule)
                return
        self._start(self._switch(oldest.entry, "request"))

    async def _drain(self, old: Entry, why: str) -> None:
        """Wait for the requests on `old` to finish; past drain_timeout, cut them."""
        if not self.inflight:
            return
        self.say(f"waiting for {self.inflight} request(s) on {old.id} to finish")
        try:
            await asyncio.wait_for(self._drained.wait(), self.drain_timeout or None)
        except TimeoutError:
            self.say(f"{self.inflight} request(s) on {old.id} still running after "
                     f"{self.drain_timeout:g} s (--drain-timeout): cutting them")
            self.cut_all(why)
            await self._drained.wait()

    def _busy(self, entry: Entry, timeout: float) -> RouterBusyError:
        doing = self.status[self.resident.id].state if self.resident else "idle"
        return RouterBusyError(
            f"{entry.id} was not ready within the load timeout ({timeout:.0f} s); the router is "
            f"{doing}{' ' + self.resident.id if self.resident else ''} with {self.waiting} request(s) "
            "queued", "send the request again later (the load goes on), or raise the load timeout")

    # --- the engine's health --------------------------------------------------------------------

    def engine_gone(self, entry: Entry, why: str) -> None:
        """The resident engine stopped answering after it was ready (it crashed, or answers only
        errors): the next request unloads what is left of it and loads it again."""
        if self.resident is entry and self.status[entry.id].state == READY:
            self.say(f"{entry.id}: the engine at {self.url} stopped answering ({why})")
            self._set(entry, FAILED, StackError(
                f"the engine of {entry.id} stopped answering at {self.url} ({why})",
                f"see its log (invoke logs, or generated/router/{entry.profile}.log); the next "
                "request loads it again"))
            self._schedule()

    async def _check(self, entry: Entry, when: str) -> bool:
        """Probe the resident engine (one probe at a time, shared); False (and marked gone) when
        its /health does not answer 200."""
        if self.probe is None or self.url is None:
            return True
        if self._probing is None or self._probing.done():
            self._probing = asyncio.get_running_loop().create_task(self.probe(self.url))
        ok = await asyncio.shield(self._probing)
        if ok:
            self._last_ok = self.clock()
        else:
            self.engine_gone(entry, f"its /health did not answer {when}")
        return ok

    async def _fresh(self, entry: Entry) -> bool:
        """Before a request is forwarded after the engine was quiet for the health interval."""
        if self.inflight or self.clock() - self._last_ok < self.limits.health_interval:
            return True
        return await self._check(entry, "after a pause")

    def answered(self, entry: Entry, status: int) -> None:
        """A forward got an answer with `status`: a run of errors gets the engine reloaded."""
        self._last_ok = self.clock()
        if status < 500:
            self._errors = 0
            return
        self._errors += 1
        if self._errors >= self.limits.error_run and self.ready(entry):
            self._errors = 0
            run = f"{self.limits.error_run} answers of 500 or above in a row (ROUTER_ERROR_RUN)"
            asyncio.get_running_loop().create_task(self._reload_after(entry, run))

    async def _reload_after(self, entry: Entry, run: str) -> None:
        healthy = await self.probe(self.url) if self.probe and self.url else False
        self.engine_gone(entry, f"{run}; its /health {'answers 200' if healthy else 'does not answer'}")

    async def upstream_failed(self, entry: Entry, why: str) -> bool:
        """A forward got no usable answer; whether the engine is gone (then loaded again by the
        next request). One that still answers /health stays: one bad answer is not a crash."""
        self._errors += 1
        if not self.ready(entry):
            return True
        if self.probe is not None and self.url is not None and await self.probe(self.url):
            self.say(f"{entry.id}: one forward failed ({why}); the engine answers /health, kept")
            return False
        self.engine_gone(entry, why)
        return True

    # --- the lifecycle API --------------------------------------------------------------------

    async def load(self, entry: Entry, timeout: float) -> None:
        before = self._last_request
        await self.acquire(entry, timeout)
        self.release()
        self._last_request = before  # a load by the API is not a request of the model's clients

    async def unload(self, timeout: float, reason: str = "unload") -> Entry | None:
        """Unload the resident model (after its requests finish); what was unloaded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.switching():  # a switch the queue started meanwhile: wait for it too
            assert self._task is not None
            try:
                await asyncio.wait_for(asyncio.shield(self._task), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise RouterBusyError(f"the router is busy loading; nothing was unloaded within "
                                      f"{timeout:.0f} s", "try again once the load is done") from None
        resident = self.resident
        if resident is None:
            return None
        task = self._start(self._switch(None, reason))
        await asyncio.shield(task)
        return resident

    def _start(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda _: self._schedule())
        self._task = task
        return task

    async def _switch(self, entry: Entry | None, reason: str) -> None:
        """Unload the resident (after its requests drain), then load `entry` (None: only unload)."""
        old, start = self.resident, self.clock()
        stop_s = start_s = 0.0
        try:
            if old is not None:
                await self._drain(old, f"the router unloads {old.id}"
                                       + (f" to load {entry.id}" if entry else f" ({reason})"))
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
            self._last_ok, self._errors = self.clock(), 0
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

    # --- idle unload, health watch and stop -----------------------------------------------------

    async def idle_loop(self) -> None:
        """Unload the resident model once it has had no request for its TTL (0: never), and
        probe an idle engine every health interval. The TTL clock starts when it is ready and
        restarts at every request's start and end, so a long load or stream is never cut by it."""
        while True:
            await asyncio.sleep(IDLE_POLL_S)
            entry = self.resident
            if (entry is None or not self.ready(entry) or self.inflight or self.switching()
                    or self._queue):
                continue
            if entry.ttl and self.clock() - self.last_used >= entry.ttl:
                self.say(f"{entry.id} idle for {entry.ttl:g} s: unloading")
                await asyncio.shield(self._start(self._switch(None, "idle")))
            elif self.probe is not None and \
                    self.clock() - self._last_ok >= self.limits.health_interval:
                await self._check(entry, "while idle")

    async def shutdown(self) -> None:
        """Stop the engine the router started or adopted (a boot in progress is cut short)."""
        self.closing = True
        self._schedule()  # every waiter learns the router is stopping
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

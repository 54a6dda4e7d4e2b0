"""The engine pool: one engine per loaded profile, awake, asleep or stopped, loaded on demand.

A load is `invoke up` for that profile (serve.lifecycle.up: checks, guards, boot watch, crash
diagnosis, warm-up), an unload is `invoke down`; in sleep mode (ROUTER_SWAP, plan.swap_mode) an
engine that gives way is put to sleep (vLLM's sleep level 1) and woken in about a second
instead. These block, so they run in worker threads while the event loop keeps serving. Nothing
here speaks HTTP: the HTTP layer (server, upstream) asks for an engine with acquire/release,
reports how each forward went, and hands in `probe` (the engine's /health) and a `cut` per
request.

What gives way is the memory plan's call (plan.Plan.arrange): engines that fit together stay
awake together, and a request for an awake engine is served at once. A request that needs a
switch waits; requests for an engine that switch puts away are served first until the oldest
waiter has waited ROUTER_SWAP_WAIT, or that engine had no request for ROUTER_SWAP_GRACE. Then
the switch runs as a task of its own (a request that gives up never cancels it half way): each
engine that gives way is drained (its requests finish, cut after the drain timeout), then put to
sleep or stopped; sleeping engines beyond the plan are stopped; the target is woken or started
(with the share of the card the plan leaves, checked against the card's free memory first).
After every sleep the card's own used memory is read: a sleep that did not release it switches
that profile to restart (said, and kept in generated/router/memory.json). A request never
reaches an engine that is not ready: asleep, going to sleep, waking or loading. The first sleep
of an engine is slow (vLLM pins host buffers): it is paid right after the load when no client
waits for the engine, else in the background once it is idle.

Health: an idle ready engine's /health is checked every ROUTER_HEALTH_INTERVAL, and before a
request is forwarded after such a pause; a run of ROUTER_ERROR_RUN answers of 500 or above, or a
failed forward whose engine then fails the probe, marks it failed (loaded again by the next
request for it). A load that fails leaves its model `failed` with the diagnosis; the requests
that waited for it get it, and the next request tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Coroutine
from typing import Any

import vllmstack.router.swaps as swaps
import vllmstack.router.watch as watch
from vllmstack.core.errors import StackError
from vllmstack.router.catalog import Entry
from vllmstack.router.member import Cut, Member
from vllmstack.router.plan import RESTART, Arrangement
from vllmstack.router.pool import DRAIN_TIMEOUT_S, Pool, Waiter
from vllmstack.router.states import (
    ASLEEP,
    FAILED,
    LOADING,
    READY,
    UNLOADED,
    Lifecycle,
    Loaded,
    LoadFailedError,
    RouterBusyError,
)

__all__ = ["DRAIN_TIMEOUT_S", "EngineManager", "Lifecycle", "LoadFailedError", "Loaded",
           "RouterBusyError"]

IDLE_POLL_S = 0.5
# An engine whose first sleep is still unpaid is primed once it had no request for this long.
PRIME_IDLE_S = 1.0


class EngineManager(Pool):
    """The pool of engines and the queue in front of it (all methods on the event loop)."""

    def snapshot(self) -> dict[str, Any]:
        """What /v1/health, router.json and the dashboard show."""
        return watch.snapshot(self)

    async def adopt(self) -> list[Entry]:
        """At start: take over healthy engines of our profiles that already run."""
        found = await asyncio.to_thread(self.lifecycle.adoptable, self.catalog)
        for adopted in found:
            member = self.members[adopted.entry.id]
            member.url, member.util, member.adopted, member.started = (
                adopted.url, adopted.util, True, True)
            member.primed = adopted.asleep  # an engine that slept has paid its first sleep
            if member.sleeps and not adopted.sleep_mode:
                member.mode, member.temporary = RESTART, True
                member.why = ("adopted, started without sleep mode: it restarts until it is "
                              "stopped, then sleeps from its next start")
            member.last_used = member.last_ok = self.clock()
            self.set_state(member, ASLEEP if adopted.asleep else READY)
            self.shown = member if not adopted.asleep else self.shown or member
            self.say(f"adopted the running engine of profile {adopted.entry.profile} "
                     f"({adopted.entry.id}, {'asleep' if adopted.asleep else 'awake'}) at "
                     f"{adopted.url}")
        return [a.entry for a in found]

    # --- requests -----------------------------------------------------------------------------

    async def acquire(self, entry: Entry, timeout: float, *, api: bool = False) -> str:
        """Wait until `entry`'s engine is ready (waking or loading it if needed) and count the
        caller as one request on it; its URL. Pair with release(entry). RouterBusyError after
        `timeout` seconds, LoadFailedError when the load failed."""
        member = self.members[entry.id]
        if self.servable(entry) and await watch.fresh(self, member) and self.servable(entry):
            return self._grant(member)
        loop = asyncio.get_running_loop()
        waiter = Waiter(entry, self.clock(), self.attempts.get(entry.id, 0),
                        loop.create_future(), api)
        self._queue.append(waiter)  # until granted or refused: what the dashboard shows as the queue
        self.schedule()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.granted), timeout)
        except BaseException as exc:
            if waiter.granted.done() and not waiter.granted.cancelled() \
                    and waiter.granted.exception() is None:
                self.release(entry)  # granted just as it gave up (its client left, its timeout)
            waiter.granted.cancel()
            if isinstance(exc, TimeoutError):
                raise self._busy(entry, timeout) from None
            raise
        finally:
            if waiter in self._queue:
                self._queue.remove(waiter)
                self.schedule()

    def _grant(self, member: Member) -> str:
        member.inflight += 1
        member.drained.clear()
        member.last_used = member.last_request = self.clock()
        assert member.url is not None
        return member.url

    def release(self, entry: Entry) -> None:
        member = self.members[entry.id]
        member.inflight -= 1
        member.last_used = member.last_request = self.clock()
        if member.inflight == 0:
            member.drained.set()
            if self._queue:
                self.schedule()  # a swap held back for this engine's requests may go now

    def hold(self, entry: Entry, cut: Cut) -> None:
        """Register how to cut a granted request short (its stream ends with an error)."""
        self.members[entry.id].holders.add(cut)

    def unhold(self, entry: Entry, cut: Cut) -> None:
        self.members[entry.id].holders.discard(cut)

    def schedule(self) -> None:
        """Grant the waiters that can go (or give them their failure); start the switch the
        oldest waiter needs, or look again when its bound or the grace of what gives way is up."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        due = self.due()
        for waiter in list(self._queue):
            if waiter.granted.done():
                self._queue.remove(waiter)
            elif self.closing:
                waiter.granted.set_exception(LoadFailedError(
                    "the router is stopping", "send the request again once the router runs"))
            elif self._failed_since(waiter):
                error = self.members[waiter.entry.id].status.error or {}
                waiter.granted.set_exception(LoadFailedError(
                    error.get("cause", f"{waiter.entry.id} did not load"), error.get("fix") or None))
            elif self.servable(waiter.entry, waiter.arrived, due):
                waiter.granted.set_result(self._grant(self.members[waiter.entry.id]))
            else:
                continue
            if waiter in self._queue:
                self._queue.remove(waiter)
        pending = [w for w in self._queue if not self.members[w.entry.id].ready]
        if self.closing or self.switching() or not pending:
            return  # a switch's end schedules again
        oldest = min(pending, key=lambda w: w.arrived)
        arrangement = self.arrange(oldest.entry)
        giving = [self.members[i] for i in arrangement.put_away if self.members[i].ready]
        if giving:
            now = self.clock()
            bound = oldest.arrived + self.limits.swap_wait
            idle = (max(m.last_request for m in giving) + self.limits.swap_grace
                    if all(m.inflight == 0 for m in giving) else math.inf)
            if now < min(bound, idle):
                self._timer = asyncio.get_running_loop().call_later(min(bound, idle) - now,
                                                                    self.schedule)
                return
        self.start(swaps.switch(self, oldest.entry, arrangement, "request", oldest))

    def start(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda _: self.schedule())
        self._task = task
        return task

    def _busy(self, entry: Entry, timeout: float) -> RouterBusyError:
        member = self.members[entry.id]
        return RouterBusyError(
            f"{entry.id} was not ready within the load timeout ({timeout:.0f} s); it is "
            f"{member.state}, with {self.waiting} request(s) queued",
            "send the request again later (the load goes on), or raise the load timeout")

    # --- the engine's health --------------------------------------------------------------------

    def answered(self, entry: Entry, status: int) -> None:
        """A forward got an answer with `status`: a run of errors gets the engine reloaded."""
        watch.answered(self, self.members[entry.id], status)

    async def upstream_failed(self, entry: Entry, why: str) -> bool:
        """A forward got no usable answer; whether the engine is gone (then loaded again by the
        next request). One that still answers /health stays: one bad answer is not a crash."""
        return await watch.upstream_failed(self, self.members[entry.id], why)

    # --- the lifecycle API --------------------------------------------------------------------

    async def load(self, entry: Entry, timeout: float) -> None:
        member = self.members[entry.id]
        before = member.last_request
        await self.acquire(entry, timeout, api=True)
        self.release(entry)
        member.last_request = before  # a load by the API is not a request of the model's clients

    async def unload(self, timeout: float, reason: str = "unload",
                     entry: Entry | None = None) -> list[Entry]:
        """Stop `entry`'s engine, or every engine (awake or asleep), after their requests
        finish; what was stopped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.switching():  # a switch the queue started meanwhile: wait for it too
            assert self._task is not None
            try:
                await asyncio.wait_for(asyncio.shield(self._task), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise RouterBusyError(f"the router is busy loading; nothing was unloaded within "
                                      f"{timeout:.0f} s", "try again once the load is done") from None
        chosen = [m for m in self.members.values() if m.started
                  and (entry is None or m.entry is entry)]
        if not chosen:
            return []
        stop = Arrangement(None, stop=tuple(m.id for m in chosen))
        await asyncio.shield(self.start(swaps.switch(self, None, stop, reason)))
        return [m.entry for m in chosen]

    # --- idle unload, priming, health watch and stop -------------------------------------------

    async def idle_loop(self) -> None:
        """Stop an engine once it had no request for its TTL (0: never), awake or asleep; pay
        an engine's first sleep once it is idle; probe idle engines every health interval. The
        TTL clock restarts at every request's start and end, so a long stream is never cut."""
        while True:
            await asyncio.sleep(IDLE_POLL_S)
            if self.switching():
                continue
            now, asked = self.clock(), {w.entry.id for w in self._queue}
            for member in self.members.values():
                if member.inflight or member.id in asked or member.state not in (READY, ASLEEP):
                    continue
                ttl = member.entry.ttl
                if ttl and now - member.last_used >= ttl:
                    self.say(f"{member.id} idle for {ttl:g} s: unloading")
                    stop = Arrangement(None, stop=(member.id,))
                    await asyncio.shield(self.start(swaps.switch(self, None, stop, "idle")))
                    break
                if member.ready and member.sleeps and not member.primed \
                        and now - member.last_used >= PRIME_IDLE_S:
                    await asyncio.shield(self.start(swaps.prime(self, member)))
                    break
                if member.ready and self.probe is not None \
                        and now - member.last_ok >= self.limits.health_interval:
                    await watch.check(self, member, "while idle")

    async def shutdown(self) -> None:
        """Stop every engine the router started or adopted, awake or asleep (a boot in
        progress is cut short)."""
        self.closing = True
        self.schedule()  # every waiter learns the router is stopping
        task = self._task
        if task is not None and not task.done():
            for member in self.members.values():
                if member.state == LOADING:
                    self.say(f"stopping: cutting the load of {member.id} short")
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(self.lifecycle.abort, member.entry)
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        failed: StackError | None = None
        for member in [m for m in self.members.values() if m.started]:
            self.say(f"stopping: unloading {member.id} ({member.state})")
            try:
                await swaps.stop(self, member)
            except StackError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
        if all(m.state in (UNLOADED, FAILED) for m in self.members.values()):
            self.shown = None

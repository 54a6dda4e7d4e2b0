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
waiter has waited ROUTER_SWAP_WAIT (2 s: the bound on how long one model's clients can hold the
card while another's wait), or that engine had no request for ROUTER_SWAP_GRACE. Then
the switch runs as a task of its own (a request that gives up never cancels it half way;
a load that nobody waits for any more is cut short once a request for another model waits): each
engine that gives way is drained (its requests finish, cut after the drain timeout), then put to
sleep or stopped; sleeping engines beyond the plan are stopped; the target is woken or started
(with the share of the card the plan leaves, checked against the card's free memory first).
After every sleep the card's own used memory is read: a sleep that did not release it switches
that profile to restart (said, and kept in generated/router/memory.json). A request never
reaches an engine that is not ready: asleep, going to sleep, waking or loading. The first sleep
of an engine is slow (vLLM pins host buffers): it is always paid as part of the load, before the
engine is declared ready, so no request ever lands on it later (no idle priming).

Health: an idle ready engine's /health is checked every ROUTER_HEALTH_INTERVAL, and before a
request is forwarded after such a pause; after a run of ROUTER_ERROR_RUN answers of 500 or above,
a failed forward or a stream the engine broke off, /health is probed, and only an engine that
fails it is marked failed (loaded again by the next request for it). A load that fails leaves its
model `failed` with the diagnosis; the requests that waited for it get it, and for
ROUTER_LOAD_BACKOFF a client's request gets the same error at once (no boot, no engine put away
for it); then the next request tries again. A POST /v1/load tries again at once.
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
from vllmstack.router.tiers import STOPPED, Move, Tier

__all__ = ["DRAIN_TIMEOUT_S", "EngineManager", "Lifecycle", "LoadFailedError", "Loaded",
           "RouterBusyError"]

IDLE_POLL_S = 0.5
# How long a stop past its bound waits for an engine's kill (SIGKILL to its process group).
KILL_WAIT_S = 10.0


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
            # A router primes every engine at its load (swaps.bring_up), so one started able to
            # sleep has paid its first sleep; nothing is primed later, where a request could wait.
            member.primed = adopted.asleep or adopted.sleep_mode
            if member.sleeps and not adopted.sleep_mode:
                member.mode, member.temporary = RESTART, True
                member.why = ("adopted, started without sleep mode: it restarts until it is "
                              "stopped, then sleeps from its next start")
            member.last_used = member.last_ok = self.clock()
            if adopted.asleep:  # its tier: what its last sleep freed, where the file says so
                member.slept_in = {"kv": Tier.KV, "all": Tier.HOST}.get(adopted.frees or "")
            self.set_state(member, ASLEEP if adopted.asleep else READY)
            self.shown = member if not adopted.asleep else self.shown or member
            self.say(f"adopted the running engine of profile {adopted.entry.profile} "
                     f"({adopted.entry.id}, {self.tier(member)}) at "
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
        left = self.backoff_left(entry)
        if left and not api and member.state == FAILED:
            raise self.backed_off(entry, left)
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
        if self.switching() and not self.closing:
            self._cut_abandoned_load()
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

    def backed_off(self, entry: Entry, left: float) -> LoadFailedError:
        """The failure of `entry`'s last load, again, while ROUTER_LOAD_BACKOFF lasts: no boot,
        no engine put away for it (a POST /v1/load tries again at once)."""
        error = self.members[entry.id].status.error or {}
        fix = error.get("fix") or "see the router's log"
        return LoadFailedError(
            error.get("cause", f"{entry.id} did not load"),
            f"{fix}; the router tries the load again in {math.ceil(left)} s "
            "(ROUTER_LOAD_BACKOFF), or at once on POST /v1/load")

    def _cut_abandoned_load(self) -> None:
        """A load that no request (and no /v1/load) waits for any more is cut short
        (Lifecycle.abort) as soon as a request for another model waits behind it: a hung boot
        whose client left held every model for its UP_TIMEOUT (issue 35). With nobody else
        waiting it goes on, so a client that retries finds it loaded."""
        if not self._queue:
            return
        for member in self.members.values():
            if member.state != LOADING or member.id in self.aborted \
                    or any(w.entry is member.entry for w in self._queue):
                continue
            self.aborted.add(member.id)
            self.say(f"cutting the load of {member.id} short: no request waits for it any more, "
                     f"and {self.waiting} request(s) for other models do")
            asyncio.get_running_loop().create_task(self._abort(member.entry))

    async def _abort(self, entry: Entry) -> None:
        try:
            await asyncio.to_thread(self.lifecycle.abort, entry)
        except Exception as exc:  # the load then ends on its own: said, nothing else to do
            self.say(f"warning: cutting the load of {entry.id} short failed: {exc}")

    def _busy(self, entry: Entry, timeout: float) -> RouterBusyError:
        member = self.members[entry.id]
        return RouterBusyError(
            f"{entry.id} was not ready within the load timeout ({timeout:.0f} s); it is "
            f"{member.state}, with {self.waiting} request(s) queued",
            "send the request again later (the load goes on), or raise the load timeout")

    # --- the engine's health --------------------------------------------------------------------

    def answered(self, entry: Entry, status: int, arrived: float | None = None) -> None:
        """A forward got an answer with `status` (its first byte; the request arrived at
        `arrived`, the pool's clock): a run of errors gets the engine's /health checked."""
        watch.answered(self, self.members[entry.id], status, arrived)

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
        stop = Arrangement.of(None, [Move(m.id, self.tier(m), STOPPED) for m in chosen])
        await asyncio.shield(self.start(swaps.switch(self, None, stop, reason)))
        return [m.entry for m in chosen]

    # --- idle unload, priming, health watch and stop -------------------------------------------

    async def idle_loop(self) -> None:
        """Stop an engine once it had no request for its TTL (0: never), awake, asleep or
        failed (a crashed engine, or one whose stop failed, still holds the card); probe idle
        engines every health interval. The TTL clock restarts at every request's start and
        end, so a long stream is never cut. No engine is primed here: its first sleep is part
        of its load (swaps.bring_up), so no request can land on it. A pass that fails (a full
        disk under a stop, a probe that raised) says what failed and the loop goes on: it
        ended for good once, and no TTL, probe or priming ran after (issue 35)."""
        while True:
            await asyncio.sleep(IDLE_POLL_S)
            try:
                await self._idle_pass()
            except Exception as exc:
                self.say(f"warning: the idle watch (TTL, health probes) failed this pass: "
                         f"{type(exc).__name__}: {exc}; it goes on")

    async def _idle_pass(self) -> None:
        if self.switching():
            return
        now, asked = self.clock(), {w.entry.id for w in self._queue}
        for member in self.members.values():
            if member.inflight or member.id in asked or member.state not in (READY, ASLEEP, FAILED):
                continue
            ttl = member.entry.ttl
            if ttl and member.started and now - member.last_used >= ttl:
                self.say(f"{member.id} idle for {ttl:g} s: unloading")
                stop = Arrangement.of(None, [Move(member.id, self.tier(member), STOPPED)])
                await asyncio.shield(self.start(swaps.switch(self, None, stop, "idle")))
                if member.started:  # the stop failed (said): tried again after another TTL
                    member.last_used = self.clock()
                return
            if member.ready and self.probe is not None \
                    and now - member.last_ok >= self.limits.health_interval:
                await watch.check(self, member, "while idle")

    async def shutdown(self, timeout: float | None = None) -> None:
        """Stop every engine the router started or adopted, awake or asleep (a boot in
        progress is cut short), within `timeout` seconds in all (ROUTER_STOP_TIMEOUT; systemd
        kills at 90 s, orphaning the engines): a switch still busy after a third of it (a wake
        may hang for SLEEP_TIMEOUT_S) is cancelled, the engines are stopped side by side, and
        one still stopping at the bound has its process group killed, which the log says."""
        self.closing = True
        self.schedule()  # every waiter learns the router is stopping
        loop = asyncio.get_running_loop()
        bound = self.limits.stop_timeout if timeout is None else timeout
        deadline = loop.time() + bound
        task = self._task
        if task is not None and not task.done():
            for member in self.members.values():
                if member.state == LOADING:
                    self.say(f"stopping: cutting the load of {member.id} short")
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.to_thread(self.lifecycle.abort,
                                                                 member.entry), bound / 3)
            done, _ = await asyncio.wait([task], timeout=max(0.0, deadline - 2 * bound / 3
                                                             - loop.time()))
            if not done:
                busy = ", ".join(f"{m.id} {m.state}" for m in self.members.values()
                                 if m.state not in (READY, ASLEEP, UNLOADED, FAILED))
                self.say(f"stopping: the switch under way ({busy or 'no engine'}) is still busy "
                         f"after {bound / 3:.0f} s: cancelled; its engines are stopped as they are")
                task.cancel()
                await asyncio.wait([task], timeout=1.0)
        failed: BaseException | None = None
        started = [m for m in self.members.values() if m.started]
        for member in started:
            self.say(f"stopping: unloading {member.id} ({member.state})")
        stops = {m.id: loop.create_task(swaps.stop(self, m)) for m in started}
        if stops:
            await asyncio.wait(stops.values(), timeout=max(0.0, deadline - loop.time()))
        for member in started:
            stopping = stops[member.id]
            if not stopping.done():
                self.say(f"stopping: {member.id} did not stop within {bound:g} s "
                         "(ROUTER_STOP_TIMEOUT): killing its process group")
                try:
                    await asyncio.wait_for(asyncio.to_thread(self.lifecycle.kill, member.entry),
                                           KILL_WAIT_S)
                except Exception as exc:  # said; the next engine still goes
                    failed = failed or StackError(f"{member.id} could not be killed: {exc}",
                                                  "end its processes by hand (ps, kill -9)")
                    continue
                await asyncio.wait([stopping], timeout=KILL_WAIT_S)  # its `down` sees it gone
                if not stopping.done():
                    stopping.cancel()
                    member.started = False
                    self.set_state(member, UNLOADED)
                self.say(f"stopping: {member.id} killed")
            elif stopping.exception() is not None:
                failed = failed or stopping.exception()  # every other engine was still stopped
        if failed is not None:
            raise failed
        if all(m.state in (UNLOADED, FAILED) for m in self.members.values()):
            self.shown = None

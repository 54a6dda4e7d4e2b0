"""The engine pool's state, shared by the manager (engines), its switches (swaps) and its
watch (watch): the engines, the queue of waiting requests, the switch under way, and the
questions every part asks (is an engine servable, what would a switch put away)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from vllmstack.core.errors import StackError
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.limits import Limits
from vllmstack.router.member import Member
from vllmstack.router.plan import UNKNOWN_LOAD_S, Arrangement, Plan, View, exclusive_plan
from vllmstack.router.states import (
    FAILED,
    LOADING,
    SLEEPING,
    UNLOADING,
    WAKING,
    Lifecycle,
    MemberState,
    ModelStatus,
    Swap,
)
from vllmstack.router.tiers import AWAKE, STOPPED, Tier

RECENT_SWAPS = 20
FIRST_TOKENS = 1000  # first-token times kept per model for the snapshot's percentiles
# A swap waits this long for the old model's requests before it cuts them: long enough for any
# ordinary answer (32k tokens at 60 t/s is under 10 minutes), short of holding the router for ever.
DRAIN_TIMEOUT_S = 600.0

Probe = Callable[[str], Coroutine[Any, Any, bool]]  # whether the engine at a URL answers /health
Remember = Callable[[str, dict[str, Any]], None]  # keep a profile's measured figures


@dataclass(eq=False)
class Waiter:
    """A request queued for its model: its future gets the engine's URL once granted."""

    entry: Entry
    arrived: float
    seen: int  # failed loads of its model that had finished when it arrived
    granted: asyncio.Future[str]
    api: bool = False  # /v1/load: no client waits for an answer from the model



class Pool:
    """The pool's state: its engines, the queue, the switch under way (engines.EngineManager
    acts on it; swaps and watch read and change it)."""

    def __init__(self, catalog: Catalog, lifecycle: Lifecycle, *,
                 say: Callable[[str], None] = lambda line: None,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 drain_timeout: float = DRAIN_TIMEOUT_S, limits: Limits | None = None,
                 probe: Probe | None = None, plan: Plan | None = None,
                 remember: Remember = lambda profile, figures: None) -> None:
        self.catalog, self.lifecycle = catalog, lifecycle
        # How long a swap or an unload waits for the requests on an engine that gives way (0: for
        # ever); then it cuts them, so one stream that never ends cannot hold every model off.
        self.drain_timeout = drain_timeout
        self.limits = limits or Limits()
        self.probe, self.say, self.on_change, self.clock = probe, say, on_change, clock
        self.remember = remember
        self.plan = plan or exclusive_plan([(e.id, e.profile) for e in catalog.entries.values()])
        self.members = {e.id: Member(e, self.plan.needs[e.id].mode, self.plan.needs[e.id].why,
                                     last_used=clock(), last_ok=clock())
                        for e in catalog.entries.values()}
        self.swaps: deque[Swap] = deque(maxlen=RECENT_SWAPS)
        self.closing = False
        self._queue: list[Waiter] = []
        self._task: asyncio.Task[None] | None = None  # the switch under way
        self._timer: asyncio.TimerHandle | None = None  # when a held-back swap is looked at again
        # Finished loads per model: a request that saw one end in failure while it waited gets
        # that failure; only a request arriving after it tries again.
        self.attempts: dict[str, int] = {}
        self.victims: frozenset[str] = frozenset()  # what the switch under way puts away
        # When each model's last load failed (the pool's clock): for ROUTER_LOAD_BACKOFF after
        # it, a client's request gets that failure at once, without a boot and without putting
        # the awake engines away (issue 35: one SDK call with its 2 retries booted a broken
        # profile 3 times). Cleared by a load that succeeds.
        self.load_failed: dict[str, float] = {}
        # Loads the pool cut short because nobody waited for them any more while requests for
        # other models did (issue 35: a hung load held every model for its UP_TIMEOUT).
        self.aborted: set[str] = set()
        # Per model, the recent first-token times: from a request's arrival at the router to the
        # engine's first answer byte (the snapshot's p50/p99; a starved model shows here).
        self.first_tokens: dict[str, deque[float]] = {e.id: deque(maxlen=FIRST_TOKENS)
                                                      for e in catalog.entries.values()}
        self.shown: Member | None = None  # the engine `loaded` names: the latest one brought up

    @property
    def waiters(self) -> list[Waiter]:
        return list(self._queue)

    # --- state --------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def inflight(self) -> int:
        return sum(m.inflight for m in self.members.values())

    @property
    def status(self) -> Mapping[str, ModelStatus]:
        return {i: m.status for i, m in self.members.items()}

    @property
    def resident(self) -> Entry | None:
        """The engine `loaded` names (the latest brought up, while it runs)."""
        shown = self.shown
        return shown.entry if shown is not None and shown.started else None

    def member(self, entry: Entry) -> Member:
        return self.members[entry.id]

    def ready(self, entry: Entry) -> bool:
        return self.members[entry.id].ready

    def switching(self) -> bool:
        return self._task is not None and not self._task.done()

    def views(self) -> list[View]:
        """The engines that hold memory, as the plan sees them."""
        return [m.view() for m in self.members.values() if m.started]

    def tier(self, member: Member) -> Tier:
        """Its tier now: stopped (no process), asleep in the tier its sleep went to, or awake
        (ready, or on its way: loading, waking, sleeping)."""
        return self.plan.tier_of(member.view()) if member.started else STOPPED

    def arrange(self, entry: Entry) -> Arrangement:
        return self.plan.arrange(entry.id, self.views(), self.clock())

    def expected_s(self, member: Member) -> float:
        """The seconds bringing it back from its tier now is expected to take (0 awake)."""
        tier = self.tier(member)
        return 0.0 if tier == AWAKE else round(
            self.plan.needs[member.id].wake_s(tier, member.load_s or UNKNOWN_LOAD_S), 3)

    def preview(self, entry: Entry) -> dict[str, Any]:
        """What a request for `entry` would do now, changing nothing (GET /v1/router/plan): its
        tier, the action (none, wake, load, or wait for the switch under way), the others'
        moves in the order the switch makes them, the expected seconds, what blocks it."""
        member = self.members[entry.id]
        tier = self.tier(member)
        if member.ready:
            arrangement, action = Arrangement(entry.id), "none"
        else:
            arrangement = self.arrange(entry)
            action = ("wait" if self.switching() or member.state in (LOADING, WAKING, SLEEPING,
                                                                      UNLOADING)
                      else "wake" if member.asleep else "load")
        blocked = None if arrangement.fits else arrangement.why
        left = self.backoff_left(entry)
        if left and not member.ready:
            error = member.status.error or {}
            blocked = (f"its last load failed {self.limits.load_backoff - left:.0f} s ago "
                       f"(ROUTER_LOAD_BACKOFF): a request gets that failure for {left:.0f} s more"
                       + (f": {error.get('cause')}" if error.get("cause") else ""))
        return {"model": entry.id, "profile": entry.profile, "state": member.state,
                "tier": tier, "action": action,
                "moves": [m.as_dict() for m in arrangement.moves],
                "sleeps": list(arrangement.sleep), "deepens": list(arrangement.deepen),
                "stops": list(arrangement.stop), "util": arrangement.util,
                "expected_s": 0.0 if member.ready else arrangement.expected_s,
                "blocked": blocked}

    def due(self) -> list[tuple[float, frozenset[str]]]:
        """The switches that are due: per model whose oldest waiter has waited ROUTER_SWAP_WAIT,
        that waiter's arrival and what its switch puts away (one plan per model, not per
        request: the queue can hold thousands)."""
        now, oldest = self.clock(), dict[str, Waiter]()
        for waiter in self._queue:
            if now - waiter.arrived >= self.limits.swap_wait and not self.ready(waiter.entry):
                first = oldest.get(waiter.entry.id)
                if first is None or waiter.arrived < first.arrived:
                    oldest[waiter.entry.id] = waiter
        return [(w.arrived, self.arrange(w.entry).put_away) for w in oldest.values()]

    def servable(self, entry: Entry, arrived: float | None = None,
                 due: list[tuple[float, frozenset[str]]] | None = None) -> bool:
        """Whether a request for `entry` (arrived at `arrived`) may go to its engine now: it is
        ready, not being put away, and no due switch that came earlier puts it away (requests
        for it arriving after that switch's request queue behind it)."""
        member = self.members[entry.id]
        if not member.ready or self.closing or member.id in self.victims:
            return False
        when = self.clock() if arrived is None else arrived
        return not any(first <= when and member.id in away
                       for first, away in (self.due() if due is None else due))

    def backoff_left(self, entry: Entry) -> float:
        """Seconds until a request may boot `entry` again after its failed load (0: it may)."""
        failed = self.load_failed.get(entry.id)
        if failed is None or not self.limits.load_backoff:
            return 0.0
        return max(0.0, failed + self.limits.load_backoff - self.clock())

    def _failed_since(self, waiter: Waiter) -> bool:
        return self.attempts.get(waiter.entry.id, 0) > waiter.seen

    def set_state(self, member: Member, state: MemberState, error: StackError | None = None
                  ) -> None:
        """Every state change: checked against states.TRANSITIONS (IllegalTransitionError, a bug,
        for one it does not allow), then shown (on_change writes router.json)."""
        member.set(state, error)
        self.on_change()

    async def drain(self, member: Member, why: str) -> None:
        """Wait for the requests on `member` to finish; past drain_timeout, cut them."""
        if not member.inflight:
            return
        self.say(f"waiting for {member.inflight} request(s) on {member.id} to finish")
        try:
            await asyncio.wait_for(member.drained.wait(), self.drain_timeout or None)
        except TimeoutError:
            self.say(f"{member.inflight} request(s) on {member.id} still running after "
                     f"{self.drain_timeout:g} s (--drain-timeout): cutting them")
            self.cut_all(why, [member])
            await member.drained.wait()

    def cut_all(self, reason: str, members: list[Member] | None = None) -> int:
        """Cut every request in flight (on `members`, default all) now; how many."""
        holders = [cut for m in (members or list(self.members.values())) for cut in m.holders]
        for cut in holders:
            cut(reason)
        return len(holders)

    def engine_gone(self, entry: Entry, why: str) -> None:
        """The engine stopped answering after it was ready (it crashed, or answers only
        errors): the next request for it stops what is left of it and loads it again."""
        member = self.members[entry.id]
        if member.ready:
            self.say(f"{entry.id}: the engine at {member.url} stopped answering ({why})")
            self.set_state(member, FAILED, StackError(
                f"the engine of {entry.id} stopped answering at {member.url} ({why})",
                f"see its log (invoke logs, or generated/router/{entry.profile}.log); the next "
                "request loads it again"))
            self.schedule()

    def schedule(self) -> None:
        """Grant what can go and start the switch the queue needs (engines.EngineManager)."""
        raise NotImplementedError

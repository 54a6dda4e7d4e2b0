"""One engine of the router's pool: its state, URL, requests in flight, health counters, how it
swaps and what it was started with. Plain bookkeeping on the event loop; the pool (engines) acts."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllmstack.core.errors import StackError
from vllmstack.router.catalog import Entry
from vllmstack.router.plan import SLEEP, View
from vllmstack.router.states import ASLEEP, READY, MemberState, ModelStatus, Swap, check_transition
from vllmstack.router.tiers import Tier

Cut = Callable[[str], None]  # end one request in flight now, saying why


@dataclass(eq=False)
class Member:
    entry: Entry
    mode: str  # plan.SLEEP or plan.RESTART
    why: str  # why that mode (a fallback to restart says what the sleep did)
    status: ModelStatus = field(default_factory=ModelStatus)
    url: str | None = None  # where it answers while loaded (awake or asleep)
    util: float | None = None  # the gpu_memory_utilization it was started with
    adopted: bool = False
    primed: bool = False  # its first (slow) sleep is paid
    inflight: int = 0
    holders: set[Cut] = field(default_factory=set)
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    last_used: float = field(default_factory=time.monotonic)  # the TTL's and eviction's clock
    last_request: float = -math.inf  # a client request's start or end: the swap grace's clock
    last_ok: float = field(default_factory=time.monotonic)  # its last answer
    errors: int = 0  # answers of 500 or above in a row
    probing: asyncio.Task[bool] | None = None
    load_s: float | None = None  # its last start, for the score policy
    residue: int | None = None  # bytes per card it held asleep, as measured
    swap: Swap | None = None  # the swap that made it ready, until its first answer is seen
    started: bool = False  # its process runs (from a load's start until it is stopped)
    ready_at: float = 0.0  # when the last swap made it ready (monotonic)
    temporary: bool = False  # its restart mode holds only until it is stopped
    slept_in: Tier | None = None  # the tier its last sleep went to (kv-released or asleep)

    def __post_init__(self) -> None:
        self.drained.set()

    @property
    def id(self) -> str:
        return self.entry.id

    @property
    def state(self) -> MemberState:
        return self.status.state

    @property
    def ready(self) -> bool:
        return self.state == READY

    @property
    def asleep(self) -> bool:
        return self.state == ASLEEP

    @property
    def sleeps(self) -> bool:
        return self.mode == SLEEP

    def set(self, state: MemberState, error: StackError | None = None) -> None:
        """The one place a state changes (through Pool.set_state, which says it changed);
        IllegalTransitionError, nothing changed, for a change states.TRANSITIONS does not allow."""
        check_transition(self.id, self.status.state, state)
        self.status.state, self.status.since = state, time.time()
        self.status.error = (None if error is None else
                             {"cause": error.cause, "fix": error.fix or ""})

    def view(self) -> View:
        return View(self.id, awake=not self.asleep, util=self.util, last_used=self.last_used,
                    load_s=self.load_s or 60.0, tier=self.slept_in if self.asleep else None)

"""The engine pool's vocabulary: model states and the transitions between them, a load's
outcome, a swap's record, the errors a request can get, and the Lifecycle interface loads and
unloads go through (stacks.StackLifecycle for real, fakes in tests)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from vllmstack.core.errors import StackError
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.runtime.gpu import GpuMemory


class MemberState(StrEnum):
    """An engine's state in the pool. A StrEnum, so each is exactly its value wherever it is
    written (the JSON of /v1/health, router.json and the dashboard's router card, f-strings in
    the log): byte for byte the plain strings these were."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    UNLOADING = "unloading"
    # Sleep mode: a loaded engine whose weights are in host RAM; it answers no request until woken.
    SLEEPING = "sleeping"
    ASLEEP = "asleep"
    WAKING = "waking"


UNLOADED, LOADING, READY, FAILED, UNLOADING = (MemberState.UNLOADED, MemberState.LOADING,
                                               MemberState.READY, MemberState.FAILED,
                                               MemberState.UNLOADING)
SLEEPING, ASLEEP, WAKING = MemberState.SLEEPING, MemberState.ASLEEP, MemberState.WAKING

# What each state may become: every edge is one the pool takes (named where), nothing more; a
# change outside it is a bug (IllegalTransitionError), never a card showing a state the engine is not
# in. FAILED is reachable from every state: a switch that fails marks its target failed whatever
# step it reached (swaps.switch), and that handler must never raise itself.
TRANSITIONS: Mapping[MemberState, frozenset[MemberState]] = {
    # swaps.bring_up starts it; engines.adopt takes over an engine that runs, awake or asleep;
    # a switch failing before the load began (no fit, an engine giving way not stopped, no room
    # on the card). UNLOADING: a load cut short after its engine started (its first sleep or
    # wake failed) is marked unloaded while its process may still run, so it is stopped later.
    UNLOADED: frozenset({LOADING, READY, ASLEEP, FAILED, UNLOADING}),
    # Ready after the load, or after its first sleep (swaps.pay_first_sleep, before it is
    # declared ready); failed; unloaded when the pool cut the load short (nobody waited).
    LOADING: frozenset({READY, SLEEPING, FAILED, UNLOADED}),
    # Put to sleep or stopped as it gives way (also idle TTL, /v1/unload, the router's stop);
    # failed when it stops answering (Pool.engine_gone).
    READY: frozenset({SLEEPING, UNLOADING, FAILED}),
    # Asleep, or awake again when the sleep failed on a live engine, or stopped when the sleep
    # failed or kept its memory (also the router's stop after cancelling the switch); failed
    # when the engine died in its first sleep, unloaded when that load was cut short.
    SLEEPING: frozenset({ASLEEP, READY, UNLOADING, FAILED, UNLOADED}),
    # Woken (never ready without WAKING), stopped, or failed as the target of a failed switch.
    ASLEEP: frozenset({WAKING, UNLOADING, FAILED}),
    # Ready; stopped when the wake failed (then started anew) or by the router's stop; failed,
    # or unloaded in a load cut short, when a first sleep's wake raised.
    WAKING: frozenset({READY, UNLOADING, FAILED, UNLOADED}),
    # Stopped, or failed when `down` raised; UNLOADING again: the router's stop stops anew an
    # engine whose stop the switch it cancelled had begun.
    UNLOADING: frozenset({UNLOADED, FAILED, UNLOADING}),
    # Loaded again (its failed load left nothing running), or what is left of it stopped first;
    # FAILED again: a stop that failed in a switch is marked by the stop, then by the switch.
    FAILED: frozenset({LOADING, UNLOADING, FAILED}),
}


class IllegalTransitionError(RuntimeError):
    """A state change TRANSITIONS does not allow. A RuntimeError, not a StackError: it is the
    router's own bug, with no cause or fix the user could act on; swaps.switch reports it as
    "a bug of the router" and marks its target failed, a request handler answers 500."""

    def __init__(self, member: str, old: MemberState, new: MemberState) -> None:
        super().__init__(f"{member}: {old} -> {new} is not a transition of the engine pool "
                         f"(from {old}: {', '.join(sorted(TRANSITIONS[old])) or 'none'})")
        self.member, self.old, self.new = member, old, new


def check_transition(member: str, old: MemberState, new: MemberState) -> None:
    """Raise IllegalTransitionError unless `old` may become `new`."""
    if new not in TRANSITIONS[old]:
        raise IllegalTransitionError(member, old, new)


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


@dataclass(frozen=True)
class Slept:
    """A sleep's outcome: how long it took and the cards' used memory (bytes, summed over the
    cards the engine spans) right before and after; None where nothing reads the cards."""

    seconds: float
    before: int | None
    after: int | None


@dataclass(frozen=True)
class Adopted:
    """An engine of one of the router's profiles that already runs (a router before this one
    started it): where it answers, whether it sleeps, and the share of the card it started with."""

    entry: Entry
    url: str
    asleep: bool = False
    util: float | None = None
    sleep_mode: bool = True  # started able to sleep (its dev-mode /is_sleeping answers)
    frees: str | None = None  # what its last sleep freed (kv, all; None: not known)


class Lifecycle(Protocol):
    """How the manager loads and unloads (serve.lifecycle for real; a fake in unit tests).
    Every method blocks and is called from a worker thread."""

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = "all") -> Loaded:
        """Start the engine (as `invoke up`); once healthy and warm. StackError on failure.
        `util`: its gpu_memory_utilization (None: the profile's); `sleep_mode`: start it able
        to sleep (vLLM's --enable-sleep-mode and its dev-mode endpoints, on loopback only);
        `frees`: what its sleeps free ("kv": the KV cache only, the weights stay; "all")."""

    def unload(self, entry: Entry) -> None:
        """Stop it (as `invoke down`), returning once its memory is released."""

    def abort(self, entry: Entry) -> None:
        """Cut a boot short (the router is stopping): the load then fails at once."""

    def kill(self, entry: Entry) -> None:
        """End the engine's process group now, without its stop grace (a stop that ran past
        ROUTER_STOP_TIMEOUT)."""

    def adoptable(self, catalog: Catalog) -> list[Adopted]:
        """Healthy engines of the catalog's profiles that already run."""

    def sleep(self, entry: Entry, frees: str = "all") -> Slept:
        """Put a loaded engine to sleep (level 1: weights to host RAM, KV cache dropped; never
        level 2, after which vLLM does not reload MTP drafts). `frees`: "kv" keeps the weights
        on the card (kv-released; an engine started with frees="kv"), "all" backs them up.
        StackError on failure."""

    def wake(self, entry: Entry) -> float:
        """Wake it; the seconds it took. StackError on failure."""

    def memory(self) -> list[GpuMemory] | None:
        """The cards' memory now (the probe `up`'s guards and `doctor` read)."""


@dataclass
class ModelStatus:
    state: MemberState = UNLOADED
    error: dict[str, str] | None = None  # {"cause", "fix"} of the last failure
    since: float = field(default_factory=time.time)


@dataclass
class Swap:
    """One switch: what gave way (put to sleep, stopped) and how long that took, the target's
    wake or start, the whole, and the first answer after it."""

    unloaded: str | None  # the first engine put away (slept or stopped)
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
    sleep_s: float = 0.0  # putting the engines that gave way to sleep
    wake_s: float = 0.0  # waking the target (instead of starting it)
    slept: tuple[str, ...] = ()
    stopped: tuple[str, ...] = ()
    util: float | None = None  # the share of the card a start asked for, where the plan set it
    first_s: float | None = None  # from the end of the swap to the engine's first answer
    request_s: float | None = None  # from the request that asked for it to that first answer
    asked_at: float | None = None  # monotonic: when that request arrived

    def as_dict(self) -> dict[str, Any]:
        def r(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {"unloaded": self.unloaded, "loaded": self.loaded, "stop_s": r(self.stop_s),
                "start_s": r(self.start_s), "boot_s": r(self.boot_s),
                "warmup_s": r(self.warmup_s), "sleep_s": r(self.sleep_s), "wake_s": r(self.wake_s),
                "slept": list(self.slept), "stopped": list(self.stopped), "util": self.util,
                "first_s": r(self.first_s), "request_s": r(self.request_s),
                "total_s": r(self.total_s), "ok": self.ok, "reason": self.reason, "at": self.at,
                "error": self.error}

"""The router's memory plan: which engines stay awake, which sleep, which are stopped.

Per profile it knows (`Need`): how it swaps (`sleep`: vLLM's sleep mode level 1; `restart`:
stopped and booted again) and why; what its sleep frees (`all`: vLLM's own level 1, the weights
backed up in host RAM and copied back at each wake; `kv`: the KV cache only, the weights stay on
the card and nothing is copied, through the stack's engine plugin engine-plugins/vllmstack_sleep);
its GPU budget per card (gpu_memory_utilization x the card: vLLM takes that much, KV cache
included); its residue while asleep (what a sleeping vLLM still holds: measured after its first
sleep and kept in generated/router/memory.json; until then 2 GiB, plus its weights where the sleep
frees only the KV cache); its host-RAM backup while asleep (its weight size, config.weights;
nothing where the weights stay on the card).

Every engine not serving sits in a tier (tiers.Tier: kv-released, asleep at level 1, stopped);
the tiers a profile may sleep in come from ROUTER_SLEEP_FREES and its engine (tiers.sleep_tiers,
`keeps_weights`). `arrange` decides, for a model that must be awake, what has to give way: the
others move one tier deeper at a time, the cheapest loss first (the seconds the move adds to
that engine's next swap back, from the measured wake and load times; within LOSS_STEP_S the
eviction policy decides), until the target's budget fits beside the budgets of the engines still
awake and the residues of the sleeping ones. Awake engines go down a tier (a restart engine is
stopped) and kv-released ones to level 1 (where the card has room for the wake that deepening
takes) before any sleeping engine is stopped; if a fresh start still does not fit at the
profile's utilization, its utilization is lowered to what does (vLLM refuses to start when less
is free than it asks for), down to what its weights need; below that, sleeping engines are
stopped too. Level-1 sleepers together stay within the host RAM ROUTER_HOST_RAM_GIB allows
(default: half of MemTotal). Profiles that fit together stay awake together. Without a card
reading (CPU, or Compose: one engine per checkout) the plan is exclusive: one engine awake at a
time. The outcome (`Arrangement`) is the moves (member, from, to) and the expected seconds.

`judge_sleep` reads a sleep's before/after GPU memory: a sleep that did not release the memory
(ROCm before vLLM's 2026 sleep fixes) sends that profile back to restart, and the store keeps why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllmstack.config.engines.table import kind_named
from vllmstack.router.tiers import (
    AWAKE,
    DEFAULT_WAKE_S,
    HOST,
    KV_RELEASED,
    LOSS_STEP_S,
    STOPPED,
    Move,
    Tier,
    deeper,
    typical,
)

GIB = 1024**3
SLEEP, RESTART = "sleep", "restart"
KV, ALL = "kv", "all"  # what a sleep frees: the KV cache only, or the weights too
LRU, SCORE = "lru", "score"
# What a sleeping vLLM keeps on each card until its own residue is measured: 1.2-1.4 GiB seen on
# an H200 (0.6B, 8B, 27B hybrid), "all but ~2 GiB per GPU" at TP2.
DEFAULT_RESIDUE = 2 * GIB
# Kept free on each card beyond the plan (the driver's and other processes' growth).
MARGIN = GIB // 2
# A sleep released the memory when at least this share of what it should free was freed.
RELEASE_SHARE = 0.5
# Host RAM the sleeping engines may hold when ROUTER_HOST_RAM_GIB is 0: half of MemTotal.
HOST_SHARE = 0.5
# A load time for the score policy until one was measured.
UNKNOWN_LOAD_S = 60.0
STORE = "memory.json"  # under generated/router/


@dataclass(frozen=True)
class Need:
    """One profile's figures."""

    id: str
    profile: str
    mode: str  # SLEEP or RESTART
    why: str  # why this mode
    util: float  # the profile's gpu_memory_utilization (a share of each card)
    gpus: int  # tensor parallel: cards it spans
    host: int  # bytes backed up in host RAM while asleep (its weights); 0 when unknown
    residue: int = DEFAULT_RESIDUE  # bytes per card asleep in its first sleep tier
    measured: bool = False  # the residue was measured on this host
    frees: str = ALL  # how it is started: KV (the plugin: it can keep its weights) or ALL
    tiers: tuple[Tier, ...] | None = None  # its sleep tiers (None: from mode and frees)
    host_residue: int = DEFAULT_RESIDUE  # bytes per card at level 1 where it starts with KV
    host_measured: bool = False
    # Measured seconds per tier (memory.json): a wake from kv-released or asleep, a start
    # from stopped; the newest last.
    wakes: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def sleep_tiers(self) -> tuple[Tier, ...]:
        if self.mode != SLEEP:
            return ()
        if self.tiers is not None:
            return self.tiers
        return (KV_RELEASED,) if self.frees == KV else (HOST,)

    @property
    def kept_asleep(self) -> int:
        """Bytes per card a sleep that frees only the KV cache leaves, until measured: its
        weights, beside what any sleep keeps."""
        return self.host // max(1, self.gpus) + DEFAULT_RESIDUE

    def residue_at(self, tier: Tier) -> int:
        """Bytes per card it holds in `tier` (awake: see Plan.budget)."""
        if tier == STOPPED:
            return 0
        first = self.sleep_tiers[0] if self.sleep_tiers else HOST
        if tier == first:
            return self.residue
        return self.kept_asleep if tier == KV_RELEASED else self.host_residue

    def measured_at(self, tier: Tier) -> bool:
        first = self.sleep_tiers[0] if self.sleep_tiers else HOST
        return self.measured if tier == first else tier == HOST and self.host_measured

    def backup_at(self, tier: Tier) -> int:
        """Bytes it holds in host RAM in `tier`: its weights at level 1 only."""
        return self.host if tier == HOST else 0

    @property
    def backup(self) -> int:
        """Bytes it holds in host RAM while asleep in its first sleep tier."""
        return self.backup_at(self.sleep_tiers[0] if self.sleep_tiers else HOST)

    def wake_s(self, tier: Tier, load_s: float = UNKNOWN_LOAD_S) -> float:
        """The seconds bringing it back from `tier` is expected to take: the median of what this
        host measured, else DEFAULT_WAKE_S; from stopped its load time."""
        if tier == STOPPED:
            return typical(self.wakes.get(STOPPED, ()), load_s)
        return typical(self.wakes.get(tier, ()), DEFAULT_WAKE_S[tier])

    @property
    def floor(self) -> float:
        """The lowest share of a card worth starting it with: its weights and 2 GiB."""
        return 0.0 if not self.host else self.host / max(1, self.gpus) * 1.1 + 2 * GIB


@dataclass(frozen=True)
class View:
    """An engine as the plan sees it: awake (ready, or loading/waking) or asleep in a tier."""

    id: str
    awake: bool
    util: float | None  # what it was started with (None: not started)
    last_used: float
    load_s: float = UNKNOWN_LOAD_S
    tier: Tier | None = None  # asleep: its tier (None: its profile's first sleep tier)


@dataclass(frozen=True)
class Arrangement:
    """What makes `target` awake: the moves of the others (member, from, to tier) in the order
    they are made, and the share of the card a fresh start asks for (None: the profile's own,
    or no card to plan with). `sleep` (awake ones put to sleep), `stop` and `deepen` (from
    kv-released to level 1) derive from the moves, as do `put_away`."""

    target: str | None
    sleep: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    util: float | None = None
    fits: bool = True
    why: str = ""
    moves: tuple[Move, ...] = ()
    expected_s: float = 0.0  # the target's wake (or start) and the deepenings' wakes

    @classmethod
    def of(cls, target: str | None, moves: Sequence[Move], **rest: Any) -> Arrangement:
        """Ordered as a switch makes them: awake ones put to sleep, then the stops, then the
        deepenings (their wake needs the room the others left)."""
        ordered = ([m for m in moves if m.frm == AWAKE and m.to != STOPPED]
                   + [m for m in moves if m.to == STOPPED]
                   + [m for m in moves if m.frm != AWAKE and m.to != STOPPED])
        return cls(target, tuple(m.member for m in ordered if m.frm == AWAKE and m.to != STOPPED),
                   tuple(m.member for m in ordered if m.to == STOPPED), moves=tuple(ordered),
                   **rest)

    @property
    def deepen(self) -> tuple[str, ...]:
        return tuple(m.member for m in self.moves if m.frm != AWAKE and m.to != STOPPED)

    def tier_of(self, member: str) -> Tier | None:
        """Where the arrangement puts `member` (None: it stays where it is)."""
        return next((m.to for m in self.moves if m.member == member), None)

    @property
    def put_away(self) -> frozenset[str]:
        return frozenset(self.sleep) | frozenset(self.stop)


@dataclass
class Plan:
    needs: dict[str, Need]
    card: int | None  # bytes of the smallest card the engines use; None: no reading
    baseline: int = 0  # bytes per card in use by others (the desktop, other programs)
    host_limit: int = 0  # bytes the sleeping engines may hold in host RAM
    policy: str = LRU
    exclusive: bool = False  # one engine at a time (no card reading, or one engine per checkout)
    notes: list[str] = field(default_factory=list)

    @property
    def capacity(self) -> int | None:
        return None if self.card is None else max(0, self.card - self.baseline - MARGIN)

    def budget(self, id_: str, util: float | None = None) -> int:
        need = self.needs[id_]
        return 0 if self.card is None else int(self.card * (util or need.util))

    def tier_of(self, view: View) -> Tier:
        if view.awake:
            return AWAKE
        if view.tier is not None:
            return view.tier
        tiers = self.needs[view.id].sleep_tiers
        return tiers[0] if tiers else HOST

    def held(self, view: View, tier: Tier) -> int:
        """Bytes per card `view` holds in `tier`: its budget awake, its residue asleep."""
        return (self.budget(view.id, view.util) if tier == AWAKE
                else self.needs[view.id].residue_at(tier))

    def usage(self, views: Sequence[View], skip: str | None = None) -> int:
        """Bytes per card the engines take: awake ones their budget, asleep ones their residue."""
        return sum(self.held(v, self.tier_of(v)) for v in views if v.id != skip)

    def order(self, views: Sequence[View], now: float) -> list[View]:
        """Least wanted first: the least recently used (lru), or the highest idle time / load
        time (score: long unused and quick to bring back)."""
        if self.policy == SCORE:
            return sorted(views, key=lambda v: -(now - v.last_used) / max(v.load_s, 0.1))
        return sorted(views, key=lambda v: v.last_used)

    def loss(self, view: View, frm: Tier, to: Tier) -> float:
        """What a move costs the next request for `view`: the seconds its swap back grows by."""
        need = self.needs[view.id]
        return need.wake_s(to, view.load_s) - need.wake_s(frm, view.load_s)

    def arrange(self, target: str | None, views: Sequence[View], now: float | None = None,
                stop: Sequence[str] = ()) -> Arrangement:
        """What gives way so that `target` is awake (None with `stop`: only stop those)."""
        now = time.monotonic() if now is None else now
        start = {v.id: self.tier_of(v) for v in views}
        if target is None:
            return Arrangement.of(None, [Move(v.id, start[v.id], STOPPED) for v in views
                                         if v.id in stop])
        others = {v.id: v for v in views if v.id != target}
        tier = {i: STOPPED if i in stop else start[i] for i in others}
        mine = next((v for v in views if v.id == target), None)
        waking = mine is not None and not mine.awake and mine.util is not None
        need = self.needs[target]
        util = mine.util if mine is not None and waking and mine.util else need.util
        if self.exclusive or self.capacity is None:
            for i in others:
                if tier[i] == AWAKE:
                    tier[i] = deeper(self.needs[i].sleep_tiers, AWAKE)
            return self._finish(target, mine, start, tier, others, now, None)
        capacity, card = self.capacity, self.card or 0

        def used() -> int:
            return sum(self.held(others[i], t) for i, t in tier.items())

        def fits(share: float) -> bool:
            return used() + self.budget(target, share) <= capacity

        def step(stopping: bool) -> bool:
            """Make the cheapest move of its pass, False when none is left. The first pass
            puts awake engines one tier down (a restart engine is stopped) and deepens
            kv-released ones to level 1; the second stops sleeping ones."""
            moves = []
            ranked = {v.id: n for n, v in enumerate(self.order(list(others.values()), now))}
            for i, v in others.items():
                frm = tier[i]
                if frm == STOPPED or (stopping and frm == AWAKE) or (
                        not stopping and frm == HOST):
                    continue
                to = STOPPED if stopping else deeper(self.needs[i].sleep_tiers, frm)
                while to != STOPPED and self.held(v, to) >= self.held(v, frm):
                    to = deeper(self.needs[i].sleep_tiers, to)  # this tier would free nothing
                if frm != AWAKE and not stopping and (to == STOPPED or used() - self.held(
                        v, frm) + self.budget(i, v.util) > capacity):
                    continue  # deeper is a stop, or its deepening's wake has no room now
                if self.held(v, to) >= self.held(v, frm):
                    continue  # frees nothing
                moves.append((round(self.loss(v, frm, to) / LOSS_STEP_S), ranked[i], i, to))
            if not moves:
                return False
            _, _, chosen, to = min(moves)
            tier[chosen] = to
            return True

        while not fits(util) and step(stopping=False):
            pass
        chosen: float | None = None
        if not waking and not fits(util):
            while (capacity - used()) < need.floor and step(stopping=True):
                pass
            chosen = math.floor(min(util, (capacity - used()) / card if card else 0.0) * 1000) / 1000
        elif waking:
            while not fits(util) and step(stopping=True):
                pass
        arrangement = self._finish(target, mine, start, tier, others, now, chosen)
        share = chosen if chosen is not None else util
        if not fits(share) or (chosen is not None and chosen * card < need.floor):
            shown = self.budget(target, util) / GIB
            return replace(arrangement, fits=False, why=(
                f"{target} needs {shown:.1f} GiB of a {card / GIB:.1f} GiB card "
                f"({util:g} x card) and at least {need.floor / GIB:.1f} GiB for its weights; "
                f"{max(0, capacity - used()) / GIB:.1f} GiB is left beside what must stay"))
        return arrangement

    def _finish(self, target: str, mine: View | None, start: Mapping[str, Tier],
                tier: dict[str, Tier], others: Mapping[str, View], now: float,
                util: float | None) -> Arrangement:
        """Keep the level-1 sleepers within the host RAM limit (the least wanted are stopped),
        then the moves and the expected seconds."""
        if self.host_limit:
            sleeping = [v for i, v in others.items() if tier[i] == HOST]
            while sum(self.needs[v.id].host for v in sleeping) > self.host_limit and sleeping:
                victim = self.order(sleeping, now)[0]
                sleeping.remove(victim)
                tier[victim.id] = STOPPED
        moves = [Move(i, start[i], t) for i, t in tier.items() if t != start[i]]
        need = self.needs[target]
        own = STOPPED if mine is None else self.tier_of(mine)
        seconds = need.wake_s(own, mine.load_s if mine else UNKNOWN_LOAD_S)
        seconds += sum(self.needs[m.member].wake_s(m.frm) for m in moves
                       if m.frm != AWAKE and m.to != STOPPED)
        return Arrangement.of(target, moves, util=util, expected_s=round(seconds, 3))


def exclusive_plan(ids: Sequence[tuple[str, str]], why: str = "one engine at a time") -> Plan:
    """One engine awake at a time, each stopped for the next (the router before sleep mode; the
    unit tests' default). `ids`: (served name, profile)."""
    return Plan({i: Need(i, p, RESTART, why, 1.0, 1, 0) for i, p in ids}, None, exclusive=True)


# --- a sleep's verdict ------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    released: bool
    residue: int | None  # bytes per card it still holds asleep (None: no reading)
    freed: int | None
    text: str


def judge_sleep(plan: Plan, id_: str, util: float | None, before: int | None,
                after: int | None, tier: Tier | None = None) -> Verdict:
    """Whether a sleep into `tier` (None: the profile's first sleep tier) released the GPU
    memory, from the card's used memory before and after (summed over the cards it spans)."""
    need = plan.needs[id_]
    tier = tier or (need.sleep_tiers[0] if need.sleep_tiers else HOST)
    if before is None or after is None or plan.card is None:
        return Verdict(True, None, None, "no GPU memory reading: the release was not checked")
    freed = before - after
    budget = plan.budget(id_, util) * need.gpus
    kept = need.host if tier == KV_RELEASED else 0  # the weights that stay on the card
    expected = max(0, budget - DEFAULT_RESIDUE * need.gpus - kept)
    residue = max(0, min(budget, after - before + budget)) // need.gpus
    released = freed >= RELEASE_SHARE * expected
    text = (f"sleep freed {freed / GIB:.1f} GiB of the {budget / GIB:.1f} GiB it held "
            f"({residue / GIB:.2f} GiB per card left asleep)")
    return Verdict(released, residue, freed, text)


# --- building it --------------------------------------------------------------------------------


def host_limit(setting_gib: float, meminfo: Path = Path("/proc/meminfo")) -> int:
    """ROUTER_HOST_RAM_GIB, or half of MemTotal when it is 0 (0 when that cannot be read)."""
    if setting_gib > 0:
        return int(setting_gib * GIB)
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(int(line.split()[1]) * 1024 * HOST_SHARE)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def keeps_weights(need: Need, card: int | None, vendor: str) -> tuple[bool, str]:
    """Whether ROUTER_SLEEP_FREES=auto lets this profile sleep kv-released (its weights stay on
    the card, the plugin's backend): on CUDA only (measured there; ROCm is not), with a card
    reading and its weight size known (the plan counts them on the card)."""
    if vendor != "nvidia":
        return False, f"weights stay on the card on CUDA only (GPU_VENDOR={vendor})"
    if card is None:
        return False, "no reading of the card"
    if not need.host:
        return False, f"the weight size of {need.id} is unknown"
    return True, "kv-released, then level 1, then stopped"


def swap_mode(setting: str, engine: str, vendor: str, several: bool) -> tuple[str, str]:
    """How a profile swaps, and why: `auto` sleeps vLLM on CUDA and ROCm where several engines
    run (the native runtime); llama.cpp and one-engine runtimes restart."""
    kind = kind_named(engine)
    if not kind.sleeps:
        return RESTART, f"{kind.display} has no sleep mode (a load takes about a second)"
    if not several:
        return RESTART, "this runtime runs one engine per checkout (Compose): restart"
    if setting == RESTART:
        return RESTART, "ROUTER_SWAP=restart"
    if setting == SLEEP:
        return SLEEP, "ROUTER_SWAP=sleep" + ("" if vendor in ("nvidia", "amd") else
                                             f" (forced: GPU_VENDOR={vendor})")
    if vendor in ("nvidia", "amd"):
        return SLEEP, f"ROUTER_SWAP=auto: vLLM sleeps on {vendor}"
    return RESTART, f"ROUTER_SWAP=auto: no vLLM sleep mode with GPU_VENDOR={vendor}"

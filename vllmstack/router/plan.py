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

`arrange` decides, for a model that must be awake, what has to give way: awake engines are put
to sleep (or stopped, for restart ones) in the eviction policy's order until the target's budget
fits beside the budgets of the engines still awake and the residues of the sleeping ones; if a
fresh start still does not fit at the profile's utilization, its utilization is lowered to what
does (vLLM refuses to start when less is free than it asks for), down to what its weights need;
below that, sleeping engines are stopped too. Sleeping engines together stay within the host RAM
ROUTER_HOST_RAM_GIB allows (default: half of MemTotal). Profiles that fit together stay awake
together. Without a card reading (CPU, or Compose: one engine per checkout) the plan is
exclusive: one engine awake at a time.

`choose_frees` decides what sleeps free (ROUTER_SLEEP_FREES): `auto` keeps the weights on the card
where every profile's budget fits beside the weights of all the other sleeping profiles (on CUDA,
where it was measured), and frees them otherwise.

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
from vllmstack.core.files import JsonFileError, read_json_file, write_json
from vllmstack.core.paths import Project

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
    residue: int = DEFAULT_RESIDUE  # bytes per card while asleep
    measured: bool = False  # the residue was measured on this host
    frees: str = ALL  # what its sleep frees: ALL (weights to host RAM) or KV (weights stay)

    @property
    def kept_asleep(self) -> int:
        """Bytes per card a sleep that frees only the KV cache leaves, until measured: its
        weights, beside what any sleep keeps."""
        return self.host // max(1, self.gpus) + DEFAULT_RESIDUE

    @property
    def backup(self) -> int:
        """Bytes it holds in host RAM while asleep: its weights, unless they stay on the card."""
        return 0 if self.frees == KV else self.host

    @property
    def floor(self) -> float:
        """The lowest share of a card worth starting it with: its weights and 2 GiB."""
        return 0.0 if not self.host else self.host / max(1, self.gpus) * 1.1 + 2 * GIB


@dataclass(frozen=True)
class View:
    """An engine as the plan sees it: awake (ready, or loading/waking) or asleep."""

    id: str
    awake: bool
    util: float | None  # what it was started with (None: not started)
    last_used: float
    load_s: float = UNKNOWN_LOAD_S


@dataclass(frozen=True)
class Arrangement:
    """What makes `target` awake: engines to put to sleep, engines to stop, and the share of the
    card a fresh start asks for (None: the profile's own, or no card to plan with)."""

    target: str | None
    sleep: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    util: float | None = None
    fits: bool = True
    why: str = ""

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

    def usage(self, views: Sequence[View], skip: str | None = None) -> int:
        """Bytes per card the engines take: awake ones their budget, asleep ones their residue."""
        return sum(self.budget(v.id, v.util) if v.awake else self.needs[v.id].residue
                   for v in views if v.id != skip)

    def order(self, views: Sequence[View], now: float) -> list[View]:
        """Least wanted first: the least recently used (lru), or the highest idle time / load
        time (score: long unused and quick to bring back)."""
        if self.policy == SCORE:
            return sorted(views, key=lambda v: -(now - v.last_used) / max(v.load_s, 0.1))
        return sorted(views, key=lambda v: v.last_used)

    def arrange(self, target: str | None, views: Sequence[View], now: float | None = None,
                stop: Sequence[str] = ()) -> Arrangement:
        """What gives way so that `target` is awake (None with `stop`: only stop those)."""
        now = time.monotonic() if now is None else now
        others = [v for v in views if v.id != target and v.id not in stop]
        awake = [v for v in others if v.awake]
        asleep = [v for v in others if not v.awake]
        to_sleep: list[View] = []
        to_stop: list[View] = [v for v in views if v.id in stop]
        if target is None:
            return Arrangement(None, stop=tuple(v.id for v in to_stop))
        mine = next((v for v in views if v.id == target), None)
        waking = mine is not None and not mine.awake and mine.util is not None
        need = self.needs[target]
        util = mine.util if mine is not None and waking and mine.util else need.util
        if self.exclusive or self.capacity is None:
            for victim in awake:
                (to_sleep if self._sleeps(victim) else to_stop).append(victim)
            return self._host_fit(target, to_sleep, to_stop, asleep, now, None)
        capacity = self.capacity
        kept_awake = list(awake)
        kept_asleep = list(asleep)

        def used() -> int:
            return self.usage([*kept_awake, *kept_asleep, *(replace(v, awake=False)
                                                            for v in to_sleep)])

        for victim in self.order(awake, now):
            if used() + self.budget(target, util) <= capacity:
                break
            kept_awake.remove(victim)
            (to_sleep if self._sleeps(victim) else to_stop).append(victim)
        chosen: float | None = None
        if not waking and used() + self.budget(target, util) > capacity:
            room = (capacity - used()) / self.card if self.card else 0.0
            while room * (self.card or 0) < need.floor and kept_asleep + to_sleep:
                victim = self.order([*kept_asleep, *to_sleep], now)[0]
                (kept_asleep if victim in kept_asleep else to_sleep).remove(victim)
                to_stop.append(victim)
                room = (capacity - used()) / self.card if self.card else 0.0
            chosen = math.floor(min(util, room) * 1000) / 1000
        elif waking:
            while used() + self.budget(target, util) > capacity and kept_asleep + to_sleep:
                victim = self.order([*kept_asleep, *to_sleep], now)[0]
                (kept_asleep if victim in kept_asleep else to_sleep).remove(victim)
                to_stop.append(victim)
        arrangement = self._host_fit(target, to_sleep, to_stop, kept_asleep, now, chosen)
        share = chosen if chosen is not None else util
        if used() + self.budget(target, share) > capacity or (
                chosen is not None and chosen * (self.card or 0) < need.floor):
            shown = self.budget(target, util) / GIB
            return replace(arrangement, fits=False, why=(
                f"{target} needs {shown:.1f} GiB of a {(self.card or 0) / GIB:.1f} GiB card "
                f"({util:g} x card) and at least {need.floor / GIB:.1f} GiB for its weights; "
                f"{max(0, capacity - used()) / GIB:.1f} GiB is left beside what must stay"))
        return arrangement

    def _sleeps(self, view: View) -> bool:
        return self.needs[view.id].mode == SLEEP

    def _host_fit(self, target: str, to_sleep: list[View], to_stop: list[View],
                  asleep: list[View], now: float, util: float | None) -> Arrangement:
        """Keep the sleeping engines within the host RAM limit: the least wanted are stopped."""
        if self.host_limit:
            sleeping = [*asleep, *to_sleep]
            while sum(self.needs[v.id].backup for v in sleeping) > self.host_limit and sleeping:
                victim = self.order(sleeping, now)[0]
                sleeping.remove(victim)
                if victim in to_sleep:
                    to_sleep.remove(victim)
                to_stop.append(victim)
        return Arrangement(target, tuple(v.id for v in to_sleep), tuple(v.id for v in to_stop),
                           util)


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
                after: int | None) -> Verdict:
    """Whether a sleep released the GPU memory, from the card's used memory before and after
    (summed over the cards the engine spans)."""
    need = plan.needs[id_]
    if before is None or after is None or plan.card is None:
        return Verdict(True, None, None, "no GPU memory reading: the release was not checked")
    freed = before - after
    budget = plan.budget(id_, util) * need.gpus
    kept = need.host if need.frees == KV else 0  # the weights that stay on the card
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


def choose_frees(needs: Mapping[str, Need], capacity: int | None, card: int | None, setting: str,
                 vendor: str) -> tuple[str, str]:
    """What the sleeping engines free, and why: `kv` (the KV cache only) where every profile's
    budget fits on the card beside the weights of all the other sleeping profiles; `all` (vLLM's
    level 1) otherwise. `auto` keeps weights only on CUDA (measured there; ROCm is not) and only
    when every sleeping profile's weight size is known."""
    sleepers = [n for n in needs.values() if n.mode == SLEEP]
    if setting == ALL or not sleepers:
        return ALL, "ROUTER_SLEEP_FREES=all" if setting == ALL else "no profile sleeps"
    if setting == KV:
        return KV, "ROUTER_SLEEP_FREES=kv"
    if vendor != "nvidia":
        return ALL, f"ROUTER_SLEEP_FREES=auto: weights stay on the card on CUDA only (GPU_VENDOR={vendor})"
    if capacity is None or card is None:
        return ALL, "ROUTER_SLEEP_FREES=auto: no reading of the card"
    unknown = [n.id for n in sleepers if not n.host]
    if unknown:
        return ALL, f"ROUTER_SLEEP_FREES=auto: the weight size of {', '.join(unknown)} is unknown"
    weights = {n.id: n.kept_asleep for n in sleepers}
    for need in needs.values():
        beside = sum(w for i, w in weights.items() if i != need.id)
        if int(card * need.util) + beside > capacity:
            return ALL, (f"ROUTER_SLEEP_FREES=auto: {need.id}'s budget "
                         f"({card * need.util / GIB:.1f} GiB) and the others' weights asleep "
                         f"({beside / GIB:.1f} GiB) do not fit the card: weights go to host RAM")
    return KV, (f"ROUTER_SLEEP_FREES=auto: every budget fits beside the others' weights asleep "
                f"(at most {max(weights.values()) / GIB:.1f} GiB each): the weights stay on the card")


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


# --- the store (generated/router/memory.json) -----------------------------------------------------


def store_path(project: Project) -> Path:
    return project.generated / "router" / STORE


def read_store(project: Project) -> dict[str, dict[str, Any]]:
    """Per profile: its measured residue, or why it swaps by restart after a failed release. A
    damaged file is ignored (it is rewritten at the next measurement)."""
    try:
        data = read_json_file(store_path(project))
    except JsonFileError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, dict)}


def write_store(project: Project, profile: str, **fields: Any) -> None:
    data = read_store(project)
    data[profile] = {**data.get(profile, {}), **fields, "at": time.time()}
    path = store_path(project)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)


def apply_store(need: Need, stored: Mapping[str, Any]) -> Need:
    """A need with what the store says of its profile: the measured residue (measured with the
    same kind of sleep: one that kept the weights holds more), or the fallback."""
    residue = stored.get("residue_bytes")
    same = stored.get("frees", ALL) == need.frees
    if isinstance(residue, int) and not isinstance(residue, bool) and residue >= 0 and same:
        need = replace(need, residue=residue, measured=True)
    fallback = stored.get("fallback")
    if need.mode == SLEEP and isinstance(fallback, str) and fallback:
        need = replace(need, mode=RESTART,
                       why=f"{fallback} (recorded in generated/router/{STORE}; delete its entry "
                           "to try sleep again)")
    return need

"""The tiers an engine of the router is in, and a move between two of them (issue 37).

An engine not serving is in one of four tiers, from the cheapest to bring back to the dearest:

* `awake` (serving, or able to at once);
* `kv-released`: its weights stay on the card, only the KV cache is freed (the stack's engine
  plugin, engine-plugins/vllmstack_sleep): its wake maps the KV cache again (0.36 s for an 8B on
  an H200), and the card keeps its weights meanwhile;
* `asleep`: vLLM's level-1 sleep, the weights backed up in host RAM and copied back at the wake
  (0.70 s for the 8B), the card keeps ~1.3 GiB;
* `stopped`: nothing held; a start boots it (a minute or more for vLLM).

Which tiers an engine may sleep in comes from its engine and ROUTER_SLEEP_FREES (`sleep_tiers`);
the plan (plan.Plan.arrange) moves the others one tier deeper, cheapest loss first, until the
engine asked for fits. A move from `kv-released` to `asleep` is a wake then a level-1 sleep that
backs the weights up (vLLM's /sleep has no way to deepen a sleep in place).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Tier(StrEnum):
    """A StrEnum: written as its plain value in /v1/health, router.json and memory.json."""

    AWAKE = "awake"
    KV = "kv-released"
    HOST = "asleep"
    STOPPED = "stopped"


AWAKE, KV_RELEASED, HOST, STOPPED = Tier.AWAKE, Tier.KV, Tier.HOST, Tier.STOPPED
DEPTH = (AWAKE, KV_RELEASED, HOST, STOPPED)  # shallow to deep
SLEEP_TIERS = (KV_RELEASED, HOST)

# What a wake from each tier takes until this host measured it (seconds): the H200 figures of
# docs/router.md, an 8B (kv 0.36-0.40 s, level 1 0.70 s); a start is the engine's load time.
DEFAULT_WAKE_S: Mapping[Tier, float] = {AWAKE: 0.0, KV_RELEASED: 0.4, HOST: 1.0}
# Losses within this many seconds are equal: the eviction policy decides between them, as
# measured wake times of a few milliseconds apart say nothing about which engine to give up.
LOSS_STEP_S = 0.1
WAKES_KEPT = 20  # measured wake times kept per profile and tier (memory.json)


@dataclass(frozen=True)
class Move:
    """One engine going from one tier to another so that the engine asked for fits."""

    member: str
    frm: Tier
    to: Tier

    def as_dict(self) -> dict[str, str]:
        return {"member": self.member, "from": str(self.frm), "to": str(self.to)}


def sleep_tiers(restart: bool, setting: str, keeps_weights: bool) -> tuple[Tier, ...]:
    """The tiers an engine may sleep in: none for an engine that swaps by restart (it is
    stopped); ROUTER_SLEEP_FREES=all: level 1 only; kv: kv-released only (deeper is a stop);
    auto: kv-released then level 1 where the engine can keep its weights (`keeps_weights`: the
    plugin's backend on CUDA, with its weight size known), else level 1."""
    if restart:
        return ()
    if setting == "all":
        return (HOST,)
    if setting == "kv":
        return (KV_RELEASED,)
    return (KV_RELEASED, HOST) if keeps_weights else (HOST,)


def deeper(allowed: Sequence[Tier], tier: Tier) -> Tier:
    """The next tier down from `tier` among those allowed (stopped when none is left)."""
    below = DEPTH[DEPTH.index(tier) + 1:]
    return next((t for t in below if t in allowed), STOPPED)


def typical(samples: Sequence[float], default: float) -> float:
    """The median of the measured wake times (robust to one slow wake), else the default."""
    return statistics.median(samples) if samples else default

"""The router's plan for its catalog on this host (plan.Plan), and `invoke router --plan`.

Per profile: how it swaps (ROUTER_SWAP, its engine, the platform's GPU vendor, whether the
runtime runs several engines), its budget (VLLM_GPU_MEM_UTIL x the card), its weights (the host
RAM a sleeping vLLM backs them up in: MODEL_WEIGHT_GIB, the files on disk, or config.json's
geometry), the tiers it may sleep in (ROUTER_SLEEP_FREES and its engine,
tiers.sleep_tiers), and what
generated/router/memory.json measured (its residue asleep, or why its sleep falls back to
restart). The card is what the stack's GPU probe reads (nvidia-smi, sysfs, or
GPU_MEMORY_DIR); nothing is started to build the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from vllmstack.config.modelinfo import load_model_facts
from vllmstack.core.paths import Project
from vllmstack.router.catalog import Catalog
from vllmstack.router.history import apply_store, read_store
from vllmstack.router.plan import (
    GIB,
    KV,
    LRU,
    SLEEP,
    Need,
    Plan,
    View,
    host_limit,
    keeps_weights,
    swap_mode,
)
from vllmstack.router.tiers import HOST, KV_RELEASED, Tier, sleep_tiers
from vllmstack.runtime.gpu import GpuMemory


def build_plan(project: Project, catalog: Catalog, environ: Mapping[str, str], *, setting: str,
               several: bool, cards: list[GpuMemory] | None,
               meminfo: Path = Path("/proc/meminfo")) -> Plan:
    """The plan before anything runs: the card as read now (its used memory is the baseline:
    what other programs hold), the profiles' needs, the store's measurements."""
    store = read_store(project)
    needs: dict[str, Need] = {}
    first = next(iter(catalog.entries.values())).resolved
    card = min((c.total_bytes for c in cards), default=None) if cards else None
    for entry in catalog.entries.values():
        resolved = entry.resolved
        mode, why = swap_mode(setting, entry.engine, resolved.get_str("GPU_VENDOR"), several)
        weights = load_model_facts(resolved, environ).weight_gib or 0.0
        if entry.kind.vllm_cli:  # --gpu-memory-utilization: a share of the card
            util, gpus = resolved.get_float("VLLM_GPU_MEM_UTIL"), max(1, resolved.get_int("VLLM_TP"))
        else:
            # llama.cpp takes what its weights and context need, not a share of the card: its
            # weights and a fifth, plus 2 GiB (the whole card where the weights are unknown).
            util, gpus = 1.0, 1
            if weights and card:
                util = min(1.0, round((weights * 1.2 + 2) * GIB / card, 3))
        needs[entry.id] = Need(entry.id, entry.profile, mode, why, util, gpus, int(weights * GIB))
    baseline = max((c.used_bytes for c in cards), default=0) if cards else 0
    setting = first.get_str("ROUTER_SLEEP_FREES") or "auto"
    whys: list[str] = []
    for id_, need in needs.items():
        keeps, why = keeps_weights(need, card, first.get_str("GPU_VENDOR"))
        tiers = sleep_tiers(need.mode != SLEEP, setting, keeps)
        if KV_RELEASED in tiers:  # started with the plugin; its residue its weights, until measured
            need = replace(need, frees=KV, residue=need.kept_asleep, tiers=tiers)
        else:
            need = replace(need, tiers=tiers)
        if need.mode == SLEEP and setting == "auto" and not keeps:
            whys.append(f"{id_}: {why}")
        needs[id_] = apply_store(need, store.get(need.profile, {}))
    plan = Plan(needs, card, baseline,
                host_limit(first.get_float("ROUTER_HOST_RAM_GIB"), meminfo),
                first.get_str("ROUTER_EVICT") or LRU,
                exclusive=not several or card is None)
    if any(n.mode == SLEEP for n in needs.values()):
        plan.notes.append(f"sleep tiers (ROUTER_SLEEP_FREES={setting}): the plan moves engines "
                          "one tier deeper, cheapest loss first"
                          + (f"; level 1 only for {'; '.join(whys)}" if whys else ""))
    return plan


def render_plan(plan: Plan, catalog: Catalog) -> str:
    """`invoke router --plan`: per profile its swap mode, budget, residue and host backup; then
    what stays awake together, when each profile is the one asked for."""
    card = f"{plan.card / GIB:.1f} GiB per card" if plan.card else "no card reading"
    lines = [f"router plan for platform {catalog.platform} ({card}; "
             f"{plan.baseline / GIB:.1f} GiB in use by others; room for the engines "
             + (f"{plan.capacity / GIB:.1f} GiB" if plan.capacity is not None else "unknown")
             + f"; sleeping engines may hold {plan.host_limit / GIB:.1f} GiB of host RAM; "
             f"eviction {plan.policy})"]
    if plan.exclusive:
        lines.append("one engine at a time: " + (
            "no reading of the card's memory" if plan.card is None else
            "this runtime runs one engine per checkout"))
    lines += plan.notes
    lines.append(f"{'model':<24} {'swap':<8} {'util':>5} {'budget':>8} {'kv-rel.':>8} "
                 f"{'asleep':>8} {'host':>7}  tiers (expected swap back)  why")
    for need in plan.needs.values():
        budget = (f"{plan.budget(need.id) * need.gpus / GIB:.1f}G" if plan.card else "-")
        tiers = need.sleep_tiers

        def held(tier: Tier, need: Need = need, tiers: tuple[Tier, ...] = tiers) -> str:
            if tier not in tiers:
                return "-"
            return (f"{need.residue_at(tier) * need.gpus / GIB:.1f}G"
                    + ("" if need.measured_at(tier) else "*"))

        host = (f"{need.host / GIB:.1f}G" if need.host else "?") if HOST in tiers else "-"
        ladder = ", ".join(f"{t} {need.wake_s(t):.2f}s" for t in tiers)
        ladder = (ladder + ", " if ladder else "") + "stopped: a start"
        lines.append(f"{need.id[:24]:<24} {need.mode:<8} {need.util:>5g} {budget:>8} "
                     f"{held(KV_RELEASED):>8} {held(HOST):>8} {host:>7}  {ladder}  {need.why}")
    lines.append("(* not measured yet: 2 GiB per card assumed, plus the weights kv-released; swap "
                 "times are this host's medians, else the H200 figures of docs/router.md)")
    for target in plan.needs:
        others = [View(i, awake=True, util=None, last_used=0.0) for i in plan.needs if i != target]
        arrangement = plan.arrange(target, others, now=0.0)
        awake = [i for i in plan.needs if i != target and i not in arrangement.put_away]
        moved = [f"{m.member} -> {m.to}" for m in arrangement.moves]
        text = (f"asking for {target}: "
                + (f"awake beside {', '.join(awake)}; " if awake else "")
                + (f"moves: {', '.join(moved)}; " if moved else "")
                + (f"started at gpu_memory_utilization {arrangement.util:g}"
                   if arrangement.util is not None else ""))
        if not arrangement.fits:
            text += f"DOES NOT FIT: {arrangement.why}"
        lines.append(text.rstrip("; "))
    return "\n".join(lines)

"""How the pool watches its engines and what it shows: health probes (one at a time per engine,
shared), answers and failed forwards, the first answer after a swap, and the snapshot that
/v1/health, router.json and the dashboard read."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from typing import Any

from vllmstack.router.member import Member
from vllmstack.router.plan import GIB
from vllmstack.router.pool import Pool
from vllmstack.router.states import ASLEEP, READY, UNLOADED


async def check(pool: Pool, member: Member, when: str) -> bool:
    """Probe a ready engine; False (and marked gone) when its /health does not answer 200."""
    if pool.probe is None or member.url is None:
        return True
    if member.probing is None or member.probing.done():
        member.probing = asyncio.get_running_loop().create_task(pool.probe(member.url))
    ok = await asyncio.shield(member.probing)
    if ok:
        member.last_ok = pool.clock()
    else:
        pool.engine_gone(member.entry, f"its /health did not answer {when}")
    return ok


async def fresh(pool: Pool, member: Member) -> bool:
    """Before a request is forwarded after the engine was quiet for the health interval."""
    if member.inflight or pool.clock() - member.last_ok < pool.limits.health_interval:
        return True
    return await check(pool, member, "after a pause")


def answered(pool: Pool, member: Member, status: int, arrived: float | None = None) -> None:
    """A forward got an answer: its first-token time is kept (from `arrived`, the request's
    arrival), the first after a swap is timed; a run of errors gets the engine's /health
    checked, and only an engine that fails it is loaded again."""
    now = pool.clock()
    member.last_ok = now
    if arrived is not None:
        pool.first_tokens[member.id].append(now - arrived)
    swap = member.swap
    if swap is not None:
        member.swap = None
        swap.first_s = now - member.ready_at
        if swap.asked_at is not None:
            swap.request_s = now - swap.asked_at
        pool.on_change()
    if status < 500:
        member.errors = 0
        return
    member.errors += 1
    if member.errors >= pool.limits.error_run and member.ready:
        member.errors = 0
        run = f"{pool.limits.error_run} answers of 500 or above in a row (ROUTER_ERROR_RUN)"
        asyncio.get_running_loop().create_task(_reload_after(pool, member, run))


async def _reload_after(pool: Pool, member: Member, run: str) -> None:
    """Restart only when health fails: any client that can provoke a 500 (a bad prompt, a tool
    call the engine rejects) restarted a shared engine whose /health answered 200 (issue 35)."""
    if pool.probe is None or member.url is None:
        return  # nothing to ask: the next failed forward decides
    try:
        healthy = await pool.probe(member.url)
    except Exception:
        healthy = False
    if healthy:
        pool.say(f"{member.id}: {run}; its /health answers 200: kept")
        return
    pool.engine_gone(member.entry, f"{run}; its /health does not answer")


async def upstream_failed(pool: Pool, member: Member, why: str) -> bool:
    member.errors += 1
    if not member.ready:
        return True
    if pool.probe is not None and member.url is not None and await pool.probe(member.url):
        pool.say(f"{member.id}: one forward failed ({why}); the engine answers /health, kept")
        return False
    pool.engine_gone(member.entry, why)
    return True


def first_token(times: Iterable[float]) -> dict[str, Any]:
    """p50 and p99 of a model's recent first-token times (arrival at the router to the engine's
    first answer byte; the last FIRST_TOKENS answers), None before its first answer."""
    ordered = sorted(times)
    if not ordered:
        return {"first_token_p50_s": None, "first_token_p99_s": None, "first_tokens": 0}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 3)

    return {"first_token_p50_s": at(0.5), "first_token_p99_s": at(0.99),
            "first_tokens": len(ordered)}


def snapshot(pool: Pool) -> dict[str, Any]:
    """The pool's state. `loaded`/`state`/`profile`/`engine_url` name one engine (the one a
    switch brings up, else the latest brought up) for readers of one resident engine; `engines`
    has every one: awake or asleep, its share of the card, what it holds, how it swaps."""
    now = pool.clock()
    plan = pool.plan
    shown = pool.shown if pool.shown is not None and pool.shown.started else None
    state = shown.state if shown else UNLOADED
    engines: dict[str, Any] = {}
    for member in pool.members.values():
        need, tier = plan.needs[member.id], pool.tier(member)
        budget = plan.budget(member.id, member.util) * need.gpus if plan.card else None
        engines[member.id] = {
            "state": member.state, "profile": member.entry.profile, "url": member.url,
            "swap": member.mode, "why": member.why,
            "util": member.util, "primed": member.primed, "inflight": member.inflight,
            "gpu_gib": round((budget if member.ready else need.residue_at(tier) * need.gpus
                              if member.asleep else 0) / GIB, 2) if budget is not None else None,
            "budget_gib": round(budget / GIB, 2) if budget is not None else None,
            "residue_gib": round(need.residue / GIB, 2), "residue_measured": need.measured,
            "host_gib": round(need.backup_at(tier) / GIB, 2),
            "sleep_frees": need.frees if member.mode == "sleep" else None,
            # Its tier (awake, kv-released, asleep, stopped), those it may sleep in, and what
            # bringing it back from there is expected to take (measured history, else defaults).
            "tier": tier, "sleep_tiers": [str(t) for t in need.sleep_tiers],
            "swap_s": pool.expected_s(member),
            "weights_gib": round(need.host / GIB, 2),
            "idle_s": round(now - member.last_used, 1) if member.started else None,
            **first_token(pool.first_tokens[member.id]),
        }
    return {
        "status": "ok",
        "loaded": shown.id if shown else None,
        "state": state,
        "profile": shown.entry.profile if shown else None,
        "engine_url": shown.url if shown and state == READY else None,
        "adopted": bool(shown and shown.adopted),
        "queue": pool.waiting,
        "inflight": pool.inflight,
        "idle_s": round(now - shown.last_used, 1) if shown and pool.inflight == 0 else 0.0,
        "models": {m.id: {"state": m.state, "error": m.status.error}
                   for m in pool.members.values()},
        "awake": [m.id for m in pool.members.values() if m.ready],
        "asleep": [m.id for m in pool.members.values() if m.state == ASLEEP],
        "engines": engines,
        "plan": {"card_gib": round(plan.card / GIB, 2) if plan.card else None,
                 "capacity_gib": round(c / GIB, 2) if (c := plan.capacity) is not None else None,
                 "host_limit_gib": round(plan.host_limit / GIB, 2), "policy": plan.policy,
                 "exclusive": plan.exclusive},
        "swaps": [s.as_dict() for s in pool.swaps],
    }

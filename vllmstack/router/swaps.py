"""A switch, step by step (the pool's, engines.Pool): the engines that give way are
drained, then put to sleep or stopped; the target is woken, or started with the share of the
card the plan leaves it (checked against the card's free memory first); an engine's first,
slow sleep is paid as part of its load, before it is declared ready (`pay_first_sleep`), never
later while idle, where a request arriving just then would wait for it. After every sleep the
card's own used memory says whether it was released (plan.judge_sleep); where it was not, the
profile swaps by restart from then on, and the router's memory store keeps why.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from vllmstack.core.errors import StackError
from vllmstack.router.catalog import Entry
from vllmstack.router.member import Member
from vllmstack.router.plan import ALL, GIB, KV, MARGIN, RESTART, Arrangement, judge_sleep
from vllmstack.router.pool import Pool, Waiter
from vllmstack.router.states import (
    ASLEEP,
    FAILED,
    LOADING,
    READY,
    SLEEPING,
    UNLOADED,
    UNLOADING,
    WAKING,
    Swap,
)
from vllmstack.router.tiers import (
    AWAKE,
    HOST,
    KV_RELEASED,
    SLEEP_TIERS,
    STOPPED,
    WAKES_KEPT,
    Tier,
)

MIN_SHARE = 0.05  # vLLM's own lower bound for gpu_memory_utilization in the schema


async def switch(pool: Pool, target: Entry | None, arrangement: Arrangement,
                 reason: str, waiter: Waiter | None = None) -> None:
    """Put away what the arrangement names, then bring `target` up (None: only put away)."""
    member = pool.members[target.id] if target is not None else None
    began = pool.clock()
    first = (arrangement.sleep + arrangement.stop)[:1]
    swap = Swap(first[0] if first else None, target.id if target else None, 0.0, 0.0, 0.0, True,
                reason, asked_at=waiter.arrived if waiter else None)
    pool.victims = arrangement.put_away
    try:
        if not arrangement.fits:
            raise StackError(arrangement.why, "lower VLLM_GPU_MEM_UTIL of the profiles that run "
                             "together, or let the router stop the others (ROUTER_SWAP=restart)")
        why = f"to load {target.id}" if target is not None else f"({reason})"
        for move in arrangement.moves:  # awake ones down a tier, then the stops, the deepenings
            other = pool.members[move.member]
            if move.frm != AWAKE and move.to != STOPPED:
                await deepen(pool, other, move.to, swap)
            else:
                await put_away(pool, other, swap, why, sleep_it=move.to != STOPPED,
                               tier=move.to)
        if member is None:
            return
        await bring_up(pool, member, arrangement, swap, waiter)
    except Exception as exc:
        error = exc if isinstance(exc, StackError) else StackError(
            f"{type(exc).__name__}: {exc}", "see the router's log; this is a bug of the router")
        swap.ok, swap.error = False, error.cause
        if member is not None and member.id in pool.aborted:
            # Cut short because nobody waited for it: not the profile's failure, so no back-off
            # and no error for a request that comes later; that one loads it anew.
            swap.error = f"cut short: no request waited for it ({error.cause})"
            pool.set_state(member, UNLOADED)
            pool.say(f"the load of {member.id} was cut short: no request waited for it")
            return
        if member is not None:
            pool.attempts[member.id] = pool.attempts.get(member.id, 0) + 1
            pool.load_failed[member.id] = pool.clock()
            pool.set_state(member, FAILED, error)
        pool.say(f"{'bringing up ' + member.id if member else 'unloading'} failed: {error.cause}"
                 + (f"\n  fix: {error.fix}" if error.fix else ""))
    finally:
        pool.victims = frozenset()
        if member is not None:
            pool.aborted.discard(member.id)
        swap.total_s = pool.clock() - began
        pool.swaps.append(swap)
        pool.on_change()


async def put_away(pool: Pool, member: Member, swap: Swap, why: str, *,
                   sleep_it: bool, tier: Tier | None = None) -> None:
    """Drain one engine that gives way, then sleep it into `tier` (sleep mode, ready) or stop
    it; `why` ends the reason a request cut by the drain timeout is given."""
    sleeps = sleep_it and member.ready and member.sleeps
    if member.ready:
        action = f"puts {member.id} to sleep" if sleeps else f"unloads {member.id}"
        await pool.drain(member, f"the router {action} {why}")
        # A forward that failed during the drain may have marked it gone (failed): only a
        # ready engine is put to sleep (failed -> sleeping is no transition); a gone one stops.
        sleeps = sleeps and member.ready
    began = pool.clock()
    if sleeps:
        slept = await sleep(pool, member, stop_unreleased=True, tier=tier)
        swap.sleep_s += pool.clock() - began
        if slept:
            swap.slept += (member.id,)
            return
        swap.stopped += (member.id,)
        return
    if member.started:
        await stop(pool, member)
        swap.stop_s += pool.clock() - began
        swap.stopped += (member.id,)


async def deepen(pool: Pool, member: Member, tier: Tier, swap: Swap) -> None:
    """A kv-released engine to level 1: woken, then put to sleep backing its weights up (vLLM
    has no way to deepen a sleep in place). Its wake needs its KV cache back on the card for a
    moment: where the card has no room for it now, it is stopped instead."""
    if not member.asleep or member.slept_in == tier:
        return  # it changed since the plan was made: nothing to deepen
    need, began = pool.plan.needs[member.id], pool.clock()
    cards = await asyncio.to_thread(pool.lifecycle.memory)
    if cards and pool.plan.card is not None:
        used = cards[:max(1, need.gpus)]
        total, free = min(c.total_bytes for c in used), min(c.free_bytes for c in used)
        want = int(total * (member.util or need.util)) - (member.residue or need.residue)
        if free - MARGIN < want:
            pool.say(f"{member.id}: no room to wake it for its level-1 sleep ({free / GIB:.1f} "
                     f"GiB free, its wake needs {want / GIB:.1f} GiB): stopping it instead")
            await stop(pool, member)
            swap.stop_s += pool.clock() - began
            swap.stopped += (member.id,)
            return
    pool.say(f"{member.id}: kv-released -> {tier} (woken, then its weights to host RAM)")
    await wake(pool, member)
    if await sleep(pool, member, stop_unreleased=True, tier=tier):
        swap.slept += (member.id,)
    else:
        swap.stopped += (member.id,)
    swap.sleep_s += pool.clock() - began


async def bring_up(pool: Pool, member: Member, arrangement: Arrangement, swap: Swap,
                   waiter: Waiter | None) -> None:
    entry = member.entry
    if member.asleep:
        await make_room(pool, member, None, swap, waking=True)
        pool.shown = member
        began = pool.clock()
        try:
            await wake(pool, member)
            swap.wake_s = pool.clock() - began
        except StackError as exc:
            pool.say(f"{member.id} did not wake ({exc.cause}): stopping it and starting it anew")
            await stop(pool, member)
    if not member.ready:
        if member.started:  # what is left of a failed engine goes first
            began = pool.clock()
            await stop(pool, member)
            swap.stop_s += pool.clock() - began
            swap.stopped += (member.id,)
        util = await make_room(pool, member, arrangement.util, swap, waking=False)
        member.started = True
        pool.shown = member
        pool.set_state(member, LOADING)
        pool.say(f"loading {member.id} ({entry.profile}, {entry.engine}, {member.mode}"
                 + (f", gpu_memory_utilization {util:g}" if util is not None else "") + ")")
        began = pool.clock()
        try:
            loaded = await asyncio.to_thread(pool.lifecycle.load, entry, util, member.sleeps,
                                             pool.plan.needs[member.id].frees)
        except BaseException:
            member.started = False  # `up` stops an engine that failed to boot
            raise
        finally:
            swap.start_s = pool.clock() - began
        member.url, member.util = loaded.url, util if util is not None else member.util
        member.load_s = swap.start_s
        measured(pool, member, STOPPED, wake_s=swap.start_s)
        swap.boot_s, swap.warmup_s, swap.util = loaded.boot_s, loaded.warmup_s, util
        if member.sleeps and not member.primed:
            # Always here, before the engine is declared ready: the first sleep is part of the
            # load, which its waiting clients wait for anyway. Paid later, while idle, a request
            # that arrived just then waited for it (issue 35: 15 s for an 8B, 50 s for a 27B).
            await pay_first_sleep(pool, member, swap)
        if not member.ready:
            pool.set_state(member, READY)
    pool.load_failed.pop(member.id, None)
    now = pool.clock()
    member.last_used = member.last_ok = member.ready_at = now
    member.errors = 0
    member.swap = swap if swap.asked_at is not None else None
    pool.shown = member
    pool.say(f"{member.id} is ready at {member.url} (" + ", ".join(
        f"{k} {v:.2f} s" for k, v in (("sleep", swap.sleep_s), ("stop", swap.stop_s),
                                      ("wake", swap.wake_s), ("start", swap.start_s)) if v) + ")")


async def make_room(pool: Pool, member: Member, util: float | None, swap: Swap, *,
                    waking: bool) -> float | None:
    """The card's free memory now, against what the engine asks: a start's share is lowered to
    what is free (down to its weights' need), else sleeping engines are stopped (the policy's
    least wanted first); not enough even then is an error naming the numbers."""
    plan, need = pool.plan, pool.plan.needs[member.id]
    if plan.card is None or plan.exclusive:
        return util
    while True:
        cards = await asyncio.to_thread(pool.lifecycle.memory)
        if not cards:
            return util
        used = cards[:max(1, need.gpus)]
        total, free = min(c.total_bytes for c in used), min(c.free_bytes for c in used)
        share = util if util is not None else need.util
        held = member.residue or need.residue_at(pool.tier(member))  # what it holds asleep
        want = int(total * (member.util or share)) - held if waking else int(total * share)
        if free - MARGIN >= want:
            return util
        room = int((free - MARGIN) / total * 1000) / 1000
        if not waking and room >= MIN_SHARE and room * total >= need.floor:
            pool.say(f"{member.id}: {free / GIB:.1f} GiB free on the card: starting it with "
                     f"gpu_memory_utilization {room:g} instead of {share:g}")
            return room
        asleep = [m for m in pool.members.values() if m.asleep and m is not member]
        if not asleep:
            raise StackError(
                f"not enough free GPU memory to {'wake' if waking else 'start'} {member.id}: "
                f"{free / GIB:.1f} GiB free of {total / GIB:.1f} GiB, it needs {want / GIB:.1f} "
                "GiB (and the router's other engines are stopped or needed)",
                "stop what else uses the GPU (nvidia-smi / amd-smi), or lower VLLM_GPU_MEM_UTIL "
                f"of {member.entry.profile}")
        victim = pool.members[plan.order([m.view() for m in asleep], pool.clock())[0].id]
        pool.say(f"stopping the sleeping {victim.id} to make room for {member.id}")
        began = pool.clock()
        await stop(pool, victim)
        swap.stop_s += pool.clock() - began
        swap.stopped += (victim.id,)


async def sleep(pool: Pool, member: Member, *, stop_unreleased: bool,
                tier: Tier | None = None) -> bool:
    """Put a ready engine to sleep into `tier` (None: its profile's first sleep tier;
    kv-released frees the KV cache only, asleep is level 1) and check the card released its
    memory. False when it did not (or the sleep failed): the profile swaps by restart from now
    on, and the engine is stopped (`stop_unreleased`) or woken again."""
    entry, need = member.entry, pool.plan.needs[member.id]
    tier = tier if tier in SLEEP_TIERS else (need.sleep_tiers[0] if need.sleep_tiers else HOST)
    pool.set_state(member, SLEEPING)
    try:
        slept = await asyncio.to_thread(pool.lifecycle.sleep, entry,
                                        KV if tier == KV_RELEASED else ALL)
    except StackError as exc:
        if not stop_unreleased and not await answers(pool, member):
            # Its process is gone (issue 35: a dead engine was marked ready here): not a
            # fallback, a failure the caller's load reports.
            raise StackError(f"the engine of {entry.id} stopped answering at {member.url} "
                             f"during its sleep ({exc.cause})",
                             f"see its log (invoke logs, or generated/router/{entry.profile}.log)"
                             "; the next request loads it again") from exc
        # Not the card's doing (an engine started without sleep mode, a dev endpoint that did
        # not answer): restart until this engine is stopped, and nothing kept in the store.
        fall_back(pool, member, f"its sleep failed: {exc.cause}", keep=False)
        if stop_unreleased:
            await stop(pool, member)
        else:
            pool.set_state(member, READY)
        return False
    verdict = judge_sleep(pool.plan, member.id, member.util, slept.before, slept.after, tier)
    if not verdict.released:
        fall_back(pool, member, f"its sleep did not release the GPU memory: {verdict.text}")
        member.slept_in = tier
        if stop_unreleased:
            await stop(pool, member)
        else:
            pool.set_state(member, ASLEEP)
            await wake(pool, member)
        return False
    member.slept_in = tier
    if verdict.residue is not None:
        member.residue = verdict.residue
        measured(pool, member, tier, residue=verdict.residue)
    first = not member.primed
    member.primed = True
    pool.set_state(member, ASLEEP)
    pool.say(f"{member.id} {tier} after {slept.seconds:.2f} s"
             + (" (its first sleep)" if first else "") + f"; {verdict.text}")
    return True


async def answers(pool: Pool, member: Member) -> bool:
    """Whether the engine answers /health (True where the pool has no probe)."""
    if pool.probe is None or member.url is None:
        return True
    try:
        return await pool.probe(member.url)
    except Exception:  # a probe that raised is an engine that did not answer
        return False


def fall_back(pool: Pool, member: Member, why: str, *, keep: bool = True) -> None:
    """Restart instead of sleep for this profile: for good, kept in the store (`keep`: the card
    did not release the memory), or only until this engine is stopped."""
    pool.say(f"warning: {member.id}: {why}; it swaps by restart "
             + ("from now on" if keep else "until it is started again"))
    member.mode, member.why = RESTART, why
    member.temporary = not keep
    if keep:
        pool.plan.needs[member.id] = replace(pool.plan.needs[member.id], mode=RESTART, why=why)
        pool.remember(member.entry.profile, {"fallback": why})


async def wake(pool: Pool, member: Member) -> None:
    tier = pool.tier(member)
    pool.set_state(member, WAKING)
    seconds = await asyncio.to_thread(pool.lifecycle.wake, member.entry)
    member.last_ok = pool.clock()
    member.slept_in = None
    pool.set_state(member, READY)
    measured(pool, member, tier, wake_s=seconds)
    pool.say(f"{member.id} awake after {seconds:.2f} s (from {tier})")


def measured(pool: Pool, member: Member, tier: Tier, *, wake_s: float | None = None,
             residue: int | None = None) -> None:
    """Keep what a wake (from `tier`; a start: from stopped) took or a sleep left on the card,
    in the plan (its expected swap times) and the store (generated/router/memory.json)."""
    need = pool.plan.needs[member.id]
    figures: dict[str, object] = {}
    if wake_s is not None:
        wakes = {**need.wakes, tier: (*need.wakes.get(tier, ()), round(wake_s, 3))[-WAKES_KEPT:]}
        need = replace(need, wakes=wakes)
        figures["wake_s"] = list(wakes[tier])
    if residue is not None:
        first = need.sleep_tiers[0] if need.sleep_tiers else HOST
        need = (replace(need, residue=residue, measured=True) if tier == first else
                replace(need, host_residue=residue, host_measured=True))
        figures["residue_bytes"] = residue
    pool.plan.needs[member.id] = need
    pool.remember(member.entry.profile, {"tiers": {str(tier): figures}, "util": member.util})


async def pay_first_sleep(pool: Pool, member: Member, swap: Swap) -> None:
    """Sleep and wake once: vLLM pins its host buffers at the first sleep (12 s for an 8B, 41 s
    for a 27B), so no swap later pays for it."""
    began = pool.clock()
    tiers = pool.plan.needs[member.id].sleep_tiers
    # Level 1 where it may go there: that sleep pins the host buffers, a kv-released one none.
    if await sleep(pool, member, stop_unreleased=False, tier=HOST if HOST in tiers else None):
        swap.sleep_s += pool.clock() - began
        woke = pool.clock()
        await wake(pool, member)
        swap.wake_s += pool.clock() - woke


async def stop(pool: Pool, member: Member) -> None:
    """Stop an engine, awake or asleep (`invoke down` for its profile's engine)."""
    pool.set_state(member, UNLOADING)
    pool.say(f"unloading {member.id} ({member.entry.profile})")
    try:
        await asyncio.to_thread(pool.lifecycle.unload, member.entry)
    except Exception as exc:  # an OSError too (a full disk): never left `unloading` for good
        error = exc if isinstance(exc, StackError) else StackError(
            f"{type(exc).__name__}: {exc}", "see the router's log; the idle TTL or the next "
            "request tries again")
        pool.set_state(member, FAILED, error)
        raise StackError(f"{member.id} could not be stopped: {error.cause}", error.fix) from exc
    member.started, member.url, member.util, member.swap = False, None, None, None
    member.slept_in = None
    member.adopted = False
    if member.temporary:  # started anew, it sleeps as its profile says
        need = pool.plan.needs[member.id]
        member.mode, member.why, member.temporary = need.mode, need.why, False
    if pool.shown is member:
        pool.shown = None
    pool.set_state(member, UNLOADED)

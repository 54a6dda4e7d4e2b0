"""The router's memory plan (issue 21): what gives way when a model must be awake, the share of
the card a start asks for, the host RAM sleeping engines may hold, the eviction policies, the
verdict on a sleep, and the pool acting on it over a fake card that refuses, like vLLM, a start
or a wake that does not fit."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import until
from test_router_engines import catalog, entry, run

from vllmstack.checks.context import build_context
from vllmstack.checks.router import rule_router_swap
from vllmstack.config.profiles import resolve
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import EngineManager
from vllmstack.router.history import apply_store
from vllmstack.router.limits import Limits
from vllmstack.router.memory import render_plan
from vllmstack.router.plan import (
    DEFAULT_RESIDUE,
    GIB,
    KV,
    RESTART,
    SCORE,
    SLEEP,
    Need,
    Plan,
    View,
    exclusive_plan,
    host_limit,
    judge_sleep,
    keeps_weights,
    swap_mode,
)
from vllmstack.router.states import Adopted, Loaded, Slept
from vllmstack.router.tiers import Move, Tier, sleep_tiers
from vllmstack.runtime.gpu import GpuMemory

CARD = 40 * GIB


def need(name: str, util: float, mode: str = SLEEP, host_gib: float = 4.0) -> Need:
    return Need(name, name, mode, "test", util, 1, int(host_gib * GIB))


def plan(*needs: Need, host_limit_gib: float = 0, policy: str = "lru") -> Plan:
    return Plan({n.id: n for n in needs}, CARD, 0, int(host_limit_gib * GIB), policy)


def awake(name: str, used: float, util: float | None = None, load_s: float = 60.0) -> View:
    return View(name, True, util, used, load_s)


def asleep(name: str, used: float, util: float = 0.6, load_s: float = 60.0) -> View:
    return View(name, False, util, used, load_s)


# --- arrange ---------------------------------------------------------------------------------


def test_the_awake_engine_sleeps_only_when_both_do_not_fit() -> None:
    both = plan(need("a", 0.6), need("b", 0.6))
    arrangement = both.arrange("b", [awake("a", 1.0, 0.6)], now=2.0)
    assert (arrangement.sleep, arrangement.stop, arrangement.util) == (("a",), (), None)
    small = plan(need("a", 0.3), need("b", 0.3))
    together = small.arrange("b", [awake("a", 1.0, 0.3)], now=2.0)
    assert together.put_away == frozenset() and together.fits  # profiles that fit stay awake


def test_the_cheapest_loss_gives_way_first_and_the_policy_breaks_ties() -> None:
    three = plan(need("a", 0.45), need("b", 0.45, RESTART), need("c", 0.45))
    # b is the least recently used, but stopping it costs its next request a load (60 s until
    # measured) where a's sleep costs a wake (1 s): a sleeps.
    arrangement = three.arrange("c", [awake("a", 5.0, 0.45), awake("b", 3.0, 0.45)], now=9.0)
    assert (arrangement.sleep, arrangement.stop) == (("a",), ())
    assert arrangement.moves == (Move("a", Tier.AWAKE, Tier.HOST),)
    # A restart engine that loads in half a second (llama.cpp) is the cheaper one to stop.
    quick = three.arrange("c", [awake("a", 5.0, 0.45), awake("b", 3.0, 0.45, load_s=0.5)],
                          now=9.0)
    assert (quick.sleep, quick.stop) == ((), ("b",))
    # Two restart engines cost the same: the least recently used is stopped.
    both = plan(need("a", 0.45, RESTART), need("b", 0.45, RESTART), need("c", 0.45))
    assert both.arrange("c", [awake("a", 5.0, 0.45), awake("b", 3.0, 0.45)],
                        now=9.0).stop == ("b",)


def test_a_fresh_start_asks_for_what_is_left_beside_the_sleeping_residues() -> None:
    # Three sleeping engines hold 3 x 2 GiB of a 40 GiB card; d's 0.95 does not fit beside them
    # (nor beside the margin): it starts with the share left, rounded down.
    crowd = plan(need("a", 0.5), need("b", 0.5), need("c", 0.5), need("d", 0.95))
    views = [asleep("a", 1.0), asleep("b", 2.0), asleep("c", 3.0)]
    arrangement = crowd.arrange("d", views, now=4.0)
    left = (CARD - GIB // 2 - 3 * DEFAULT_RESIDUE) / CARD
    assert arrangement.put_away == frozenset() and arrangement.fits
    assert arrangement.util == pytest.approx(int(left * 1000) / 1000)
    # A model whose weights need more than that stops the least recently used sleepers instead.
    heavy = plan(need("a", 0.5), need("b", 0.5), need("c", 0.5),
                 need("d", 0.95, host_gib=31.0))
    arrangement = heavy.arrange("d", views, now=4.0)
    assert arrangement.stop == ("a", "b") and arrangement.fits
    assert arrangement.util is not None and arrangement.util * CARD >= heavy.needs["d"].floor


def test_a_model_that_cannot_fit_says_so_with_its_numbers() -> None:
    huge = plan(need("a", 0.5), need("d", 0.95, host_gib=60.0))
    arrangement = huge.arrange("d", [asleep("a", 1.0)], now=2.0)
    assert not arrangement.fits
    assert "d needs 38.0 GiB of a 40.0 GiB card" in arrangement.why


def test_waking_needs_room_for_the_share_it_started_with() -> None:
    two = plan(need("a", 0.6), need("b", 0.6), need("c", 0.4))
    # b sleeps at 0.6; c is awake at 0.4 and a sleeps: b's 24 GiB needs c asleep too.
    views = [asleep("b", 1.0), awake("c", 2.0, 0.4), asleep("a", 0.5)]
    arrangement = two.arrange("b", views, now=3.0)
    assert arrangement.sleep == ("c",) and arrangement.util is None


def test_sleeping_engines_stay_within_the_host_ram_limit_by_policy() -> None:
    needs = (need("a", 0.6, host_gib=10), need("b", 0.6, host_gib=10), need("c", 0.6))
    views = [asleep("a", 1.0, load_s=100.0), awake("b", 5.0, 0.6, load_s=10.0)]
    # c needs b asleep; a and b asleep hold 20 GiB of host RAM, over 15: one sleeper goes.
    lru = plan(*needs, host_limit_gib=15).arrange("c", views, now=10.0)
    assert (lru.sleep, lru.stop) == (("b",), ("a",))  # a: least recently used
    # score = idle / load time: a idle 9 s / 100 s load, b idle 5 s / 10 s: b is cheaper to
    # bring back, so b is stopped instead of put to sleep.
    score = plan(*needs, host_limit_gib=15, policy=SCORE).arrange("c", views, now=10.0)
    assert (score.sleep, score.stop) == ((), ("b",))


def test_an_exclusive_plan_keeps_one_engine_awake() -> None:
    one = exclusive_plan([("a", "a"), ("b", "b")])
    arrangement = one.arrange("b", [awake("a", 1.0)], now=2.0)
    assert arrangement.stop == ("a",) and arrangement.sleep == ()


# --- a sleep's verdict, modes, the store ------------------------------------------------------


def test_a_sleep_that_freed_little_is_not_released() -> None:
    card = plan(need("a", 0.6))
    budget = int(CARD * 0.6)
    done = judge_sleep(card, "a", 0.6, budget + GIB, GIB + int(1.3 * GIB))
    assert done.released and done.residue == pytest.approx(1.3 * GIB, rel=0.01)
    kept = judge_sleep(card, "a", 0.6, budget + GIB, budget + GIB - GIB // 2)
    assert not kept.released and "sleep freed 0.5 GiB of the 24.0 GiB it held" in kept.text
    blind = judge_sleep(card, "a", 0.6, None, None)
    assert blind.released and "not checked" in blind.text


@pytest.mark.parametrize(("setting", "engine", "vendor", "several", "mode"), [
    ("auto", "vllm", "nvidia", True, SLEEP), ("auto", "vllm", "amd", True, SLEEP),
    ("auto", "vllm", "none", True, RESTART), ("auto", "llamacpp", "nvidia", True, RESTART),
    ("sleep", "vllm", "none", True, SLEEP), ("restart", "vllm", "nvidia", True, RESTART),
    ("auto", "vllm", "nvidia", False, RESTART),
])
def test_swap_modes(setting: str, engine: str, vendor: str, several: bool, mode: str) -> None:
    assert swap_mode(setting, engine, vendor, several)[0] == mode


def test_the_store_brings_a_measured_residue_and_a_fallback() -> None:
    measured = apply_store(need("a", 0.6), {"residue_bytes": 1400 * 1024**2})
    assert measured.measured and measured.residue == 1400 * 1024**2 and measured.mode == SLEEP
    fallen = apply_store(need("a", 0.6), {"fallback": "its sleep did not release the memory"})
    assert fallen.mode == RESTART and "delete its entry" in fallen.why


def test_the_host_limit_defaults_to_half_of_memtotal(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemFree: 1 kB\n")
    assert host_limit(0, meminfo) == 65536000 * 1024 // 2
    assert host_limit(12, meminfo) == 12 * GIB


def test_the_plan_is_printed_with_what_does_not_fit() -> None:
    huge = plan(need("a", 0.5), need("d", 0.95, host_gib=60.0))
    shown = render_plan(huge, Catalog("nvidia", {}, {}))
    assert "40.0 GiB per card" in shown and "DOES NOT FIT: d needs 38.0 GiB" in shown
    assert "asking for a: awake beside d" not in shown
    assert "asking for a: moves: d -> asleep" in shown and "asleep 1.00s" in shown


def test_check_warns_when_sleep_is_forced_where_vllm_does_not_sleep(project: Project) -> None:
    def findings(*sets: str) -> list[str]:
        resolved = resolve(project, platform="cpu", model="qwen3-0.6b", overrides=list(sets),
                           environ={})
        return [f.code for f in rule_router_swap(build_context(project, resolved, {}))]

    assert findings("ROUTER_SWAP=sleep") == ["sleep-unsupported"]
    assert findings("ROUTER_SWAP=auto") == []
    assert findings("ROUTER_SWAP=sleep", "GPU_VENDOR=nvidia") == []
    assert findings("ROUTER_SWAP=sleep", "GPU_VENDOR=nvidia", "RUNTIME=compose") == [
        "sleep-one-engine"]
    # Weights kept on the card asleep: measured on CUDA, a warning elsewhere.
    assert findings("ROUTER_SLEEP_FREES=kv", "GPU_VENDOR=amd") == ["sleep-kv-unmeasured"]
    assert findings("ROUTER_SLEEP_FREES=kv", "GPU_VENDOR=nvidia") == []
    assert findings("ROUTER_SLEEP_FREES=auto", "GPU_VENDOR=amd") == []


# --- the pool over a fake card --------------------------------------------------------------


class FakeCard:
    """A lifecycle whose engines hold memory on one fake card: a start or a wake that does not
    fit fails as vLLM does, and the highest use is kept."""

    def __init__(self, total: int, *, residue: int = GIB, keep: tuple[str, ...] = (),
                 util: float = 0.6, weights: int = 0) -> None:
        self.total, self.residue, self.keep, self.util = total, residue, keep, util
        self.weights = weights  # what an engine started with frees="kv" keeps asleep
        self.frees: dict[str, str] = {}
        self.held: dict[str, int] = {}
        self.budget: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []
        self.peak = 0
        self.lock = threading.Lock()

    def _hold(self, name: str, amount: int) -> None:
        self.held[name] = amount
        self.peak = max(self.peak, sum(self.held.values()))

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = "all") -> Loaded:
        with self.lock:
            self.calls.append(("load", entry.id))
            want = int(self.total * (util or self.util))
            free = self.total - sum(self.held.values())
            if free < want:
                raise StackError(f"Free memory on device ({free}) is less than desired ({want})")
            self.budget[entry.id] = want
            self.frees[entry.id] = frees
            self._hold(entry.id, want)
        return Loaded(f"http://127.0.0.1:1/{entry.id}")

    def unload(self, entry: Entry) -> None:
        with self.lock:
            self.calls.append(("unload", entry.id))
            self.held.pop(entry.id, None)

    def abort(self, entry: Entry) -> None:
        self.calls.append(("abort", entry.id))

    def adoptable(self, catalog: Catalog) -> list[Adopted]:
        return []

    def sleep(self, entry: Entry, frees: str = "all") -> Slept:
        with self.lock:
            self.calls.append(("sleep", entry.id))
            before = sum(self.held.values())
            if entry.id not in self.keep:
                kept = self.weights if self.frees.get(entry.id) == KV else 0
                self._hold(entry.id, self.residue + kept)
            return Slept(0.01, before, sum(self.held.values()))

    def wake(self, entry: Entry) -> float:
        with self.lock:
            self.calls.append(("wake", entry.id))
            want = self.budget[entry.id] - self.held[entry.id]
            if self.total - sum(self.held.values()) < want:
                raise StackError("out of memory on wake")
            self._hold(entry.id, self.budget[entry.id])
        return 0.01

    def memory(self) -> list[GpuMemory] | None:
        with self.lock:
            return [GpuMemory(0, self.total, sum(self.held.values()))]


def sleeping_pool(card: FakeCard, *entries: Entry, util: float = 0.6,
                  host_limit_gib: float = 0) -> tuple[EngineManager, list[dict[str, object]]]:
    remembered: list[dict[str, object]] = []
    needs = [Need(e.id, e.profile, SLEEP, "test", util, 1, 2 * GIB) for e in entries]
    pool_plan = Plan({n.id: n for n in needs}, card.total, 0, int(host_limit_gib * GIB))
    manager = EngineManager(catalog(*entries), card, plan=pool_plan,
                            limits=Limits(swap_wait=0, swap_grace=0),
                            remember=lambda profile, fields: remembered.append(
                                {"profile": profile, **fields}))
    return manager, remembered


A, B, C = entry("a"), entry("b"), entry("c")


def test_swaps_sleep_and_wake_and_the_card_never_holds_more_than_it_has() -> None:
    card = FakeCard(40 * GIB)

    async def go() -> None:
        manager, remembered = sleeping_pool(card, A, B)
        await manager.load(A, 5)  # no client waits: its first sleep is paid at load
        assert card.calls == [("load", "a"), ("sleep", "a"), ("wake", "a")]
        # its load time, its residue and its wake time, each under its tier
        assert [(tier, list(figures)) for r in remembered
                for tier, figures in r["tiers"].items()] == [  # type: ignore[attr-defined]
            ("stopped", ["wake_s"]), ("asleep", ["residue_bytes"]), ("asleep", ["wake_s"])]
        assert remembered[1]["tiers"] == {"asleep": {"residue_bytes": GIB}}
        for model in (B, A, B, A):
            await manager.acquire(model, 5)
            manager.release(model)
        # b's first sleep is part of its load too (issue 35: never paid later, while idle).
        assert card.calls[3:] == [("sleep", "a"), ("load", "b"), ("sleep", "b"), ("wake", "b"),
                                  ("sleep", "b"), ("wake", "a"), ("sleep", "a"), ("wake", "b"),
                                  ("sleep", "b"), ("wake", "a")]
        assert card.peak <= card.total and manager.snapshot()["asleep"] == ["b"]
        await manager.shutdown()  # stops the sleeping engine too
        assert card.held == {} and card.calls[-2:] == [("unload", "a"), ("unload", "b")]

    run(go)


def test_a_sleep_that_keeps_its_memory_falls_back_to_restart() -> None:
    card = FakeCard(40 * GIB, keep=("a",))
    said: list[str] = []

    async def go() -> None:
        manager, remembered = sleeping_pool(card, A, B)
        manager.say = said.append
        await manager.acquire(A, 5)  # its first sleep, at load, frees nothing: woken again
        manager.release(A)
        assert card.calls == [("load", "a"), ("sleep", "a"), ("wake", "a")]
        await manager.acquire(B, 5)
        manager.release(B)
        # a restarts from now on: stopped, not put to sleep, to load b (which primes).
        assert card.calls[3:] == [("unload", "a"), ("load", "b"), ("sleep", "b"), ("wake", "b")]
        member = manager.members["a"]
        assert member.mode == RESTART and "did not release the GPU memory" in member.why
        assert {"profile": "a", "fallback": member.why} in remembered
        assert any("it swaps by restart from now on" in line for line in said)
        assert card.peak <= card.total

    run(go)


def test_three_models_on_a_card_for_two_keep_the_most_recent_awake() -> None:
    card = FakeCard(40 * GIB, util=0.45)

    async def go() -> None:
        manager, _ = sleeping_pool(card, A, B, C, util=0.45)
        for model in (A, B):
            await manager.acquire(model, 5)
            manager.release(model)
        assert manager.snapshot()["awake"] == ["a", "b"]  # 0.45 + 0.45 fit together
        await manager.acquire(C, 5)
        manager.release(C)
        snap = manager.snapshot()
        assert snap["awake"] == ["b", "c"] and snap["asleep"] == ["a"]  # a: least recently used
        assert card.peak <= card.total

    run(go)


def test_the_host_ram_limit_stops_a_sleeper_instead_of_keeping_it() -> None:
    card = FakeCard(40 * GIB)

    async def go() -> None:
        manager, _ = sleeping_pool(card, A, B, C, host_limit_gib=3)  # one 2 GiB sleeper fits
        for model in (A, B, C):
            await manager.acquire(model, 5)
            manager.release(model)
        snap = manager.snapshot()
        assert snap["awake"] == ["c"] and snap["asleep"] == ["b"]
        assert manager.members["a"].state == "unloaded" and ("unload", "a") in card.calls

    run(go)


def test_requests_for_an_engine_going_to_sleep_wait_for_its_wake() -> None:
    card = FakeCard(40 * GIB)

    async def go() -> None:
        manager, _ = sleeping_pool(card, A, B)
        await manager.acquire(A, 5)
        switch = asyncio.create_task(manager.acquire(B, 5))
        await until(lambda: manager.victims == frozenset({"a"}), what="the switch to b under way")
        assert not manager.servable(A)
        late = asyncio.create_task(manager.acquire(A, 5))  # queued, never sent to a sleeper
        manager.release(A)
        await switch
        manager.release(B)
        assert await late == "http://127.0.0.1:1/a" and manager.members["a"].ready
        manager.release(A)

    run(go)


def test_an_idle_sleeping_engine_is_stopped_after_its_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllmstack.router import engines

    monkeypatch.setattr(engines, "IDLE_POLL_S", 0.02)
    card = FakeCard(40 * GIB)
    short = entry("short", ttl=0.3)

    async def go() -> None:
        manager, _ = sleeping_pool(card, short, B)
        began = time.monotonic()  # short's TTL clock starts after this, at the end of its load
        await manager.load(short, 5)
        await manager.load(B, 5)  # short sleeps beside b
        assert manager.members["short"].asleep
        idle = asyncio.create_task(manager.idle_loop())
        await until(lambda: manager.members["short"].state == "unloaded"
                    and not manager.switching(), what="the idle sleeper stopped")
        idle.cancel()
        assert time.monotonic() - began >= 0.3  # not before its TTL
        assert "short" not in card.held
        assert manager.swaps[-1].reason == "idle" and manager.members["b"].ready

    run(go)


def test_the_stand_in_card_counts_only_live_processes(tmp_path: Path) -> None:
    import os
    import subprocess

    from vllmstack.runtime.gpu import StandinProbe, total_used

    (tmp_path / "total").write_text(f"{16 * GIB}\n")
    (tmp_path / f"{os.getpid()}.used").write_text(f"{3 * GIB}\n")
    dead = subprocess.Popen(["true"])  # a pid that no longer runs (reaped)
    dead.wait()
    (tmp_path / f"{dead.pid}.used").write_text(f"{5 * GIB}\n")
    (tmp_path / "notes.used").write_text("not a pid\n")
    memory = StandinProbe(tmp_path).memory()
    assert memory is not None
    assert (memory[0].total_bytes, total_used(memory)) == (16 * GIB, 3 * GIB)
    assert StandinProbe(tmp_path / "none").memory() is None  # no `total`: no reading


def test_a_sleep_that_fails_keeps_the_engine_and_restarts_it_only_until_it_stops() -> None:
    class NoDevMode(FakeCard):
        def sleep(self, entry: Entry, frees: str = "all") -> Slept:
            self.calls.append(("sleep", entry.id))
            raise StackError("the engine of a answered 404 to POST /sleep?level=1")

    card = NoDevMode(40 * GIB)

    async def go() -> None:
        manager, remembered = sleeping_pool(card, A, B)
        await manager.load(A, 5)  # its first sleep fails: a stays awake and serves
        member = manager.members["a"]
        assert member.ready and member.mode == RESTART and member.temporary
        # not the card's doing: nothing kept for later routers (its load time is)
        assert not any("fallback" in r for r in remembered)
        await manager.acquire(B, 5)  # a is stopped, not put to sleep
        manager.release(B)
        assert ("unload", "a") in card.calls and member.state == "unloaded"
        assert member.mode == SLEEP and not member.temporary  # sleeps from its next start

    run(go)


def test_a_load_pays_its_first_sleep_before_it_is_ready_and_nothing_primes_while_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 35: the first sleep was paid in the background once the engine was idle, and a
    # request that arrived just then waited for it. It is part of the load now, always.
    from vllmstack.router import engines

    monkeypatch.setattr(engines, "IDLE_POLL_S", 0.02)
    card = FakeCard(40 * GIB)

    async def go() -> None:
        manager, _ = sleeping_pool(card, A, B)
        idle = asyncio.create_task(manager.idle_loop())
        await manager.acquire(A, 5)  # granted once the load, its first sleep included, is done
        assert card.calls == [("load", "a"), ("sleep", "a"), ("wake", "a")]
        assert manager.members["a"].primed and manager.members["a"].ready
        manager.release(A)
        await until(lambda: manager.members["a"].last_used + 0.2 < time.monotonic(),
                    what="a idle for 0.2 s")
        assert card.calls == [("load", "a"), ("sleep", "a"), ("wake", "a")]  # no idle prime
        assert [s.reason for s in manager.swaps] == ["request"]
        idle.cancel()

    run(go)


# --- sleeps that free the KV cache only (ROUTER_SLEEP_FREES=kv) --------------------------------


def test_auto_lets_each_engine_keep_its_weights_where_it_can_and_what_is_set_wins() -> None:
    small = need("small", 0.5, host_gib=1.2)
    assert keeps_weights(small, CARD, "nvidia")[0]
    # Only on CUDA, with a card reading and the weight size known.
    assert keeps_weights(small, CARD, "amd") == (
        False, "weights stay on the card on CUDA only (GPU_VENDOR=amd)")
    assert not keeps_weights(small, None, "nvidia")[0]
    assert keeps_weights(need("x", 0.5, host_gib=0), CARD, "nvidia") == (
        False, "the weight size of x is unknown")
    assert sleep_tiers(False, "auto", True) == (Tier.KV, Tier.HOST)
    assert sleep_tiers(False, "auto", False) == (Tier.HOST,)
    assert sleep_tiers(False, "kv", False) == (Tier.KV,)
    assert sleep_tiers(False, "all", True) == (Tier.HOST,)
    assert sleep_tiers(True, "auto", True) == ()  # a restart engine is stopped


def test_a_kv_sleep_is_judged_against_what_it_should_free_and_holds_no_host_ram() -> None:
    kv = replace(need("big", 0.6, host_gib=15.3), frees=KV, residue=int(16.8 * GIB))
    the_plan = plan(kv)
    budget = the_plan.budget("big")
    # Freed 24 GiB - 15.3 GiB weights - 1.5 GiB: released, as it should be.
    verdict = judge_sleep(the_plan, "big", None, budget, int(16.8 * GIB))
    assert verdict.released and verdict.residue == int(16.8 * GIB)
    # A sleep that freed only half of the KV cache is not.
    assert not judge_sleep(the_plan, "big", None, budget, budget - int(3 * GIB)).released
    assert kv.backup == 0 and need("big", 0.6, host_gib=15.3).backup == int(15.3 * GIB)
    # A residue measured by a sleep that freed the weights too is not this sleep's.
    assert not apply_store(kv, {"residue_bytes": GIB}).measured
    assert apply_store(kv, {"residue_bytes": 17 * GIB, "frees": "kv"}).residue == 17 * GIB


def test_the_pool_starts_kv_engines_so_and_two_weights_stay_beside_one_budget() -> None:
    """Two 0.6-budget engines on a 40 GiB card: each sleep keeps its 6 GiB of weights, so the
    card holds one budget and one sleeper's weights, never more; every start asks for kv."""
    card = FakeCard(40 * GIB, weights=6 * GIB)

    async def go() -> None:
        remembered: list[dict[str, object]] = []
        needs = [replace(Need(e.id, e.profile, SLEEP, "test", 0.6, 1, 6 * GIB), frees=KV,
                         residue=6 * GIB + DEFAULT_RESIDUE) for e in (A, B)]
        manager = EngineManager(catalog(A, B), card, plan=Plan({n.id: n for n in needs},
                                                               card.total, 0, 0),
                                limits=Limits(swap_wait=0, swap_grace=0),
                                remember=lambda profile, fields: remembered.append(
                                    {"profile": profile, **fields}))
        for model in (A, B, A, B):
            await manager.acquire(model, 5)
            manager.release(model)
        assert card.frees == {"a": KV, "b": KV}
        assert [c for c in card.calls if c[0] in ("sleep", "wake")] == [
            ("sleep", "a"), ("wake", "a"), ("sleep", "a"), ("sleep", "b"), ("wake", "b"),
            ("sleep", "b"), ("wake", "a"), ("sleep", "a"), ("wake", "b")]
        assert card.peak <= 24 * GIB + 7 * GIB  # one budget, one sleeper's weights and residue
        assert {"profile": "a", "tiers": {"kv-released": {"residue_bytes": 7 * GIB}},
                "util": None} in remembered
        assert all(m.mode == SLEEP for m in manager.members.values())  # no fallback
        await manager.shutdown()

    run(go)

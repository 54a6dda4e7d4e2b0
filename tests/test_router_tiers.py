"""Sleep tiers per engine (issue 37): awake, kv-released (weights on the card), asleep at level 1
(weights in host RAM), stopped. The plan moves the others one tier deeper, cheapest loss first,
before it stops anything; GET /v1/router/plan says what a request would do, and the request then
does exactly that: six profiles on a fake card where not all fit as kv-released, every tier
transition, in a seeded random order."""

from __future__ import annotations

import json
import random
import threading
from dataclasses import replace
from pathlib import Path

import requests
from test_router_engines import catalog, entry, run
from test_router_server import FakeEngine, router

from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import EngineManager
from vllmstack.router.history import apply_store, read_store, write_store
from vllmstack.router.limits import Limits
from vllmstack.router.plan import DEFAULT_RESIDUE, GIB, KV, SLEEP, Need, Plan, View
from vllmstack.router.states import Adopted, Loaded, Slept
from vllmstack.router.tiers import DEFAULT_WAKE_S, Move, Tier, deeper
from vllmstack.runtime.gpu import GpuMemory

CARD = 116 * GIB
# name: (gpu_memory_utilization, weights GiB, sleep tiers). On 116 GiB the 27B's budget (69.6
# GiB) does not fit beside the five others kv-released or asleep (46.6 GiB): one must go deeper.
SIX = {"q06": (0.08, 1.2, (Tier.KV, Tier.HOST)), "q17": (0.10, 3.4, (Tier.KV, Tier.HOST)),
       "q4": (0.15, 8.0, (Tier.HOST,)),  # its weight size unknown to `auto`: level 1 only
       "q8a": (0.25, 16.0, (Tier.KV, Tier.HOST)), "q8b": (0.25, 16.0, (Tier.KV, Tier.HOST)),
       "q27": (0.60, 54.0, (Tier.KV, Tier.HOST))}
WAKE_S = {Tier.KV: 0.36, Tier.HOST: 0.70}  # what the fake card's wakes report


def six_needs() -> dict[str, Need]:
    needs = {}
    for name, (util, weights, tiers) in SIX.items():
        need = Need(name, name, SLEEP, "test", util, 1, int(weights * GIB), tiers=tiers)
        if Tier.KV in tiers:  # started with the plugin: asleep it keeps its weights, at first
            need = replace(need, frees=KV, residue=need.kept_asleep)
        needs[name] = need
    return needs


class TierCard:
    """A lifecycle over one fake card that does what vLLM and the plugin do: a start takes its
    budget (refused, as vLLM refuses, when less is free), a kv sleep keeps the weights (only on
    an engine started with the plugin), a level-1 sleep keeps 2 GiB, a wake takes the budget
    back (refused when it does not fit)."""

    def __init__(self, total: int, weights: dict[str, int]) -> None:
        self.total, self.weights = total, weights
        self.held: dict[str, int] = {}
        self.budget: dict[str, int] = {}
        self.started_with: dict[str, str] = {}
        self.asleep_in: dict[str, str] = {}
        self.calls: list[tuple[str, ...]] = []
        self.peak = 0
        self.lock = threading.Lock()

    def _hold(self, name: str, amount: int) -> None:
        self.held[name] = amount
        self.peak = max(self.peak, sum(self.held.values()))
        assert sum(self.held.values()) <= self.total

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = "all") -> Loaded:
        with self.lock:
            self.calls.append(("load", entry.id))
            want = int(self.total * (util or SIX[entry.id][0]))
            if self.total - sum(self.held.values()) < want:
                raise StackError(f"Free memory on device is less than desired ({want})")
            self.budget[entry.id], self.started_with[entry.id] = want, frees
            self._hold(entry.id, want)
        return Loaded(f"http://127.0.0.1:1/{entry.id}")

    def unload(self, entry: Entry) -> None:
        with self.lock:
            self.calls.append(("unload", entry.id))
            self.held.pop(entry.id, None)
            self.asleep_in.pop(entry.id, None)

    def abort(self, entry: Entry) -> None:
        pass

    def kill(self, entry: Entry) -> None:
        pass

    def adoptable(self, catalog: Catalog) -> list[Adopted]:
        return []

    def sleep(self, entry: Entry, frees: str = "all") -> Slept:
        with self.lock:
            self.calls.append(("sleep", entry.id, frees))
            if frees == KV and self.started_with[entry.id] != KV:
                raise StackError("started without the plugin: its sleep frees the weights too")
            before = sum(self.held.values())
            kept = self.weights[entry.id] if frees == KV else 0
            self._hold(entry.id, DEFAULT_RESIDUE + kept)
            self.asleep_in[entry.id] = frees
            return Slept(0.01, before, sum(self.held.values()))

    def wake(self, entry: Entry) -> float:
        with self.lock:
            self.calls.append(("wake", entry.id))
            want = self.budget[entry.id] - self.held[entry.id]
            if self.total - sum(self.held.values()) < want:
                raise StackError("out of memory on wake")
            self._hold(entry.id, self.budget[entry.id])
            frees = self.asleep_in.pop(entry.id)
        return WAKE_S[Tier.KV if frees == KV else Tier.HOST]

    def memory(self) -> list[GpuMemory] | None:
        with self.lock:
            return [GpuMemory(0, self.total, sum(self.held.values()))]


def six_pool(host_limit_gib: float = 40) -> tuple[EngineManager, TierCard, dict[str, Entry]]:
    entries = {name: entry(name) for name in SIX}
    card = TierCard(CARD, {n: int(w * GIB) for n, (_, w, _) in SIX.items()})
    manager = EngineManager(catalog(*entries.values()), card,
                            plan=Plan(six_needs(), CARD, 0, int(host_limit_gib * GIB)),
                            limits=Limits(swap_wait=0, swap_grace=0))
    return manager, card, entries


# --- the plan alone -----------------------------------------------------------------------------


def test_the_27b_deepens_one_kv_released_engine_instead_of_stopping_anything() -> None:
    plan = Plan(six_needs(), CARD, 0, 0)
    # The five small ones kv-released, used in this order (q06 least recently).
    views = [View(n, False, SIX[n][0], float(i), tier=Tier.KV if Tier.KV in SIX[n][2]
                  else Tier.HOST) for i, n in enumerate(("q06", "q17", "q4", "q8a", "q8b"))]
    arrangement = plan.arrange("q27", views, now=10.0)
    assert arrangement.fits and arrangement.stop == () and arrangement.sleep == ()
    # 0.7 GiB too much: every kv-released one to level 1 costs the same (0.6 s, until
    # measured), so the least recently used goes, and its 1.2 GiB of weights are enough.
    assert arrangement.moves == (Move("q06", Tier.KV, Tier.HOST),)
    assert arrangement.deepen == ("q06",)
    # Its expected seconds: a start of the 27B (60 s until measured) and the 0.6B's wake.
    assert arrangement.expected_s == 60.0 + DEFAULT_WAKE_S[Tier.KV]


def test_awake_engines_go_one_tier_down_before_any_sleeper_is_stopped() -> None:
    plan = Plan(six_needs(), CARD, 0, 0)
    views = [View(n, True, SIX[n][0], float(i)) for i, n in enumerate(("q8a", "q8b", "q17"))]
    arrangement = plan.arrange("q27", views, now=10.0)
    # 29 + 29 + 11.6 GiB awake and the 27B's 69.6 do not fit: each awake one is kv-released
    # (the cheapest loss, 0.4 s), least recently used first, until the 27B fits.
    assert arrangement.moves == (Move("q8a", Tier.AWAKE, Tier.KV), Move("q8b", Tier.AWAKE, Tier.KV),
                                 Move("q17", Tier.AWAKE, Tier.KV))
    assert arrangement.sleep == ("q8a", "q8b", "q17") and not arrangement.stop
    # Measured history decides: q8a's kv wake measured at 3 s makes it the dearest loss: q8b
    # goes to level 1 (0.6 s more) and q8a stays awake.
    plan.needs["q8a"] = replace(plan.needs["q8a"], wakes={"kv-released": (3.0, 3.2)})
    cheaper = plan.arrange("q27", views, now=10.0)
    assert cheaper.moves == (Move("q8b", Tier.AWAKE, Tier.HOST), Move("q17", Tier.AWAKE, Tier.KV))
    assert deeper((Tier.KV,), Tier.KV) == Tier.STOPPED  # ROUTER_SLEEP_FREES=kv: deeper is a stop


def test_a_deepening_needs_room_for_its_wake_or_the_engine_is_stopped() -> None:
    # x kv-released holds its 20 GiB of weights and 2 GiB; its wake for a level-1 sleep would
    # take its whole 0.99 of the card back, which never fits: it is stopped for y instead.
    card = 40 * GIB
    x = Need("x", "x", SLEEP, "test", 0.99, 1, 20 * GIB, frees=KV, residue=22 * GIB,
             tiers=(Tier.KV, Tier.HOST))
    y = Need("y", "y", SLEEP, "test", 0.5, 1, 16 * GIB)  # no lower share fits its weights
    arrangement = Plan({"x": x, "y": y}, card, 0, 0).arrange(
        "y", [View("x", False, 0.99, 1.0, tier=Tier.KV)], now=2.0)
    assert arrangement.moves == (Move("x", Tier.KV, Tier.STOPPED),) and arrangement.fits
    # With room for the wake (0.5 of the card), it goes to level 1 and is not stopped.
    roomy = Plan({"x": replace(x, util=0.5), "y": replace(y, util=0.5)}, card, 0, 0).arrange(
        "y", [View("x", False, 0.5, 1.0, tier=Tier.KV)], now=2.0)
    assert roomy.moves == (Move("x", Tier.KV, Tier.HOST),)


# --- the pool over the fake card, and the plan it answers ---------------------------------------


def observed(manager: EngineManager) -> dict[str, Tier]:
    return {m.id: manager.tier(m) for m in manager.members.values()}


def test_every_tier_transition_does_what_the_plan_said_over_a_seeded_random_run() -> None:
    """Six profiles, 60 requests in a seeded random order (after one pass that loads each):
    before every request the plan's answer, after it the tiers the engines really went to."""
    manager, card, entries = six_pool()
    seen: set[tuple[Tier, Tier]] = set()

    async def go() -> None:
        order = list(SIX) + random.Random(37).choices(list(SIX), k=60)
        for name in order:
            asked = manager.preview(entries[name])
            before = observed(manager)
            await manager.acquire(entries[name], 5)
            manager.release(entries[name])
            after = observed(manager)
            moved = {(i, before[i], after[i]) for i in SIX if i != name and before[i] != after[i]}
            said = {(m["member"], Tier(m["from"]), Tier(m["to"])) for m in asked["moves"]}
            assert moved == said, (name, asked)
            assert asked["action"] == {Tier.AWAKE: "none", Tier.STOPPED: "load"}.get(
                before[name], "wake")
            assert asked["tier"] == before[name] and after[name] == Tier.AWAKE
            assert asked["blocked"] is None
            seen.update((frm, to) for _, frm, to in moved)
            seen.add((before[name], Tier.AWAKE))
        await manager.shutdown()

    run(go)
    assert card.peak <= CARD
    assert {(Tier.AWAKE, Tier.KV), (Tier.AWAKE, Tier.HOST), (Tier.KV, Tier.HOST),
            (Tier.KV, Tier.AWAKE), (Tier.HOST, Tier.AWAKE), (Tier.STOPPED, Tier.AWAKE)} <= seen
    assert any(to == Tier.STOPPED for _, to in seen)
    # Each sleep freed what its tier frees: kv on the engines started with the plugin only.
    assert all(c[2] == "all" for c in card.calls if c[0] == "sleep" and c[1] == "q4")
    assert {c[2] for c in card.calls if c[0] == "sleep" and c[1] == "q8a"} == {"kv", "all"}


def test_the_measured_wakes_become_the_expected_swap_seconds() -> None:
    manager, _, entries = six_pool()

    async def go() -> None:
        for name in ("q8a", "q8b", "q27", "q8a"):
            await manager.acquire(entries[name], 5)
            manager.release(entries[name])
        # q8b went down a tier for the 27B: its expected swap back is what its tier measured.
        member = manager.members["q8b"]
        tier = manager.tier(member)
        assert tier in (Tier.KV, Tier.HOST)
        assert manager.preview(entries["q8b"])["expected_s"] == manager.expected_s(member) == (
            WAKE_S[tier] if manager.plan.needs["q8b"].wakes.get(tier) else DEFAULT_WAKE_S[tier])
        need = manager.plan.needs["q8a"]
        # Its first sleep, paid at its load, was at level 1 (that one pins the host buffers):
        # its wake from there is measured, as is its load (from stopped).
        assert need.wakes["asleep"][0] == WAKE_S[Tier.HOST] and need.wakes["stopped"]
        snapshot = manager.snapshot()["engines"]
        assert snapshot["q8a"]["tier"] == "awake" and snapshot["q8a"]["swap_s"] == 0.0
        assert snapshot["q8b"]["tier"] == tier and snapshot["q06"]["tier"] == "stopped"
        assert snapshot["q8b"]["sleep_tiers"] == ["kv-released", "asleep"]
        await manager.shutdown()

    run(go)


def test_a_model_that_does_not_fit_even_with_everyone_stopped_is_blocked_in_the_answer() -> None:
    entries = {"huge": entry("huge")}
    needs = {"huge": Need("huge", "huge", SLEEP, "test", 1.0, 1, 200 * GIB)}
    card = TierCard(CARD, {"huge": 200 * GIB})
    manager = EngineManager(catalog(*entries.values()), card, plan=Plan(needs, CARD, 0, 0))
    answer = manager.preview(entries["huge"])
    assert answer["action"] == "load" and answer["tier"] == "stopped"
    assert answer["blocked"] is not None and "huge needs 116.0 GiB of a 116.0 GiB card" in \
        answer["blocked"]
    assert card.calls == []  # read-only


# --- the store -----------------------------------------------------------------------------------


def test_the_store_keeps_figures_per_tier_and_still_reads_the_format_before(
        tmp_path: Path) -> None:
    project = Project(tmp_path)
    need = six_needs()["q8a"]
    # The format before issue 37: one residue, and what that sleep freed.
    old = apply_store(need, {"residue_bytes": 17 * GIB, "frees": "kv", "util": 0.25})
    assert old.residue == 17 * GIB and old.measured
    level1 = apply_store(need, {"residue_bytes": GIB, "frees": "all"})
    assert level1.host_residue == GIB and level1.host_measured and not level1.measured
    write_store(project, "q8a", tiers={"kv-released": {"residue_bytes": 18 * GIB}})
    write_store(project, "q8a", tiers={"kv-released": {"wake_s": [0.36, 0.4]}})
    write_store(project, "q8a", tiers={"asleep": {"wake_s": [0.7]}}, util=0.25)
    stored = read_store(project)["q8a"]
    assert stored["tiers"] == {"kv-released": {"residue_bytes": 18 * GIB, "wake_s": [0.36, 0.4]},
                               "asleep": {"wake_s": [0.7]}}
    now = apply_store(need, stored)
    assert now.residue == 18 * GIB and now.wake_s(Tier.KV) == 0.38
    assert now.wake_s(Tier.HOST) == 0.7 and now.wake_s(Tier.STOPPED, 95.0) == 95.0
    # A damaged tier is ignored, not an error: it is rewritten at the next measurement.
    damaged = apply_store(need, {"tiers": {"asleep": {"wake_s": ["x", -1, True]}, "bogus": 3}})
    assert damaged.wakes == {} and not damaged.measured
    assert json.loads((tmp_path / "generated" / "router" / "memory.json").read_text())


# --- the endpoint ----------------------------------------------------------------------------------


def test_the_plan_endpoint_answers_what_the_request_then_does_and_changes_nothing() -> None:
    engine = FakeEngine()
    with router(engine.url) as url:
        answer = requests.get(f"{url}/v1/router/plan", params={"model": "served"}, timeout=10)
        assert answer.status_code == 200
        said = answer.json()
        assert (said["model"], said["tier"], said["action"]) == ("served", "stopped", "load")
        assert said["moves"] == [] and said["blocked"] is None
        health = requests.get(f"{url}/v1/health", timeout=10).json()
        assert health["engines"]["served"]["state"] == "unloaded"  # nothing was loaded
        reply = requests.post(f"{url}/v1/chat/completions", timeout=10, json={
            "model": "served", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200
        again = requests.get(f"{url}/v1/router/plan?model=served", timeout=10).json()
        assert (again["tier"], again["action"], again["expected_s"]) == ("awake", "none", 0.0)
        # Asking for the other one: the awake engine is stopped (an exclusive plan), as said.
        other = requests.get(f"{url}/v1/router/plan?model=bad", timeout=10).json()
        assert other["moves"] == [{"member": "served", "from": "awake", "to": "stopped"}]
        assert other["stops"] == ["served"]
        missing = requests.get(f"{url}/v1/router/plan?model=nope", timeout=10)
        assert missing.status_code == 404
        assert "The model `nope` does not exist" in missing.json()["error"]["message"]
        assert requests.get(f"{url}/v1/router/plan", timeout=10).status_code == 400
        assert requests.post(f"{url}/v1/router/plan", timeout=10).status_code == 405


def test_the_plan_endpoint_needs_the_routers_token() -> None:
    engine = FakeEngine()
    with router(engine.url, token="t0ken") as url:
        plan = f"{url}/v1/router/plan?model=served"
        assert requests.get(plan, timeout=10).status_code == 401
        assert requests.get(plan, headers={"Authorization": "Bearer wrong"},
                            timeout=10).status_code == 401
        assert requests.get(plan, headers={"Authorization": "Bearer t0ken"},
                            timeout=10).status_code == 200


def test_a_tier_that_would_free_nothing_is_skipped_for_the_next_one_down() -> None:
    # 3 GiB of weights and 2 GiB kept kv-released hold more than its 4.8 GiB budget awake:
    # giving way, it goes straight to level 1 (found over the simulators: it was left awake).
    card = 16 * GIB
    needs = {n: replace(Need(n, n, SLEEP, "test", 0.3, 1, 3 * GIB, tiers=(Tier.KV, Tier.HOST)),
                        frees=KV, residue=5 * GIB) for n in "abcd"}
    views = [View(n, True, 0.3, float(i)) for i, n in enumerate("abc")]
    arrangement = Plan(needs, card, 0, 0).arrange("d", views, now=5.0)
    assert arrangement.fits and arrangement.moves == (Move("a", Tier.AWAKE, Tier.HOST),
                                                      Move("b", Tier.AWAKE, Tier.HOST))


def test_an_adopted_sleeping_engine_keeps_the_tier_its_last_sleep_went_to() -> None:
    """A router started beside engines a router before it left asleep: the file the router
    writes before each sleep says whether that one kept its weights (kv) or backed them up."""

    class Left(TierCard):
        def adoptable(self, catalog: Catalog) -> list[Adopted]:
            return [Adopted(catalog.entries["q8a"], "http://127.0.0.1:1/q8a", True, 0.25, True,
                            "all"),
                    Adopted(catalog.entries["q8b"], "http://127.0.0.1:1/q8b", True, 0.25, True,
                            "kv"),
                    Adopted(catalog.entries["q4"], "http://127.0.0.1:1/q4", True, 0.15, True)]

    entries = {name: entry(name) for name in SIX}
    manager = EngineManager(catalog(*entries.values()), Left(CARD, {}),
                            plan=Plan(six_needs(), CARD, 0, 0))

    async def go() -> None:
        await manager.adopt()
        tiers = {m: manager.tier(manager.members[m]) for m in ("q8a", "q8b", "q4", "q06")}
        # q4 without a file: its profile's first sleep tier (level 1: it may sleep only there).
        assert tiers == {"q8a": Tier.HOST, "q8b": Tier.KV, "q4": Tier.HOST, "q06": Tier.STOPPED}

    run(go)

"""The engine pool's member states (issue 34): a StrEnum written as the plain strings it replaced,
and the transition table every state change is checked against. The table itself is pinned
(every allowed pair is taken, every other pair raises), and the pool's real flows (the router
harness, the sleep, fault and stop flows of the other router tests, and the races found
reading the code) take only transitions in it."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from itertools import product
from pathlib import Path

import pytest
import requests
import test_router_engines as engine_flows
import test_router_faults as fault_flows
import test_router_plan as plan_flows
from helpers import until
from router_harness import running_router
from test_router_engines import FakeLifecycle, catalog, entry, run
from test_router_plan import FakeCard, sleeping_pool

from vllmstack.core.errors import StackError
from vllmstack.router import member as member_module
from vllmstack.router.catalog import Entry
from vllmstack.router.engines import EngineManager, LoadFailedError
from vllmstack.router.limits import Limits
from vllmstack.router.member import Member
from vllmstack.router.plan import GIB
from vllmstack.router.states import (
    ASLEEP,
    FAILED,
    LOADING,
    READY,
    SLEEPING,
    TRANSITIONS,
    UNLOADED,
    UNLOADING,
    WAKING,
    IllegalTransitionError,
    MemberState,
    ModelStatus,
)

ROUTER = Path(member_module.__file__).parent
ALLOWED = sorted((old, new) for old, news in TRANSITIONS.items() for new in news)
ILLEGAL = sorted(pair for pair in product(MemberState, repeat=2) if pair not in ALLOWED)
Taken = list[tuple[str, MemberState, MemberState]]


def pool_in(state: MemberState) -> tuple[EngineManager, Member, list[str]]:
    """A pool whose one member is in `state` (set up as a fresh status: nothing transitions)."""
    shown: list[str] = []
    manager = EngineManager(catalog(entry("a")), FakeLifecycle(),
                            on_change=lambda: shown.append("changed"))
    member = manager.members["a"]
    member.status = ModelStatus(state, None, 0.0)
    return manager, member, shown


# --- the vocabulary -----------------------------------------------------------------------------


def test_states_are_written_byte_for_byte_as_the_strings_they_replaced() -> None:
    assert [s.value for s in MemberState] == ["unloaded", "loading", "ready", "failed",
                                              "unloading", "sleeping", "asleep", "waking"]
    for state in MemberState:
        assert json.dumps(state) == f'"{state.value}"' and f"{state}" == str(state) == state.value
        assert MemberState(state.value) is state and state == state.value
    manager, _, _ = pool_in(ASLEEP)
    # /v1/health, router.json and the dashboard's router card read this JSON.
    assert json.dumps(manager.snapshot()["models"]) == '{"a": {"state": "asleep", "error": null}}'
    assert json.dumps(manager.snapshot()["engines"]["a"]["state"]) == '"asleep"'


# --- the table, pinned ------------------------------------------------------------------------


@pytest.mark.parametrize(("old", "new"), ALLOWED, ids=[f"{o}->{n}" for o, n in ALLOWED])
def test_every_allowed_transition_is_taken_and_shown(old: MemberState, new: MemberState) -> None:
    manager, member, shown = pool_in(old)
    error = StackError("it broke", "mend it") if new is FAILED else None
    manager.set_state(member, new, error)
    assert member.state is new and shown == ["changed"] and member.status.since > 0.0
    assert member.status.error == (None if error is None else {"cause": "it broke", "fix": "mend it"})


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=[f"{o}->{n}" for o, n in ILLEGAL])
def test_every_other_transition_raises_and_changes_nothing(old: MemberState,
                                                           new: MemberState) -> None:
    manager, member, shown = pool_in(old)
    with pytest.raises(IllegalTransitionError, match=f"a: {old} -> {new} is not a transition"):
        manager.set_state(member, new)
    assert member.state is old and shown == [] and member.status.since == 0.0


def test_the_transitions_known_to_be_illegal_and_the_surprising_legal_ones() -> None:
    def legal(old: MemberState, new: MemberState) -> bool:
        return new in TRANSITIONS[old]

    assert not legal(ASLEEP, READY)  # a sleeping engine is woken (WAKING) before it serves
    assert not legal(LOADING, ASLEEP)  # a load's first sleep goes through SLEEPING
    assert not legal(READY, LOADING) and not legal(READY, UNLOADED)  # a stop is UNLOADING first
    assert not legal(UNLOADING, READY) and not legal(SLEEPING, WAKING)
    assert not legal(FAILED, SLEEPING)  # a failed engine is stopped, never put to sleep
    assert not legal(FAILED, UNLOADED) and not legal(ASLEEP, UNLOADED)
    # UNLOADED -> READY without LOADING is legal: adoption of an engine that already runs.
    assert legal(UNLOADED, READY) and legal(UNLOADED, ASLEEP)
    # A switch that fails marks its target failed whatever step it reached: from any state.
    assert all(legal(state, FAILED) for state in MemberState)


def test_the_table_has_every_state_and_no_dead_end() -> None:
    assert set(TRANSITIONS) == set(MemberState)

    def reach(start: MemberState, step: dict[MemberState, set[MemberState]]) -> set[MemberState]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in step.get(todo.pop(), set()) - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    forward = {old: set(news) for old, news in TRANSITIONS.items()}
    backward: dict[MemberState, set[MemberState]] = {}
    for old, new in ALLOWED:
        backward.setdefault(new, set()).add(old)
    assert reach(UNLOADED, forward) == set(MemberState)  # every state can happen
    assert reach(UNLOADED, backward) == set(MemberState)  # and every one leads back to unloaded
    assert {o for o, n in ALLOWED if o is n} == {UNLOADING, FAILED}


def test_every_state_change_goes_through_member_set() -> None:
    # No module of the router assigns a state but Member.set, and only Pool.set_state calls it.
    assigns = re.compile(r"\.state\b[^=!<>\n]*=(?!=)|status\s*=\s*ModelStatus\(")
    for path in sorted(ROUTER.glob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if assigns.search(line.split("#")[0]):
                assert (path.name, line.strip()) == (
                    "member.py", "self.status.state, self.status.since = state, time.time()"), (
                    f"{path.name}:{number} changes a state without Pool.set_state: {line.strip()}")
            if re.search(r"\bmember\.set\(", line):
                assert path.name == "pool.py", f"{path.name}:{number}: {line.strip()}"


# --- the pool's real flows take only legal transitions -----------------------------------------


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> Iterator[Taken]:
    """Every state change the pool asks for, legal or not (an illegal one raises inside a switch,
    which reports it as its failure: only this record shows it for what it is)."""
    seen: Taken = []
    original = Member.set

    def recording(self: Member, state: MemberState, error: StackError | None = None) -> None:
        seen.append((self.id, self.state, state))
        original(self, state, error)

    monkeypatch.setattr(Member, "set", recording)
    yield seen
    illegal = [step for step in seen if step[2] not in TRANSITIONS[step[1]]]
    assert not illegal, f"illegal transitions taken: {illegal}"


def edges(seen: Taken, name: str) -> set[tuple[MemberState, MemberState]]:
    return {(old, new) for who, old, new in seen if who == name}


def test_the_router_harness_takes_legal_transitions(taken: Taken) -> None:
    with running_router(Limits()) as router:
        for _ in range(2):
            answer = requests.post(router.url + "/v1/chat/completions", timeout=10,
                                   json={"model": "m", "messages": []})
            assert answer.status_code == 200, answer.text
            unloaded = requests.post(router.url + "/v1/unload", json={}, timeout=10)
            assert unloaded.json()["engines"] == ["m"]
        assert requests.post(router.url + "/v1/load", json={"model": "m"},
                             timeout=10).status_code == 200
    assert [(old, new) for _, old, new in taken] == [
        (UNLOADED, LOADING), (LOADING, READY), (READY, UNLOADING), (UNLOADING, UNLOADED)] * 2 + [
        (UNLOADED, LOADING), (LOADING, READY)]


def test_the_sleep_flows_take_legal_transitions(taken: Taken, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    plan_flows.test_swaps_sleep_and_wake_and_the_card_never_holds_more_than_it_has()
    plan_flows.test_a_sleep_that_keeps_its_memory_falls_back_to_restart()
    plan_flows.test_a_sleep_that_fails_keeps_the_engine_and_restarts_it_only_until_it_stops()
    plan_flows.test_the_host_ram_limit_stops_a_sleeper_instead_of_keeping_it()
    plan_flows.test_an_idle_sleeping_engine_is_stopped_after_its_ttl(monkeypatch)
    seen = {(old, new) for _, old, new in taken}
    assert {(LOADING, SLEEPING), (SLEEPING, ASLEEP), (ASLEEP, WAKING), (WAKING, READY),
            (READY, SLEEPING), (SLEEPING, READY), (ASLEEP, UNLOADING)} <= seen


def test_the_fault_and_stop_flows_take_legal_transitions(taken: Taken) -> None:
    fault_flows.test_a_hung_load_whose_client_left_is_cut_short_and_the_awake_model_keeps_serving()
    fault_flows.test_an_engine_that_dies_in_its_first_sleep_fails_its_load_instead_of_serving()
    fault_flows.test_a_broken_profile_is_booted_once_and_retries_get_its_error_at_once()
    engine_flows.test_a_failed_load_gives_every_waiter_the_diagnosis_and_the_next_request_retries()
    engine_flows.test_an_engine_gone_after_ready_is_unloaded_and_loaded_again()
    engine_flows.test_stop_cuts_a_load_short_then_unloads()
    engine_flows.test_an_adopted_engine_serves_without_a_load()
    seen = {(old, new) for _, old, new in taken}
    assert {(LOADING, UNLOADED), (SLEEPING, FAILED), (LOADING, FAILED), (FAILED, LOADING),
            (READY, FAILED), (UNLOADED, READY)} <= seen


def test_a_wake_that_fails_stops_the_engine_and_starts_it_anew(taken: Taken) -> None:
    class FailingWake(FakeCard):
        wakes = 0

        def wake(self, entry: Entry) -> float:
            self.wakes += 1
            if self.wakes == 3:  # a's and b's first sleeps woke; a's wake for its swap fails
                raise StackError("the engine of a did not wake up")
            return super().wake(entry)

    card = FailingWake(40 * GIB)
    a, b = entry("a"), entry("b")

    async def go() -> None:
        manager, _ = sleeping_pool(card, a, b)
        for model in (a, b, a):
            await manager.acquire(model, 5)
            manager.release(model)
        assert manager.members["a"].ready and manager.members["b"].asleep
        await manager.shutdown()

    run(go)
    assert {(ASLEEP, WAKING), (WAKING, UNLOADING), (UNLOADING, UNLOADED),
            (UNLOADED, LOADING)} <= edges(taken, "a")


def test_an_engine_gone_while_it_drains_for_a_sleep_is_stopped_not_put_to_sleep(
        taken: Taken) -> None:
    # Found reading the code for the table: put_away decided to sleep a ready engine before
    # its drain, and a forward that failed meanwhile marked it failed; failed -> sleeping is no
    # transition, and the sleep went to an engine that was gone.
    card = FakeCard(40 * GIB)
    a, b = entry("a"), entry("b")

    async def go() -> None:
        manager, _ = sleeping_pool(card, a, b)
        await manager.acquire(a, 5)  # one request on a, in flight
        switch = asyncio.create_task(manager.acquire(b, 5))
        await until(lambda: manager.victims == frozenset({"a"}),
                                 what="the switch to b draining a")
        manager.engine_gone(a, "its /health did not answer")
        manager.release(a)
        await switch
        manager.release(b)
        assert manager.members["b"].ready and manager.members["a"].state is UNLOADED
        assert card.calls.count(("sleep", "a")) == 1  # its first sleep, at its load; no other
        await manager.shutdown()

    run(go)
    assert {(READY, FAILED), (FAILED, UNLOADING)} <= edges(taken, "a")
    assert (FAILED, SLEEPING) not in edges(taken, "a")


def test_an_illegal_transition_in_a_switch_fails_its_target_as_the_routers_bug(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # What a wrong transition does in production: the switch reports it, nothing hangs.
    from vllmstack.router import states

    monkeypatch.setitem(states.TRANSITIONS, UNLOADED, frozenset({READY, FAILED}))  # no LOADING

    only = entry("a")

    async def go() -> None:
        manager = EngineManager(catalog(only), FakeLifecycle())
        with pytest.raises(LoadFailedError, match="IllegalTransitionError"):
            await manager.acquire(only, 5)
        assert manager.members["a"].state is FAILED
        error = manager.members["a"].status.error or {}
        assert "unloaded -> loading" in error["cause"] and "bug of the router" in error["fix"]

    run(go)


"""The router's scheduling: one resident engine, loads on demand, swaps after in-flight requests,
failures with their diagnosis, timeouts that never cancel a load, idle TTL, stop and adoption.
A fake lifecycle stands in for `up`/`down` and fails the test if two engines ever run at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from helpers import until

from vllmstack.config.profiles import Resolved, Setting
from vllmstack.core.errors import StackError
from vllmstack.router import engines
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import EngineManager, Loaded, LoadFailedError, RouterBusyError
from vllmstack.router.limits import Limits
from vllmstack.router.states import Adopted, Slept
from vllmstack.runtime.gpu import GpuMemory


def entry(name: str, ttl: float = 0.0) -> Entry:
    resolved = Resolved("cpu", name, {"VLLM_PORT": Setting("VLLM_PORT", "8180", "test")}, [])
    return Entry(name, name, "vllm", resolved, ttl)


def catalog(*entries: Entry) -> Catalog:
    return Catalog("cpu", {e.id: e for e in entries}, {})


class FakeLifecycle:
    def __init__(self, load_s: float = 0.05, unload_s: float = 0.02, fail: tuple[str, ...] = ()
                 ) -> None:
        self.load_s, self.unload_s, self.fail = load_s, unload_s, fail
        self.calls: list[tuple[str, str]] = []
        self.running: str | None = None
        self.adopt: Entry | None = None
        self.aborted = threading.Event()
        self.lock = threading.Lock()

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = "all") -> Loaded:
        with self.lock:
            self.calls.append(("load", entry.id))
            assert self.running is None, f"{entry.id} loaded while {self.running} runs"
            self.running = entry.id
        if self.aborted.wait(self.load_s) or entry.id in self.fail:
            self.running = None
            raise StackError(f"{entry.id} crashed at boot", "lower VLLM_GPU_MEM_UTIL")
        return Loaded(f"http://127.0.0.1:1/{entry.id}", self.load_s, 0.0)

    def unload(self, entry: Entry) -> None:
        self.calls.append(("unload", entry.id))
        time.sleep(self.unload_s)
        assert self.running == entry.id
        self.running = None

    def abort(self, entry: Entry) -> None:
        self.calls.append(("abort", entry.id))
        self.aborted.set()

    def adoptable(self, catalog: Catalog) -> list[Adopted]:
        if self.adopt is not None:
            self.running = self.adopt.id
            return [Adopted(self.adopt, self.adopt.url)]
        return []

    def sleep(self, entry: Entry, frees: str = "all") -> Slept:
        raise AssertionError("one engine at a time never sleeps")

    def wake(self, entry: Entry) -> float:
        raise AssertionError("one engine at a time never wakes")

    def memory(self) -> list[GpuMemory] | None:
        return None


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


A, B = entry("a"), entry("b")


def test_concurrent_requests_for_an_unloaded_model_share_one_load() -> None:
    fake = FakeLifecycle(load_s=0.2)

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake)
        urls = await asyncio.gather(*(manager.acquire(A, 5) for _ in range(5)))
        assert urls == ["http://127.0.0.1:1/a"] * 5
        assert fake.calls == [("load", "a")]
        assert (manager.inflight, manager.status["a"].state, manager.resident) == (5, "ready", A)
        for _ in range(5):
            manager.release(A)
        assert manager.inflight == 0
        snap = manager.snapshot()
        assert (snap["loaded"], snap["state"], snap["queue"]) == ("a", "ready", 0)
        assert [s["loaded"] for s in snap["swaps"]] == ["a"]

    run(go)


def test_a_swap_unloads_first_and_waits_for_the_requests_in_flight() -> None:
    fake = FakeLifecycle()

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake)
        await manager.acquire(A, 5)  # a request streaming from a
        swap = asyncio.create_task(manager.acquire(B, 5))
        await asyncio.sleep(0.2)
        assert fake.calls == [("load", "a")] and not swap.done()  # b waits for a's request
        assert manager.snapshot()["queue"] == 1
        manager.release(A)
        assert await swap == "http://127.0.0.1:1/b"  # once a's request ended (and the grace)
        assert fake.calls == [("load", "a"), ("unload", "a"), ("load", "b")]
        last = manager.swaps[-1]
        assert (last.unloaded, last.loaded, last.ok) == ("a", "b", True)
        assert last.stop_s >= 0.02 and last.start_s >= 0.05
        manager.release(B)

    run(go)


def test_with_no_swap_wait_requests_are_served_in_arrival_order() -> None:
    fake = FakeLifecycle()

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, limits=Limits(swap_wait=0))
        await manager.acquire(A, 5)
        swap = asyncio.create_task(manager.acquire(B, 5))
        await until(lambda: manager.waiting == 1, what="b's request queued")
        fast = asyncio.create_task(manager.acquire(A, 5))  # no overtaking the queued swap
        # Granted at once (a is resident) if it overtook: then it never joins the queue.
        await until(lambda: manager.waiting == 2, what="a's request queued behind b's")
        assert not fast.done() and not swap.done()
        manager.release(A)
        assert await swap == "http://127.0.0.1:1/b"
        manager.release(B)
        assert await fast == "http://127.0.0.1:1/a"  # and back, in order
        assert fake.calls == [("load", "a"), ("unload", "a"), ("load", "b"), ("unload", "b"),
                              ("load", "a")]
        manager.release(A)

    run(go)


def test_a_failed_load_gives_every_waiter_the_diagnosis_and_the_next_request_retries() -> None:
    fake = FakeLifecycle(load_s=0.1, fail=("b",))

    async def go() -> None:
        # No back-off here (tests/test_router_faults.py has it): the next request boots again.
        manager = EngineManager(catalog(A, B), fake, limits=Limits(load_backoff=0))
        results = await asyncio.gather(*(manager.acquire(B, 5) for _ in range(3)),
                                       return_exceptions=True)
        assert all(isinstance(r, LoadFailedError) for r in results)
        error = results[0]
        assert isinstance(error, LoadFailedError)
        assert (error.cause, error.fix) == ("b crashed at boot", "lower VLLM_GPU_MEM_UTIL")
        assert manager.status["b"].state == "failed"
        assert manager.status["b"].error == {"cause": "b crashed at boot",
                                             "fix": "lower VLLM_GPU_MEM_UTIL"}
        assert fake.calls == [("load", "b")] and manager.resident is None
        assert not manager.swaps[-1].ok and manager.swaps[-1].error == "b crashed at boot"
        with pytest.raises(LoadFailedError):
            await manager.acquire(B, 5)
        assert fake.calls == [("load", "b")] * 2
        assert await manager.acquire(A, 5) == "http://127.0.0.1:1/a"  # others still load

    run(go)


def test_a_request_that_gives_up_never_cancels_the_load() -> None:
    fake = FakeLifecycle(load_s=0.4)

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake)
        with pytest.raises(RouterBusyError) as caught:
            await manager.acquire(A, 0.1)
        assert "a was not ready within the load timeout" in caught.value.cause
        assert manager.status["a"].state == "loading"
        assert await manager.acquire(A, 5) == "http://127.0.0.1:1/a"
        assert fake.calls == [("load", "a")]

    run(go)


def test_idle_ttl_unloads_only_when_no_request_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "IDLE_POLL_S", 0.02)
    fake = FakeLifecycle()
    short, never = entry("short", ttl=0.2), entry("never")

    async def go() -> None:
        manager = EngineManager(catalog(short, never), fake)
        idle = asyncio.create_task(manager.idle_loop())
        await manager.acquire(short, 5)
        await asyncio.sleep(0.5)  # a long request: the TTL waits for it
        assert manager.status["short"].state == "ready"
        manager.release(short)
        await until(lambda: manager.status["short"].state == "unloaded" and not manager.switching(),
                    what="the idle unload")
        assert manager.resident is None
        assert fake.calls[-1] == ("unload", "short") and manager.swaps[-1].reason == "idle"
        await manager.acquire(never, 5)
        manager.release(never)
        await asyncio.sleep(0.4)
        assert manager.status["never"].state == "ready"  # TTL 0: never unloaded
        idle.cancel()

    run(go)


def test_an_engine_gone_after_ready_is_unloaded_and_loaded_again() -> None:
    fake = FakeLifecycle()

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake)
        await manager.acquire(A, 5)
        manager.release(A)
        manager.engine_gone(A, "connection refused")
        assert manager.status["a"].state == "failed"
        assert "stopped answering" in (manager.status["a"].error or {})["cause"]
        await manager.acquire(A, 5)
        assert fake.calls == [("load", "a"), ("unload", "a"), ("load", "a")]
        assert manager.status["a"].state == "ready"

    run(go)


def test_stop_cuts_a_load_short_then_unloads() -> None:
    fake = FakeLifecycle(load_s=10)

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake)
        waiting = asyncio.create_task(manager.acquire(A, 30))
        await until(lambda: fake.running == "a", what="a's load under way")
        await manager.shutdown()
        assert fake.calls == [("load", "a"), ("abort", "a")]
        with pytest.raises(LoadFailedError):
            await waiting
        assert manager.resident is None and fake.running is None

    run(go)


def test_stop_unloads_the_resident_model() -> None:
    fake = FakeLifecycle()

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake)
        await manager.acquire(A, 5)
        manager.release(A)
        await manager.shutdown()
        assert fake.calls == [("load", "a"), ("unload", "a")] and fake.running is None
        assert manager.status["a"].state == "unloaded"

    run(go)


def test_an_adopted_engine_serves_without_a_load() -> None:
    fake = FakeLifecycle()
    fake.adopt = B
    changes: list[Any] = []

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, on_change=lambda: changes.append(1))
        assert await manager.adopt() == [B]
        assert await manager.acquire(B, 5) == "http://127.0.0.1:8180"
        assert fake.calls == [] and manager.snapshot()["adopted"] is True and changes
        manager.release(B)
        await manager.shutdown()
        assert fake.calls == [("unload", "b")]

    run(go)


def test_a_swap_cuts_requests_that_outlast_the_drain_timeout() -> None:
    fake = FakeLifecycle()
    said: list[str] = []

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, say=said.append, drain_timeout=0.2,
                                limits=Limits(swap_wait=0))
        await manager.acquire(A, 5)  # a stream that never ends on its own
        cuts: list[str] = []

        def cut(reason: str) -> None:  # what a request's Cut does: its handler ends and releases
            cuts.append(reason)
            manager.unhold(A, cut)
            asyncio.get_running_loop().call_soon(manager.release, A)

        manager.hold(A, cut)
        started = time.monotonic()
        assert await manager.acquire(B, 5) == "http://127.0.0.1:1/b"
        assert 0.2 <= time.monotonic() - started < 2
        assert cuts == ["the router unloads a to load b"]
        assert fake.calls == [("load", "a"), ("unload", "a"), ("load", "b")]
        assert any("still running after 0.2 s (--drain-timeout): cutting them" in s for s in said)
        manager.release(B)

    run(go)


def test_drain_timeout_zero_waits_for_ever() -> None:
    fake = FakeLifecycle()

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, drain_timeout=0, limits=Limits(swap_wait=0))
        await manager.acquire(A, 5)
        manager.hold(A, lambda reason: pytest.fail("cut with drain_timeout 0"))
        swap = asyncio.create_task(manager.acquire(B, 5))
        await asyncio.sleep(0.5)
        assert not swap.done() and fake.calls == [("load", "a")]
        manager.members["a"].holders.clear()
        manager.release(A)
        assert await swap == "http://127.0.0.1:1/b"
        manager.release(B)

    run(go)

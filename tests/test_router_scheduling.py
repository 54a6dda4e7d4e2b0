"""The router's scheduling and engine health (issue 22): resident first within a bound, a dead engine
found before a request reaches it, a run of 5xx reloads it, one bad answer does not.
A fake lifecycle stands in for `up`/`down`; a fake probe for the engine's /health."""

from __future__ import annotations

import asyncio
import time

from helpers import until
from test_router_engines import FakeLifecycle, catalog, entry, run

from vllmstack.router.engines import EngineManager
from vllmstack.router.limits import Limits

A, B = entry("a"), entry("b")


class Probe:
    """The engine's /health as the manager sees it: 200 while `alive`."""

    def __init__(self) -> None:
        self.alive = True
        self.calls = 0

    async def __call__(self, url: str) -> bool:
        self.calls += 1
        return self.alive


def loads(fake: FakeLifecycle) -> int:
    return sum(1 for call, _ in fake.calls if call == "load")


def test_interleaved_requests_for_two_models_do_not_swap_at_every_request() -> None:
    # Issue 22: 40 interleaved requests for two models caused 32 loads (a strict FIFO).
    fake = FakeLifecycle(load_s=0.05)

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, limits=Limits(swap_wait=30, swap_grace=0.05))

        async def request(model: str) -> str:
            chosen = A if model == "a" else B
            url = await manager.acquire(chosen, 30)
            await asyncio.sleep(0.01)  # the engine answering
            manager.release(chosen)
            return url

        urls = await asyncio.gather(*(request("ab"[i % 2]) for i in range(40)))
        assert sorted(u.rsplit("/", 1)[1] for u in urls) == ["a"] * 20 + ["b"] * 20
        assert loads(fake) == 2, fake.calls  # a once, b once

    run(go)


def test_a_request_for_another_model_waits_at_most_the_bound() -> None:
    # Requests for the resident model keep coming; one for b is passed over for ROUTER_SWAP_WAIT,
    # then served: the resident's newer requests queue behind it.
    fake = FakeLifecycle(load_s=0.05)

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, limits=Limits(swap_wait=0.5, swap_grace=0.05))
        await manager.acquire(A, 5)
        manager.release(A)
        stop = asyncio.Event()

        async def busy_a() -> int:
            served = 0
            while not stop.is_set():
                await manager.acquire(A, 30)
                served += 1
                await asyncio.sleep(0.02)
                manager.release(A)
            return served

        clients = [asyncio.create_task(busy_a()) for _ in range(3)]
        await until(lambda: manager.members["a"].inflight > 0, what="a busy with requests")
        began = time.monotonic()
        assert await manager.acquire(B, 30) == "http://127.0.0.1:1/b"
        waited = time.monotonic() - began
        manager.release(B)
        stop.set()
        served = await asyncio.gather(*clients)
        assert 0.5 <= waited < 1.5, waited  # the bound, then the drain, the unload and the load
        assert sum(served) > 20  # a was served meanwhile, not stopped at b's arrival

    run(go)


def test_a_dead_engine_is_found_before_a_request_reaches_it() -> None:
    fake, probe = FakeLifecycle(), Probe()
    said: list[str] = []

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, limits=Limits(health_interval=0.2),
                                probe=probe, say=said.append)
        await manager.acquire(A, 5)
        manager.release(A)
        probe.alive = False  # the engine died while idle
        await asyncio.sleep(0.3)
        assert await manager.acquire(A, 5) == "http://127.0.0.1:1/a"
        # The request was granted only after the engine was loaded again.
        assert fake.calls == [("load", "a"), ("unload", "a"), ("load", "a")]
        assert any("its /health did not answer after a pause" in line for line in said), said
        manager.release(A)

    run(go)


def test_an_idle_dead_engine_is_marked_failed_without_any_request() -> None:
    fake, probe = FakeLifecycle(), Probe()

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, limits=Limits(health_interval=0.5),
                                probe=probe)
        await manager.acquire(A, 5)
        manager.release(A)
        watch = asyncio.create_task(manager.idle_loop())
        await until(lambda: probe.calls >= 1, what="the idle engine's first /health probe")
        assert manager.status["a"].state == "ready"
        probe.alive = False
        await until(lambda: manager.status["a"].state == "failed", what="the dead engine failed")
        assert "its /health did not answer while idle" in (manager.status["a"].error or {})["cause"]
        watch.cancel()

    run(go)


def test_a_run_of_server_errors_reloads_the_engine_only_when_its_health_fails() -> None:
    # Issue 22: an engine that answers 500s was never reloaded. Issue 35: one whose /health
    # answers 200 is kept (any client that can provoke a 500 restarted a shared engine).
    fake, probe = FakeLifecycle(), Probe()

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, limits=Limits(error_run=3), probe=probe)
        await manager.acquire(A, 5)
        manager.release(A)
        for status in (500, 503, 200, 500, 500):  # a 200 ends a run
            manager.answered(A, status)
        await asyncio.sleep(0.05)
        assert manager.status["a"].state == "ready"
        manager.answered(A, 502)
        await until(lambda: probe.calls == 1, what="the /health check after the run")
        await asyncio.sleep(0.05)
        assert manager.status["a"].state == "ready"  # healthy: kept
        probe.alive = False
        for status in (500, 500, 500):
            manager.answered(A, status)
        await until(lambda: manager.status["a"].state == "failed", what="the reload after the run")
        error = manager.status["a"].error or {}
        assert "3 answers of 500 or above in a row" in error["cause"]
        assert "its /health does not answer" in error["cause"]
        await manager.acquire(A, 5)
        assert fake.calls == [("load", "a"), ("unload", "a"), ("load", "a")]
        manager.release(A)

    run(go)


def test_one_bad_answer_from_a_healthy_engine_does_not_reload_it() -> None:
    # Issue 22: one malformed engine response forced a full reload.
    fake, probe = FakeLifecycle(), Probe()

    async def go() -> None:
        manager = EngineManager(catalog(A, B), fake, probe=probe)
        await manager.acquire(A, 5)
        manager.release(A)
        assert await manager.upstream_failed(A, "ClientPayloadError: malformed chunk") is False
        assert manager.status["a"].state == "ready" and probe.calls == 1
        probe.alive = False
        assert await manager.upstream_failed(A, "connection refused") is True
        assert manager.status["a"].state == "failed"
        assert fake.calls == [("load", "a")]

    run(go)

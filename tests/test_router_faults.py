"""The router's scheduling and health under faults (issue 35, rows 9-12, 17, 21): a hung load
whose client left, the first sleep a waiting request paid, a run of 500s from a healthy engine,
a broken profile booted at every retry, a stream the engine broke off, the idle loop that died.

The router's real aiohttp front (RouterApp + Front) runs in a thread of the test process, with
its idle loop as the service runs it; every model has a stand-in engine of its own (its own
port, its /health, what it answers), and a Lifecycle fake stands in for `up`/`down`/sleep/wake
with the fault each test injects. Clients are real: raw sockets, `requests`, the OpenAI SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
from helpers import free_port, until, wait_for

from vllmstack.config.profiles import Resolved, Setting
from vllmstack.core.errors import StackError
from vllmstack.router import engines
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import EngineManager, Loaded
from vllmstack.router.front import Front
from vllmstack.router.limits import Limits
from vllmstack.router.plan import GIB, SLEEP, Need, Plan
from vllmstack.router.server import RouterApp
from vllmstack.router.states import Adopted, Slept
from vllmstack.router.upstream import Upstream
from vllmstack.runtime.gpu import GpuMemory


class StandIn:
    """One engine on a port of its own: GET /health is 200 while it runs; a POST is answered as
    `mode` says ("ok": JSON, "error": a 500, "break": an SSE stream cut mid-way, after which its
    process is gone); /health is 503 once `healthy` is cleared. `kill()` is its process dying:
    its port refuses from then on."""

    def __init__(self, name: str) -> None:
        self.name, self.mode, self.healthy = name, "ok", True
        self.posts = 0
        self.health_calls = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                engine.health_calls += 1
                self.send_response(404 if self.path != "/health" else
                                   200 if engine.healthy else 503)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                engine.posts += 1
                if engine.mode == "break":
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    event = b'data: {"n": 1}\n\n'
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.write(b"40\r\ndata: {\"n\"")  # a chunk that never ends
                    self.wfile.flush()
                    self.close_connection = True
                    threading.Thread(target=engine.kill, daemon=True).start()
                    return
                status = 500 if engine.mode == "error" else 200
                data = json.dumps({"model": engine.name, "object": "text_completion"}
                                  if status == 200 else
                                  {"error": {"message": "bad tool call", "code": 500}}).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.dead = threading.Event()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kill(self) -> None:
        if not self.dead.is_set():
            self.dead.set()
            self.server.shutdown()
            self.server.server_close()


class Fleet:
    """The lifecycle: one stand-in engine per model, started anew at each load. Faults: `hang`
    (a load that waits until aborted), `broken` (a load that fails with a diagnosis),
    `first_sleep_s` (how long an engine's first sleep takes), `unload_errors` (the next unloads
    raise OSError, as a full disk did)."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.engines: dict[str, StandIn] = {}
        self.calls: list[tuple[str, str]] = []
        self.hang: set[str] = set()
        self.broken: set[str] = set()
        self.first_sleep_s = 0.0
        self.unload_errors = 0
        self.slept: set[str] = set()
        self.aborted: dict[str, threading.Event] = {n: threading.Event() for n in names}

    def count(self, call: str, name: str) -> int:
        return self.calls.count((call, name))

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = "all") -> Loaded:
        self.calls.append(("load", entry.id))
        if entry.id in self.hang:
            self.aborted[entry.id].wait(30)
            raise StackError(f"the boot of {entry.id} was cut short", "load it again")
        if entry.id in self.broken:
            raise StackError("the engine exited with code 1: CUDA out of memory",
                             f"lower VLLM_GPU_MEM_UTIL of {entry.id}")
        engine = self.engines[entry.id] = StandIn(entry.id)
        self.slept.discard(entry.id)
        return Loaded(engine.url)

    def unload(self, entry: Entry) -> None:
        self.calls.append(("unload", entry.id))
        if self.unload_errors:
            self.unload_errors -= 1
            raise OSError(28, "No space left on device")
        engine = self.engines.pop(entry.id, None)
        if engine is not None:
            engine.kill()

    def abort(self, entry: Entry) -> None:
        self.calls.append(("abort", entry.id))
        self.aborted[entry.id].set()

    def kill(self, entry: Entry) -> None:
        self.calls.append(("kill", entry.id))

    def adoptable(self, catalog: Catalog) -> list[Adopted]:
        return []

    def sleep(self, entry: Entry, frees: str = "all") -> Slept:
        self.calls.append(("sleep", entry.id))
        engine = self.engines[entry.id]
        if engine.dead.is_set():
            raise StackError(f"the engine of {entry.id} did not answer POST /sleep?level=1")
        if entry.id not in self.slept:
            time.sleep(self.first_sleep_s)  # vLLM pins its host buffers at the first sleep
            self.slept.add(entry.id)
        return Slept(0.01, None, None)

    def wake(self, entry: Entry) -> float:
        self.calls.append(("wake", entry.id))
        return 0.01

    def memory(self) -> list[GpuMemory] | None:
        return None


def make_entry(name: str, ttl: float = 0.0) -> Entry:
    resolved = Resolved("cpu", name, {"VLLM_PORT": Setting("VLLM_PORT", "1", "test")}, [])
    return Entry(name, name, "vllm", resolved, ttl)


def sleep_plan(*names: str) -> Plan:
    """Engines that sleep, two of which do not fit awake together (0.6 of a 40 GiB card each)."""
    return Plan({n: Need(n, n, SLEEP, "test", 0.6, 1, 2 * GIB) for n in names}, 40 * GIB, 0, 0)


@dataclass
class Router:
    url: str
    manager: EngineManager
    fleet: Fleet
    said: list[str] = field(default_factory=list)

    def health(self) -> dict[str, Any]:
        answer: dict[str, Any] = requests.get(self.url + "/v1/health", timeout=5).json()
        return answer

    def state(self, name: str) -> str:
        state: str = self.health()["models"][name]["state"]
        return state


@contextlib.contextmanager
def serve(fleet: Fleet, limits: Limits, *, plan: Plan | None = None, ttl: float = 0.0
          ) -> Iterator[Router]:
    """The router's front, manager and idle loop for the fleet's models, on a free port."""
    catalog = Catalog("cpu", {n: make_entry(n, ttl) for n in fleet.names}, {})
    port, started = free_port(), threading.Event()
    loop = asyncio.new_event_loop()
    stop = loop.create_future()
    said: list[str] = []
    box: dict[str, Any] = {}

    async def main() -> None:
        upstream = Upstream(limits)
        manager = EngineManager(catalog, fleet, limits=limits, probe=upstream.probe, plan=plan,
                                say=said.append)
        app = RouterApp(catalog, manager, upstream, token="", exposed_on="127.0.0.1",
                        load_timeout=20, limits=limits)
        front = Front(app.handle, limits)
        server = await loop.create_server(front, "127.0.0.1", port)
        idle = loop.create_task(manager.idle_loop())
        box["manager"] = manager
        started.set()
        await stop
        idle.cancel()
        server.close()
        for connection in front.connections:
            connection.force_close()
        for event in fleet.aborted.values():
            event.set()
        await upstream.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield Router(f"http://127.0.0.1:{port}", box["manager"], fleet, said)
    finally:
        loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(10)
        for engine in list(fleet.engines.values()):
            engine.kill()


def ask(router: Router, model: str, timeout: float = 10, **extra: Any) -> requests.Response:
    return requests.post(router.url + "/v1/chat/completions", timeout=timeout,
                         json={"model": model, "messages": [], **extra})


# --- row 9: a hung load whose client left ------------------------------------------------------


def test_a_hung_load_whose_client_left_is_cut_short_and_the_awake_model_keeps_serving() -> None:
    # Issue 35: with b's load hung and its only client gone, a request for a got TimeoutError
    # after 30 s: the switch held every model for b's UP_TIMEOUT.
    fleet = Fleet("a", "b")
    fleet.hang.add("b")
    with serve(fleet, Limits(swap_wait=0)) as router:
        assert ask(router, "a").status_code == 200
        body = json.dumps({"model": "b", "messages": []}).encode()
        client = socket.create_connection(("127.0.0.1", int(router.url.rsplit(":", 1)[1])))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                       b"content-type: application/json\r\n"
                       + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: router.state("b") == "loading", what="b's load under way")
        client.close()  # its only client is gone
        began = time.monotonic()
        answer = ask(router, "a", timeout=8)
        assert answer.status_code == 200 and answer.json()["model"] == "a"
        assert time.monotonic() - began < 5
        assert fleet.count("abort", "b") == 1 and fleet.count("load", "a") == 2
        health = router.health()
        assert health["models"]["b"] == {"state": "unloaded", "error": None}  # not failed
        assert any("cutting the load of b short" in line for line in router.said), router.said
        # Not the profile's failure: the next request for b boots it again (no back-off).
        fleet.hang.discard("b")
        assert ask(router, "b").status_code == 200 and fleet.count("load", "b") == 2


def test_a_load_nobody_else_waits_behind_goes_on_after_its_client_left() -> None:
    # A client that gives up alone does not cancel the load: its retry finds it loaded.
    fleet = Fleet("a", "b")
    fleet.hang.add("b")
    with serve(fleet, Limits(swap_wait=0)) as router:
        with pytest.raises(requests.exceptions.ReadTimeout):
            ask(router, "b", timeout=0.5)
        wait_for(lambda: router.manager.waiting == 0, what="the client's request gone")
        assert router.state("b") == "loading" and fleet.count("abort", "b") == 0
        fleet.aborted["b"].set()  # (the fake's way to end the hung boot)


# --- row 10: the first sleep is part of the load ------------------------------------------------


def test_a_request_right_after_a_load_never_waits_for_the_first_sleep() -> None:
    # Issue 35: a request arriving after a load waited 1.2 s for the engine's first sleep
    # (1 s in the stand-in; 15 s for an 8B and 50 s for a 27B with vLLM's level 1).
    fleet = Fleet("a", "b")
    fleet.first_sleep_s = 1.5
    with serve(fleet, Limits(swap_wait=0), plan=sleep_plan("a", "b")) as router:
        assert ask(router, "a").status_code == 200
        # The first sleep came before the engine was declared ready, so before that answer.
        assert fleet.calls == [("load", "a"), ("sleep", "a"), ("wake", "a")]
        assert router.health()["engines"]["a"]["primed"] is True
        # Idle past the old idle prime's second (and its poll): a request now is served at once.
        wait_for(lambda: router.health()["engines"]["a"]["idle_s"] >= 1.6, what="a idle 1.6 s")
        began = time.monotonic()
        assert ask(router, "a").status_code == 200
        assert time.monotonic() - began < 0.6
        assert fleet.calls == [("load", "a"), ("sleep", "a"), ("wake", "a")]


# --- row 11: a run of 500s from a healthy engine -----------------------------------------------


def test_a_run_of_500s_from_an_engine_whose_health_answers_never_restarts_it() -> None:
    # Issue 35: five requests the engine answered with 500 restarted it, its /health 200.
    fleet = Fleet("a")
    with serve(fleet, Limits(error_run=5)) as router:
        assert ask(router, "a").status_code == 200
        engine = fleet.engines["a"]
        engine.mode = "error"
        for _ in range(5):
            answer = ask(router, "a")
            assert answer.status_code == 500 and "bad tool call" in answer.text
        wait_for(lambda: engine.health_calls >= 1, what="the /health check after the run")
        wait_for(lambda: any("in a row (ROUTER_ERROR_RUN)" in line for line in router.said),
                 what="the run's verdict")
        assert router.state("a") == "ready"
        engine.mode = "ok"
        assert ask(router, "a").status_code == 200
        assert fleet.calls == [("load", "a")]  # never unloaded, never loaded again


def test_a_run_of_500s_from_an_engine_whose_health_fails_reloads_it() -> None:
    fleet = Fleet("a")
    with serve(fleet, Limits(error_run=2)) as router:
        assert ask(router, "a").status_code == 200
        engine = fleet.engines["a"]
        engine.mode = "error"
        assert ask(router, "a").status_code == 500
        engine.healthy = False  # its /health fails from now on
        assert ask(router, "a").status_code == 500
        wait_for(lambda: router.state("a") == "failed", what="the dead engine marked failed")
        assert ask(router, "a").status_code == 200 and fleet.count("load", "a") == 2


# --- row 12: a broken profile is booted once per back-off -------------------------------------


def test_a_broken_profile_is_booted_once_and_retries_get_its_error_at_once() -> None:
    # Issue 35: one OpenAI SDK call (max_retries=2) booted the broken profile 3 times, and each
    # time put the awake model away.
    openai = pytest.importorskip("openai")
    fleet = Fleet("a", "b")
    fleet.broken.add("b")
    with serve(fleet, Limits(swap_wait=0, load_backoff=30)) as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=20)
        with pytest.raises(openai.APIStatusError) as first:
            client.chat.completions.create(model="b", messages=[])  # the SDK's default retries
        assert first.value.status_code == 503
        assert "CUDA out of memory" in str(first.value)
        assert fleet.count("load", "b") == 1  # booted once, not once per retry
        assert ask(router, "a").status_code == 200  # a again (b's boot had put it away)
        loads = list(fleet.calls)
        for _ in range(3):  # more calls within the back-off: at once, the same error
            began = time.monotonic()
            answer = ask(router, "b")
            assert time.monotonic() - began < 1
            assert answer.status_code == 503
            error = answer.json()["error"]
            assert error["diagnosis"]["cause"] == "the engine exited with code 1: CUDA out of memory"
            assert "ROUTER_LOAD_BACKOFF" in error["diagnosis"]["fix"]
            assert 0 < int(answer.headers["Retry-After"]) <= 30
        assert fleet.calls == loads  # no boot of b, a neither drained, slept nor stopped
        assert router.state("a") == "ready" and router.state("b") == "failed"
        # /v1/load tries again at once (the API's own call, no back-off).
        fleet.broken.discard("b")
        loaded = requests.post(router.url + "/v1/load", json={"model": "b"}, timeout=10)
        assert loaded.status_code == 200 and fleet.count("load", "b") == 2
        assert ask(router, "b").status_code == 200


# --- row 17: a stream the engine broke off ------------------------------------------------------


def test_an_engine_that_breaks_off_a_stream_and_dies_is_marked_failed_and_loaded_again() -> None:
    # Issue 35: /v1/health said ready while the engine's process was gone.
    fleet = Fleet("a", "b")
    with serve(fleet, Limits(health_interval=3600)) as router:
        assert ask(router, "a").status_code == 200
        fleet.engines["a"].mode = "break"
        with requests.post(router.url + "/v1/chat/completions", stream=True, timeout=10,
                           json={"model": "a", "messages": [], "stream": True}) as broken:
            assert broken.status_code == 200
            with pytest.raises(requests.exceptions.ChunkedEncodingError):
                b"".join(broken.iter_content(None))
        wait_for(lambda: router.state("a") == "failed", what="the dead engine marked failed")
        cause = router.health()["models"]["a"]["error"]["cause"]
        assert "its answer broke off" in cause
        answer = ask(router, "a")  # the next request loads it again
        assert answer.status_code == 200 and fleet.count("load", "a") == 2


def test_an_engine_that_dies_in_its_first_sleep_fails_its_load_instead_of_serving() -> None:
    # Issue 35: a failed sleep set READY ("restart until it is started again") on a dead engine.
    class Dying(Fleet):
        def sleep(self, entry: Entry, frees: str = "all") -> Slept:
            self.engines[entry.id].kill()  # its process dies in the sleep
            return super().sleep(entry)

    fleet = Dying("a", "b")
    with serve(fleet, Limits(swap_wait=0), plan=sleep_plan("a", "b")) as router:
        answer = requests.post(router.url + "/v1/load", json={"model": "a"}, timeout=10)
        assert answer.status_code == 503
        assert "stopped answering" in answer.json()["error"]["message"]
        assert router.state("a") == "failed"
        assert router.health()["engines"]["a"]["swap"] == SLEEP  # no fallback to restart


# --- row 21: the idle loop survives a failed pass ---------------------------------------------


def test_a_ttl_unload_that_failed_once_happens_on_a_later_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 35: a TTL unload that came due while the disk was full raised out of the idle loop,
    # which ended for good: no TTL, no health probe, nothing said.
    monkeypatch.setattr(engines, "IDLE_POLL_S", 0.02)
    fleet = Fleet("a")
    fleet.unload_errors = 1
    said: list[str] = []

    async def go() -> None:
        manager = EngineManager(Catalog("cpu", {"a": make_entry("a", ttl=0.2)}, {}), fleet,
                                say=said.append)
        idle = asyncio.create_task(manager.idle_loop())
        await manager.acquire(manager.catalog.entries["a"], 5)
        manager.release(manager.catalog.entries["a"])
        await until(lambda: fleet.count("unload", "a") == 2, what="the TTL unload tried again")
        await until(lambda: manager.status["a"].state == "unloaded", what="a unloaded")
        assert not idle.done()
        assert any("No space left on device" in line for line in said), said
        idle.cancel()

    asyncio.run(asyncio.wait_for(go(), 20))


def test_the_idle_loop_goes_on_after_a_pass_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engines, "IDLE_POLL_S", 0.02)
    fleet = Fleet("a", "b")
    said: list[str] = []
    probes: list[str] = []

    async def probe(url: str) -> bool:
        probes.append(url)
        if len(probes) == 1:
            raise OSError(28, "No space left on device")
        return True

    async def go() -> None:
        entries = {"a": make_entry("a", ttl=0.5), "b": make_entry("b")}
        manager = EngineManager(Catalog("cpu", entries, {}), fleet, say=said.append, probe=probe,
                                limits=Limits(health_interval=0.1))
        await manager.acquire(entries["a"], 5)
        manager.release(entries["a"])
        idle = asyncio.create_task(manager.idle_loop())
        await until(lambda: manager.status["a"].state == "unloaded", what="the TTL unload")
        assert len(probes) >= 2 and not idle.done()
        assert any("the idle watch" in line and "No space left" in line for line in said), said
        idle.cancel()

    asyncio.run(asyncio.wait_for(go(), 20))

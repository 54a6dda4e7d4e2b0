"""The router's stop, start and full disk (issue 35, rows 13-16, 20, 22), as a client and a
fault meet them: the real `service._serve` (the aiohttp front, the pool, the stop path) in this
process's main thread, a stand-in engine over HTTP, requests through real sockets, and a real
SIGTERM to this process, which the router's own signal handler takes. The lifecycle is a
stand-in whose wake, load, unload or adoption hangs on cue.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port, wait_for

import vllmstack.core.files as files
from vllmstack.config.profiles import Resolved, Setting
from vllmstack.core.errors import StackError
from vllmstack.core.files import FileWriteError
from vllmstack.core.paths import Project
from vllmstack.router import service
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.limits import Limits
from vllmstack.router.options import RouterError
from vllmstack.router.states import Adopted, Loaded, Slept
from vllmstack.runtime.gpu import GpuMemory
from vllmstack.serve.state import write_state

HANG_S = 30.0  # what a stand-in hang lasts at most (a test that fails must still end)


class Engine:
    """A stand-in engine: /health 200, any POST a small completion."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def answer(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                data = b'{"object": "chat.completion", "choices": []}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = answer  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Lifecycle:
    """Records what the pool asks; `hang` names the step that blocks ("wake", "load",
    "unload", "adopt") until the engine is gone (unloaded, killed, aborted) or `release` is set."""

    def __init__(self, url: str, *, adopt: dict[str, bool] | None = None, hang: str = "") -> None:
        self.url, self.adopt, self.hang = url, adopt or {}, hang
        self.calls: list[str] = []
        self.gone, self.release, self.entered = threading.Event(), threading.Event(), threading.Event()

    def _step(self, name: str) -> None:
        if self.hang == name:
            self.entered.set()
            began = time.monotonic()
            while not (self.gone.is_set() or self.release.is_set()):
                if time.monotonic() - began > HANG_S:
                    break
                time.sleep(0.01)
            if name in ("wake", "load") and self.gone.is_set():
                raise StackError(f"the engine went away during its {name}", "")

    def load(self, entry: Entry, util: float | None = None, sleep_mode: bool = False,
             frees: str = "all") -> Loaded:
        self.calls.append(f"load {entry.id}")
        self._step("load")
        return Loaded(self.url)

    def unload(self, entry: Entry) -> None:
        self.calls.append(f"unload {entry.id}")
        self._step("unload")
        self.gone.set()

    def abort(self, entry: Entry) -> None:
        self.calls.append(f"abort {entry.id}")
        self.gone.set()

    def kill(self, entry: Entry) -> None:
        self.calls.append(f"kill {entry.id}")
        self.gone.set()

    def adoptable(self, catalog: Catalog) -> list[Adopted]:
        self._step("adopt")
        return [Adopted(catalog.entries[i], self.url, asleep) for i, asleep in self.adopt.items()]

    def sleep(self, entry: Entry, frees: str = "all") -> Slept:
        raise AssertionError("restart mode never sleeps")

    def wake(self, entry: Entry) -> float:
        self.calls.append(f"wake {entry.id}")
        self._step("wake")
        return 0.01

    def memory(self) -> list[GpuMemory] | None:
        return None


def catalog_of(*ids: str) -> Catalog:
    entries = {}
    for i in ids:
        resolved = Resolved("cpu", i, {"VLLM_PORT": Setting("VLLM_PORT", "1", "test")}, [])
        entries[i] = Entry(i, i, "vllm", resolved, 0.0, slot=i)
    return Catalog("cpu", entries, {})


class Run:
    """One router: `_serve` in the main thread; `client` runs beside it and ends it (SIGTERM)."""

    def __init__(self, tmp_path: Path, lifecycle: Lifecycle, *ids: str,
                 limits: Limits | None = None) -> None:
        self.project = Project(tmp_path)
        self.lifecycle, self.catalog = lifecycle, catalog_of(*ids)
        self.limits = limits or Limits(stop_timeout=6.0)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = io.StringIO()
        self.failure: BaseException | None = None
        self.stopped_at = 0.0

    def serve(self, client: Callable[[Run], None]) -> int:
        def beside() -> None:
            try:
                client(self)
            except BaseException as exc:  # the test's assertion, raised again below
                self.failure = exc
                if self.listening():
                    self.sigterm()

        thread = threading.Thread(target=beside, daemon=True)
        thread.start()
        try:
            rc = asyncio.run(service._serve(
                self.project, self.catalog, self.lifecycle, host="127.0.0.1", port=self.port,
                token="", load_timeout=60, say=service.logger(self.project, self.out),
                limits=self.limits))
        finally:
            thread.join(HANG_S)
        if self.failure is not None:
            raise self.failure
        return rc

    def listening(self) -> bool:
        try:
            self.get("/v1/health")
        except OSError:
            return False
        return True

    def sigterm(self) -> None:
        self.stopped_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)  # the router's handler takes it (the main thread)

    def get(self, path: str) -> dict[str, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("GET", path)
            data: dict[str, Any] = json.loads(connection.getresponse().read())
            return data
        finally:
            connection.close()

    def chat(self, model: str) -> tuple[int, dict[str, Any]]:
        """A chat completion through a raw HTTP/1.1 connection: (status, body); a connection
        the router drops raises http.client.RemoteDisconnected."""
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HANG_S)
        try:
            connection.request("POST", "/v1/chat/completions", body,
                               {"content-type": "application/json"})
            answer = connection.getresponse()
            return answer.status, json.loads(answer.read() or b"{}")
        finally:
            connection.close()

    def output(self) -> str:
        return self.out.getvalue()


@pytest.fixture
def engine() -> Iterator[Engine]:
    stand_in = Engine()
    yield stand_in
    stand_in.server.shutdown()


def in_thread(work: Callable[[], Any]) -> dict[str, Any]:
    """Run `work` in a thread; its result (or exception) lands in the returned dict."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as exc:
            box["error"] = exc

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


# --- row 13: a stop is bounded whatever the engines do ----------------------------------------


def test_sigterm_during_a_hung_wake_stops_within_the_bound(tmp_path: Path, engine: Engine) -> None:
    lifecycle = Lifecycle(engine.url, adopt={"m": True}, hang="wake")
    router = Run(tmp_path, lifecycle, "m", limits=Limits(stop_timeout=6.0))

    def client(run: Run) -> None:
        wait_for(run.listening, what="the router listens")
        asked = in_thread(lambda: run.chat("m"))
        wait_for(lifecycle.entered.is_set, what="the wake hangs")
        run.sigterm()
        asked["thread"].join(HANG_S)
        assert asked.get("result", (None,))[0] == 503, asked

    assert router.serve(client) == 0
    took = time.monotonic() - router.stopped_at
    assert took < 5.0, (took, router.output())  # a third of 6 s for the switch, then the stop
    assert "is still busy after 2 s: cancelled" in router.output()
    assert lifecycle.calls[-1] == "unload m"


def test_an_engine_still_stopping_at_the_bound_is_killed_and_the_log_says_so(
        tmp_path: Path, engine: Engine) -> None:
    lifecycle = Lifecycle(engine.url, adopt={"m": False}, hang="unload")
    router = Run(tmp_path, lifecycle, "m", limits=Limits(stop_timeout=3.0))

    def client(run: Run) -> None:
        wait_for(run.listening, what="the router listens")
        assert run.chat("m")[0] == 200
        run.sigterm()

    assert router.serve(client) == 0
    took = time.monotonic() - router.stopped_at
    assert took < 8.0, (took, router.output())  # not the 30 s its unload would hang
    assert "m did not stop within 3 s (ROUTER_STOP_TIMEOUT): killing its process group" \
        in router.output()
    assert lifecycle.calls == ["unload m", "kill m"]


# --- row 14: a request queued behind a load gets a 503 at stop, not a dropped connection -------


def test_a_request_queued_behind_a_load_gets_a_503_when_the_router_stops(
        tmp_path: Path, engine: Engine) -> None:
    lifecycle = Lifecycle(engine.url, hang="load")
    router = Run(tmp_path, lifecycle, "m")

    def client(run: Run) -> None:
        wait_for(run.listening, what="the router listens")
        asked = in_thread(lambda: run.chat("m"))
        wait_for(lifecycle.entered.is_set, what="the load runs")
        wait_for(lambda: run.get("/v1/health")["queue"] >= 1, what="the request is queued")
        run.sigterm()
        asked["thread"].join(HANG_S)
        assert "error" not in asked, f"the queued request got {asked.get('error')!r}"
        status, body = asked["result"]
        assert status == 503 and "the router is stopping" in body["error"]["message"], body

    assert router.serve(client) == 0
    assert lifecycle.calls[:2] == ["load m", "abort m"]


# --- row 15: adopt first, then listen ------------------------------------------------------


def test_no_request_is_taken_before_the_running_engines_are_adopted(
        tmp_path: Path, engine: Engine) -> None:
    lifecycle = Lifecycle(engine.url, adopt={"m": True}, hang="adopt")
    router = Run(tmp_path, lifecycle, "m")

    def client(run: Run) -> None:
        wait_for(lifecycle.entered.is_set, what="the adoption runs")
        refused = None
        try:
            run.chat("m")
        except ConnectionRefusedError as exc:
            refused = exc
        assert refused is not None, "the router answered before it adopted its engines"
        lifecycle.release.set()
        wait_for(run.listening, what="the router listens")
        assert run.get("/v1/health")["models"]["m"]["state"] == "asleep"
        run.sigterm()

    assert router.serve(client) == 0
    assert "wake m" not in lifecycle.calls


# --- row 16: an engine outside --profiles is named, refused, and never hidden at stop -----------


def test_an_engine_of_a_profile_outside_the_catalog_is_refused_at_start(
        tmp_path: Path, engine: Engine) -> None:
    project = Project(tmp_path)
    write_state(project, {"profile": "other", "platform": "cpu", "url": engine.url}, "other")
    router = Run(tmp_path, Lifecycle(engine.url), "m")

    def client(run: Run) -> None:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if run.listening():
                run.sigterm()  # it served: the assertion below fails
                return
            time.sleep(0.05)

    with pytest.raises(RouterError) as caught:
        router.serve(client)
    assert caught.value.cause.startswith(
        f"the engine 'other' of profile other at {engine.url} runs, and its profile is not one "
        "of the router's (m)")
    assert "--profiles" in (caught.value.fix or "") and "invoke down" in (caught.value.fix or "")


def test_the_stop_names_an_engine_left_running_instead_of_claiming_none_is(
        tmp_path: Path, engine: Engine) -> None:
    router = Run(tmp_path, Lifecycle(engine.url), "m")

    def client(run: Run) -> None:
        wait_for(run.listening, what="the router listens")
        # Meanwhile an engine of the checkout starts beside the router (`invoke up --force`).
        write_state(run.project, {"profile": "other", "platform": "cpu", "url": engine.url},
                    "other")
        run.sigterm()

    assert router.serve(client) == 0
    last = router.output().strip().splitlines()[-1]
    assert "no engine left running" not in last
    assert f"stopped; still running: the engine 'other' of profile other at {engine.url}" in last


# --- rows 20 and 22: a full disk fails no swap and no stop ------------------------------------


@pytest.fixture
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """generated/ is full: every file the stack writes there (router.json, the memory store,
    state files) fails as write_text fails on ENOSPC, and the router's log is /dev/full."""
    real = files.write_text
    generated = (tmp_path / "generated").resolve()

    def write_text(path: Path, text: str, mode: int = 0o644) -> None:
        if Path(path).resolve().is_relative_to(generated):
            raise FileWriteError(Path(path), OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        real(path, text, mode)

    monkeypatch.setattr(files, "write_text", write_text)
    log = generated / "router" / "router.log"
    log.parent.mkdir(parents=True)
    log.symlink_to("/dev/full")


@pytest.mark.usefixtures("full_disk")
def test_with_the_disk_full_a_swap_still_serves_and_marks_both_engines(
        tmp_path: Path, engine: Engine) -> None:
    lifecycle = Lifecycle(engine.url)
    router = Run(tmp_path, lifecycle, "a", "b")

    def client(run: Run) -> None:
        wait_for(run.listening, what="the router listens")
        assert run.chat("a")[0] == 200
        status, body = run.chat("b")  # a swap: a is stopped, b loaded
        assert status == 200, body
        health = run.get("/v1/health")
        assert {k: m["state"] for k, m in health["models"].items()} == {"a": "unloaded",
                                                                         "b": "ready"}
        run.sigterm()

    assert router.serve(client) == 0
    assert lifecycle.calls == ["load a", "unload a", "load b", "unload b"]
    out = router.output()
    assert "generated/router.json is stale until a write succeeds" in out
    assert "router.log: No space left on device; the router goes on without its log file" in out
    assert out.strip().splitlines()[-1].endswith("stopped; no engine left running")


@pytest.mark.usefixtures("full_disk")
def test_with_the_disk_full_sigterm_stops_every_engine(tmp_path: Path, engine: Engine) -> None:
    lifecycle = Lifecycle(engine.url, adopt={"a": False, "b": True})
    router = Run(tmp_path, lifecycle, "a", "b")

    def client(run: Run) -> None:
        wait_for(run.listening, what="the router listens")
        run.sigterm()

    assert router.serve(client) == 0
    assert sorted(lifecycle.calls) == ["unload a", "unload b"]

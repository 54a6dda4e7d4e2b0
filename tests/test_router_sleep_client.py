"""The router's /sleep and /wake_up calls (issue 34): StackLifecycle sends them through the
router's own pooled aiohttp client on its event loop, from the worker thread a Lifecycle call
runs in, not through `requests`: kept-alive connections, no proxy from the environment."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
from helpers import free_port

from vllmstack.config.profiles import Resolved, Setting
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner
from vllmstack.router.catalog import Entry
from vllmstack.router.limits import Limits
from vllmstack.router.stacks import StackLifecycle
from vllmstack.router.states import Slept
from vllmstack.router.upstream import Upstream

T = TypeVar("T")


class DevMode:
    """An engine's dev-mode endpoints: records (method, path, client port); answers `status`."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []
        self.status, self.body = 200, b""
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                engine.seen.append((self.command, self.path, self.client_address[1]))
                self.send_response(engine.status)
                self.send_header("content-length", str(len(engine.body)))
                self.end_headers()
                self.wfile.write(engine.body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def engine() -> Iterator[DevMode]:
    dev = DevMode()
    yield dev
    dev.server.shutdown()
    dev.server.server_close()


def entry_on(port: int) -> Entry:
    resolved = Resolved("cpu", "p", {"VLLM_PORT": Setting("VLLM_PORT", str(port), "test")}, [])
    return Entry("m", "p", "vllm", resolved, 0.0)


def attached(tmp_path: Path, calls: Callable[[StackLifecycle], T]) -> T:
    """Run `calls(lifecycle)` in a worker thread while the router's loop and client run."""
    lifecycle = StackLifecycle(Project(tmp_path), {}, RecordingRunner(), say=lambda line: None)

    async def go() -> T:
        upstream = Upstream(Limits())
        lifecycle.attach(upstream, asyncio.get_running_loop())
        try:
            return await asyncio.to_thread(calls, lifecycle)
        finally:
            await upstream.close()

    return asyncio.run(asyncio.wait_for(go(), 30))


def test_sleep_and_wake_go_out_on_the_routers_kept_alive_client(
        tmp_path: Path, engine: DevMode, monkeypatch: pytest.MonkeyPatch) -> None:
    # A proxy from the environment is not used for these loopback calls (requests sent them to
    # it: with no NO_PROXY entry, POST /sleep went to the proxy and failed).
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    entry = entry_on(engine.port)

    def calls(lifecycle: StackLifecycle) -> tuple[Slept, float]:
        return lifecycle.sleep(entry), lifecycle.wake(entry)

    slept, woke = attached(tmp_path, calls)
    assert [(m, p) for m, p, _ in engine.seen] == [("POST", "/sleep?level=1"), ("POST", "/wake_up")]
    assert len({port for _, _, port in engine.seen}) == 1  # one kept-alive connection
    assert slept.seconds >= 0 and (slept.before, slept.after) == (None, None) and woke >= 0


def test_an_engine_that_refuses_the_sleep_is_a_stack_error_with_its_answer(
        tmp_path: Path, engine: DevMode) -> None:
    engine.status, engine.body = 404, b'{"detail": "Not Found"}'
    entry = entry_on(engine.port)
    with pytest.raises(StackError, match=r'answered 404 to POST /sleep\?level=1: \{"detail"') as got:
        attached(tmp_path, lambda lifecycle: lifecycle.sleep(entry))
    assert got.value.fix is not None and "--enable-sleep-mode" in got.value.fix


def test_an_engine_that_does_not_answer_is_a_stack_error_naming_it(tmp_path: Path) -> None:
    entry = entry_on(free_port())  # nothing listens there
    with pytest.raises(StackError, match="the engine of m did not wake up: cannot connect"):
        attached(tmp_path, lambda lifecycle: lifecycle.wake(entry))


def test_without_the_routers_client_a_call_is_a_bug_not_a_silent_fallback(tmp_path: Path) -> None:
    lifecycle = StackLifecycle(Project(tmp_path), {}, RecordingRunner(), say=lambda line: None)
    with pytest.raises(RuntimeError, match="attach was not called"):
        lifecycle.wake(entry_on(free_port()))

    async def on_the_loop() -> None:  # it would wait for the loop it blocks
        lifecycle.attach(Upstream(Limits()), asyncio.get_running_loop())
        lifecycle.wake(entry_on(free_port()))

    with pytest.raises(RuntimeError, match="on the router's event loop"):
        asyncio.run(on_the_loop())

"""A stop signal reaches the command that brings profiles up and down wherever the main thread is,
including inside asyncio's own callbacks: `burn` measures on an event loop, and a SIGHUP landing
while a transport delivered bytes (`Protocol.data_received`) was logged by asyncio as a "fatal
error" on that connection and swallowed, so the command waited forever with its engine up
(CI, stop 30: `test_burn_signalled_takes_its_engine_down[SIGHUP]` timed out)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time

import pytest

from vllmstack.bench.fleet.resident import Interrupted, stop_on_signals


class _SignalOnData(asyncio.Protocol):
    """Sends itself `signum` from inside data_received: the handler runs there, in asyncio's
    transport callback, as the CI failure's did."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def data_received(self, data: bytes) -> None:
        os.kill(os.getpid(), self.signum)
        for _ in range(1000):  # the handler runs between bytecodes of this frame
            pass


async def _measure(signum: int) -> None:
    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(30)

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    async with server:
        await loop.create_connection(lambda: _SignalOnData(signum), "127.0.0.1", port)
        await asyncio.sleep(10)  # a measurement that never finishes by itself in time


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_inside_a_transport_callback_ends_the_loop(signum: int) -> None:
    with stop_on_signals(), pytest.raises(Interrupted) as stop:
        asyncio.run(asyncio.wait_for(_measure(signum), timeout=5))
    assert stop.value.signum == signum


def test_signal_inside_a_task_ends_the_loop_without_noise(caplog: pytest.LogCaptureFixture) -> None:
    """Landing in a task's code, the stop must not leave that task holding it: asyncio would log
    "Task exception was never retrieved" with a traceback under the command's error/fix."""
    async def measure() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(5)

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        with stop_on_signals(), pytest.raises(Interrupted) as stop:
            asyncio.run(asyncio.wait_for(measure(), timeout=5))
        gc.collect()  # where asyncio reports a task's unretrieved exception
    assert stop.value.signum == signal.SIGTERM
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_signal_while_the_loop_waits_in_select_wakes_it() -> None:
    """The loop idles in select() until its next timer (a server slow to answer): the stop must
    wake it, not wait for that timer."""
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGHUP))

    async def wait_long() -> None:
        timer.start()
        await asyncio.sleep(60)

    began = time.monotonic()
    with stop_on_signals(), pytest.raises(Interrupted):
        asyncio.run(asyncio.wait_for(wait_long(), timeout=15))  # the next timer: 15 s away
    timer.join()
    assert time.monotonic() - began < 10, "the stop waited for the loop's next timer"


def test_handlers_are_restored_afterwards() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    with stop_on_signals():
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in before} == before

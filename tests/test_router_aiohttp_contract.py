"""What vllmstack/router/front.py takes from aiohttp beyond its documented API, checked against the
installed aiohttp: each failure names the name that is gone, so an aiohttp upgrade that drops
one fails here, by name, instead of as a router that answers nothing.

front.py's Connection subclasses aiohttp's RequestHandler for what aiohttp has no option for
(the head's timeout and total size, the per-client cap): it reads the handler's private
request bookkeeping and overrides its private `_handle_request`. These exist from aiohttp
3.10.6 (`_request_in_progress` came then) up to 4.0's development branch, which is what
pyproject's `aiohttp>=3.10.6,<4` holds. The rest of what it uses is public but undocumented
(the `handle_error` hook, `BaseRequest.writer.output_size`, `aiohttp.http_exceptions`).
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections import deque
from pathlib import Path

import aiohttp
import pytest
from aiohttp import http_exceptions, web
from aiohttp.http_writer import StreamWriter

from vllmstack.router import front
from vllmstack.router.front import Connection, Front
from vllmstack.router.limits import Limits

FRONT = Path(front.__file__)
PIN = "aiohttp>=3.10.6,<4 (pyproject.toml)"

# RequestHandler's private state Connection reads, with the type each has and where it is read.
PRIVATE_STATE: dict[str, tuple[type[object], str]] = {
    "_request_count": (int, "Connection._between_requests: requests parsed on the connection"),
    "_messages": (deque, "Connection._between_requests and data_received: parsed, unhandled"),
    "_force_close": (bool, "Connection._between_requests: a refusal closes the connection"),
    "_close": (bool, "Connection._between_requests: the connection closes after this answer"),
    "_request_in_progress": (bool, "Connection.data_received: a complete head was parsed"),
}
# RequestHandler's methods Connection overrides or calls, with the parameters it relies on.
METHODS = {
    "_handle_request": ("request", "start_time", "request_handler"),  # private: overridden
    "handle_error": ("request", "status", "exc", "message"),
    "data_received": ("data",),
    "connection_made": ("transport",),
    "connection_lost": ("exc",),
    "force_close": (),
}
# Everything front.py reaches on `self` or `super()` that it does not define itself.
INHERITED = {*PRIVATE_STATE, *METHODS, "transport"}


def gone(name: str, where: str) -> str:
    return (f"aiohttp {aiohttp.__version__} has no {name}, which vllmstack/router/front.py "
            f"relies on ({where}): keep aiohttp within {PIN}, or port front.py")


def connection() -> Connection:
    """A Connection as Front makes one for a client (on a running loop, never connected)."""
    async def make() -> Connection:
        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            return web.Response()

        made = Front(handler, Limits())()
        assert isinstance(made, Connection)
        return made

    return asyncio.run(make())


@pytest.mark.parametrize("name", sorted(PRIVATE_STATE))
def test_request_handler_has_the_private_state_front_reads(name: str) -> None:
    kind, where = PRIVATE_STATE[name]
    made = connection()
    assert hasattr(made, name), gone(f"RequestHandler.{name}", where)
    value = getattr(made, name)
    assert isinstance(value, kind), (f"aiohttp {aiohttp.__version__}: RequestHandler.{name} is "
                                     f"{type(value).__name__}, front.py reads it as "
                                     f"{kind.__name__} ({where}); keep aiohttp within {PIN}")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_request_handler_has_the_methods_front_overrides(name: str) -> None:
    method = getattr(web.RequestHandler, name, None)
    assert callable(method), gone(f"RequestHandler.{name}()", "Connection overrides or calls it")
    parameters = list(inspect.signature(method).parameters)[1:]  # without self
    assert parameters[:len(METHODS[name])] == list(METHODS[name]), (
        f"aiohttp {aiohttp.__version__}: RequestHandler.{name}{tuple(parameters)} is not "
        f"{name}{METHODS[name]} as front.py's Connection calls it; keep aiohttp within {PIN}")
    if name == "_handle_request":
        assert inspect.iscoroutinefunction(method), gone("an async RequestHandler._handle_request",
                                                         "Connection awaits super()'s")


def test_request_handler_takes_the_options_front_passes() -> None:
    # Front makes each Connection itself (its __call__), with these keyword arguments.
    async def options() -> dict[str, object]:
        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            return web.Response()

        return Front(handler, Limits()).options

    given = asyncio.run(options())
    accepted = inspect.signature(web.RequestHandler.__init__).parameters
    for name in ["manager", "loop", *given]:
        assert name in accepted, gone(f"RequestHandler(..., {name}=)", "Front.__call__ passes it")
    assert "handler_cancellation" in inspect.signature(web.Server.__init__).parameters, gone(
        "web.Server(handler_cancellation=)", "a client that leaves ends its handler")


def test_the_public_names_front_uses_are_there() -> None:
    assert isinstance(inspect.getattr_static(web.BaseRequest, "writer", None), property), gone(
        "BaseRequest.writer", "Connection.handle_error: whether the answer had begun")

    async def output_size() -> object:
        return getattr(StreamWriter(None, asyncio.get_running_loop()),  # type: ignore[arg-type]
                       "output_size", None)

    assert isinstance(asyncio.run(output_size()), int), gone(
        "StreamWriter.output_size", "Connection.handle_error: whether the answer had begun")
    assert issubclass(getattr(http_exceptions, "LineTooLong", type(None)), Exception), gone(
        "aiohttp.http_exceptions.LineTooLong", "parser_refusal: a too-long line is 431")
    assert hasattr(connection(), "transport"), gone("RequestHandler.transport",
                                                    "Connection.refuse writes its answer on it")


def test_front_uses_no_other_inherited_name_and_its_own_names_are_not_aiohttps() -> None:
    # What front.py reads on self/super() and does not define is in this file's list; a new
    # use of an aiohttp internal must be added here (and so checked above).
    source = FRONT.read_text(encoding="utf-8")
    own = set(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source))
    own |= set(re.findall(r"def (\w+)\(", source))
    used = set(re.findall(r"(?:self|super\(\))\.(\w+)", source))
    stray = {n for n in used - own - INHERITED if n.startswith("_")}
    assert not stray, (f"front.py uses {sorted(stray)} of aiohttp's, not in this contract: add "
                       "them to PRIVATE_STATE/METHODS here")
    # front.py's own private names (and Front.options) must not shadow aiohttp's: a future
    # RequestHandler with a `_finished` of its own would have it overwritten.
    async def server_names() -> set[str]:
        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            return web.Response()

        return set(dir(web.Server)) | set(vars(web.Server(handler)))

    theirs = (set(dir(web.RequestHandler)) | set(getattr(web.RequestHandler, "__slots__", ()))
              | asyncio.run(server_names()))
    mine = {n for n in own - INHERITED if n.startswith("_") and not n.startswith("__")}
    mine.add("options")
    assert not mine & theirs, f"front.py reuses aiohttp's own names: {sorted(mine & theirs)}"

"""`invoke router`: run the router in the foreground until SIGTERM or SIGINT.

Start: refuse to listen beyond loopback without a token; build the catalog; adopt a healthy
engine of one of its profiles that already runs (generated/state.json); listen. Stop: close the
listener and every client connection, then stop the engine the router started or adopted and
wait for its memory to be released, so no engine outlives the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from vllmstack.core import access
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner, SubprocessRunner
from vllmstack.observe.health import identify_server
from vllmstack.router.catalog import Catalog, build_catalog
from vllmstack.router.engines import DRAIN_TIMEOUT_S, EngineManager, Lifecycle
from vllmstack.router.http import Connection
from vllmstack.router.record import remove_record, write_record
from vllmstack.router.server import RouterApp
from vllmstack.router.stacks import ROUTER_DIR, StackLifecycle

DEFAULT_HOST = "127.0.0.1"
# llama-swap's port, where OpenAI clients of a local swapper already point.
DEFAULT_PORT = 8080
TOKEN_VAR = "ROUTER_TOKEN"


class RouterError(StackError):
    """The router cannot start; the message names the setting and the fix."""


def run_router(project: Project, environ: Mapping[str, str], *, host: str = DEFAULT_HOST,
               port: int = DEFAULT_PORT, platform: str | None = None, ttl: float | None = None,
               profiles: Sequence[str] = (), token: str | None = None, out: TextIO | None = None,
               runner: Runner | None = None, runtime: str | None = None,
               load_timeout: float | None = None, drain_timeout: float | None = None,
               lifecycle: Lifecycle | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean stop. `token` None: ROUTER_TOKEN from
    `environ`, else from .env. `ttl` (seconds, 0 = never) overrides every profile's IDLE_TTL;
    `load_timeout` bounds how long a request waits for its model (default: the profile's
    UP_TIMEOUT plus the previous engine's stop); `drain_timeout` how long a swap waits for the
    old model's requests before it cuts them (0 = for ever)."""
    out = out or sys.stdout
    if ttl is not None and ttl < 0:
        raise RouterError(f"--ttl {ttl:g} is negative", "give idle seconds, or 0 for never")
    if drain_timeout is not None and drain_timeout < 0:
        raise RouterError(f"--drain-timeout {drain_timeout:g} is negative",
                          "give seconds, or 0 to wait for ever")
    catalog = build_catalog(project, environ, platform=platform, profiles=profiles, ttl=ttl,
                            router_port=port)
    if token is None:
        first = next(iter(catalog.entries.values())).resolved
        token = environ.get(TOKEN_VAR) or first.get(TOKEN_VAR) or ""
    if access.exposed_without_token(host, token):
        raise RouterError(
            f"the router would listen on {host}, reachable from other machines, without a token",
            f"set {TOKEN_VAR} in .env or the environment (any long random string, e.g. `python -c "
            "'import secrets; print(secrets.token_urlsafe(24))'`; clients send it as 'Authorization: "
            f"Bearer TOKEN') or listen on {DEFAULT_HOST} (--host)")
    log_lock = threading.Lock()
    log_path = project.generated / ROUTER_DIR / "router.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        text = f"{time.strftime('%H:%M:%S')} {line}"
        with log_lock:
            print(text, file=out, flush=True)
            with log_path.open("a", encoding="utf-8") as handle:
                handle.write(text + "\n")

    lifecycle = lifecycle or StackLifecycle(project, environ, runner or SubprocessRunner(),
                                            say=say, runtime=runtime)
    return asyncio.run(_serve(project, catalog, lifecycle, host=host, port=port, token=token,
                              load_timeout=load_timeout, say=say,
                              drain_timeout=DRAIN_TIMEOUT_S if drain_timeout is None
                              else drain_timeout))


def local_url(host: str, port: int) -> str:
    """Where this machine reaches the router (a wildcard bind answers on loopback)."""
    if host in ("", "0.0.0.0", "::"):
        host = DEFAULT_HOST
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _serve(project: Project, catalog: Catalog, lifecycle: Lifecycle, *, host: str, port: int,
                 token: str, load_timeout: float | None, say: Callable[[str], None],
                 drain_timeout: float = DRAIN_TIMEOUT_S) -> int:
    loop = asyncio.get_running_loop()
    url = local_url(host, port)
    started = time.time()
    manager: EngineManager

    def record() -> None:
        snap = manager.snapshot()
        write_record(project, {"pid": os.getpid(), "url": url, "host": host, "port": port,
                               "platform": catalog.platform, "started": started,
                               "auth_required": access.token_required(host, token), **snap})

    manager = EngineManager(catalog, lifecycle, say=say, on_change=record,
                            drain_timeout=drain_timeout)
    app = RouterApp(catalog, manager, token=token, exposed_on=host, load_timeout=load_timeout)
    connections: set[Connection] = set()
    try:
        server = await loop.create_server(lambda: Connection(app.handle, connections), host, port,
                                          reuse_address=True)
    except OSError as exc:
        taken = exc.errno == errno.EADDRINUSE
        raise RouterError(
            f"cannot listen on {host}:{port}: "
            + (f"the port is taken by {identify_server(url)}" if taken else str(exc.strerror or exc)),
            "choose another --port" if taken else "check --host") from None
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    idle: asyncio.Task[None] | None = None
    try:
        await manager.adopt()
        record()
        names = ", ".join(f"{e.id} ({e.profile}, {e.engine}, ttl {e.ttl:g} s)"
                          for e in catalog.entries.values())
        say(f"router on {url}/v1 for platform {catalog.platform}: {names}")
        say("token required for requests" if app.auth_required else "loopback only, no token")
        idle = loop.create_task(manager.idle_loop())
        await stop.wait()
        say("stopping")
    finally:
        server.close()
        if idle is not None:
            idle.cancel()
        for conn in list(connections):
            if conn.transport is not None:
                conn.transport.abort()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5)
        try:
            await manager.shutdown()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            remove_record(project)
    say("stopped; no engine left running")
    return 0

"""`invoke router`: run the router in the foreground until SIGTERM, SIGINT or SIGHUP.

Start: take the checkout's router lock (one router per checkout); check the options; refuse to
listen beyond loopback without a token; build the catalog (one engine per profile where the
runtime runs several: native) and the memory plan (router.memory), read the ROUTER_* limits;
raise the open-file limit to fit the connection cap; adopt the healthy engines of its profiles
that already run (their state files), awake or asleep; listen. Stop (any of the three signals:
closing the terminal is SIGHUP): stop accepting, end every stream in flight with an error
event, close the client connections, then stop every engine the router started or adopted,
awake or asleep, and wait for their memory to be released, so no engine outlives the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

import vllmstack.router.options as options
from vllmstack.core import access
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner, SubprocessRunner
from vllmstack.observe.health import health_status, identify_server
from vllmstack.router.catalog import Catalog, build_catalog
from vllmstack.router.engines import DRAIN_TIMEOUT_S, EngineManager, Lifecycle
from vllmstack.router.front import Front
from vllmstack.router.history import write_store
from vllmstack.router.limits import Limits, read_limits
from vllmstack.router.link import PeerLink
from vllmstack.router.memory import build_plan, render_plan
from vllmstack.router.options import TOKEN_VAR, RouterError
from vllmstack.router.peers import Peer, plain_loopback, start_peers
from vllmstack.router.plan import SLEEP, Plan
from vllmstack.router.record import identity, remove_record, router_lock, write_record
from vllmstack.router.server import RouterApp
from vllmstack.router.stacks import ROUTER_DIR, StackLifecycle
from vllmstack.router.upstream import Upstream
from vllmstack.runtime.gpu import probe_for
from vllmstack.runtime.select import requested_runtime, runs_several
from vllmstack.serve.engines import OtherEngine, recorded_engines
from vllmstack.serve.state import StateError, read_state

DEFAULT_HOST = "127.0.0.1"
# llama-swap's port, where OpenAI clients of a local swapper already point.
DEFAULT_PORT = 8080
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FD_RESERVE = 256  # descriptors beyond the client cap: engine connections, logs, the lifecycle's
CUT_WAIT_S = 2.0  # how long a stop lets cut streams write their error event


def run_router(project: Project, environ: Mapping[str, str], *, host: str = DEFAULT_HOST,
               port: int | str = DEFAULT_PORT, platform: str | None = None,
               ttl: float | str | None = None, profiles: Sequence[str] = (),
               token: str | None = None, token_file: str | Path | None = None,
               out: TextIO | None = None, runner: Runner | None = None, runtime: str | None = None,
               load_timeout: float | str | None = None, drain_timeout: float | str | None = None,
               lifecycle: Lifecycle | None = None, swap: str | None = None,
               peers: str | None = None, peer_token_dir: str | None = None) -> int:
    """Serve until a stop signal; 0 after a clean stop. The token: `token_file`, else
    ROUTER_TOKEN from `environ`, else from .env (`token` only for callers in this process).
    `ttl` (seconds, 0 = never) overrides every profile's IDLE_TTL; `load_timeout` bounds how long
    a request waits for its model (default: the profile's UP_TIMEOUT plus the previous engine's
    stop); `drain_timeout` how long a swap waits for the old model's requests before it cuts
    them (0 = for ever); `swap` (--swap) overrides ROUTER_SWAP; `peers` (--peers) ROUTER_PEERS
    and `peer_token_dir` ROUTER_PEER_TOKEN_DIR (router.peers)."""
    out = out or sys.stdout
    port = options.port(port)
    ttl = options.seconds("--ttl", ttl, zero_means="never unload")
    load_timeout = options.seconds("--load-timeout", load_timeout)
    drain = options.seconds("--drain-timeout", drain_timeout, zero_means="wait for ever")
    swap = options.swap(swap)
    with router_lock(project):
        catalog, plan = plan_router(project, environ, platform=platform, profiles=profiles,
                                    ttl=ttl, router_port=port, runtime=runtime, swap=swap,
                                    runner=runner)
        first = next(iter(catalog.entries.values())).resolved
        limits = read_limits(first)
        token = options.choose_token(token, token_file, environ, first.get_raw(TOKEN_VAR),
                                     first.source(TOKEN_VAR) or ".env")
        if access.exposed_without_token(host, token):
            raise RouterError(
                f"the router would listen on {host}, reachable from other machines, without a token",
                f"set {TOKEN_VAR} in the environment or .env, or pass --token-file FILE (a random "
                f"string of at least {options.MIN_TOKEN_BYTES} bytes, e.g. {options.MAKE_TOKEN}; "
                f"clients send it as 'Authorization: Bearer TOKEN'), or listen on {DEFAULT_HOST} "
                "(--host)")
        peer_list = start_peers(first, environ, root=project.root, peers=peers,
                                token_dir=peer_token_dir)
        say = logger(project, out)
        limits = fit_open_files(limits, say)
        # The token is the router's: the engines it starts never see it.
        engine_environ = {k: v for k, v in environ.items() if k != TOKEN_VAR}
        for note in catalog.notes + plan.notes:
            say(f"note: {note}")
        lifecycle = lifecycle or StackLifecycle(project, engine_environ,
                                                runner or SubprocessRunner(), say=say,
                                                runtime=runtime, catalog=catalog)
        with asyncio.Runner(loop_factory=loop_factory()) as loop_runner:
            return loop_runner.run(_serve(
                project, catalog, lifecycle, host=host, port=port, token=token,
                load_timeout=load_timeout, say=say, limits=limits, plan=plan,
                drain_timeout=DRAIN_TIMEOUT_S if drain is None else drain, peers=peer_list))


def plan_router(project: Project, environ: Mapping[str, str], *, platform: str | None = None,
                profiles: Sequence[str] = (), ttl: float | None = None,
                router_port: int | None = None, runtime: str | None = None,
                swap: str | None = None, runner: Runner | None = None) -> tuple[Catalog, Plan]:
    """The catalog and its memory plan (nothing is started): one engine per profile where the
    runtime runs several side by side (native), else one at a time; ROUTER_SWAP=sleep (or
    --swap sleep) where it cannot is refused."""
    catalog = build_catalog(project, environ, platform=platform, profiles=profiles, ttl=ttl,
                            router_port=router_port)
    first = next(iter(catalog.entries.values())).resolved
    try:
        previous = read_state(project) or {}
    except StateError:
        previous = {}
    requested = requested_runtime(first, runtime, previous)
    several = runs_several(requested)
    setting = swap or first.get_str("ROUTER_SWAP")
    if setting == SLEEP and not several:
        raise RouterError(
            f"ROUTER_SWAP=sleep keeps several engines loaded side by side, which the {requested} "
            "runtime does not run (one engine per checkout): sleep mode is native-only for now",
            "run the router on the native runtime (--runtime native, or RUNTIME=native), or "
            "use --swap restart")
    if several:
        catalog = build_catalog(project, environ, platform=platform, profiles=profiles, ttl=ttl,
                                router_port=router_port, several=True)
        first = next(iter(catalog.entries.values())).resolved
    probe = probe_for(first.get_str("GPU_VENDOR"), runner or SubprocessRunner(),
                      unified_memory=first.get_bool("UNIFIED_MEMORY"),
                      standin=first.get_str("GPU_MEMORY_DIR"))
    plan = build_plan(project, catalog, environ, setting=setting, several=several,
                      cards=probe.memory())
    return catalog, plan


def show_plan(project: Project, environ: Mapping[str, str], *, out: TextIO,
              platform: str | None = None, profiles: Sequence[str] = (),
              router_port: int | None = None, runtime: str | None = None,
              swap: str | None = None) -> int:
    """`invoke router --plan`: the plan for the platform's profiles; nothing is started."""
    catalog, plan = plan_router(project, environ, platform=platform, profiles=profiles,
                                router_port=router_port, runtime=runtime, swap=options.swap(swap))
    print(render_plan(plan, catalog), file=out)
    return 0


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (fewer microseconds per relayed chunk)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def logger(project: Project, out: TextIO) -> Callable[[str], None]:
    """`say`: a line to `out` and to generated/router/router.log. A closed terminal (SIGHUP, a
    pipe gone) does not stop the log file."""
    lock = threading.Lock()
    path = project.generated / ROUTER_DIR / "router.log"
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
    failing: list[str] = []  # the log file's write error, said once until a write succeeds

    def show(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(text, file=out, flush=True)

    def say(line: str) -> None:
        text = f"{time.strftime('%H:%M:%S')} {line}"
        with lock:
            show(text)
            try:
                with path.open("a", encoding="utf-8") as handle:
                    handle.write(text + "\n")
            except OSError as exc:
                # A full disk (ENOSPC) must not fail what was being said: a swap, a stop.
                if not failing:
                    failing.append(str(exc.strerror or exc))
                    show(f"{time.strftime('%H:%M:%S')} warning: cannot write {path}: "
                         f"{failing[0]}; the router goes on without its log file until it can")
            else:
                failing.clear()

    return say


def fit_open_files(limits: Limits, say: Callable[[str], None]) -> Limits:
    """Raise the soft open-file limit to hold ROUTER_MAX_CONNECTIONS (a default `ulimit -n` of
    1024 was exhausted by 1,100 idle connections); where the hard limit is lower, lower the cap."""
    want = limits.max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return limits
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft >= want:
        return limits
    cap = max(16, soft - FD_RESERVE)
    say(f"warning: the open-file limit is {soft} (hard {hard}); serving at most {cap} client "
        f"connections instead of {limits.max_connections} (ROUTER_MAX_CONNECTIONS; raise "
        "`ulimit -Hn` for more)")
    return dataclasses.replace(limits, max_connections=cap)


def local_url(host: str, port: int) -> str:
    """Where this machine reaches the router (a wildcard bind answers on loopback)."""
    if host in ("", "0.0.0.0", "::"):
        host = DEFAULT_HOST
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _serve(project: Project, catalog: Catalog, lifecycle: Lifecycle, *, host: str, port: int,
                 token: str, load_timeout: float | None, say: Callable[[str], None],
                 limits: Limits, drain_timeout: float = DRAIN_TIMEOUT_S,
                 plan: Plan | None = None, peers: Sequence[Peer] = ()) -> int:
    loop = asyncio.get_running_loop()
    url = local_url(host, port)
    started = time.time()
    me = identity()
    manager: EngineManager
    unwritten: set[str] = set()  # the reports that failed to write, said once until they heal

    def report(what: str, write: Callable[[], None]) -> None:
        """router.json and the memory store are reports: a full disk (FileWriteError, ENOSPC)
        must not fail the swap or the stop whose state change wrote them (issue 35)."""
        try:
            write()
        except OSError as exc:
            if what not in unwritten:
                unwritten.add(what)
                say(f"warning: {exc}; the router goes on serving, {what} is stale until a "
                    "write succeeds")
        else:
            unwritten.discard(what)

    def record() -> None:
        snap = manager.snapshot()
        report("generated/router.json", lambda: write_record(project, {
            **me, "url": url, "host": host, "port": port, "platform": catalog.platform,
            "started": started, "auth_required": access.token_required(host, token), **snap}))

    upstream = Upstream(limits)
    if isinstance(lifecycle, StackLifecycle):  # its /sleep and /wake_up go out on this client
        lifecycle.attach(upstream, loop)
    manager = EngineManager(catalog, lifecycle, say=say, on_change=record,
                            drain_timeout=drain_timeout, limits=limits, probe=upstream.probe,
                            plan=plan, remember=lambda profile, figures: report(
                                "generated/router/memory.json",
                                lambda: write_store(project, profile, **figures)))
    link = PeerLink(list(peers), upstream, say) if peers else None
    app = RouterApp(catalog, manager, upstream, token=token, exposed_on=host,
                    load_timeout=load_timeout, limits=limits, peers=link)
    front = Front(app.handle, limits, say=say)
    outside = await asyncio.to_thread(outside_engines, project, catalog)
    if outside:
        raise RouterError(
            f"{outside[0].shown} runs, and its profile is not one of the router's "
            f"({', '.join(catalog.entries)}): the router would neither adopt nor stop it, and "
            "every load would be refused beside it"
            + (f" ({len(outside) - 1} more: {', '.join(o.shown for o in outside[1:])})"
               if len(outside) > 1 else ""),
            "add its profile to --profiles (the router then adopts it), or stop it first: "
            "invoke down")
    try:
        # Bound, not yet listening (a connection is refused): a taken port is an error before
        # anything is adopted, and no request reaches an engine the router has not adopted yet
        # (one sent as a restarted router began to listen reached a sleeping engine: a 500).
        server = await loop.create_server(front, host, port, reuse_address=True, backlog=1024,
                                          start_serving=False)
    except OSError as exc:
        taken = exc.errno == errno.EADDRINUSE
        raise RouterError(
            f"cannot listen on {host}:{port}: "
            + (f"the port is taken by {identify_server(url)}" if taken else str(exc.strerror or exc)),
            "choose another --port" if taken else "check --host") from None
    stop = asyncio.Event()
    got: list[str] = []

    def stopping(sig: signal.Signals) -> None:
        got.append(sig.name)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stopping, sig)
    idle: asyncio.Task[None] | None = None
    watch: asyncio.Task[None] | None = None
    try:
        adopted = await manager.adopt()
        if plan is not None and adopted and plan.card is not None:
            # What the adopted engines hold is theirs, not other programs': out of the baseline.
            held = plan.usage(manager.views())
            plan.baseline = max(0, plan.baseline - held)
        record()
        if link is not None:  # what the peers serve is known before the first request
            await link.poll_all()
            watch = loop.create_task(link.watch())
        await server.start_serving()
        names = ", ".join(f"{e.id} ({e.profile}, {e.engine}, {manager.members[e.id].mode}, "
                          f"ttl {e.ttl:g} s)" for e in catalog.entries.values())
        say(f"router on {url}/v1 for platform {catalog.platform}: {names}")
        say("token required for requests" if app.auth_required else "loopback only, no token")
        for name, state in (link.states.items() if link else ()):
            say(f"peer {name}: {state.peer.url}, "
                + (f"up: {', '.join(sorted(state.models)) or 'no models'}" if state.up
                   else f"down: {state.reason}"))
            if not plain_loopback(state.peer.url):
                say(f"warning: peer {name} is plain http beyond loopback: its token and the "
                    "requests cross the network unencrypted (put TLS in front of it and use "
                    "https://, or keep the link on a trusted network)")
        idle = loop.create_task(manager.idle_loop())
        await stop.wait()
        say(f"stopping ({got[0] if got else 'stop'})")
    finally:
        if watch is not None:
            watch.cancel()
        await _close(server, front, manager, idle, link)
        try:
            await manager.shutdown(limits.stop_timeout)
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            with contextlib.suppress(OSError):
                remove_record(project, me)
            # Only now: a switch the stop lets finish may still put an engine to sleep or wake
            # it through this client (StackLifecycle.attach), and probe it.
            await upstream.close()
    left = await asyncio.to_thread(running_engines, project)
    if left:  # never "none left" while one answers (one outside --profiles, one it failed to end)
        say("stopped; still running: " + "; ".join(o.shown for o in left)
            + " (not the router's to stop: `invoke down` stops every engine of the checkout)")
    else:
        say("stopped; no engine left running")
    return 0


def running_engines(project: Project) -> list[OtherEngine]:
    """The checkout's engines that answer on their port now, as their state files name them."""
    return [e for e in recorded_engines(project)
            if e.url and health_status(e.url, timeout=1.0) is not None]


def outside_engines(project: Project, catalog: Catalog) -> list[OtherEngine]:
    """Engines of the checkout that run but are no engine of the catalog: a named engine of a
    profile outside --profiles, or `invoke up`'s default engine where the router runs named
    ones. The router's loads would be refused beside them (serve.guards' checkout-engine)."""
    slots = {e.slot for e in catalog.entries.values()}
    return [e for e in running_engines(project) if e.slot not in slots]


async def _close(server: asyncio.AbstractServer, front: Front, manager: EngineManager,
                 idle: asyncio.Task[None] | None, link: PeerLink | None = None) -> None:
    """Stop accepting; answer the queued requests 503 and end the streams in flight with an
    error event; close every connection once its answer is written."""
    server.close()
    if idle is not None:
        idle.cancel()
    # The queue first: a request waiting for a load gets its 503 ("the router is stopping")
    # before its connection closes, not a dropped connection (issue 35).
    manager.closing = True
    manager.schedule()
    # The peers' streams too: each ends with its error event, not a dropped connection.
    cut_peers = link.cut_all("the router is stopping") if link is not None else 0
    if manager.cut_all("the router is stopping") or cut_peers:
        deadline = time.monotonic() + CUT_WAIT_S
        while (manager.inflight or (link is not None and link.cuts)) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    # aiohttp's graceful close: each handler still writing (a 503, an error event) gets up to
    # CUT_WAIT_S, then it is cancelled and the connection closed; idle ones close at once.
    await front.shutdown(CUT_WAIT_S)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(server.wait_closed(), 5)

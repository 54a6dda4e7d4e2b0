"""The router's endpoints: an OpenAI front routed by `model`, and the lifecycle API.

    GET  /v1/models             every catalog entry: id, object, owned_by (the engine), state
                                (ready, asleep, loading, waking, ...), and the diagnosis
                                (`error`) when its last load failed
    GET  /v1/health, /health    {"status", "loaded", "state"} plus the queue, in-flight requests,
                                every model's state and the recent swaps
    POST the OpenAI paths an engine serves (GENERATION: /v1/chat/completions,
         /v1/completions, /v1/responses, /v1/embeddings, /v1/messages, /tokenize,
         /detokenize, the pooling, score and rerank paths, /v1/audio/transcriptions and
         /translations)
                                load the body's `model` (JSON, or the `model` field of an
                                audio route's multipart form) if needed, then forward
                                (streams pass through as they come); a path the model's
                                engine does not serve is 404
    POST /v1/load, /v1/unload   {"model": ID} or {"model_name": ID}; unload without a model
                                stops every engine, awake or asleep
    GET  /v1/router/plan?model=ID  read-only: what a request for ID would do now (its tier,
                                the action, the others' moves between tiers, the stops, the
                                expected swap seconds, what blocks it); 404 naming the model

Nothing else is routed: every other path is 404, whatever the engine would answer there (its
dev-mode endpoints /sleep, /wake_up, /collective_rpc, /reset_prefix_cache among them, and the
paths that name no model, such as GET /v1/responses/{id}, which no engine can be chosen for).
Paths are matched as sent, not decoded, and a forward goes to the route's own path.

Every request follows the dashboard's rule (core.access), reads included (the engines' state is
not for strangers; vLLM's --api-key guards /v1/models too): beyond loopback, or with a token
set, `Authorization: Bearer TOKEN` is required, and a client's repeated wrong tokens are
answered ever later (limits.FailureThrottle); on loopback without a token, the Host must be a
loopback name (DNS rebinding) and a browser request must come from a loopback origin. The check
comes before the body is read; bodies held at once are bounded in all (ROUTER_MAX_QUEUED_BODY_BYTES).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from typing import Any

import aiohttp
from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestPayloadError

from vllmstack.config.engines.table import ENGINES
from vllmstack.core import access
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import EngineManager, LoadFailedError, RouterBusyError
from vllmstack.router.limits import (
    BodyError,
    BodyLedger,
    FailureThrottle,
    Limits,
    error_body,
    form_field,
    parse_body,
    shown_name,
)
from vllmstack.router.link import HOP_HEADER, PeerLink
from vllmstack.router.stacks import DOWN_TIMEOUT_S
from vllmstack.router.upstream import (
    Cut,
    Upstream,
    UpstreamError,
    begin_response,
    relay,
    request_headers,
)

# The engines' POST routes that name their model, forwarded by it: each kind's `routes`
# (config/engines: vLLM's from its boot route list, llama-server's from its server.cpp).
GENERATION = frozenset().union(*(kind.routes for kind in ENGINES.values()))
# OpenAI's audio API sends a multipart form, its `model` a field of it.
FORM_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
LIFECYCLE = frozenset({"/v1/load", "/v1/unload"})
READS = frozenset({"/v1/models", "/v1/health", "/health", "/v1/router/plan"})
MODEL_KEYS = ("model", "model_name")
SHOWN_PATH = 200
# Reports of engine failures still probing (a task is kept only while referenced).
REPORTS: set[asyncio.Task[bool]] = set()
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def reply(status: int, data: Any, *, close: bool = False) -> web.Response:
    response = web.Response(status=status, body=json.dumps(data).encode(),
                            content_type="application/json")
    if close:  # the rest of the request was not read: the connection cannot carry another
        response.force_close()
    return response


def refuse(status: int, message: str, *, close: bool = False, **extra: Any) -> web.Response:
    return reply(status, error_body(message, status, **extra), close=close)


class SendAgainError(Exception):
    """The engine refused the connection and is gone: load it again and send the request again
    (nothing reached it)."""


def _queue_full(ledger: BodyLedger) -> BodyError:
    return BodyError(503, f"the router holds {ledger.limit} bytes of request bodies "
                          "(ROUTER_MAX_QUEUED_BODY_BYTES); try again")


async def read_body(request: web.BaseRequest, limits: Limits,
                    ledger: BodyLedger | None = None) -> bytes:
    """The request body, within ROUTER_MAX_BODY_BYTES (chunked too) and ROUTER_HEADER_TIMEOUT
    between two reads; BodyError otherwise. Its bytes are counted in `ledger` as they are read
    (a 503 past its total); the caller gives back len(body) when the request is done, and a
    body refused here has given its bytes back already."""
    length = request.content_length
    if length is not None and length > limits.max_body:
        raise BodyError(413, f"the request body is {length} bytes, over {limits.max_body} "
                             "(ROUTER_MAX_BODY_BYTES)")
    if ledger is not None and length is not None and ledger.held + length > ledger.limit:
        raise _queue_full(ledger)  # before a byte of it is read
    if request.headers.get("expect", "").lower() == "100-continue":
        await request.writer.write(CONTINUE)
    parts: list[bytes] = []
    size = 0
    try:
        while True:
            try:
                async with asyncio.timeout(limits.header_timeout):
                    data = await request.content.readany()
            except TimeoutError:
                raise BodyError(408, f"the request body stalled for {limits.header_timeout:g} s "
                                     "(ROUTER_HEADER_TIMEOUT)") from None
            except (RequestPayloadError, http_exceptions.HttpProcessingError) as exc:
                raise BodyError(400, f"malformed request body: "
                                     f"{str(exc).splitlines()[0][:200]}") from None
            if not data:
                return b"".join(parts)
            if size + len(data) > limits.max_body:
                raise BodyError(413, f"the request body is over {limits.max_body} bytes "
                                     "(ROUTER_MAX_BODY_BYTES)")
            if ledger is not None and not ledger.take(len(data)):
                raise _queue_full(ledger)
            size += len(data)
            parts.append(data)
    except BaseException:
        if ledger is not None:
            ledger.give(size)
        raise


def protocol_problem(request: web.BaseRequest) -> str | None:
    """What aiohttp's parser lets through that the router refuses."""
    if request.version not in (aiohttp.HttpVersion10, aiohttp.HttpVersion11):
        return f"HTTP/{request.version.major}.{request.version.minor} is not served (HTTP/1.1 is)"
    coding = request.headers.getall("transfer-encoding", [])
    if coding and [c.strip().lower() for c in coding] != ["chunked"]:
        return "the only Transfer-Encoding taken is chunked"
    for name in ("authorization", "origin"):
        if len(request.headers.getall(name, [])) > 1:
            return f"the request has more than one {name.title()} header"
    return None


class RouterApp:
    def __init__(self, catalog: Catalog, manager: EngineManager, upstream: Upstream, *,
                 token: str, exposed_on: str, load_timeout: float | None = None,
                 limits: Limits | None = None, peers: PeerLink | None = None) -> None:
        self.catalog, self.manager, self.upstream, self.token = catalog, manager, upstream, token
        self.peers = peers  # ROUTER_PEERS: the models of other boxes' routers (link.py)
        self.limits = limits or Limits()
        self.auth_required = access.token_required(exposed_on, token)
        self.load_timeout = load_timeout
        self.created = int(time.time())
        self.ledger = BodyLedger(self.limits.max_queued_body)
        self.throttle = FailureThrottle()
        # The client's bearer token is the router's, not the engine's: it stays here.
        self.drop = frozenset({"authorization"}) if token else frozenset()

    def timeout_for(self, entry: Entry) -> float:
        """How long a request waits for its model: a swap's stop and the profile's boot."""
        return self.load_timeout or entry.up_timeout + DOWN_TIMEOUT_S

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path, method = request.rel_url.raw_path, request.method
        problem = protocol_problem(request)
        if problem:
            return refuse(400, problem, close=True)
        # Every route, reads included: /v1/health and /v1/models told anyone the engines'
        # state, past a token and to a rebound host name (issue 35).
        denied = self.denial(request)
        if denied is not None:
            if denied.status == 401:  # a wrong token: slower at every guess (FailureThrottle)
                await asyncio.sleep(self.throttle.failed(request.remote or "", time.monotonic()))
            return denied
        if method == "GET" and path == "/v1/models":
            return reply(200, self.models())
        if method == "GET" and path in ("/v1/health", "/health"):
            snapshot = self.manager.snapshot()
            if self.peers is not None:
                snapshot["peers"] = self.peers.snapshot()
            return reply(200, snapshot)
        if method == "GET" and path == "/v1/router/plan":
            return self.plan_for(request.rel_url.query.get("model"))
        if method == "POST" and (path in GENERATION or path in LIFECYCLE):
            try:
                body = await read_body(request, self.limits, self.ledger)
            except BodyError as exc:
                refused = refuse(exc.status, exc.message, close=True)
                if exc.status == 503:
                    refused.headers["Retry-After"] = "1"
                return refused
            try:  # the body's bytes stay counted until the request is done
                if path in GENERATION:
                    return await self.generate(request, path, body)
                if (model := self.peer_model(request, body)) is not None and self.peers:
                    return await self.peers.forward(request, path, body, model)
                return await (self.load(body) if path == "/v1/load" else self.unload(body))
            finally:
                self.ledger.give(len(body))
        if path in GENERATION or path in LIFECYCLE or path in READS:
            return refuse(405, f"{method[:20]} is not allowed on {path}")
        return refuse(404, f"no route {path[:SHOWN_PATH]}")

    def denial(self, request: web.BaseRequest) -> web.Response | None:
        denial = access.write_denial(request.headers, token=self.token,
                                     required=self.auth_required)
        if denial == access.NEEDS_TOKEN:
            return refuse(401, "this router needs its token: send 'Authorization: Bearer TOKEN' "
                               "(ROUTER_TOKEN)")
        if denial == access.NOT_LOCAL:
            return refuse(403, "requests must come from this machine (http://127.0.0.1 or "
                               "http://localhost); set a router token to allow others")
        return None

    # --- views --------------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        data = []
        for entry in self.catalog.entries.values():
            status = self.manager.status[entry.id]
            item: dict[str, Any] = {"id": entry.id, "object": "model", "created": self.created,
                                    "owned_by": entry.engine, "profile": entry.profile,
                                    "state": status.state}
            if status.error:
                item["error"] = status.error
            data.append(item)
        if self.peers is not None:
            data += self.peers.listing(self.created, set(self.catalog.entries))
        return {"object": "list", "data": data}

    def peer_model(self, request: web.BaseRequest, body: bytes | None, data: Any = None,
                   keys: tuple[str, ...] = MODEL_KEYS) -> str | None:
        """The model a request names (in `data`, else in the JSON `body`) when no profile here
        serves it and a peer lists it; None for one that came over a peer link (HOP_HEADER):
        it is answered here, never sent on."""
        if self.peers is None or HOP_HEADER in request.headers:
            return None
        if data is None:
            try:
                data = parse_body(body or b"", self.limits)
            except BodyError:
                return None
        if not isinstance(data, dict):
            return None
        name = next((data[k] for k in keys if k in data), None)
        if isinstance(name, str) and self.catalog.find(name) is None and self.peers.knows(name):
            return name
        return None

    def entry_for(self, data: Any, *, strict: bool) -> Entry | web.Response:
        """The catalog entry the body names, or the 400/404 answer. `strict` (the lifecycle
        API): the body holds nothing but the model's name."""
        ids = ", ".join(self.catalog.ids)
        if not isinstance(data, dict):
            return refuse(400, f"the body must be a JSON object naming a model: {{\"model\": ID}} "
                               f"with one of {ids}")
        if strict and (unknown := [k for k in data if k not in MODEL_KEYS]):
            return refuse(400, f"unknown field {shown_name(str(unknown[0]))!r}: send "
                               f"{{\"model\": ID}} with one of {ids}", param=str(unknown[0])[:80])
        keys = MODEL_KEYS if strict else MODEL_KEYS[:1]
        name = next((data[k] for k in keys if k in data), None)
        if not isinstance(name, str) or not name:
            return refuse(400, f"name a model in 'model' (a string): one of {ids}", param="model")
        entry = self.catalog.find(name)
        if entry is None:
            # A peer that is down may serve it: the 404 says which, and why it is down.
            down = self.peers.down() if self.peers is not None else ""
            return refuse(404, f"The model `{shown_name(name)}` does not exist. Known models: {ids}"
                          + (f"; not known from {down}" if down else ""),
                          param="model", known=self.catalog.ids)
        return entry

    def failed(self, entry: Entry, exc: LoadFailedError | RouterBusyError) -> web.Response:
        message = (f"{entry.id} could not be loaded: {exc.cause}"
                   if isinstance(exc, LoadFailedError) else exc.cause)
        refused = refuse(503, message, param="model",
                         diagnosis={"cause": exc.cause, "fix": exc.fix or ""})
        left = self.manager.backoff_left(entry)
        if isinstance(exc, LoadFailedError) and left:
            # When a retry can boot it again (ROUTER_LOAD_BACKOFF); until then a retry gets
            # this answer again, so the OpenAI SDK is told not to retry (its x-should-retry):
            # its 2 retries booted a broken profile 3 times (issue 35).
            refused.headers["Retry-After"] = str(math.ceil(left))
            refused.headers["x-should-retry"] = "false"
        return refused

    # --- routes -------------------------------------------------------------------------------

    def plan_for(self, name: str | None) -> web.Response:
        """GET /v1/router/plan?model=NAME: what a request for NAME would do now (Pool.preview),
        read-only: nothing is queued, woken or put away."""
        ids = ", ".join(self.catalog.ids)
        if not name:
            return refuse(400, f"name a model: /v1/router/plan?model=NAME with one of {ids}",
                          param="model")
        entry = self.catalog.find(name)
        if entry is None:
            return refuse(404, f"The model `{shown_name(name)}` does not exist. Known models: {ids}",
                          param="model", known=self.catalog.ids)
        return reply(200, self.manager.preview(entry))

    async def generate(self, request: web.BaseRequest, path: str, body: bytes
                       ) -> web.StreamResponse:
        kind = request.headers.get("content-type", "")
        form = form_field(body, kind, "model") if path in FORM_PATHS else None
        if path in FORM_PATHS and kind.lower().startswith("multipart/"):
            # An audio upload: `model` is a form field; the file part is never decoded.
            data: Any = {} if form is None else {"model": form[0]}
        else:
            try:
                data = parse_body(body, self.limits)
            except BodyError as exc:
                return refuse(exc.status, exc.message)
        query = request.rel_url.raw_query_string
        target = path + ("?" + query if query else "")
        # A generation names its model in `model` only (entry_for, strict=False).
        if (model := self.peer_model(request, None, data, MODEL_KEYS[:1])) is not None \
                and self.peers:
            return await self.peers.forward(request, target, body, model)
        entry = self.entry_for(data, strict=False)
        if isinstance(entry, web.Response):
            return entry
        if path not in entry.kind.routes:
            return refuse(404, f"the engine of {entry.id} ({entry.engine}) does not serve "
                               f"{path}", param="model")
        if data["model"] != entry.id:  # named by its profile: the engine knows its served name
            body = (body[:form[1]] + entry.id.encode() + body[form[2]:] if form is not None
                    else json.dumps({**data, "model": entry.id}).encode())
        headers = request_headers(request.headers.items(), self.drop)
        arrived = self.manager.clock()  # its first-token time counts from here (the snapshot's)
        for attempt in (1, 2):
            try:
                url = await self.manager.acquire(entry, self.timeout_for(entry))
            except (LoadFailedError, RouterBusyError) as exc:
                return self.failed(entry, exc)
            cut = Cut(task=asyncio.current_task(), transport=request.transport)
            self.manager.hold(entry, cut)
            try:
                return await self.forward(request, entry, url + target, headers, body, cut,
                                          retry=attempt == 1, arrived=arrived)
            except SendAgainError:
                continue
            finally:
                cut.done = True
                self.manager.unhold(entry, cut)
                self.manager.release(entry)
        raise AssertionError("unreachable: the second attempt never retries")

    async def forward(self, request: web.BaseRequest, entry: Entry, url: str, headers: Any,
                      body: bytes, cut: Cut, *, retry: bool, arrived: float | None = None
                      ) -> web.StreamResponse:
        try:
            async with self.upstream.open(url, headers, body, cut) as answer:
                self.manager.answered(entry, answer.status, arrived)
                response = await begin_response(request, answer)
                try:
                    await relay(answer, response)
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    await self.broken_off(request, entry, response, cut, exc)
                    return response
                await response.write_eof()
                return response
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if cut.reason and task is not None and task.uncancel() == 0:  # cut, not the client
                return refuse(503, cut.reason + " before the engine answered")
            raise
        except UpstreamError as exc:
            if cut.reason:
                return refuse(503, cut.reason + " before the engine answered")
            gone = await self.manager.upstream_failed(entry, str(exc))
            if exc.refused and gone and retry:
                raise SendAgainError from None
            if exc.timeout:
                return refuse(504, f"the engine of {entry.id} did not answer: {exc}")
            return refuse(502, f"the engine of {entry.id} did not answer: {exc}"
                               + ("; the next request loads it again" if gone else ""))

    async def broken_off(self, request: web.BaseRequest, entry: Entry,
                         response: web.StreamResponse, cut: Cut, exc: BaseException) -> None:
        """The engine's answer stopped before its end: cut by the router (a swap's drain, a
        stop), timed out, or dropped by the engine. A stream gets an SSE error event; then the
        client connection closes without the body's end, so no client takes it as complete.
        One the router did not cut is the engine's failure: its /health is probed, and a dead
        engine is marked failed (issue 35: /v1/health said ready while its process was gone)."""
        if cut.reason:
            status, message = 503, cut.reason
        elif isinstance(exc, TimeoutError):
            status, message = 504, (f"the engine sent nothing for {self.limits.read_timeout:g} s "
                                    "(ROUTER_UPSTREAM_READ_TIMEOUT)")
        else:
            status, message = 502, f"the engine's answer broke off ({type(exc).__name__})"
        if response.content_type == "text/event-stream":
            event = b"data: " + json.dumps(error_body(message, status)).encode() + b"\n\n"
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.write(event)
        if not cut.reason:  # a task of its own: closing the client ends this handler
            report = asyncio.get_running_loop().create_task(
                self.manager.upstream_failed(entry, f"its answer broke off: {message}"))
            REPORTS.add(report)
            report.add_done_callback(REPORTS.discard)
        if request.transport is not None:
            request.transport.close()  # after the error event; the final chunk is never sent

    async def load(self, body: bytes) -> web.Response:
        try:
            data = parse_body(body, self.limits)
        except BodyError as exc:
            return refuse(exc.status, exc.message)
        entry = self.entry_for(data, strict=True)
        if isinstance(entry, web.Response):
            return entry
        began = time.monotonic()
        try:
            await self.manager.load(entry, self.timeout_for(entry))
        except (LoadFailedError, RouterBusyError) as exc:
            return self.failed(entry, exc)
        return reply(200, {"status": "success", "model": entry.id, "state": "ready",
                           "seconds": round(time.monotonic() - began, 3)})

    async def unload(self, body: bytes) -> web.Response:
        try:
            data = parse_body(body, self.limits, empty={})
        except BodyError as exc:
            return refuse(exc.status, exc.message)
        entry: Entry | None = None
        if data != {}:  # {} unloads every engine, awake or asleep; else it must name a model
            found = self.entry_for(data, strict=True)
            if isinstance(found, web.Response):
                return found
            entry = found
            if not self.manager.member(entry).started:
                return reply(200, {"status": "success", "unloaded": None, "engines": [],
                                   "message": f"{entry.id} is not loaded"})
        try:
            gone = await self.manager.unload(DOWN_TIMEOUT_S + 60, entry=entry)
        except RouterBusyError as exc:
            return refuse(503, exc.cause)
        for each in gone:
            if self.manager.status[each.id].state != "unloaded":
                error = self.manager.status[each.id].error or {}
                return refuse(503, f"{each.id} could not be unloaded: {error.get('cause')}",
                              diagnosis=error)
        return reply(200, {"status": "success", "unloaded": gone[0].id if gone else None,
                           "engines": [e.id for e in gone]})

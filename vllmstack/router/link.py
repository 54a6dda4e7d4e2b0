"""The link to the peer routers (peers.py): what each one serves, whether it answers, and the
requests for its models, forwarded to it as they are.

Every PEER_POLL_S each peer's `GET /v1/models` is asked with its token, within PEER_TIMEOUT_S; a
peer that does not answer 200 in time is down at once (its models listed `unreachable`, its
requests refused with a 503 naming it), one that answers again is up again: no restart of
either router. Only a peer's own models are taken, never the ones it lists from its peers, and a
request that came over a link is never sent over another (HOP_HEADER): two routers that peer
each other cannot bounce a request between them.

A request for a peer's model goes to a peer that has it awake (`ready`), else to one that has
it at all: the peer's router loads or wakes it by its own memory plan, exactly as for its own
clients. The client's Authorization header stays here; the peer's token goes instead. Only the
routes the server forwards reach a peer (the engines' OpenAI paths, and /v1/load and /v1/unload
naming a peer's model): its dev endpoints and /v1/router/* never do. Streams are relayed chunk
for chunk (upstream.relay).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from vllmstack.router.limits import error_body
from vllmstack.router.peers import Peer
from vllmstack.router.upstream import (
    Cut,
    Upstream,
    UpstreamError,
    begin_response,
    relay,
    request_headers,
)

PEER_POLL_S = 1.0
PEER_TIMEOUT_S = 1.0
# A peer that refused the token is asked less often: the token is read at start, so only the
# peer's side can change, and each refusal feeds that peer's wrong-token back-off
# (limits.FailureThrottle), which soon holds its 401s past PEER_TIMEOUT_S.
PEER_REFUSED_POLL_S = 5.0
MAX_LISTING_BYTES = 4 * 1024 * 1024
HOP_HEADER = "x-vllmstack-peer-hop"  # set on every forward: its receiver never forwards again


@dataclass
class PeerState:
    """What this router knows of one peer: `up` (None until its first answer or failure), why
    it is down, and its own models by id (each its /v1/models item)."""

    peer: Peer
    up: bool | None = None
    reason: str = ""
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    since: float = 0.0  # when `up` last changed (time.time())
    refused: bool = False  # its last answer refused the token
    polled: float = -math.inf  # when it was last asked (time.monotonic())

    def view(self) -> dict[str, Any]:
        return {"url": self.peer.url, "up": bool(self.up), "reason": self.reason or None,
                "since": self.since, "models": sorted(self.models)}


def reply(status: int, message: str, **extra: Any) -> web.Response:
    return web.Response(status=status, body=json.dumps(error_body(message, status, **extra)).encode(),
                        content_type="application/json")


class PeerLink:
    """The peers' states, their poll loop and the forwards to them (made on the event loop)."""

    def __init__(self, peers: list[Peer], upstream: Upstream,
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.states = {p.name: PeerState(p) for p in peers}
        self.upstream, self.say = upstream, say
        self.cuts: set[Cut] = set()  # the forwards in flight, for a stop to end (cut_all)

    def cut_all(self, reason: str) -> int:
        """End every forward in flight with `reason` (the router stops): a stream gets an SSE
        error event, a request still waiting for the peer a 503. How many there were."""
        cuts = list(self.cuts)
        for cut in cuts:
            cut(reason)
        return len(cuts)

    # --- health -------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Poll every peer every PEER_POLL_S until cancelled."""
        while True:
            began = time.monotonic()
            await self.poll_all()
            await asyncio.sleep(max(0.0, PEER_POLL_S - (time.monotonic() - began)))

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(state) for state in self.states.values()))

    async def poll(self, state: PeerState) -> None:
        peer = state.peer
        now = time.monotonic()
        if state.refused and now - state.polled < PEER_REFUSED_POLL_S:
            return
        state.polled = now
        try:
            async with self.upstream.session.get(
                    peer.url + "/v1/models", allow_redirects=False,
                    headers={"Authorization": f"Bearer {peer.token}"},
                    timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)) as answer:
                body = await answer.content.read(MAX_LISTING_BYTES + 1)
                status = answer.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if state.refused and isinstance(exc, TimeoutError):
                return  # its back-off holding the 401: the token is still the reason
            self.mark(state, False, (f"no answer within {PEER_TIMEOUT_S:g} s"
                                     if isinstance(exc, TimeoutError)
                                     else f"no answer ({type(exc).__name__})"))
            return
        if status in (401, 403):
            self.mark(state, False, f"it refused this router's token for it ({status}): check "
                                    f"{peer.token_file} holds its ROUTER_TOKEN", refused=True)
            return
        models = own_models(body) if status == 200 and len(body) <= MAX_LISTING_BYTES else None
        if models is None:
            self.mark(state, False, f"its /v1/models answered {status} without a model list")
            return
        state.models = models
        self.mark(state, True, "")

    def mark(self, state: PeerState, up: bool, reason: str, *, refused: bool = False) -> None:
        if state.up is not up:
            state.since = time.time()
            self.say(f"peer {state.peer.name} ({state.peer.url}) is up: "
                     f"{', '.join(sorted(state.models)) or 'no models'}" if up
                     else f"peer {state.peer.name} ({state.peer.url}) is down: {reason}")
        state.up, state.reason, state.refused = up, reason, refused

    # --- views --------------------------------------------------------------------------------

    def knows(self, model: str) -> bool:
        return any(model in s.models for s in self.states.values())

    def holders(self, model: str) -> list[PeerState]:
        """The peers listing `model`: up ones first, those with it awake before them."""
        having = [s for s in self.states.values() if model in s.models]
        return sorted(having, key=lambda s: (not s.up, s.models[model].get("state") != "ready"))

    def listing(self, created: int, local: set[str]) -> list[dict[str, Any]]:
        """/v1/models items for the peers' models not served here: OpenAI's fields, the peer's
        own `owned_by`, `profile` and `state` (`unreachable` while the peer is down) and `peer`:
        the name of the peer a request goes to, with `peer_up`."""
        items: dict[str, dict[str, Any]] = {}
        for state in self.states.values():
            for model in state.models:
                if model in local or model in items:
                    continue
                best = self.holders(model)[0]
                own = best.models[model]
                items[model] = {
                    "id": model, "object": "model", "created": created,
                    "owned_by": str(own.get("owned_by") or "peer"), "profile": own.get("profile"),
                    "state": str(own.get("state") or "unknown") if best.up else "unreachable",
                    "peer": best.peer.name, "peer_up": bool(best.up),
                    "peers": [s.peer.name for s in self.holders(model)]}
        return list(items.values())

    def down(self) -> str:
        """The peers down now, each with why ("" when all answer)."""
        return "; ".join(f"peer {s.peer.name} ({s.peer.url}), down: {s.reason}"
                         for s in self.states.values() if not s.up)

    def snapshot(self) -> dict[str, Any]:
        return {name: state.view() for name, state in self.states.items()}

    # --- forwards -----------------------------------------------------------------------------

    async def forward(self, request: web.BaseRequest, target: str, body: bytes, model: str
                      ) -> web.StreamResponse:
        """Send the request for `model` to a peer that has it; the peer's answer relayed as it
        comes, or a 503 naming the peers that had it when none answers."""
        for state in self.holders(model):
            if not state.up:
                break  # sorted: the rest are down too
            answered = await self.send(request, state, target, body)
            if answered is not None:
                return answered
        down = self.holders(model)  # every one is down now: those tried were marked so
        named = "; ".join(f"peer {s.peer.name} ({s.peer.url}) is down: {s.reason}" for s in down)
        response = reply(503, f"{model} lives on {' and '.join(s.peer.name for s in down)}, "
                              f"which does not answer: {named}", param="model",
                         peer=[s.peer.name for s in down])
        response.headers["Retry-After"] = str(int(PEER_POLL_S))
        return response

    async def send(self, request: web.BaseRequest, state: PeerState, target: str, body: bytes
                   ) -> web.StreamResponse | None:
        """One forward to `state`'s peer; None when it could not be reached (it is marked down,
        nothing reached it): the caller tries another."""
        peer = state.peer
        headers = request_headers(request.headers.items(), frozenset({"authorization"}))
        headers["Authorization"] = f"Bearer {peer.token}"
        headers[HOP_HEADER] = "1"
        cut = Cut(task=asyncio.current_task(), transport=request.transport)
        self.cuts.add(cut)
        try:
            async with self.upstream.open(peer.url + target, headers, body, cut) as answer:
                if answer.status in (401, 403):  # the peer's refusal is about our token for it
                    self.mark(state, False, f"it refused this router's token for it "
                                            f"({answer.status}): check {peer.token_file}",
                              refused=True)
                    return reply(502, f"peer {peer.name} ({peer.url}) refused this router's "
                                      f"token for it ({answer.status}): check {peer.token_file}",
                                 peer=peer.name)
                response = await begin_response(request, answer)
                try:
                    await relay(answer, response)
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    await self.broken_off(request, response, peer, exc, cut.reason)
                    return response
                await response.write_eof()
                return response
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if cut.reason and task is not None and task.uncancel() == 0:  # cut, not the client
                return reply(503, f"{cut.reason} before peer {peer.name} answered")
            raise
        except UpstreamError as exc:
            if cut.reason:
                return reply(503, f"{cut.reason} before peer {peer.name} answered")
            if exc.refused:
                self.mark(state, False, f"cannot connect: {exc}")
                return None
            return reply(504 if exc.timeout else 502,
                         f"peer {peer.name} ({peer.url}) did not answer: {exc}", peer=peer.name)
        finally:
            cut.done = True
            self.cuts.discard(cut)

    async def broken_off(self, request: web.BaseRequest, response: web.StreamResponse,
                         peer: Peer, exc: BaseException, reason: str = "") -> None:
        """The peer's answer stopped before its end (or this router cut it: `reason`): a stream
        gets an SSE error event, then the client connection closes without the body's end, so
        no client takes it as complete."""
        status, message = (503, reason) if reason else (502, (
            f"peer {peer.name} sent nothing in time" if isinstance(exc, TimeoutError)
            else f"peer {peer.name}'s answer broke off ({type(exc).__name__})"))
        if response.content_type == "text/event-stream":
            event = b"data: " + json.dumps(error_body(message, status)).encode() + b"\n\n"
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.write(event)
        if request.transport is not None:
            request.transport.close()


def own_models(body: bytes) -> dict[str, dict[str, Any]] | None:
    """A peer's /v1/models answer as its own models by id (items it lists from its own peers
    left out); None when it is not an OpenAI model list."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return None
    return {item["id"]: item for item in items
            if isinstance(item, dict) and isinstance(item.get("id"), str) and item["id"]
            and "peer" not in item}

"""The router's endpoints: an OpenAI front routed by `model`, and the lifecycle API.

    GET  /v1/models             every catalog entry: id, object, owned_by (the engine), state,
                                and the diagnosis (`error`) when its last load failed
    GET  /v1/health, /health    {"status", "loaded", "state"} plus the queue, in-flight requests,
                                every model's state and the recent swaps
    POST /v1/chat/completions, /v1/completions, /v1/embeddings
                                load the body's `model` if needed, then forward (streams pass
                                through as they come)
    POST /v1/load, /v1/unload   {"model": ID} or {"model_name": ID}; unload without a model
                                unloads whatever is resident

POSTs change state (a load can evict another model), so they follow the dashboard's rule
(core.access): beyond loopback, or with a token set, `Authorization: Bearer TOKEN` is required;
on loopback without a token, a browser request must come from a loopback origin.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit

from vllmstack.core import access
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import EngineManager, LoadFailedError, RouterBusyError
from vllmstack.router.http import Connection, Request, UpstreamError, error_body
from vllmstack.router.relay import RelayPool, forward
from vllmstack.router.stacks import DOWN_TIMEOUT_S

GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


class RouterApp:
    def __init__(self, catalog: Catalog, manager: EngineManager, *, token: str, exposed_on: str,
                 load_timeout: float | None = None) -> None:
        self.catalog, self.manager, self.token = catalog, manager, token
        self.auth_required = access.token_required(exposed_on, token)
        self.load_timeout = load_timeout
        self.created = int(time.time())
        # The client's bearer token is the router's, not the engine's: it stays here.
        self.drop = frozenset({"authorization"}) if token else frozenset()
        self.relays = RelayPool()

    def timeout_for(self, entry: Entry) -> float:
        """How long a request waits for its model: a swap's stop and the profile's boot."""
        return self.load_timeout or entry.up_timeout + DOWN_TIMEOUT_S

    async def handle(self, request: Request, conn: Connection) -> None:
        path, method = request.path, request.method
        if method == "GET":
            if path == "/v1/models":
                return conn.send_json(200, self.models())
            if path in ("/v1/health", "/health"):
                return conn.send_json(200, self.manager.snapshot())
        elif method == "POST":
            known = path in GENERATION or path in ("/v1/load", "/v1/unload")
            if known and not self.allowed(request, conn):
                return None
            if path in GENERATION:
                return await self.generate(request, conn)
            if path == "/v1/load":
                return await self.load(request, conn)
            if path == "/v1/unload":
                return await self.unload(request, conn)
        if path in GENERATION or path in ("/v1/models", "/v1/health", "/health", "/v1/load",
                                          "/v1/unload"):
            return conn.send_json(405, error_body(f"{method} is not allowed on {path}", 405))
        return conn.send_json(404, error_body(f"no route {path}", 404))

    def allowed(self, request: Request, conn: Connection) -> bool:
        denial = access.write_denial(request.headers, token=self.token, required=self.auth_required)
        if denial == access.NEEDS_TOKEN:
            conn.send_json(401, error_body(
                "this router needs its token: send 'Authorization: Bearer TOKEN' (ROUTER_TOKEN)", 401))
        elif denial == access.NOT_LOCAL:
            conn.send_json(403, error_body(
                "requests must come from this machine (http://127.0.0.1 or http://localhost); "
                "set a router token to allow others", 403))
        return denial is None

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
        return {"object": "list", "data": data}

    def entry_for(self, data: Any, conn: Connection, keys: tuple[str, ...]) -> Entry | None:
        """The catalog entry the body names; None after answering 400/404."""
        name = next((data[k] for k in keys if isinstance(data, dict) and data.get(k)), None)
        ids = ", ".join(self.catalog.ids)
        if not isinstance(name, str):
            conn.send_json(400, error_body(f"name a model in {keys[0]!r}: one of {ids}", 400,
                                           param=keys[0]))
            return None
        entry = self.catalog.find(name)
        if entry is None:
            conn.send_json(404, error_body(f"The model `{name}` does not exist. Known models: {ids}",
                                           404, param="model", known=self.catalog.ids))
        return entry

    def failed(self, conn: Connection, entry: Entry, exc: Exception) -> None:
        if isinstance(exc, LoadFailedError):
            message = f"{entry.id} could not be loaded: {exc.cause}"
            diagnosis = {"cause": exc.cause, "fix": exc.fix or ""}
        else:
            assert isinstance(exc, RouterBusyError)
            message, diagnosis = exc.cause, {"cause": exc.cause, "fix": exc.fix or ""}
        conn.send_json(503, error_body(message, 503, param="model", diagnosis=diagnosis))

    # --- routes -------------------------------------------------------------------------------

    async def generate(self, request: Request, conn: Connection) -> None:
        try:
            data = json.loads(request.body)
        except ValueError as exc:
            return conn.send_json(400, error_body(f"the body is not JSON ({exc})", 400))
        entry = self.entry_for(data, conn, ("model",))
        if entry is None:
            return None
        body = request.body
        if data["model"] != entry.id:  # named by its profile: the engine knows its served name
            body = json.dumps({**data, "model": entry.id}).encode()
        try:
            url = await self.manager.acquire(entry, self.timeout_for(entry))
        except (LoadFailedError, RouterBusyError) as exc:
            return self.failed(conn, entry, exc)
        self.manager.hold(conn.abort)
        try:
            parts = urlsplit(url)
            await forward(conn, request, parts.hostname or "127.0.0.1", parts.port or 80, body,
                          self.relays, drop=self.drop)
        except UpstreamError as exc:
            self.manager.engine_gone(entry, str(exc))
            conn.send_json(502, error_body(f"the engine of {entry.id} did not answer: {exc}; the "
                                           "next request loads it again", 502))
        finally:
            self.manager.unhold(conn.abort)
            self.manager.release()
        return None

    def _json(self, request: Request, conn: Connection) -> Any:
        try:
            return json.loads(request.body or b"{}")
        except ValueError as exc:
            conn.send_json(400, error_body(f"the body is not JSON ({exc})", 400))
            return None

    async def load(self, request: Request, conn: Connection) -> None:
        data = self._json(request, conn)
        entry = None if data is None else self.entry_for(data, conn, ("model", "model_name"))
        if entry is None:
            return None
        began = time.monotonic()
        try:
            await self.manager.load(entry, self.timeout_for(entry))
        except (LoadFailedError, RouterBusyError) as exc:
            return self.failed(conn, entry, exc)
        conn.send_json(200, {"status": "success", "model": entry.id, "state": "ready",
                             "seconds": round(time.monotonic() - began, 3)})
        return None

    async def unload(self, request: Request, conn: Connection) -> None:
        data = self._json(request, conn)
        if data is None:
            return None
        named = isinstance(data, dict) and (data.get("model") or data.get("model_name"))
        if named:
            entry = self.entry_for(data, conn, ("model", "model_name"))
            if entry is None:
                return None
            if self.manager.resident is not entry:
                return conn.send_json(200, {"status": "success", "unloaded": None,
                                            "message": f"{entry.id} is not loaded"})
        try:
            gone = await self.manager.unload(DOWN_TIMEOUT_S + 60)
        except RouterBusyError as exc:
            return conn.send_json(503, error_body(exc.cause, 503))
        if gone is not None and self.manager.status[gone.id].state != "unloaded":
            error = self.manager.status[gone.id].error or {}
            return conn.send_json(503, error_body(f"{gone.id} could not be unloaded: "
                                                  f"{error.get('cause')}", 503, diagnosis=error))
        conn.send_json(200, {"status": "success", "unloaded": gone.id if gone else None})
        return None

"""`invoke router`: one OpenAI endpoint for every model profile of the platform.

catalog (which profiles, by served name) < engines (the one resident engine: load, unload, idle
TTL, the resident-first queue, health; its vocabulary in states) over stacks (serve.lifecycle's
up/down) < limits (ROUTER_* limits, OpenAI errors) < upstream (the pooled client to the engine,
the chunk relay) < front (aiohttp's server with the connection and head limits) < server (the
routes) < service (run_router: lock, start, signals, stop). options checks the start options;
record keeps generated/router.json and the router lock, and gives the dashboard the router's state.
"""

from __future__ import annotations

from vllmstack.router.options import RouterError
from vllmstack.router.record import router_state
from vllmstack.router.service import DEFAULT_HOST, DEFAULT_PORT, run_router

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "RouterError", "router_state", "run_router"]

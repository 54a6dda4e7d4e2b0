"""`invoke router`: one OpenAI endpoint for every model profile of the platform.

catalog (which profiles, by served name) < engines (the one resident engine: load, unload, idle
TTL, queue) over stacks (serve.lifecycle's up/down) < http (client connections, the byte pipe to
the engine) < server (the routes) < service (run_router: start, signals, stop). record keeps
generated/router.json and gives the dashboard the router's state.
"""

from __future__ import annotations

from vllmstack.router.record import router_state
from vllmstack.router.service import DEFAULT_HOST, DEFAULT_PORT, RouterError, run_router

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "RouterError", "router_state", "run_router"]

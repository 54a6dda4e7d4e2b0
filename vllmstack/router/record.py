"""generated/router.json: what the running router serves, for the dashboard and for people.

The router rewrites it at every state change (a load, a ready engine, an unload, a failure)
and removes it when it stops. Between changes the live numbers (queue, in-flight requests) come
from the router itself: `router_state` asks its /v1/health when it runs.
"""

from __future__ import annotations

import json
import os
from typing import Any

import requests

from vllmstack.core.files import write_json
from vllmstack.core.paths import Project

ROUTER_FILE = "router.json"


def write_record(project: Project, data: dict[str, Any]) -> None:
    project.generated.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_json(project.generated / ROUTER_FILE, data)


def remove_record(project: Project) -> None:
    (project.generated / ROUTER_FILE).unlink(missing_ok=True)


def read_record(project: Project) -> dict[str, Any] | None:
    try:
        data = json.loads((project.generated / ROUTER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def router_state(project: Project, *, timeout: float = 1.0) -> dict[str, Any] | None:
    """The router's state for the dashboard: None when no router runs for this checkout, else
    router.json (url, pid, resident model, every model's state, recent swaps with their stop and
    start seconds), with `live` True and the current queue and in-flight counts when its
    /v1/health answered within `timeout`."""
    record = read_record(project)
    if record is None or not _alive(record.get("pid")):
        return None
    state = dict(record)
    state["live"] = False
    try:
        answer = requests.get(f"{record.get('url')}/v1/health", timeout=timeout)
        if answer.status_code == 200:
            state.update(answer.json())
            state["live"] = True
    except (requests.RequestException, ValueError):
        pass
    return state

"""The state file between invocations: what `up` started, so `status` and `down` know it.

generated/state.json records the runtime (and compose flavour), profile, platform, the exact argv,
the URL and GPU memory in use before `up`.
"""

from __future__ import annotations

import json
from typing import Any

from vllmstack.core.files import write_json
from vllmstack.core.paths import Project

STATE_FILE = "state.json"


def write_state(project: Project, state: dict[str, Any]) -> None:
    project.generated.mkdir(parents=True, exist_ok=True)
    write_json(project.generated / STATE_FILE, state)


def read_state(project: Project) -> dict[str, Any] | None:
    path = project.generated / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

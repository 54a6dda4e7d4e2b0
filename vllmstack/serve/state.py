"""The state file between invocations: what `up` started, so `status` and `down` know it.

generated/state.json records the runtime (and compose flavour), the Compose project name, profile,
platform, the exact argv, the URL and GPU memory in use before `up`. It decides which runtime and
which containers later commands look at, so a damaged one is an error that names it, never a
guess: guessing would make `down` look for the wrong containers and report "stopped".
"""

from __future__ import annotations

import json
from typing import Any

from vllmstack.core.errors import StackError
from vllmstack.core.files import PRIVATE, write_json
from vllmstack.core.paths import Project

STATE_FILE = "state.json"
# Field -> the types it may have (absent is always fine: older `up`s wrote fewer fields).
FIELDS: dict[str, tuple[type, ...]] = {
    "runtime": (str,), "flavour": (str,), "compose_project": (str, type(None)),
    "profile": (str,), "platform": (str,), "argv": (list,), "url": (str,),
    "served_name": (str,), "started": (int, float), "gpu_used_before": (int, type(None)),
    "sets": (list,),  # the --set overrides (serve.running: later commands resolve the same)
}


class StateError(StackError):
    """generated/state.json exists but cannot be used; the message names it."""


def write_state(project: Project, state: dict[str, Any]) -> None:
    """Created mode 0600: the recorded argv can hold a token (--api-key in VLLM_EXTRA_ARGS)."""
    project.generated.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_json(project.generated / STATE_FILE, state, mode=PRIVATE)


def read_state(project: Project) -> dict[str, Any] | None:
    """The recorded state; None when there is none. A file that is there but unreadable,
    not JSON, or has a field of the wrong type raises StateError naming the file."""
    path = project.generated / STATE_FILE
    where = f"generated/{STATE_FILE}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise _damaged(f"{where} cannot be read ({exc})") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise _damaged(f"{where} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise _damaged(f"{where} holds a JSON {type(data).__name__}, not an object")
    for key, types in FIELDS.items():
        if (key in data and not isinstance(data[key], types)) or isinstance(data.get(key), bool):
            raise _damaged(f"{where}: {key} is {data[key]!r}, which no `invoke up` writes")
    return data


def _damaged(cause: str) -> StateError:
    return StateError(
        f"{cause}; it records what `invoke up` started here (runtime, Compose project), so "
        "nothing was done",
        "move it aside (mv generated/state.json generated/state.json.bad), then stop what runs: "
        "invoke down --runtime native, or --runtime compose (add --set COMPOSE_PROJECT=vllmstack "
        "for a stack started before that name was derived per checkout)")

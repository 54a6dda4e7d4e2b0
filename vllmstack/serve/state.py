"""The state file between invocations: what `up` started, so `status` and `down` know it.

generated/state.json records the runtime (and compose flavour), the Compose project name, profile,
platform, the exact argv, the URL, GPU memory in use before `up`, and once the engine is healthy
the phases of its boot (serve.startup). It decides which runtime and
which containers later commands look at, so a damaged one is an error that names it, never a
guess: guessing would make `down` look for the wrong containers and report "stopped". Only
`down` goes on past a damaged one: it sets the file aside (renamed, not deleted) and stops what
this checkout's own markers and settings name (`set_aside_damaged`).

It also records the checkout that wrote it (its id and path): a copy of a checkout (`cp -a A B`)
carries A's state.json, which names A's Compose project; B ignores it (`read_state` gives None,
`foreign_state` says why), so B's `down` never stops A's containers.

Each of the checkout's named engines (`slot`: the router runs one per profile) has a state file
of its own, generated/engines/NAME/state.json (core.checkout.engine_dir); "" is the default
engine's generated/state.json.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from vllmstack.core.checkout import checkout_id, default_compose_project, engine_dir
from vllmstack.core.errors import StackError
from vllmstack.core.files import PRIVATE, FileWriteError, JsonFileError, read_json_file, write_json
from vllmstack.core.paths import Project

STATE_FILE = "state.json"
# Field -> the types it may have (absent is always fine: older `up`s wrote fewer fields).
FIELDS: dict[str, tuple[type, ...]] = {
    "runtime": (str,), "flavour": (str,), "compose_project": (str, type(None)),
    "profile": (str,), "platform": (str,), "argv": (list,), "url": (str,),
    "served_name": (str,), "started": (int, float), "gpu_used_before": (int, type(None)),
    "sets": (list,),  # the --set overrides (serve.running: later commands resolve the same)
    "checkout": (str,), "root": (str,),  # who wrote it (a copied checkout is not that one)
    "slot": (str,),  # the engine's name in the checkout ("" or absent: the default engine)
    "launched": (int, float),  # when `up` started it: its boot's phases count from there
    "boot": (dict,),  # its boot's phases, once healthy (serve.boot_phases; `invoke startup`)
}
# A state file is a few kilobytes (the argv); far more is not one the stack wrote.
STATE_MAX_BYTES = 1_000_000
# The Compose project name a checkout derives from its path (core.checkout.default_compose_project).
DERIVED_PROJECT = re.compile(r"vllmstack-[0-9a-f]{8}")


class StateError(StackError):
    """generated/state.json exists but cannot be used; the message names it."""


def state_path(project: Project, slot: str = "") -> Path:
    return engine_dir(project.generated, slot) / STATE_FILE


def write_state(project: Project, state: dict[str, Any], slot: str = "") -> None:
    """Created mode 0600: the recorded argv can hold a token (--api-key in VLLM_EXTRA_ARGS).
    A write that fails (full disk, no permission) raises FileWriteError naming the file."""
    path = state_path(project, slot)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise FileWriteError(path, exc) from exc
    write_json(path, {**state, "checkout": checkout_id(project.root),
                      "root": str(project.root.resolve())}, mode=PRIVATE)


def read_state(project: Project, slot: str = "") -> dict[str, Any] | None:
    """The recorded state; None when there is none. A file that is there but unreadable,
    not JSON, or has a field of the wrong type raises StateError naming the file."""
    data = _read(project, slot)
    return None if data is None or _written_elsewhere(project, data) else data


def foreign_state(project: Project) -> str | None:
    """Why generated/state.json is ignored here: it was written by another checkout (this one
    is a copy of it); None when it is this checkout's, absent or damaged."""
    try:
        data = _read(project)
    except StateError:
        return None
    if data is None:
        return None
    origin = _written_elsewhere(project, data)
    if origin is None:
        return None
    return (f"generated/{STATE_FILE} was written by {origin}, not by this checkout (a copy of "
            "it?): ignored here")


def set_aside_damaged(project: Project) -> str | None:
    """`down` on a damaged state file: rename it (state.json.damaged-TIME, never deleted) so the
    stack can be stopped by what its markers and settings name; returns the warning to print,
    None when the file is fine or absent."""
    try:
        _read(project)
    except StateError as exc:
        path = project.generated / STATE_FILE
        aside = path.with_name(f"{STATE_FILE}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            path.rename(aside)
        except OSError:
            raise exc from None
        return (f"warning: {exc.cause.split('; it records')[0]}; set aside as "
                f"generated/{aside.name}: stopping what this checkout's markers and settings "
                "name (a Compose stack started under another project name is not found this way)")
    return None


def _read(project: Project, slot: str = "") -> dict[str, Any] | None:
    path = state_path(project, slot)
    where = str(path.relative_to(project.root))
    try:
        data = read_json_file(path, where, max_bytes=STATE_MAX_BYTES)
    except JsonFileError as exc:
        raise _damaged(exc.cause) from exc
    if data is None:
        return None
    for key, types in FIELDS.items():
        if (key in data and not isinstance(data[key], types)) or isinstance(data.get(key), bool):
            raise _damaged(f"{where}: {key} is {data[key]!r}, which no `invoke up` writes")
    return dict(data)


def _written_elsewhere(project: Project, data: dict[str, Any]) -> str | None:
    """The checkout that wrote `data` when it is not this one, else None. A state file from
    before the checkout was recorded still tells: a Compose project name derived from another
    path."""
    recorded = data.get("checkout")
    if isinstance(recorded, str):
        if recorded == checkout_id(project.root):
            return None
        return f"the checkout at {data.get('root') or '?'}"
    name = data.get("compose_project")
    if isinstance(name, str) and DERIVED_PROJECT.fullmatch(name) \
            and name != default_compose_project(project.root):
        return f"another checkout (its Compose project {name} is derived from another path)"
    return None


def _damaged(cause: str) -> StateError:
    return StateError(
        f"{cause}; it records what `invoke up` started here (runtime, Compose project), so "
        "nothing was done",
        "move it aside (mv generated/state.json generated/state.json.bad), then stop what runs: "
        "invoke down --runtime native, or --runtime compose (add --set COMPOSE_PROJECT=vllmstack "
        "for a stack started before that name was derived per checkout)")

"""Which runtime runs the engine: --runtime, else RUNTIME, else what the last `up` used, else detect.

Also which Compose project a checkout's containers belong to (`compose_project_name`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TextIO

from vllmstack.config.engines.kind import Placement
from vllmstack.config.profiles import Resolved
from vllmstack.core.checkout import DERIVED_FROM_CHECKOUT, default_compose_project
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime import compose
from vllmstack.runtime.base import EngineRuntime
from vllmstack.runtime.compose_files import compose_files
from vllmstack.runtime.native.command import native_placement
from vllmstack.runtime.native.engine import NativeEngine

# The default before it was derived per checkout: state files written by an `up` of that time
# record no project name, and their containers run under this one.
LEGACY_COMPOSE_PROJECT = "vllmstack"
# What Compose v2 accepts (v1 and Podman accept at least as much).
COMPOSE_PROJECT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class SeveralEnginesError(StackError):
    """A named engine (several per checkout) was asked of a runtime that runs only one."""


# The runtime that runs several engines of one checkout side by side (named engines).
MULTI_ENGINE_RUNTIME = "native"


def requested_runtime(resolved: Resolved, runtime: str | None, previous: Mapping[str, Any],
                      slot: str = "") -> str:
    """The runtime asked for; `auto` reuses what `up` used (the compose flavour it detected).
    A named engine runs where it was started (its own state), else natively: only the native
    runtime runs several engines of a checkout."""
    if slot and not runtime:
        return str(previous.get("flavour") or MULTI_ENGINE_RUNTIME)
    requested = runtime or resolved.get_str("RUNTIME")
    if requested == "auto" and previous.get("runtime"):
        requested = str(previous.get("flavour") or
                        ("native" if previous["runtime"] == "native" else "auto"))
    return requested


def image_client(resolved: Resolved, runtime: str) -> str:
    """The container CLI whose image store holds the engine image on `runtime` (a runtime kind or
    a concrete flavour): Podman's own on the podman runtime, else DOCKER's."""
    return "podman" if runtime == "podman" else resolved.get_str("DOCKER")


def compose_project_name(project: Project, resolved: Resolved, previous: Mapping[str, Any]) -> str:
    """The Compose project of this checkout's stack.

    While generated/state.json says a compose stack was started here, the name it was started
    under: `down` and `status` must find those containers even after COMPOSE_PROJECT or its
    default changed. A state file from before the name was recorded means the name of that time:
    COMPOSE_PROJECT as set, else `vllmstack`. Otherwise COMPOSE_PROJECT, whose default is derived
    from the checkout's path (the resolver fills it in), so two clones never share containers.
    """
    configured = resolved.get_str("COMPOSE_PROJECT")
    if previous.get("runtime") == "compose":
        recorded = previous.get("compose_project")
        if recorded:
            return str(recorded)
        if "compose_project" not in previous:
            source = resolved.source("COMPOSE_PROJECT") or "default"
            explicit = source != "default" and not source.startswith(DERIVED_FROM_CHECKOUT)
            return configured if explicit and configured else LEGACY_COMPOSE_PROJECT
    name = configured or default_compose_project(project.root)
    if not COMPOSE_PROJECT_NAME.match(name):
        raise compose.ComposeError(
            f"COMPOSE_PROJECT={name!r} (set at {resolved.source('COMPOSE_PROJECT') or 'default'}) "
            "is not a Compose project name",
            "use lowercase letters, digits, '-' and '_', starting with a letter or digit; or "
            "remove the line to use this checkout's own default")
    return name


def runs_several(requested: str) -> bool:
    """Whether this runtime runs several engines of one checkout at once (named engines, each
    with its own port, record, log and lock): the native runtime; Compose runs one."""
    return requested == MULTI_ENGINE_RUNTIME


def engine_placement(project: Project, resolved: Resolved, environ: Mapping[str, str],
                     requested: str) -> Placement:
    """Where the profile's engine runs on the runtime `requested` (its name, as `--runtime`
    takes it): the argv `check` builds for it is the one `up` records and the runtime starts."""
    if requested == "native":
        return native_placement(project, resolved, environ)
    return Placement()  # a container: the image's own program, templates at their mount


def open_runtime(project: Project, resolved: Resolved, environ: Mapping[str, str], runner: Runner,
                 requested: str, out: TextIO, *, compose_project: str | None = None,
                 slot: str = "") -> EngineRuntime:
    if requested == "native":
        engine = NativeEngine.for_stack(project, resolved, environ, runner, slot=slot)
        engine.out = out
        return engine
    if slot:
        raise SeveralEnginesError(
            f"several engines per checkout (engine {slot!r}) run on the native runtime only; "
            f"{requested} runs one engine per checkout",
            "use --runtime native (or RUNTIME=native), or run one engine at a time")
    cli = compose.detect_compose(runner, resolved.get_str("DOCKER"), requested)
    name = compose_project or compose_project_name(project, resolved, {})
    return compose.ComposeEngine(cli, runner, name, compose_files(project),
                                 project.generated / "compose.env",
                                 project=project, resolved=resolved, environ=environ, out=out)

"""Which runtime runs the engine: --runtime, else RUNTIME, else what the last `up` used, else detect."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TextIO

from vllmstack.config.profiles import Resolved
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime import compose
from vllmstack.runtime.base import EngineRuntime
from vllmstack.runtime.compose_files import compose_files
from vllmstack.runtime.native.engine import NativeEngine


def requested_runtime(resolved: Resolved, runtime: str | None, previous: Mapping[str, Any]) -> str:
    """The runtime asked for; `auto` reuses what `up` used (the compose flavour it detected)."""
    requested = runtime or resolved.get_str("RUNTIME")
    if requested == "auto" and previous.get("runtime"):
        requested = str(previous.get("flavour") or
                        ("native" if previous["runtime"] == "native" else "auto"))
    return requested


def open_runtime(project: Project, resolved: Resolved, environ: Mapping[str, str], runner: Runner,
                 requested: str, out: TextIO) -> EngineRuntime:
    if requested == "native":
        engine = NativeEngine.for_stack(project, resolved, environ, runner)
        engine.out = out
        return engine
    cli = compose.detect_compose(runner, resolved.get_str("DOCKER"), requested)
    return compose.ComposeEngine(cli, runner, resolved.get_str("COMPOSE_PROJECT"),
                                 compose_files(project), project.generated / "compose.env",
                                 project=project, resolved=resolved, environ=environ, out=out)

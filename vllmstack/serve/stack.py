"""One resolved profile on one runtime: what every lifecycle command works on."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TextIO

from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime.base import EngineRuntime
from vllmstack.runtime.gpu import GpuProbe, probe_for
from vllmstack.runtime.select import open_runtime, requested_runtime
from vllmstack.serve.state import read_state


class LifecycleError(StackError):
    """A lifecycle step failed; `cause` and `fix` are the last lines the user sees."""


def engine_url(resolved: Resolved) -> str:
    return f"http://127.0.0.1:{resolved.get_int('VLLM_PORT')}"


@dataclass
class Stack:
    """Everything `up`/`down`/`status` need about one resolved profile on one runtime."""

    project: Project
    resolved: Resolved
    environ: Mapping[str, str]
    runner: Runner
    engine: EngineRuntime
    probe: GpuProbe
    out: TextIO

    @property
    def url(self) -> str:
        return engine_url(self.resolved)

    @property
    def served_name(self) -> str:
        return self.resolved.get_str("VLLM_SERVED_NAME")


def open_stack(
    project: Project,
    resolved: Resolved,
    environ: Mapping[str, str],
    runner: Runner,
    *,
    runtime: str | None = None,
    probe: GpuProbe | None = None,
    out: TextIO | None = None,
) -> Stack:
    """Pick the runtime (--runtime, else RUNTIME, else what a previous `up` used, else detect)."""
    out = out or sys.stdout
    requested = requested_runtime(resolved, runtime, read_state(project) or {})
    probe = probe or probe_for(resolved.get_str("GPU_VENDOR"), runner,
                               unified_memory=resolved.get_bool("UNIFIED_MEMORY"))
    engine = open_runtime(project, resolved, environ, runner, requested, out)
    return Stack(project, resolved, environ, runner, engine, probe, out)

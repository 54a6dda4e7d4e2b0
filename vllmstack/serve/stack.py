"""One resolved profile on one runtime: what every lifecycle command works on."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TextIO

from vllmstack.config.profiles import Resolved
from vllmstack.core.checkout import engine_dir, stack_lock
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime.base import EngineRuntime
from vllmstack.runtime.gpu import GpuProbe, probe_for
from vllmstack.runtime.select import compose_project_name, open_runtime, requested_runtime
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
    # The Compose project name this checkout's stack runs under (None: not a compose runtime);
    # `up` records it in generated/state.json so that `down` finds the same containers.
    compose_project: str | None = None
    # The engine's name in the checkout: "" is `invoke up`'s default engine; the router runs one
    # named engine per profile, each with its own state, record, log, lock and port.
    slot: str = ""
    # The other named engines the caller runs beside this one (the router's pool): they do not
    # count as another engine holding the GPU; any other engine of the checkout does.
    siblings: frozenset[str] = frozenset()

    @property
    def url(self) -> str:
        return engine_url(self.resolved)

    @property
    def port(self) -> int:
        return self.resolved.get_int("VLLM_PORT")

    def lock(self, command: str, *, dry_run: bool = False, wait: float | None = None,
             stoppable: bool = False) -> AbstractContextManager[None]:
        """The stack lock for `up`/`down` (vllmstack.core.checkout); a dry run changes nothing
        and takes none. `stoppable`: this command ends cleanly on SIGTERM (see lifecycle.down)."""
        if dry_run:
            return contextlib.nullcontext()
        return stack_lock(engine_dir(self.project.generated, self.slot), command, wait=wait,
                          stoppable=stoppable, say=lambda line: print(line, file=self.out))

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
    slot: str = "",
    siblings: frozenset[str] = frozenset(),
) -> Stack:
    """Pick the runtime (--runtime, else RUNTIME, else what a previous `up` used, else detect).
    `slot`: one of the checkout's named engines (only runtimes that run several, see
    runtime.select.runs_several)."""
    out = out or sys.stdout
    previous = read_state(project, slot) or {}  # a corrupt state file is a StateError naming it
    requested = requested_runtime(resolved, runtime, previous, slot)
    probe = probe or probe_for(resolved.get_str("GPU_VENDOR"), runner,
                               unified_memory=resolved.get_bool("UNIFIED_MEMORY"),
                               standin=resolved.get_str("GPU_MEMORY_DIR"))
    name = None if requested == "native" else compose_project_name(project, resolved, previous)
    engine = open_runtime(project, resolved, environ, runner, requested, out, compose_project=name,
                          slot=slot)
    return Stack(project, resolved, environ, runner, engine, probe, out, name, slot,
                 frozenset(siblings) - {slot})

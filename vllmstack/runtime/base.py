"""The runtime seam: how an engine is prepared, started, watched, logged and stopped.

Two implementations: Compose (a container: vllmstack.runtime.compose) and a native process group
(vllmstack.runtime.native). Everything runtime-specific sits behind this interface, so the
serving layer (`up`/`down`/`status`) never asks which runtime it has. A new runtime implements
this Protocol and is chosen in vllmstack.runtime.select.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core.runner import Result


@dataclass(frozen=True)
class EngineState:
    """What the runtime says about the engine process or container."""

    exists: bool
    running: bool
    status: str  # running | exited | restarting | created | dead | missing | stale
    restart_count: int = 0
    exit_code: int | None = None
    details: dict[str, Any] = field(default_factory=dict)


MISSING = EngineState(exists=False, running=False, status="missing")


@dataclass(frozen=True)
class Beside:
    """Where a Python module of this package runs with the engine's own torch and transformers,
    for work done before the engine starts (the fp8 KV calibration): the engine's interpreter on
    the host (native), or a one-off container of the engine service, with its devices, user,
    caches and mounts (compose). `vllmstack` is importable there either way."""

    # What a result measured there depends on: the engine version, and the interpreter or image.
    identity: dict[str, str]
    dry_run: bool
    # A host path as the process sees it; None: it cannot see it.
    see: Callable[[Path], str | None]
    # `python ARGS`, with these host folders writable at the same path, under a timeout in seconds.
    run: Callable[[Sequence[str], Sequence[Path], float], Result]


class EngineRuntime(Protocol):
    name: str  # "compose" | "native": what `invoke status` reports

    @property
    def flavour(self) -> str:
        """The concrete variant (compose, compose-v1, podman, native), so later calls reuse it."""
        ...

    def prepare(self, command: ServeCommand, *, dry_run: bool) -> list[str]:
        """Everything before start (images, folders, rendered files); returns notes for the user.
        `command` was built for this runtime's placement (runtime/select.engine_placement): it
        is what `start` runs and what `up` records."""
        ...

    def beside(self, command: ServeCommand) -> Beside:
        """Where a module runs beside the engine (see Beside); `command`: the profile's engine
        command, which a container runtime renders its files for before running anything."""
        ...

    def start(self) -> None:
        """Start (or recreate) the engine; returns once it is launched, not healthy."""
        ...

    def state(self) -> EngineState: ...

    def log_lines(self, tail: int = 400) -> list[str]: ...

    def log_command(self, *, tail: int, follow: bool, service: str) -> list[str] | None:
        """The argv that streams a service's log, or None when `log_lines` is all there is."""
        ...

    def exec_command(self, command: Sequence[str], *, tty: bool) -> list[str]:
        """The argv that runs `command` beside the engine (raises where there is nowhere to run)."""
        ...

    def stop(self) -> None:
        """Stop the engine (keeping its log where the runtime can)."""
        ...

    def remove(self) -> list[str] | None:
        """Stop and remove everything this runtime started. Returns what it found but left
        alone because this checkout did not start it (each line names it), if anything."""
        ...

    def members(self) -> list[dict[str, Any]]:
        """Containers or processes, for `invoke status`."""
        ...

    def dashboard_up(self) -> None:
        """Start the dashboard beside the engine unless it runs (idempotent); raise a StackError
        with cause and fix when it cannot (`up` then warns and keeps the engine)."""
        ...

    def dashboard_down(self) -> None:
        """Stop the dashboard; `remove` stops it too."""
        ...

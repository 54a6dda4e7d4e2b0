"""The runtime seam: how an engine is started, watched, logged and stopped.

Two implementations: Compose (a container, vllmstack.runtime.compose) and a native process group
(vllmstack.runtime.native.engine). Everything else in `up`/`down`/`status` is shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


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


class EngineRuntime(Protocol):
    name: str  # "compose" | "native": what `invoke status` reports

    @property
    def flavour(self) -> str:
        """The concrete variant (compose, compose-v1, podman, native), so later calls reuse it."""
        ...

    def start(self) -> None:
        """Start (or recreate) the engine; returns once it is launched, not healthy."""
        ...

    def state(self) -> EngineState: ...

    def log_lines(self, tail: int = 400) -> list[str]: ...

    def stop(self) -> None:
        """Stop the engine (keeping its log where the runtime can)."""
        ...

    def remove(self) -> None:
        """Stop and remove everything this runtime started."""
        ...

    def members(self) -> list[dict[str, Any]]:
        """Containers or processes, for `invoke status`."""
        ...

"""The engine pool's vocabulary: model states, a load's outcome, a swap's record, the errors a
request can get, and the Lifecycle interface loads and unloads go through (stacks.StackLifecycle
for real, fakes in tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllmstack.core.errors import StackError
from vllmstack.router.catalog import Catalog, Entry

UNLOADED, LOADING, READY, FAILED, UNLOADING = "unloaded", "loading", "ready", "failed", "unloading"


class RouterBusyError(StackError):
    """A request waited longer than its load timeout for its model."""


class LoadFailedError(StackError):
    """The model could not be loaded; cause and fix are the diagnosis."""


@dataclass(frozen=True)
class Loaded:
    """A load's outcome: where the engine answers, and how long its boot and warm-up took."""

    url: str
    boot_s: float = 0.0  # start to /health 200 (the engine's own start)
    warmup_s: float = 0.0


class Lifecycle(Protocol):
    """How the manager loads and unloads (serve.lifecycle for real; a fake in unit tests).
    Every method blocks and is called from a worker thread."""

    def load(self, entry: Entry) -> Loaded:
        """Start the engine (as `invoke up`); once healthy and warm. StackError on failure."""

    def unload(self, entry: Entry) -> None:
        """Stop it (as `invoke down`), returning once its memory is released."""

    def abort(self, entry: Entry) -> None:
        """Cut a boot short (the router is stopping): the load then fails at once."""

    def adoptable(self, catalog: Catalog) -> Entry | None:
        """A healthy engine of one of the catalog's profiles that is already running."""


@dataclass
class ModelStatus:
    state: str = UNLOADED
    error: dict[str, str] | None = None  # {"cause", "fix"} of the last failure
    since: float = field(default_factory=time.time)


@dataclass
class Swap:
    """One switch: the old engine's stop time, the new one's start, and the whole."""

    unloaded: str | None
    loaded: str | None
    stop_s: float
    start_s: float
    total_s: float
    ok: bool
    reason: str  # "request", "unload", "idle"
    at: float = field(default_factory=time.time)
    error: str | None = None
    boot_s: float = 0.0  # of start_s: the engine's boot to /health 200
    warmup_s: float = 0.0  # of start_s: the warm-up request

    def as_dict(self) -> dict[str, Any]:
        return {"unloaded": self.unloaded, "loaded": self.loaded, "stop_s": round(self.stop_s, 3),
                "start_s": round(self.start_s, 3), "boot_s": round(self.boot_s, 3),
                "warmup_s": round(self.warmup_s, 3), "total_s": round(self.total_s, 3),
                "ok": self.ok, "reason": self.reason, "at": self.at, "error": self.error}

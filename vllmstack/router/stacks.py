"""Loads and unloads through the serving lifecycle, exactly as `invoke up` / `invoke down` do.

What a lifecycle call prints (checks' warnings, the boot progress, the diagnosis) goes to the
model's own log, generated/router/<profile>.log, and line by line, named, to the router's log.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO, cast

from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.observe.health import health_status
from vllmstack.router.catalog import Catalog, Entry
from vllmstack.router.engines import Loaded
from vllmstack.serve import lifecycle
from vllmstack.serve.stack import Stack
from vllmstack.serve.state import StateError, read_state

ROUTER_DIR = "router"
# `down` waits this long for the GPU memory to be released (as `invoke down` does by default).
DOWN_TIMEOUT_S = 120.0


class LineLog(io.TextIOBase):
    """A text sink for a lifecycle call: every write goes to the model's log file at once, and
    each complete line to `say`, prefixed with the model's name."""

    def __init__(self, path: Path, say: Callable[[str], None], prefix: str) -> None:
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._say, self._prefix, self._partial = say, prefix, ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._file.write(text)
            self._file.flush()
            *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._say(f"{self._prefix}{line}")
        return len(text)

    def isatty(self) -> bool:
        return False  # the progress display prints plain lines, never carriage returns

    def close(self) -> None:
        if self._partial:
            self._say(f"{self._prefix}{self._partial}")
            self._partial = ""
        self._file.close()
        super().close()


class StackLifecycle:
    """engines.Lifecycle over serve.lifecycle: load = `up` (no dashboard side-car: the
    dashboard follows one engine, not a router), unload = `down`."""

    def __init__(self, project: Project, environ: Mapping[str, str], runner: Runner, *,
                 say: Callable[[str], None], runtime: str | None = None) -> None:
        self.project, self.environ, self.runner = project, environ, runner
        self.say, self.runtime = say, runtime

    def log_path(self, entry: Entry) -> Path:
        return self.project.generated / ROUTER_DIR / f"{entry.profile}.log"

    @contextmanager
    def stack(self, entry: Entry) -> Iterator[Stack]:
        out = LineLog(self.log_path(entry), self.say, f"[{entry.id}] ")
        try:
            yield lifecycle.open_stack(self.project, entry.resolved, self.environ, self.runner,
                                       runtime=self.runtime, out=cast(TextIO, out))
        finally:
            out.close()

    def load(self, entry: Entry) -> Loaded:
        with self.stack(entry) as stack:
            try:
                result = lifecycle.up(stack, dashboard=False)
            except StackError as exc:
                print(exc.render(), file=stack.out)  # the evidence (log lines) and the diagnosis
                self._end_started(entry, stack)
                raise
            return Loaded(result.url, result.boot_seconds, result.warmup_seconds or 0.0)

    def _end_started(self, entry: Entry, stack: Stack) -> None:
        """A load that failed after its engine started (the warm-up request failed): end that
        engine, or every later load would be refused while it holds the GPU. An engine that
        `up` did not start for this profile (another profile's, a user's) is never touched."""
        try:
            started_here = (read_state(self.project) or {}).get("profile") == entry.profile
        except StateError:
            return
        if started_here and stack.engine.state().running:
            try:
                lifecycle.down(stack, timeout=DOWN_TIMEOUT_S)
            except StackError as exc:
                print(f"the failed load's engine did not stop: {exc.render()}", file=stack.out)

    def unload(self, entry: Entry) -> None:
        with self.stack(entry) as stack:
            try:
                lifecycle.down(stack, timeout=DOWN_TIMEOUT_S)
            except StackError as exc:
                print(exc.render(), file=stack.out)
                raise

    def abort(self, entry: Entry) -> None:
        with self.stack(entry) as stack:
            stack.engine.stop()

    def adoptable(self, catalog: Catalog) -> Entry | None:
        """The engine generated/state.json names, when it is one of the catalog's profiles on its
        platform and it runs and answers /health with 200."""
        try:
            state = read_state(self.project) or {}
        except StateError as exc:
            self.say(f"warning: nothing adopted: {exc.cause}")
            return None
        entry = catalog.by_profile(str(state.get("profile", "")))
        if entry is None or state.get("platform") != catalog.platform:
            if state:
                self.say(f"not adopting the engine of generated/state.json (profile "
                         f"{state.get('profile')} on {state.get('platform')}): not one of the "
                         "router's profiles; a load will refuse while it runs")
            return None
        with self.stack(entry) as stack:
            if stack.engine.state().running and health_status(stack.url) == 200:
                return entry
        return None

"""A router load that fails after its engine started leaves no engine behind (issue 14)."""

from __future__ import annotations

import io
from typing import Any

import pytest

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner
from vllmstack.router.catalog import Entry
from vllmstack.router.stacks import StackLifecycle
from vllmstack.runtime.base import EngineState
from vllmstack.serve import lifecycle
from vllmstack.serve.state import write_state


class Running:
    """What open_stack gives: an engine that runs until `down` ends it."""

    def __init__(self) -> None:
        self.running = True

    def state(self) -> EngineState:
        return EngineState(True, self.running, "running" if self.running else "missing")


@pytest.mark.parametrize("started_here", [True, False])
def test_a_load_that_fails_after_the_engine_started_ends_that_engine_only(
        project: Project, monkeypatch: pytest.MonkeyPatch, started_here: bool) -> None:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ={})
    entry = Entry("qwen3-0.6b", "qwen3-0.6b", "vllm", resolved, 0.0)
    engine = Running()
    downs: list[str] = []

    class FakeStack:
        def __init__(self) -> None:
            self.engine, self.out = engine, io.StringIO()

    def fake_open(*args: Any, **kwargs: Any) -> FakeStack:
        return FakeStack()

    def failing_up(stack: Any, **kwargs: Any) -> Any:
        # `up` records the profile when it starts the engine; then the warm-up request fails.
        write_state(project, {"profile": "qwen3-0.6b" if started_here else "someone-else"})
        raise lifecycle.LifecycleError("the warm-up request failed: timed out",
                                       "the engine is up but does not answer; see `invoke logs`")

    def fake_down(stack: Any, **kwargs: Any) -> bool:
        downs.append("down")
        engine.running = False
        return True

    monkeypatch.setattr(lifecycle, "open_stack", fake_open)
    monkeypatch.setattr(lifecycle, "up", failing_up)
    monkeypatch.setattr(lifecycle, "down", fake_down)
    loads = StackLifecycle(project, {}, RecordingRunner(), say=lambda line: None)
    with pytest.raises(lifecycle.LifecycleError, match="warm-up request failed"):
        loads.load(entry)
    # Its own engine is ended (later loads would be refused while it holds the GPU); an engine
    # that this load did not start is left alone.
    assert downs == (["down"] if started_here else [])
    assert engine.running is not started_here

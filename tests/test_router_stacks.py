"""A router load that fails after its engine started leaves no engine behind (issue 14)."""

from __future__ import annotations

import io
from typing import Any

import pytest

from vllmstack.config.profiles import resolve
from vllmstack.config.schema import load_schema
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner
from vllmstack.router.catalog import Entry
from vllmstack.router.stacks import StackLifecycle
from vllmstack.runtime.base import EngineState
from vllmstack.runtime.engine_env import engine_environment
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


@pytest.mark.parametrize("frees", ["kv", "all"])
def test_an_engine_whose_sleep_frees_the_kv_cache_only_gets_the_plugin(
        project: Project, monkeypatch: pytest.MonkeyPatch, frees: str) -> None:
    """ROUTER_SLEEP_FREES=kv: the engine's environment puts engine-plugins first on its
    PYTHONPATH, keeps the path the profile gave (or the router's own), and turns the plugin on;
    without it, nothing of the plugin reaches the engine."""
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ={},
                       overrides=["ENGINE_ENV=PYTHONPATH=/opt/mine HF_HUB_OFFLINE=1"])
    entry = Entry("qwen3-0.6b", "qwen3-0.6b", "vllm", resolved, 0.0)
    seen: list[Any] = []

    class Up:
        url, boot_seconds, warmup_seconds = "http://127.0.0.1:1", 1.0, 0.1

    def fake_open(project: Project, resolved: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(resolved)
        return type("FakeStack", (), {"engine": Running(), "out": io.StringIO()})()

    monkeypatch.setattr(lifecycle, "open_stack", fake_open)
    monkeypatch.setattr(lifecycle, "up", lambda stack, **kwargs: Up())
    loads = StackLifecycle(project, {"PYTHONPATH": "/tmp/site"}, RecordingRunner(),
                           say=lambda line: None)
    loads.load(entry, 0.5, True, frees)
    env = engine_environment(seen[0], load_schema())
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    if frees == "kv":
        plugins = project.root / "engine-plugins"
        assert env["PYTHONPATH"] == f"{plugins}:/opt/mine"
        assert env["VLLMSTACK_SLEEP_FREES"] == "kv"
        assert (plugins / "vllmstack_sleep-1.0.dist-info" / "entry_points.txt").is_file()
        # Where it reads what each sleep frees: kv at its start, what the router says before
        # each /sleep (all: the tier `asleep`, its weights to host RAM).
        said = loads.frees_path(entry)
        assert env["VLLMSTACK_SLEEP_FREES_FILE"] == str(said) and said.read_text() == "kv\n"
        posted: list[tuple[str, str]] = []
        monkeypatch.setattr(loads, "_post", lambda e, path, what: posted.append(
            (path, said.read_text())))
        monkeypatch.setattr(loads, "probe", type("P", (), {"memory": staticmethod(lambda: None)}))
        loads.sleep(entry, "all")
        loads.sleep(entry, "kv")
        assert posted == [("/sleep?level=1", "all\n"), ("/sleep?level=1", "kv\n")]
        assert loads._last_frees(entry) == "kv"  # what a router adopting it reads its tier from
    else:
        assert env["PYTHONPATH"] == "/opt/mine" and "VLLMSTACK_SLEEP_FREES" not in env
        assert "VLLMSTACK_SLEEP_FREES_FILE" not in env and not loads.frees_path(entry).exists()
        assert loads._last_frees(entry) is None
    # Without a path of the profile's own, the router's is kept behind the plugin.
    bare = Entry("qwen3-0.6b", "qwen3-0.6b", "vllm",
                 resolve(project, platform="cpu", model="qwen3-0.6b", environ={}), 0.0)
    loads.load(bare, 0.5, True, frees)
    env = engine_environment(seen[1], load_schema())
    assert env.get("PYTHONPATH") == (f"{project.root / 'engine-plugins'}:/tmp/site"
                                     if frees == "kv" else None)

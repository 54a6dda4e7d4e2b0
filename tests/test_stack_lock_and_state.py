"""One stack, one command at a time; a state file that cannot be read is named; one Compose
project per checkout.

The lock: `up`, `down` and `install-engine` of one checkout hold generated/stack.lock (flock). A
second command waits a bounded time, then refuses, naming the holder's command and pid. The
real two-`up` race against the engine simulator is in tests/integration/test_native_lifecycle.py.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import ROOT, copy_project, free_port, write_dotenv

from vllmstack.config.profiles import resolve
from vllmstack.config.view import render_config
from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core import checkout
from vllmstack.core.checkout import LockBusyError, default_compose_project, stack_lock
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.runtime.base import MISSING, EngineState
from vllmstack.runtime.compose import ComposeEngine, ComposeError
from vllmstack.runtime.native import install
from vllmstack.runtime.select import LEGACY_COMPOSE_PROJECT, compose_project_name
from vllmstack.serve import lifecycle
from vllmstack.serve.stack import Stack, open_stack
from vllmstack.serve.state import StateError, read_state

HOLD = """
import sys, time
from pathlib import Path
from vllmstack.core.checkout import stack_lock
with stack_lock(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(project: Project) -> Iterator[subprocess.Popen[str]]:
    """Another process holding this stack's lock as `invoke up` would."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(project.generated), "up"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


# --- the lock ------------------------------------------------------------------------------------

def test_a_second_command_waits_then_refuses_naming_the_holder(
        project: Project, holder: subprocess.Popen[str]) -> None:
    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(LockBusyError) as err, stack_lock(project.generated, "down", wait=0.5,
                                                    say=said.append):
        raise AssertionError("must not run while another command holds the lock")
    assert 0.5 <= time.monotonic() - started < 5
    assert said == [f"waiting up to 0.5 s for `invoke up` (pid {holder.pid}, for 0 s: "
                    f"{sys.executable} -c " + said[0].split(" -c ", 1)[1]]
    assert f"`invoke up` (pid {holder.pid}" in err.value.cause
    assert "`invoke down` did nothing" in err.value.cause
    assert err.value.fix is not None and "kill the pid named above" in err.value.fix


def test_the_waiter_goes_ahead_when_the_holder_ends_even_by_sigkill(
        project: Project, holder: subprocess.Popen[str]) -> None:
    said: list[str] = []
    threading.Timer(0.5, lambda: os.kill(holder.pid, signal.SIGKILL)).start()
    ran = False
    with stack_lock(project.generated, "up", wait=10, say=said.append):
        ran = True
        # Now this process is the one named as holder.
        data = json.loads((project.generated / "stack.lock").read_text())
        assert (data["pid"], data["command"]) == (os.getpid(), "up")
    assert ran and said[-1] == "the stack lock is free; `invoke up` goes ahead"


def test_the_lock_file_is_private_kept_and_nested_use_does_not_wait_for_itself(
        project: Project) -> None:
    # Nested in one process (up -> down, say): no waiting for itself.
    with stack_lock(project.generated, "up", wait=0.2), stack_lock(project.generated, "down",
                                                                   wait=0.2):
        pass
    # Another thread of the same process is another command: it waits.
    with stack_lock(project.generated, "up", wait=0.2):
        failed: list[BaseException] = []

        def second() -> None:
            try:
                with stack_lock(project.generated, "down", wait=0.2):
                    pass
            except LockBusyError as exc:
                failed.append(exc)

        thread = threading.Thread(target=second)
        thread.start()
        thread.join()
        assert len(failed) == 1 and f"(pid {os.getpid()}" in str(failed[0])
    path = project.generated / "stack.lock"
    inode = path.stat().st_ino
    assert path.stat().st_mode & 0o777 == 0o600
    with stack_lock(project.generated, "up", wait=0.2):
        pass
    assert path.stat().st_ino == inode  # never replaced: a new inode would be a second lock


@dataclass
class Engine:
    """A runtime that only records what it was asked to do."""

    calls: list[str] = field(default_factory=list)
    running: bool = False
    name: str = "fake"
    flavour: str = "fake"

    def prepare(self, command: ServeCommand, *, dry_run: bool) -> list[str]:
        self.calls.append("prepare")
        return []

    def start(self) -> None:
        self.calls.append("start")

    def state(self) -> EngineState:
        return EngineState(True, True, "running") if self.running else MISSING

    def log_lines(self, tail: int = 400) -> list[str]:
        return []

    def stop(self) -> None:
        self.calls.append("stop")

    def remove(self) -> None:
        self.calls.append("remove")

    def members(self) -> list[dict[str, object]]:
        return []

    def dashboard_up(self) -> None:
        self.calls.append("dashboard_up")


@dataclass
class NoProbe:
    def missing_devices(self) -> list[str]:
        return []

    def memory(self) -> None:
        return None


def fake_stack(project: Project, engine: Engine, compose_project: str | None = None) -> Stack:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ={}, overrides=[
        f"VLLM_PORT={free_port()}", "OTHER_ENGINE_PORTS="])
    return Stack(project, resolved, {}, RecordingRunner(), engine, NoProbe(),  # type: ignore[arg-type]
                 io.StringIO(), compose_project)


def test_up_and_down_refuse_under_a_held_lock_and_touch_nothing(
        project: Project, holder: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkout, "LOCK_WAIT_S", 0.3)
    engine = Engine()
    stack = fake_stack(project, engine)
    for command, call in (("up", lambda: lifecycle.up(stack, dashboard=False)),
                          ("down", lambda: lifecycle.down(stack))):
        with pytest.raises(LockBusyError, match=rf"(?s)pid {holder.pid}.*`invoke {command}` did nothing"):
            call()
    assert engine.calls == []
    assert "waiting up to 0.3 s for `invoke up`" in stack.out.getvalue()  # type: ignore[attr-defined]
    # A dry run changes nothing, so it neither takes nor waits for the lock.
    lifecycle.down(stack, dry_run=True)
    assert engine.calls == ["remove"]


def test_install_engine_holds_the_stack_lock(project: Project, holder: subprocess.Popen[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkout, "LOCK_WAIT_S", 0.3)
    runner = RecordingRunner()
    with pytest.raises(LockBusyError, match=rf"(?s)pid {holder.pid}.*`invoke install-engine` did nothing"):
        install.install_engine(project, runner, version="0.31.0", python=sys.executable,
                               environ={}, out=io.StringIO())
    assert runner.calls == []  # not even the interpreter was asked for its version
    dry = RecordingRunner(dry_run=True)
    dry.respond([sys.executable, "-c"], Result((), 0, "3.11\n"))
    install.install_engine(project, dry, version="0.31.0", python=sys.executable, environ={},
                           out=io.StringIO())
    assert dry.calls  # a dry run does not wait for the lock


# --- the state file --------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "message"), [
    ('{"runtime": "compose", "compose_pro', r"generated/state\.json is not valid JSON"),
    ("", r"generated/state\.json is not valid JSON"),
    ('["compose"]', r"generated/state\.json holds a JSON list, not an object"),
    ('{"runtime": "compose", "compose_project": 5}', r"compose_project is 5, which no"),
    ('{"runtime": true}', r"runtime is True"),
])
def test_a_damaged_state_file_is_an_error_that_names_it(project: Project, text: str,
                                                        message: str) -> None:
    project.generated.mkdir()
    (project.generated / "state.json").write_text(text)
    with pytest.raises(StateError, match=message) as err:
        read_state(project)
    assert err.value.fix is not None and "mv generated/state.json" in err.value.fix
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ={})
    with pytest.raises(StateError, match=message):
        open_stack(project, resolved, {}, RecordingRunner(), runtime="native")


def test_invoke_status_and_down_on_a_damaged_state_file_say_so_without_a_traceback(
        tmp_path: Path) -> None:
    root = copy_project(tmp_path / "stack")
    write_dotenv(root, {"VLLM_PORT": str(free_port()), "RUNTIME": "native"})
    (root / "generated").mkdir()
    damaged = '{"runtime": "comp'
    (root / "generated" / "state.json").write_text(damaged)

    def invoke(*task: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "invoke", *task], cwd=root, text=True,
                              capture_output=True, timeout=120, check=False,
                              env={**os.environ, "HOME": str(tmp_path)})

    # status reads it and says so; it changes nothing.
    done = invoke("status")
    assert done.returncode == 1
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-2].startswith("error: generated/state.json is not valid JSON"), lines
    assert lines[-1].startswith("fix:   move it aside")
    # down still works: the file is set aside (renamed, its text kept), then the stack stopped.
    done = invoke("down")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stdout.startswith("warning: generated/state.json is not valid JSON")
    [aside] = (root / "generated").glob("state.json.damaged-*")
    assert aside.read_text() == damaged and aside.name in done.stdout
    assert not (root / "generated" / "state.json").exists()
    assert done.stdout.rstrip().endswith("stopped")


# --- one Compose project per checkout -----------------------------------------------------------------

def test_the_default_compose_project_is_per_checkout_and_explained(tmp_path: Path) -> None:
    one, two = (Project(copy_project(tmp_path / name)) for name in ("one", "two"))
    names = []
    for project in (one, two):
        resolved = resolve(project, environ={})
        name = resolved.get_str("COMPOSE_PROJECT")
        assert name == default_compose_project(project.root)
        assert name.startswith("vllmstack-") and len(name) == len("vllmstack-") + 8
        explained = json.loads(render_config(resolved, explain=True, as_json=True))
        assert explained["COMPOSE_PROJECT"] == {
            "value": name, "source": f"derived from the checkout path {project.root}"}
        names.append(name)
    assert names[0] != names[1]
    # The same checkout, reached through another path spelling, is the same stack.
    assert default_compose_project(one.root / "env" / "..") == names[0]
    # A value set in .env wins, and says where it was set.
    (one.root / ".env").write_text(one.dotenv_example.read_text() + "COMPOSE_PROJECT=mine\n")
    resolved = resolve(one, environ={})
    assert resolved.get_str("COMPOSE_PROJECT") == "mine"
    assert resolved.source("COMPOSE_PROJECT", ).startswith(".env:")  # type: ignore[union-attr]


def test_down_and_status_find_the_project_a_stack_was_started_under(project: Project) -> None:
    resolved = resolve(project, environ={})
    derived = default_compose_project(project.root)
    assert compose_project_name(project, resolved, {}) == derived
    # Recorded by `up`: used while that stack may run, whatever the setting says now.
    recorded = {"runtime": "compose", "compose_project": "vllmstack-0123abcd"}
    assert compose_project_name(project, resolved, recorded) == "vllmstack-0123abcd"
    # A state file of an `up` from before the name was recorded: the default of that time ...
    legacy = {"runtime": "compose", "flavour": "compose"}
    assert compose_project_name(project, resolved, legacy) == LEGACY_COMPOSE_PROJECT == "vllmstack"
    # ... or the name the user had set then (and still sets).
    mine = resolve(project, environ={}, overrides=["COMPOSE_PROJECT=mine"])
    assert compose_project_name(project, mine, legacy) == "mine"
    # A native stack's state says nothing about Compose.
    assert compose_project_name(project, resolved, {"runtime": "native"}) == derived


@pytest.mark.parametrize("bad", ["My Stack", "-x", "a/b", "ÄÖ"])
def test_an_invalid_compose_project_is_refused_with_its_source(project: Project, bad: str) -> None:
    resolved = resolve(project, environ={}, overrides=[f"COMPOSE_PROJECT={bad}"])
    with pytest.raises(ComposeError, match=r"COMPOSE_PROJECT=.* \(set at --set\) is not a Compose "
                                           r"project name") as err:
        compose_project_name(project, resolved, {})
    assert err.value.fix is not None and "lowercase" in err.value.fix


def test_open_stack_uses_the_legacy_name_and_up_records_the_one_it_used(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    project.generated.mkdir()
    (project.generated / "state.json").write_text(json.dumps({"runtime": "compose",
                                                              "flavour": "compose"}))
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ={})
    stack = open_stack(project, resolved, {}, RecordingRunner(), runtime="compose")
    assert isinstance(stack.engine, ComposeEngine)
    assert stack.engine.project_name == stack.compose_project == "vllmstack"
    # `down` removes the state file; the next `up` uses this checkout's own name and records it.
    (project.generated / "state.json").unlink()
    stack = open_stack(project, resolved, {}, RecordingRunner(), runtime="compose")
    assert stack.compose_project == default_compose_project(project.root)
    engine = Engine()
    fake = fake_stack(project, engine, stack.compose_project)
    monkeypatch.setattr(lifecycle, "wait_until_healthy", lambda *args, **kw: 1.0)
    monkeypatch.setattr(lifecycle, "warm_up", lambda *args, **kw: 0.1)
    lifecycle.up(fake, dashboard=False)
    assert engine.calls == ["prepare", "start"]
    state = read_state(project)
    assert state is not None and state["compose_project"] == default_compose_project(project.root)
    assert (project.generated / "stack.lock").is_file()

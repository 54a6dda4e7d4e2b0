"""Several engines in one checkout (issue 21): named engines on the native runtime, each with its
own port, state, record, log and lock, through the real lifecycle (`up`, `status`, `down`) with
the engine simulator as the engine.

The router runs one named engine per profile; these tests drive the serving layer the way it
does (open_stack with a name and the pool's other names as siblings), so what they prove holds
for `invoke router` and for anything else that starts named engines.
"""

from __future__ import annotations

import io
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, simulator_project

from vllmstack.config.profiles import resolve
from vllmstack.core.checkout import checkout_id, engine_dir
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner
from vllmstack.observe.health import health_status
from vllmstack.runtime.native.records import read_record
from vllmstack.runtime.select import SeveralEnginesError
from vllmstack.serve import lifecycle
from vllmstack.serve.stack import LifecycleError, Stack

PROFILES = {"sim-a": "SIM_BOOT_SECONDS=0.2", "sim-b": "SIM_BOOT_SECONDS=0.2"}


def marked(root: Path) -> dict[str, list[int]]:
    """Live processes carrying one of this checkout's engine markers, by marker prefix."""
    checkout = checkout_id(root)
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        for item in environ:
            value = item.partition(b"=")[2].decode()
            if item.startswith(b"VLLMSTACK_ENGINE_ID=") and value.startswith(checkout) \
                    and state not in ("Z", "X"):
                key = value.rsplit("@", 1)[0] + "@" if "@" in value else value.split("-")[0] + "-"
                found.setdefault(key, []).append(int(entry.name))
    return found


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Project]:
    root = simulator_project(tmp_path / "stack", PROFILES, port=free_port())
    yield Project(root)
    for pids in marked(root).values():
        for pid in pids:
            os.kill(pid, signal.SIGKILL)


def open_named(project: Project, profile: str, port: int, *, slot: str | None = None,
               siblings: frozenset[str] = frozenset(), out: io.StringIO | None = None) -> Stack:
    resolved = resolve(project, model=profile, overrides=[f"VLLM_PORT={port}"], environ=os.environ)
    return lifecycle.open_stack(project, resolved, os.environ, SubprocessRunner(),
                                out=out or io.StringIO(),
                                slot=profile if slot is None else slot, siblings=siblings)


@pytest.mark.slow  # two boots, a third refused, one down: about 6 s
def test_two_named_engines_run_side_by_side_and_down_stops_them_all(project: Project) -> None:
    pool = frozenset(PROFILES)
    port_a, port_b = free_port(), free_port()
    a = open_named(project, "sim-a", port_a, siblings=pool)
    lifecycle.up(a, dashboard=False)
    b = open_named(project, "sim-b", port_b, siblings=pool)
    lifecycle.up(b, dashboard=False)
    # Both answer, each on its own port, each with its own state, record, lock and log.
    assert health_status(a.url) == 200 and health_status(b.url) == 200
    checkout = checkout_id(project.root)
    groups = marked(project.root)
    assert set(groups) == {f"{checkout}@sim-a@", f"{checkout}@sim-b@"}, groups
    for name in PROFILES:
        folder = engine_dir(project.generated, name)
        assert (folder / "state.json").is_file() and (folder / "stack.lock").is_file()
        assert (folder / "native" / "engine.log").read_text().strip()
        record = read_record(project, name)
        assert record is not None and record.marker.startswith(f"{checkout}@{name}@")
    assert not (project.generated / "state.json").exists()  # the default engine is not started
    # Starting one again (same command) leaves the other alone.
    lifecycle.up(open_named(project, "sim-a", port_a, siblings=pool), dashboard=False)
    assert health_status(b.url) == 200
    # A stack that does not count them as siblings (a plain `invoke up`) is refused, naming one.
    plain = open_named(project, "sim-a", free_port(), slot="")
    with pytest.raises(LifecycleError) as refused:
        lifecycle.up(plain, dashboard=False)
    assert "engine 'sim-a' of profile sim-a" in refused.value.cause
    assert "another engine of this checkout" in refused.value.cause
    # `status` (the default engine's) lists both, each in its own place.
    report = lifecycle.status(plain)
    assert [(e["name"], e["state"], e["url"]) for e in report["engines"]] == [
        ("sim-a", "healthy", a.url), ("sim-b", "healthy", b.url)]
    assert "engine sim-b: healthy (profile sim-b" in lifecycle.render_status(report)
    # Stopping one named engine stops only it.
    lifecycle.down(a, timeout=10)
    assert health_status(a.url) is None and health_status(b.url) == 200
    assert set(marked(project.root)) == {f"{checkout}@sim-b@"}
    # `down` of the default engine stops every engine of the checkout.
    lifecycle.down(plain, timeout=10)
    assert marked(project.root) == {} and health_status(b.url) is None
    assert not (engine_dir(project.generated, "sim-b") / "state.json").exists()


def test_compose_runs_no_named_engine(project: Project) -> None:
    resolved = resolve(project, model="sim-a", environ=os.environ)
    with pytest.raises(SeveralEnginesError) as refused:
        lifecycle.open_stack(project, resolved, os.environ, SubprocessRunner(), runtime="compose",
                             out=io.StringIO(), slot="sim-a")
    assert "native runtime only" in refused.value.cause and "--runtime native" in refused.value.fix

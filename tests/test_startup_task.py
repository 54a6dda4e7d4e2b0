"""`invoke startup` and how `up` records each boot: state.json (`status`), boot.json (after
`down`), results/boot_history.jsonl (`--history`); with a fake engine replaying a real log."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_lifecycle_units import RUNNING, DashboardEngine, FakeProbe

from vllmstack.checks.registry import run_checks
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner
from vllmstack.runtime.base import EngineState
from vllmstack.runtime.compile_cache import compile_key, read_boots_with
from vllmstack.serve import lifecycle, startup
from vllmstack.serve.boot_markers import COMPILE, STARTING, WARM_UP
from vllmstack.serve.state import read_state, state_path

DATA = Path(__file__).parent / "data"
STAMP = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")


def invoke(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root, text=True,
                          capture_output=True, check=False, timeout=120)


def test_startup_of_a_saved_log_as_json_and_as_a_table(project: Project) -> None:
    log = DATA / "boot.log"
    done = invoke(project.root, "startup", "--log", str(log), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["source"], data["engine"], data["compile"]) == (str(log), "vllm", "cold")
    assert data["agrees"] is True and data["complete"] is True
    assert abs(data["sum_s"] - data["wall_s"]) <= 0.05 * data["wall_s"]
    phases = {p["name"]: p for p in data["phases"]}
    assert phases[COMPILE]["seconds"] == pytest.approx(13.66) and phases[COMPILE]["logged_s"] == 13.66
    assert set(data["phases"][0]) == {"name", "start_s", "seconds", "line", "logged_s"}
    table = invoke(project.root, "startup", "--log", str(log))
    assert table.returncode == 0, table.stderr
    assert "cold (torch.compile compiled)" in table.stdout
    assert re.search(r"compiling +13\.7 +21\.0 %  cold \(compiled: cache miss\); vLLM logged 13\.66 s",
                     table.stdout), table.stdout
    assert "sum 65.0 s of 65.0 s wall (100.0 %)" in table.stdout


def test_startup_refusals_say_what_to_do(project: Project, tmp_path: Path) -> None:
    missing = invoke(project.root, "startup", "--log", str(tmp_path / "nope.log"))
    assert missing.returncode == 1
    assert "nope.log does not exist" in missing.stderr and "invoke logs --no-follow" in missing.stderr
    nothing = invoke(project.root, "startup")
    assert nothing.returncode == 1
    assert "no boot is recorded in generated" in nothing.stderr and "invoke up" in nothing.stderr
    engine = invoke(project.root, "startup", "--log", str(DATA / "boot.log"), "--engine", "tgi")
    assert engine.returncode == 1 and "--engine" in engine.stderr
    empty = invoke(project.root, "startup", "--history", "5")
    assert empty.returncode == 0 and "no boot is recorded in results/boot_history.jsonl" in empty.stdout


def replayed(log: str, end: float) -> list[str]:
    """`log`'s boot with its stamps moved so its last line (the server's start) is at `end`
    (local time, as the engine logs): the real boot, as if it had just happened."""
    lines = (DATA / log).read_text().splitlines()
    served = [i for i, line in enumerate(lines) if "API server: HTTP server started" in line]
    lines = lines[:served[0] + 1] if served else lines  # not the requests and shutdown after it
    stamps = [m for line in lines if (m := STAMP.search(line))]
    last = _epoch(stamps[-1])

    def moved(line: str) -> str:
        match = STAMP.search(line)
        if match is None:
            return line
        when = time.localtime(end - (last - _epoch(match)))
        return line[:match.start()] + time.strftime("%m-%d %H:%M:%S", when) + line[match.end():]

    return [moved(line) for line in lines]


def _epoch(match: re.Match[str]) -> float:
    month, day, hour, minute, second = (int(g) for g in match.groups())
    return time.mktime((2026, month, day, hour, minute, second, 0, 0, -1))


def test_up_records_the_boot_for_status_startup_and_the_history(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers import free_port

    resolved = resolve(project, platform="cpu", model="qwen3-0.6b",
                       overrides=["OTHER_ENGINE_PORTS=", f"VLLM_PORT={free_port()}"])
    engine = DashboardEngine([EngineState(False, False, "missing")], [])
    out = io.StringIO()
    stack = lifecycle.Stack(project, resolved, {}, RecordingRunner(), engine, FakeProbe(), out)

    clock = Clock(time.time())

    def healthy(*args: object, **kwargs: object) -> float:
        # The engine booted while `up` waited, 23 s of imports and then the real boot.log.
        clock.now += 23.0 + 65.0
        engine.lines = replayed("boot.log", clock.now - 0.5)
        engine.states = [RUNNING]
        return 88.0

    monkeypatch.setattr(lifecycle, "time", clock)
    monkeypatch.setattr(lifecycle, "wait_until_healthy", healthy)
    monkeypatch.setattr(lifecycle, "warm_up", lambda url, name: 0.3)
    monkeypatch.setattr(lifecycle, "health_status", lambda url: 200)
    result = lifecycle.up(stack, dashboard=False)
    assert result.boot is not None and result.boot.compile == "cold" and result.boot.agrees
    assert re.search(r"^boot: \d+\.\d s, cold \(torch\.compile compiled\); longest: starting 2\d\.\d s",
                     out.getvalue(), re.M), out.getvalue()
    seconds = {p.name: p.seconds for p in result.boot.phases}
    assert seconds[WARM_UP] == 0.3 and seconds[COMPILE] == pytest.approx(13.66)
    assert seconds[STARTING] == pytest.approx(23.0, abs=1.0)  # launch to the log's first line
    assert result.boot.wall_s == pytest.approx(88.0 + 0.3)

    state = read_state(project)
    assert state is not None and state["boot"]["compile"] == "cold"
    assert isinstance(state["launched"], float)
    monkeypatch.setattr(lifecycle.requests, "get", _no_models)
    monkeypatch.setattr(lifecycle.metrics, "fetch_metrics", lambda *a, **k: None)
    report = lifecycle.status(stack)
    assert report["boot"]["phases"] and report["boot"]["wall_s"] == result.boot.as_json()["wall_s"]
    shown = lifecycle.render_status(report)
    assert re.search(r"^boot: +\d+\.\d s, cold \(torch\.compile compiled\).*\(invoke startup\)$",
                     shown, re.M), shown

    last = startup.last_startup(project)
    assert last.running and last.source == "generated/state.json" and last.profile == "qwen3-0.6b"
    never = pytest.raises(startup.StartupError, match="no boot of tiny is recorded: the last one")
    with never:  # another profile's boot is never shown as this one's
        startup.read_startup(project, profile="tiny", default_stack=lambda: stack)
    state_path(project).unlink()  # what `down` does: boot.json still has it
    after = startup.last_startup(project)
    assert after.source == "generated/boot.json" and not after.running
    assert after.boot.as_json()["phases"] == result.boot.as_json()["phases"]

    history = startup.boot_history(project, 10)
    assert [r.profile for r in history.records] == ["qwen3-0.6b"] and history.skipped == 0
    # `check` keys the argv it builds as `up` keyed the one it ran: it finds this boot.
    _, ctx = run_checks(project, resolved, {}, runtime=engine.name)
    assert ctx.command is not None
    key = compile_key(resolved, ctx.command.argv)
    assert history.records[0].compile_key == key and len(read_boots_with(project, key)) == 1
    assert history.as_json()["boots"][0]["compile_key"] == key  # `startup --history N --json`
    with (project.results / "boot_history.jsonl").open("a") as handle:
        handle.write('{"version": 1, "recorded": 1, "profi')  # a writer killed mid-line
    again = startup.boot_history(project, 10)
    assert len(again.records) == 1 and again.skipped == 1
    assert "1 line(s) could not be read" in startup.render_history(again)
    assert "qwen3-0.6b" in startup.render_history(again)


class Clock:
    """lifecycle's `time`: the host's clock, moved on by the boot the test stands in for."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def _no_models(*args: object, **kwargs: object) -> object:
    raise lifecycle.requests.RequestException("no /v1/models in this test")


def test_a_boot_under_way_is_read_from_the_engines_log(project: Project) -> None:
    from vllmstack.serve.state import write_state

    write_state(project, {"profile": "tiny", "engine": "vllm", "launched": time.time() - 30})
    lines = replayed("boot-spec-decode.log", time.time())[:20]  # up to the engine's init
    found = startup.last_startup(project, log_lines=lambda: lines)
    assert found.running and "still booting" in found.source
    assert not found.boot.complete and found.boot.agrees
    assert "incomplete" in startup.render_startup(found)


def test_the_table_says_when_vllm_did_not_log_the_caches_hit_or_miss() -> None:
    shown = startup.render_startup(startup.saved_startup(DATA / "boot-cpu-noaot-warm.log"))
    assert "31.0 s, torch.compile, its cache not logged" in shown
    assert "note: a saved log starts at its first line" in shown
    eager = startup.render_startup(startup.saved_startup(DATA / "boot-spec-decode.log"))
    assert "35.0 s, no torch.compile" in eager


def test_status_shows_the_boot_of_each_of_the_routers_engines(project: Project) -> None:
    from vllmstack.serve.state import write_state

    boot = startup.saved_startup(DATA / "boot-h200-warm.log").boot
    write_state(project, {"profile": "qwen3-0.6b", "url": "", "boot": boot.as_json()}, "qwen3-0-6b")
    report = {"running": False, "healthy": False, "state": "missing", "runtime": "native",
              "url": "http://127.0.0.1:8180", "argv": None, "model": None, "kv_cache_usage": None,
              "profile": None, "containers": [], "engines": lifecycle.named_report(project)}
    shown = lifecycle.render_status(report)
    assert re.search(r"^engine qwen3-0-6b: not answering \(profile qwen3-0.6b, \); boot 82\.0 s, "
                     r"warm \(torch\.compile cache hit\)", shown, re.M), shown

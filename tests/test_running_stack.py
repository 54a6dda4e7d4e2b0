"""Commands follow the running stack (issue 23): the profile and platform `up` recorded in
generated/state.json (or a live router's resident model), not `.env`'s, unless flags say otherwise;
`status` after `down` does not report `.env`'s profile as if it ran."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port
from simulator.fixture import SimProcess, run_simulator

from vllmstack.bench.cli import main as bench_main
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner
from vllmstack.serve import lifecycle
from vllmstack.serve.running import (
    ROUTER_FILE,
    recorded_overrides,
    resolve_following,
    running_selection,
)
from vllmstack.serve.state import write_state


def record_up(project: Project, profile: str, platform: str, *sets: str,
              runtime: str = "native") -> None:
    write_state(project, {"runtime": runtime, "flavour": runtime, "profile": profile,
                          "platform": platform, "sets": list(sets), "argv": ["vllm", "serve"],
                          "url": "http://127.0.0.1:1", "served_name": profile})


def follow(project: Project, model: str | None = None, platform: str | None = None,
           sets: tuple[str, ...] = ()) -> tuple[Any, list[str]]:
    said: list[str] = []
    resolved = resolve_following(project, model=model, platform=platform, overrides=list(sets),
                                 environ={}, say=said.append)
    return resolved, said


def test_nothing_runs_so_dotenv_decides_and_nothing_is_said(project: Project) -> None:
    resolved, said = follow(project)
    assert (resolved.profile, resolved.platform) == ("qwen3.8-27b", "2xr9700")  # .env.example
    assert said == []


def test_the_recorded_profile_platform_and_overrides_are_followed(project: Project) -> None:
    record_up(project, "tiny", "cpu", "VLLM_PORT=8199")
    resolved, said = follow(project)
    assert (resolved.profile, resolved.platform) == ("tiny", "cpu")
    assert resolved.get_int("VLLM_PORT") == 8199  # the --set `up` was given travels too
    assert len(said) == 1
    assert "tiny on cpu" in said[0] and "generated/state.json" in said[0]
    assert "not .env's qwen3.8-27b on 2xr9700" in said[0]


def test_explicit_flags_win_field_by_field(project: Project) -> None:
    record_up(project, "tiny", "cpu")
    resolved, _ = follow(project, model="qwen3-0.6b")
    assert (resolved.profile, resolved.platform) == ("qwen3-0.6b", "cpu")
    resolved, _ = follow(project, sets=("PLATFORM=nvidia",))
    assert (resolved.profile, resolved.platform) == ("tiny", "nvidia")
    resolved, said = follow(project, model="qwen3.8-27b", platform="2xr9700")
    assert (resolved.profile, resolved.platform) == ("qwen3.8-27b", "2xr9700") and said == []


def test_same_selection_as_dotenv_says_nothing(project: Project) -> None:
    record_up(project, "qwen3.8-27b", "2xr9700")
    assert follow(project)[1] == []


def test_a_recorded_profile_that_no_longer_exists_is_an_error_with_a_fix(project: Project) -> None:
    record_up(project, "gone", "cpu")
    with pytest.raises(Exception) as caught:
        follow(project)
    assert "generated/state.json" in str(caught.value) and "gone" in str(caught.value)
    assert "invoke down" in (getattr(caught.value, "fix", "") or "")
    # status, logs and down find the engine through the state file: they go on with .env's.
    said: list[str] = []
    resolved = resolve_following(project, model=None, platform=None, overrides=[], environ={},
                                 say=said.append, fallback=True)
    assert resolved.profile == "qwen3.8-27b" and "gone" in said[0] and ".env's" in said[0]


def test_a_live_routers_resident_model_is_followed_a_dead_one_is_not(project: Project) -> None:
    project.generated.mkdir()
    from vllmstack.router.record import identity

    record = {**identity(), "url": "http://127.0.0.1:8080", "platform": "cpu",
              "profile": "tiny-gguf", "loaded": "tiny-gguf"}
    (project.generated / ROUTER_FILE).write_text(json.dumps(record))
    resolved, said = follow(project)
    assert (resolved.profile, resolved.platform) == ("tiny-gguf", "cpu")
    assert "router" in said[0]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (project.generated / ROUTER_FILE).write_text(json.dumps({**record, "pid": int(dead.stdout)}))
    assert running_selection(project) is None
    # A live pid that a later program reused (its start time is not the router's) is not believed.
    (project.generated / ROUTER_FILE).write_text(json.dumps({**record, "pid_start": -1}))
    assert running_selection(project) is None


def test_status_shows_each_router_engines_tier_and_its_swap_back(project: Project) -> None:
    """`invoke status`'s router part (issue 37): a live router's record gives each profile's
    tier and the swap back it expects; a dead router's says nothing."""
    from vllmstack.router.record import identity
    from vllmstack.serve.running import router_tiers

    project.generated.mkdir()
    engines = {"qwen3-8b": {"profile": "qwen3-8b", "tier": "kv-released", "swap_s": 0.36},
               "qwen3-0.6b": {"profile": "qwen3-0.6b", "tier": "awake", "swap_s": 0.0},
               "odd": {"profile": 3, "tier": None}}
    record = {**identity(), "platform": "cpu", "engines": engines}
    (project.generated / ROUTER_FILE).write_text(json.dumps(record))
    assert router_tiers(project) == {"qwen3-8b": {"tier": "kv-released", "swap_s": 0.36},
                                     "qwen3-0.6b": {"tier": "awake", "swap_s": 0.0}}
    report = {"healthy": False, "running": False, "state": "stopped", "profile": None,
              "runtime": "native", "selected": {"profile": "x", "platform": "cpu"},
              "url": "http://127.0.0.1:1", "model": None, "kv_cache_usage": None,
              "containers": [], "engines": [
                  {"name": "qwen3-8b", "state": "asleep", "profile": "qwen3-8b",
                   "url": "http://127.0.0.1:8001", "tier": "kv-released", "swap_s": 0.36},
                  {"name": "qwen3-0.6b", "state": "healthy", "profile": "qwen3-0.6b",
                   "url": "http://127.0.0.1:8002", "tier": "awake", "swap_s": 0.0}]}
    text = lifecycle.render_status(report)
    assert ("engine qwen3-8b: asleep (profile qwen3-8b, http://127.0.0.1:8001; router tier "
            "kv-released, swap back ~0.36 s)") in text
    assert "engine qwen3-0.6b: healthy (profile qwen3-0.6b, http://127.0.0.1:8002; router " \
           "tier awake)" in text
    (project.generated / ROUTER_FILE).write_text(json.dumps({**record, "pid_start": -1}))
    assert router_tiers(project) == {}


def test_up_records_its_overrides_for_the_commands_that_follow(project: Project) -> None:
    from vllmstack.config.profiles import resolve

    resolved = resolve(project, platform="cpu", model="tiny",
                       overrides=["VLLM_PORT=8199", "PLATFORM=cpu"])
    assert recorded_overrides(resolved) == ["VLLM_PORT=8199"]


# --- bench follows the stack: the newcomer's `invoke bench` after `up --model tiny` -----------


@pytest.fixture(scope="module")
def sim(tokenizer_file: Path) -> Iterator[SimProcess]:
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "5", "SIM_ITL_MS": "2",
           "SIM_TOKENIZER": str(tokenizer_file)}
    with run_simulator(env=env, argv=["--served-model-name", "simx", "--max-model-len", "8192",
                                      "--max-num-seqs", "4"]) as proc:
        yield proc


def test_bench_without_flags_measures_the_running_profile(
        sim: SimProcess, tokenizer_file: Path, project: Project) -> None:
    (project.env_dir / "models" / "simx.env").write_text(
        "PROFILE_DESCRIPTION=simulated\nEXTENDS=models/qwen3-0.6b\nPROFILE_PLATFORMS=cpu\n"
        f"VLLM_SERVED_NAME=simx\nVLLM_TOKENIZER={tokenizer_file}\n")
    record_up(project, "simx", "cpu", f"VLLM_PORT={sim.port}")
    out, err = io.StringIO(), io.StringIO()
    with redirect_stderr(err):
        code = bench_main(["bench", "--pp", "64", "--tg", "4", "--runs", "1", "--no-warmup",
                           "--no-history", "--json"], environ={}, project=project, out=out)
    assert code == 0, err.getvalue()
    record = json.loads(out.getvalue())
    assert (record["profile"], record["platform"], record["model"]) == ("simx", "cpu", "simx")
    assert "using profile simx on cpu" in err.getvalue()


# --- status after down ------------------------------------------------------------------------


def test_status_after_down_does_not_report_the_dotenv_profile(project: Project) -> None:
    from vllmstack.config.profiles import resolve

    resolved = resolve(project, platform="cpu", model="tiny",
                       overrides=[f"VLLM_PORT={free_port()}"])
    stack = lifecycle.open_stack(project, resolved, {}, RecordingRunner(), runtime="native",
                                 out=io.StringIO())
    report = lifecycle.status(stack)
    assert report["running"] is False and report["profile"] is None
    text = lifecycle.render_status(report)
    assert "nothing started by `invoke up`" in text and "profile tiny on cpu" not in text
    record_up(project, "tiny", "cpu")
    report = lifecycle.status(stack)
    assert (report["profile"], report["platform"]) == ("tiny", "cpu")
    assert "profile tiny on cpu" in lifecycle.render_status(report)


def test_invoke_status_follows_the_recorded_stack(project: Project) -> None:
    """`invoke status` with no flags: the recorded profile (old code: .env's qwen3.8-27b)."""
    (project.root / ".env").write_text((project.root / ".env.example").read_text()
                                       + f"\nRUNTIME=native\nVLLM_PORT={free_port()}\n")
    record_up(project, "tiny", "cpu")
    env = {**os.environ, "HOME": str(project.root / "home")}
    result = subprocess.run([sys.executable, "-m", "invoke", "status", "--json"],
                            cwd=project.root, env=env, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["profile"], report["platform"]) == ("tiny", "cpu")
    assert report["selected"] == {"profile": "tiny", "platform": "cpu"}
    assert "using profile tiny on cpu" in result.stderr

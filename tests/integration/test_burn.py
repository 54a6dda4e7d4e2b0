"""`burn` for real on the native runtime over simulator profiles, one of them crashing at boot."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from test_bench_vs import Sims  # the simulator-profile project both integration tests use

from vllmstack.bench.fleet.burn import BurnError, run_burn
from vllmstack.bench.fleet.resident import today
from vllmstack.bench.report import history
from vllmstack.serve.state import read_state


@pytest.fixture
def sims(tmp_path: Path, tokenizer_file: Path) -> Sims:
    # sim-gpu is made for another platform: a burn on cpu must leave it out.
    return Sims(tmp_path, tokenizer_file,
                {"sim-a": "cpu", "sim-crash": "cpu", "sim-gpu": "nvidia"}, only=True)


@pytest.mark.slow  # two profiles brought up and down: about 6 s
def test_burn_runs_every_profile_of_the_platform_and_a_crash_is_a_fail_row(sims: Sims) -> None:
    out = io.StringIO()
    result = run_burn(sims.project, sims.environ, runs=3, warmup=2, max_tokens=24,
                      timeout_s=30, out=out)
    assert [r["profile"] for r in result.rows] == ["sim-a", "sim-crash"]
    sims.never_both_resident(["sim-a", "sim-crash"])
    good, crash = result.rows
    assert (good["status"], good["engine"], good["runs"]) == ("PASS", "vllm", 3)
    assert good["tokens"] == [24, 24, 24]  # exactly max_tokens, counted from usage
    tps = good["tps"]
    assert tps["n"] == 3 and tps["min"] <= tps["mean"] <= tps["max"]
    # The simulator decodes at 2 ms per token: 500 t/s, steadily.
    assert 400 < tps["mean"] < 520 and good["unstable"] is False
    assert good["ttft_ms"]["mean"] > 0 and good["load_s"] > 0
    assert good["load_kind"] in ("cold", "warm")
    # The boot's phases, as `up` measured them: summing to the wall, which includes the warm-up.
    boot = good["boot"]
    assert boot["phases"] and abs(boot["sum_s"] - boot["wall_s"]) <= 0.05 * boot["wall_s"]
    assert boot["wall_s"] >= good["load_s"] and crash.get("boot") is None
    (booted,) = (json.loads(line) for line in
                 (sims.project.results / "boot_history.jsonl").read_text().splitlines())
    assert booted["profile"] == "sim-a" and booted["boot"] == boot
    assert crash["status"] == "FAIL" and crash["tps"] is None and crash["load_s"] is None
    assert "exited with code 1" in crash["diagnosis"]
    assert "out of memory for the KV cache" in crash["diagnosis"] and crash["fix"]
    assert result.failed and read_state(sims.project) is None
    # Markdown under results/ (the day's file and the latest) and JSON history.
    folder = sims.project.results
    latest = (folder / "burn-latest.md").read_text()
    dated = folder / f"burn-{today(result.record['started'])}.md"
    assert latest.split("\n", 2)[2] in dated.read_text()  # the same section, appended
    assert "| sim-a | vLLM | PASS |" in latest and "1/2 PASS" in latest
    assert "| sim-crash | vLLM | FAIL: the engine exited with code 1" in latest
    assert "sim-gpu" not in latest
    (stored,) = history.read_records(history.history_path(folder, "burn"))
    assert stored["rows"] == json.loads(json.dumps(result.rows))
    assert "[burn 2/2] sim-crash: FAIL" in out.getvalue()


def test_named_profiles_are_burned_as_given_and_unknown_ones_refused(sims: Sims) -> None:
    with pytest.raises(BurnError) as caught:
        run_burn(sims.project, sims.environ, profiles=["sim-a", "nope"], out=io.StringIO())
    assert "nope" in caught.value.cause and caught.value.fix and "sim-a" in caught.value.fix
    with pytest.raises(BurnError, match="--runs must be at least 1"):
        run_burn(sims.project, sims.environ, runs=0, out=io.StringIO())
    assert not sims.starts.exists()  # refused before anything started

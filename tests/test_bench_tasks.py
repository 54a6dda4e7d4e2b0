"""The invoke tasks are thin: the documented command lines reach the same CLI entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from simulator.fixture import run_simulator

from vllmstack.bench.selftest_tokenizer import train_corpus_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT), *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_benchmark_tasks_are_listed() -> None:
    listing = invoke("--list").stdout
    for name in ("bench", "bench-depth", "bench-conc", "probe", "stability", "report"):
        assert f"  {name} " in listing


def test_invoke_bench_json_contract(tmp_path: Path) -> None:
    tokenizer = train_corpus_tokenizer(tmp_path / "tokenizer.json")
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "10", "SIM_ITL_MS": "2",
           "SIM_TOKENIZER": str(tokenizer)}
    with run_simulator(env=env, argv=["--served-model-name", "sim"]) as sim:
        done = invoke("bench", "--url", sim.url, "--model", "sim", "--tokenizer", str(tokenizer),
                      "--pp", "512", "--tg", "32", "--runs", "2", "--json",
                      "--history-dir", str(tmp_path / "hist"))
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        (row,) = data["results"]
        assert (row["pp"], row["tg"], row["depth"], row["concurrency"]) == (512, 32, 0, 1)
        for key in ("ttft_ms", "pp_tps", "tg_tps", "itl_ms"):
            assert {"mean", "p50", "p90", "p99"} <= set(row[key])
        failed = invoke("probe", "no-such-probe", "--url", sim.url, "--model", "sim")
        assert failed.returncode == 2
        assert "invalid choice: 'no-such-probe'" in failed.stderr


@pytest.mark.parametrize("args", [["stability", "--help"], ["probe", "--help"],
                                  ["report", "--help"]])
def test_task_help_renders(args: list[str]) -> None:
    assert invoke(*args).returncode == 0

"""The CLI contract: `python -m vllmstack.bench` / `invoke bench ... --json`, history, report,
targeting the stack from its profile, clean stop on SIGTERM, clear errors."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_for
from simulator.client import call
from simulator.fixture import SimProcess, run_simulator

from vllmstack.bench.cli import main
from vllmstack.bench.report import history
from vllmstack.bench.report.png import read_png_size
from vllmstack.core.paths import Project

ROOT = Path(__file__).resolve().parents[1]
ENV = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "20", "SIM_ITL_MS": "5"}
STAT_KEYS = {"mean", "p50", "p90", "p99"}


@pytest.fixture(scope="module")
def sim(tokenizer_file: Path) -> Any:
    env = {**ENV, "SIM_TOKENIZER": str(tokenizer_file)}
    with run_simulator(env=env, argv=["--served-model-name", "sim", "--max-model-len", "8192",
                                      "--max-num-seqs", "4"]) as proc:
        yield proc


def run_cli(args: list[str], project: Project) -> tuple[int, str]:
    out = io.StringIO()
    code = main(args, environ={}, project=project, out=out, err=out)
    return code, out.getvalue()


def test_bench_json_contract_and_history(sim: SimProcess, tokenizer_file: Path,
                                         tmp_path: Path) -> None:
    code, text = run_cli(["bench", "--url", sim.url, "--model", "sim", "--tokenizer",
                          str(tokenizer_file), "--pp", "256", "512", "--tg", "16", "--runs", "2",
                          "--json"], Project(tmp_path))
    assert code == 0
    data = json.loads(text)  # stdout is one JSON document; progress went to stderr
    assert [(r["pp"], r["tg"]) for r in data["results"]] == [(256, 16), (512, 16)]
    for row in data["results"]:
        assert isinstance(row["depth"], int) and isinstance(row["concurrency"], int)
        for key in ("ttft_ms", "tg_tps", "itl_ms"):
            assert set(row[key]) >= STAT_KEYS, key
        # pp is one estimate with its uncertainty and interval (or null with a note)
        assert set(row["pp_tps"]) >= {"mean", "std", "min", "max"}
        assert row["pp_note"] is None and row["pp_uncertainty_ms"] >= 0
    stored = history.read_records(tmp_path / "results" / "bench_history.jsonl")
    assert len(stored) == 1 and stored[0]["id"] == data["id"]


def test_target_comes_from_the_profile_without_url(sim: SimProcess, tokenizer_file: Path,
                                                   project: Project) -> None:
    code, text = run_cli(["bench", "--set", f"VLLM_PORT={sim.port}",
                          "--set", "VLLM_SERVED_NAME=sim",
                          "--set", f"VLLM_TOKENIZER={tokenizer_file}",
                          "--pp", "128", "--tg", "8", "--runs", "1", "--no-warmup", "--json"],
                         project)
    assert code == 0, text
    record = json.loads(text)
    assert record["url"] == f"http://127.0.0.1:{sim.port}"
    assert record["from_profile"] is True
    assert record["profile"] and record["platform"]
    assert record["pins"]["VLLM_REF"]  # the build pins travel with every record
    assert (project.results / "bench_history.jsonl").is_file()


def test_report_renders_markdown_and_png(sim: SimProcess, tokenizer_file: Path,
                                         tmp_path: Path) -> None:
    base = ["--url", sim.url, "--model", "sim", "--tokenizer", str(tokenizer_file),
            "--history-dir", str(tmp_path)]
    assert run_cli(["depth", *base, "--pp", "128", "--tg", "8", "--runs", "1", "--depth",
                    "0", "1024", "2048"], Project(tmp_path))[0] == 0
    assert run_cli(["conc", *base, "--pp", "128", "--tg", "8", "--concurrency", "1", "2",
                    "--duration", "1"], Project(tmp_path))[0] == 0
    out = tmp_path / "report" / "report.md"
    code, _ = run_cli(["report", "--history-dir", str(tmp_path), "--kind", "depth", "conc",
                       "--png", "--out", str(out)], Project(tmp_path))
    assert code == 0
    text = out.read_text()
    assert "## depth history (1 record)" in text and "| 2K | two-phase |" in text
    assert "## conc history (1 record)" in text
    for kind in ("depth", "conc"):
        png = out.parent / f"{kind}.png"
        assert read_png_size(png.read_bytes()) == (900, 520)
        assert f"![{kind} chart]({kind}.png)" in text


def test_errors_are_one_line_with_the_fix(tmp_path: Path, sim: SimProcess) -> None:
    code, text = run_cli(["bench", "--url", sim.url, "--model", "sim", "--tokenizer",
                          str(tmp_path / "missing.json")], Project(tmp_path))
    assert code == 1
    assert "error: tokenizer" in text and "Nothing is downloaded" in text
    code, text = run_cli(["bench", "--url", sim.url, "--model", "sim", "--tokenizer",
                          str(tmp_path), "--extra-body", "{bad"], Project(tmp_path))
    assert code == 2 and "error: --extra-body is not JSON" in text
    code, text = run_cli(["conc", "--url", "http://127.0.0.1:9", "--model", "x",
                          "--tokenizer", str(tmp_path)], Project(tmp_path))
    assert code == 1 and "error:" in text
    assert "Traceback" not in text


def test_sigterm_stops_cleanly_and_appends_nothing(sim: SimProcess, tokenizer_file: Path,
                                                  tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "vllmstack.bench", "conc", "--url", sim.url, "--model", "sim",
           "--tokenizer", str(tokenizer_file), "--concurrency", "2", "--duration", "60",
           "--pp", "64", "--tg", "64", "--history-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=tmp_path)
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    for line in proc.stdout:
        if "concurrency ladder" in line or time.monotonic() > deadline:
            break
    wait_for(lambda: call(sim.url, "/load").json()["server_load"] >= 1, timeout=30,
             what="the ladder's streams open on the simulator")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=15)
    assert time.monotonic() - started < 5
    assert proc.returncode == 1
    assert "stopped by signal" in rest
    assert not (tmp_path / "conc_history.jsonl").exists()

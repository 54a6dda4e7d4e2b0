"""Probes and stability runs pass against the simulator and fail against faults made to break
them. Driven through the same CLI entry the tasks and the dashboard use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import bench_cli as cli
from simulator.fixture import run_simulator

from vllmstack.bench.client.client import RequestResult
from vllmstack.bench.probes.probes import make_probe_image, stall_windows
from vllmstack.bench.probes.stability import check_loop
from vllmstack.bench.report import history
from vllmstack.bench.report.png import decode_png, read_png_size

FAST = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "5", "SIM_ITL_MS": "2"}
ARGV = ["--served-model-name", "sim", "--max-model-len", "16384", "--max-num-seqs", "8",
        "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser",
        "hermes"]


def failed_checks(record: dict[str, Any]) -> list[str]:
    return [c["name"] for c in record["checks"] if c["verdict"] == "fail"]


def test_probes_pass_against_a_healthy_server(tokenizer_file: Path, tmp_path: Path) -> None:
    with run_simulator(env=FAST, argv=ARGV) as sim:
        for name in ("thinkoff", "tool-truncation", "prefix-cache", "multi-image"):
            code, record = cli(sim.url, tokenizer_file, tmp_path, "probe", name)
            assert (code, record["verdict"]) == (0, "pass"), record["checks"]
    # The simulator paces every stream on its own clock, so a big prefill must not stall the
    # others. (10 ms steps: its own GIL pauses while tokenizing the big prompt stay well below.)
    paced = {**FAST, "SIM_ITL_MS": "10", "SIM_TOKENIZER": str(tokenizer_file)}
    with run_simulator(env=paced, argv=ARGV) as sim:
        code, record = cli(sim.url, tokenizer_file, tmp_path, "probe", "itl-stall",
                           "--max-num-seqs", "4", "-p", "bully_tokens=8000",
                           "-p", "victim_tokens=1000")
        assert (code, record["verdict"]) == (0, "pass"), record["checks"]
        assert record["details"]["choke"] < 10
        assert record["details"]["bully_tokens"] >= 7900
    stored = history.read_records(history.history_path(tmp_path, "probe"))
    assert [r["name"] for r in stored] == ["thinkoff", "tool-truncation", "prefix-cache",
                                           "multi-image", "itl-stall"]


def test_stream_mismatch_fails_the_thinkoff_parity(tokenizer_file: Path, tmp_path: Path) -> None:
    with run_simulator(env={**FAST, "SIM_FAULT": "stream-mismatch"}, argv=ARGV) as sim:
        code, record = cli(sim.url, tokenizer_file, tmp_path, "probe", "thinkoff")
    assert (code, record["verdict"]) == (1, "fail")
    assert any("stream equals non-stream" in n for n in failed_checks(record))


def test_tool_truncation_fault_is_caught(tokenizer_file: Path, tmp_path: Path) -> None:
    with run_simulator(env={**FAST, "SIM_FAULT": "tool-truncation"}, argv=ARGV) as sim:
        code, record = cli(sim.url, tokenizer_file, tmp_path, "probe", "tool-truncation")
    assert (code, record["verdict"]) == (1, "fail")
    assert any("mid-arguments" in n and "parity" in n for n in failed_checks(record))


def test_prefix_cache_probe_is_inconclusive_when_caching_is_off(tokenizer_file: Path,
                                                               tmp_path: Path) -> None:
    with run_simulator(env=FAST, argv=[*ARGV, "--no-enable-prefix-caching"]) as sim:
        code, record = cli(sim.url, tokenizer_file, tmp_path, "probe", "prefix-cache")
    assert (code, record["verdict"]) == (2, "inconclusive")


def test_stability_passes_then_catches_dropped_requests_and_loops(tokenizer_file: Path,
                                                                  tmp_path: Path) -> None:
    with run_simulator(env=FAST, argv=ARGV) as sim:
        for mode, extra in (("smoke", []), ("stress", ["--workers", "3", "--requests", "6",
                                                       "--max-tokens", "16"]),
                            ("long", ["--runs", "2", "--max-tokens", "200"])):
            code, record = cli(sim.url, tokenizer_file, tmp_path, "stability", mode, *extra)
            assert (code, record["verdict"]) == (0, "pass"), (mode, record["checks"])
    env = {**FAST, "SIM_FAULT": "drop-requests", "SIM_DROP_EVERY": "4"}
    with run_simulator(env=env, argv=ARGV) as sim:
        code, record = cli(sim.url, tokenizer_file, tmp_path, "stability", "stress",
                           "--workers", "3", "--requests", "6", "--max-tokens", "16")
    assert (code, record["verdict"]) == (1, "fail")
    assert "requests succeeded" in failed_checks(record)
    assert record["details"]["ok"] + record["details"]["failed"] == 18  # every one counted
    assert record["details"]["failed"] >= 4
    with run_simulator(env={**FAST, "SIM_FAULT": "token-loop"}, argv=ARGV) as sim:
        code, record = cli(sim.url, tokenizer_file, tmp_path, "stability", "long",
                           "--runs", "1", "--max-tokens", "200")
    assert (code, record["verdict"]) == (1, "fail")
    assert failed_checks(record) == ["run 1: no token loop"]


def test_loop_check_tells_loops_from_small_vocabulary_text() -> None:
    import random

    rng = random.Random(1)
    first, second = ["ka", "lo", "mi", "ren", "to", "sa"], ["du", "ne", "pa", "ri", "gon", "te"]
    vocab = [a + b for a in first for b in second]
    varied = " ".join(rng.choice(vocab) for _ in range(1000))  # 36 words, no structure
    assert not check_loop(varied).looped
    looped = " ".join(["alpha beta gamma delta"] * 200)
    assert check_loop(looped).looped
    tail_loop = varied[:2000] + " " + " ".join(["and then we went"] * 150)
    assert check_loop(tail_loop).looped
    assert not check_loop("too short to judge").looped


def _victim(times: list[float]) -> RequestResult:
    return RequestResult(chunk_times=times, chunk_tokens=[1] * len(times))


def test_stall_windows_count_the_gap_that_spans_the_prefill() -> None:
    # decode every 10 ms; big prefill from 1.000 to 1.300 s; the victim stalls over it
    times = [0.5 + 0.01 * i for i in range(51)] + [1.31 + 0.01 * i for i in range(20)]
    before, during, after = stall_windows([_victim(times)], fired=1.0, prefilled=1.3)
    assert len(before) == 50 and max(before) == pytest.approx(0.01)
    assert during == pytest.approx([0.31])  # the stall itself
    assert len(after) == 19


def test_probe_images_are_generated_locally_as_valid_png() -> None:
    data = make_probe_image(0, 320, 200)
    assert read_png_size(data) == (320, 200)
    canvas = decode_png(data)
    assert canvas.get(0, 0) == (0, 0, 0)  # the frame
    assert make_probe_image(1, 320, 200) != data  # every image differs

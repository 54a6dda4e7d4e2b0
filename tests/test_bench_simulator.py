"""The benchmark runs against the engine simulator, whose pacing is known exactly.

Tolerances here are loose enough for a busy 2-core CI box; the tight accuracy numbers are
measured and printed by benchmarks/bench_client_accuracy.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from simulator.fixture import SimProcess, run_simulator, sim_env

from vllmstack.bench.report import history
from vllmstack.bench.runs.runs import RunOptions, execute
from vllmstack.bench.target import target_from_url

TTFT_MS, PREFILL_TPS, ITL_MS = 40.0, 20000.0, 10.0
PACING = {"ttft_ms": TTFT_MS, "prefill_tps": PREFILL_TPS, "itl_ms": ITL_MS}


@pytest.fixture
def sim(tokenizer_file: Path) -> Iterator[SimProcess]:
    with run_simulator(env=sim_env(tokenizer_file, **PACING),
                       argv=["--served-model-name", "sim", "--max-model-len", "16384",
                             "--max-num-seqs", "8"]) as proc:
        yield proc


def run(kind: str, url: str, tokenizer: Path, folder: Path | None, **opts: Any
        ) -> dict[str, Any]:
    target = target_from_url(url, "sim", tokenizer=str(tokenizer), max_num_seqs=8)
    lines: list[str] = []
    outcome = asyncio.run(execute(kind, target, RunOptions(**opts), environ={},
                                  history_dir=folder, progress=lines.append))
    assert outcome.exit_code == 0, lines
    return outcome.record


def truth_ttft_ms(prompt_tokens: float, role_delay_ms: float = 0.0) -> float:
    return TTFT_MS + prompt_tokens / PREFILL_TPS * 1000 + role_delay_ms


def test_bench_matches_known_pacing_at_concurrency_1(sim: SimProcess, tokenizer_file: Path,
                                                     tmp_path: Path) -> None:
    record = run("bench", sim.url, tokenizer_file, tmp_path, pp=[2048], tg=[64], runs=3)
    (row,) = record["results"]
    assert (row["pp"], row["tg"], row["depth"], row["concurrency"]) == (2048, 64, 0, 1)
    truth = truth_ttft_ms(row["prompt_tokens"]["mean"])
    assert truth - 1.0 <= row["ttft_ms"]["mean"] <= truth + 15.0
    assert row["tg_tps"]["mean"] == pytest.approx(1000 / ITL_MS, rel=0.02)
    assert row["itl_ms"]["p50"] == pytest.approx(ITL_MS, rel=0.02)
    assert row["pp_tps"]["mean"] == pytest.approx(PREFILL_TPS, rel=0.10)
    assert row["token_source"] == "usage-per-chunk"
    assert row["completion_tokens"]["mean"] == 64
    # the record went to history with what was measured and against what
    (stored,) = history.read_records(history.history_path(tmp_path, "bench"))
    assert stored["schema_version"] == history.SCHEMA_VERSION
    assert stored["model"] == "sim" and stored["server"]["version"]
    assert stored["results"][0]["ttft_ms"] == row["ttft_ms"]


def test_early_role_chunk_does_not_shorten_ttft(tokenizer_file: Path) -> None:
    env = sim_env(tokenizer_file, **PACING, SIM_ROLE_DELAY_MS="150")
    with run_simulator(env=env, argv=["--served-model-name", "sim"]) as sim:
        record = run("bench", sim.url, tokenizer_file, None, pp=[1024], tg=[16], runs=2)
    row = record["results"][0]
    truth = truth_ttft_ms(row["prompt_tokens"]["mean"], role_delay_ms=150)
    assert truth - 1.0 <= row["ttft_ms"]["mean"] <= truth + 15.0
    # the role chunk came 150 ms before the first token; TTFR shows it, TTFT ignores it
    assert row["ttft_ms"]["mean"] - row["ttfr_ms"]["mean"] == pytest.approx(150, abs=10)
    # pp is computed from TTFT, so an early role chunk cannot inflate it (+1900 % elsewhere)
    assert row["pp_tps"]["mean"] < 2 * PREFILL_TPS


def test_several_tokens_per_chunk_keep_decode_rate_and_itl_right(tokenizer_file: Path) -> None:
    env = sim_env(tokenizer_file, **PACING, SIM_TOKENS_PER_CHUNK="4", SIM_ITL_MS="20")
    with run_simulator(env=env, argv=["--served-model-name", "sim"]) as sim:
        record = run("bench", sim.url, tokenizer_file, None, pp=[256], tg=[129], runs=2)
    row = record["results"][0]
    assert row["tg_tps"]["mean"] == pytest.approx(4 * 1000 / 20, rel=0.02)
    assert row["itl_ms"]["p50"] == pytest.approx(5.0, rel=0.03)  # per token, not per chunk


def test_depth_two_phase_checks_the_cache_hit(sim: SimProcess, tokenizer_file: Path,
                                             tmp_path: Path) -> None:
    # 2048 fresh tokens: a 100 ms marginal prefill, well above a busy box's jitter (with 512,
    # 25 ms, a noisy overhead measurement can honestly make it "below resolution").
    record = run("depth", sim.url, tokenizer_file, tmp_path, pp=[2048], tg=[8], runs=1,
                 depths=[0, 4096])
    rows = record["results"]
    assert [r["depth"] for r in rows] == [0, 4096]
    deep = rows[1]
    assert deep["mode"] == "two-phase"
    assert deep["cache_hit_tokens"]["mean"] >= 4096 * 0.9
    # pp over the uncached part only: near the prefill rate, not (4096+2048)/TTFT
    assert deep["pp_tps"]["mean"] == pytest.approx(PREFILL_TPS, rel=0.25)
    assert deep["ctx_pp_tps"]["mean"] == pytest.approx(PREFILL_TPS, rel=0.25)
    assert not record["warnings"]


def test_depth_without_prefix_cache_is_labelled_blended(tokenizer_file: Path) -> None:
    argv = ["--served-model-name", "sim", "--max-model-len", "8192", "--no-enable-prefix-caching"]
    with run_simulator(env=sim_env(tokenizer_file, **PACING), argv=argv) as sim:
        record = run("depth", sim.url, tokenizer_file, None, pp=[512], tg=[8], runs=1,
                     margin=256)
    depths = [r["depth"] for r in record["results"]]
    # the ladder follows the live max_model_len: 8192 - 512 - 8 - 256 = 7416 is the top rung
    assert depths == [0, 1024, 2048, 4096, 7416]
    assert all(r["mode"] == "blended" for r in record["results"][1:])


def test_conc_is_a_steady_closed_loop(sim: SimProcess, tokenizer_file: Path,
                                      tmp_path: Path) -> None:
    record = run("conc", sim.url, tokenizer_file, tmp_path, pp=[256], tg=[32],
                 concurrency=[1, 4], duration_s=2.0, warmup=False)
    one, four = record["results"]
    assert (one["concurrency"], four["concurrency"]) == (1, 4)
    # closed loop: workers keep sending for the whole duration, several requests each
    assert four["requests"] >= 4 * 2 and four["errors"] == 0
    assert four["tg_tps"]["mean"] == pytest.approx(1000 / ITL_MS, rel=0.05)
    assert four["total_tg_tps"] == pytest.approx(4 * one["total_tg_tps"], rel=0.15)
    assert 0 < four["window_s"] <= 2.0


def test_bench_and_conc_agree_at_concurrency_1(sim: SimProcess, tokenizer_file: Path) -> None:
    # On one H200 the two commands said 147k and 450k pp t/s, 585 and 504 decode t/s, for the
    # same server at c=1. One stream must measure the same whichever loop drives it.
    # 4096 tokens: a 200 ms marginal prefill, so a busy CI box's few ms of jitter stay small.
    for _attempt in range(2):
        bench = run("bench", sim.url, tokenizer_file, None, pp=[4096], tg=[64], runs=5)
        conc = run("conc", sim.url, tokenizer_file, None, pp=[4096], tg=[64], concurrency=[1],
                   duration_s=4.0)
        (b,), (c,) = bench["results"], conc["results"]
        # "below resolution" here means the box stalled a run by a quarter second or more (the
        # honest answer then); measure again rather than compare nothing.
        if b["pp_tps"] and c["pp_tps"]:
            break
    assert b["pp_tps"] and c["pp_tps"], (b["pp_note"], c["pp_note"])
    assert c["requests"] >= 3 and c["errors"] == 0
    for key in ("pp_tps", "tg_tps"):
        assert c[key]["mean"] == pytest.approx(b[key]["mean"], rel=0.05), key
    assert b["pp_tps"]["mean"] == pytest.approx(PREFILL_TPS, rel=0.10)
    # A second closed loop over the same server gets no prefix-cache hits from the first: its
    # re-used prompts carry fresh random markers, so TTFT (and pp) stay the same.
    again = run("conc", sim.url, tokenizer_file, None, pp=[4096], tg=[64], concurrency=[1],
                duration_s=4.0)["results"][0]
    assert again["ttft_ms"]["mean"] == pytest.approx(c["ttft_ms"]["mean"], rel=0.10)


def test_unknown_model_is_a_clear_error(sim: SimProcess, tokenizer_file: Path) -> None:
    from vllmstack.bench.runs.runs import RunError

    target = target_from_url(sim.url, "nope", tokenizer=str(tokenizer_file))
    with pytest.raises(RunError, match="does not serve 'nope'; it serves: sim"):
        asyncio.run(execute("bench", target, RunOptions(runs=1), environ={},
                            history_dir=None, progress=lambda _: None))

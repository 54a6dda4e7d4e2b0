"""pp t/s where TTFT is small: a number with its uncertainty, or "below resolution".

Fixture numbers are the real H200 run of 2026-11-30 (Qwen3-0.6B, pp 2048, concurrency 1, vLLM
0.27.1): `bench` measured an overhead of 22.4 ms and TTFTs of 42.4, 34.6 and 34.0 ms and printed
147,414 t/s; `bench-conc` on the same server printed 450,015 t/s.
"""

from __future__ import annotations

import pytest

from vllmstack.bench.runs.session import (
    BELOW_RESOLUTION,
    Overhead,
    pp_estimate,
    pp_text,
    robust_spread,
)

PROMPT = 2048 + 27  # what the chat template makes of a 2048-token prompt (about)
OVERHEAD_PROMPT = 23


def test_real_h200_bench_gets_an_interval_not_a_bare_number() -> None:
    overhead = Overhead(ttft_s=0.0224, prompt_tokens=OVERHEAD_PROMPT, spread_s=0.0015)
    row = pp_estimate(overhead, [(PROMPT, 0.0424), (PROMPT, 0.0346), (PROMPT, 0.0340)])
    pp = row.pp_tps
    assert pp is not None
    # The ratio of medians (2052 tokens / 12.2 ms), not the mean of per-run ratios, which the
    # 20 ms run would drag and a near-zero marginal time would blow up.
    assert pp.mean == pytest.approx(2052 / 0.0122, rel=0.01)
    # The robust spread of the marginal times (0.9 ms: the 20 ms run is one disturbed run) and
    # the overhead's (1.5 ms) make the interval: about 147k to 196k t/s.
    assert row.pp_uncertainty_ms == pytest.approx(1.74, abs=0.05)
    assert pp.min == pytest.approx(2052 / 0.01394, rel=0.01)
    assert pp.max == pytest.approx(2052 / 0.01046, rel=0.01)
    assert pp_text(row).endswith("t/s") and "±" in pp_text(row)


def test_marginal_time_inside_the_noise_is_below_resolution() -> None:
    # A 2 ms marginal prefill against overhead samples spread by 3 ms: no number is honest.
    # (bench-conc's 450,015 t/s on the H200 was a 10 ms marginal time over a 30.3 ms overhead.)
    overhead = Overhead(ttft_s=0.030, prompt_tokens=OVERHEAD_PROMPT, spread_s=0.003)
    row = pp_estimate(overhead, [(PROMPT, 0.031), (PROMPT, 0.033), (PROMPT, 0.032)])
    assert row.pp_tps is None
    assert row.pp_note == BELOW_RESOLUTION
    assert pp_text(row).startswith("below resolution (marginal prefill 2.0 ms, uncertainty")
    # A TTFT below the overhead (noise) is below resolution too, never a negative rate.
    row = pp_estimate(overhead, [(PROMPT, 0.028)])
    assert row.pp_tps is None and row.pp_note == BELOW_RESOLUTION


def test_a_clear_marginal_time_gives_a_tight_number() -> None:
    overhead = Overhead(ttft_s=0.020, prompt_tokens=16, spread_s=0.0002)
    row = pp_estimate(overhead, [(2016, 0.1200), (2016, 0.1202), (2016, 0.1198)])
    pp = row.pp_tps
    assert pp is not None and pp.std is not None
    assert pp.mean == pytest.approx(20000, rel=0.001)
    assert pp.std / pp.mean < 0.01
    assert row.pp_note is None


def test_one_stalled_run_moves_neither_the_number_nor_its_resolution() -> None:
    overhead = Overhead(ttft_s=0.020, prompt_tokens=16, spread_s=0.0005)
    steady = [(2016, 0.120), (2016, 0.121), (2016, 0.119), (2016, 0.120)]
    stalled = pp_estimate(overhead, [*steady, (2016, 0.520)]).pp_tps
    steady_pp = pp_estimate(overhead, steady).pp_tps
    assert stalled is not None and steady_pp is not None
    assert stalled.mean == pytest.approx(steady_pp.mean, rel=0.01)


def test_robust_spread_is_the_standard_deviation_of_well_behaved_samples() -> None:
    assert robust_spread([1.0]) == 0.0
    assert robust_spread([10.0, 11.0, 12.0, 13.0, 14.0]) == pytest.approx(1.4826)
    assert robust_spread([10.0, 11.0, 12.0, 13.0, 400.0]) == pytest.approx(1.4826)

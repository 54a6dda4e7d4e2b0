"""Rates derived from successive /metrics snapshots: what the dashboard's cards show."""

from __future__ import annotations

import pytest

from vllmstack.observe.metrics import MetricsSnapshot, RateDeriver, parse_metrics


def snap(
    *,
    prompt: float = 0,
    local: float | None = None,
    cached: float = 0,
    gen: float = 0,
    queries: float = 0,
    hits: float = 0,
    running: float = 1,
    ttft: tuple[float, float] = (0.0, 0),
    itl: tuple[float, float] = (0.0, 0),
    spec: tuple[float, float, float] | None = None,
) -> MetricsSnapshot:
    """A vLLM-shaped exposition with the given counters (spec = drafts, draft tokens, accepted)."""
    lab = '{engine="0",model_name="m"}'
    lines = [
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{lab} {running}",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{lab} 0",
        "# TYPE vllm:prompt_tokens_total counter", f"vllm:prompt_tokens_total{lab} {prompt}",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{lab} {gen}",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{lab} {queries}",
        "# TYPE vllm:prefix_cache_hits_total counter", f"vllm:prefix_cache_hits_total{lab} {hits}",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        f"vllm:time_to_first_token_seconds_sum{lab} {ttft[0]}",
        f"vllm:time_to_first_token_seconds_count{lab} {ttft[1]}",
        "# TYPE vllm:inter_token_latency_seconds histogram",
        f"vllm:inter_token_latency_seconds_sum{lab} {itl[0]}",
        f"vllm:inter_token_latency_seconds_count{lab} {itl[1]}",
    ]
    if local is not None:
        lines += [
            "# TYPE vllm:prompt_tokens_by_source_total counter",
            f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="local_compute"}}'
            f" {local}",
            f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",'
            f'source="local_cache_hit"}} {cached}',
        ]
    if spec is not None:
        drafts, tokens, accepted = spec
        lines += [
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f"vllm:spec_decode_num_drafts_total{lab} {drafts}",
            "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
            f"vllm:spec_decode_num_draft_tokens_total{lab} {tokens}",
            "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
            f"vllm:spec_decode_num_accepted_tokens_total{lab} {accepted}",
        ]
    return parse_metrics("\n".join(lines) + "\n")


def test_generation_rate_and_ema() -> None:
    d = RateDeriver(alpha=0.5)
    first = d.update(snap(gen=0), 0.0)
    assert first.generation_tps is None  # one point is no rate
    r = d.update(snap(gen=100), 1.0)
    assert r.generation_tps_raw == 100.0
    assert r.generation_tps == 100.0  # the first rate seeds the EMA
    r = d.update(snap(gen=300), 2.0)
    assert r.generation_tps_raw == 200.0
    assert r.generation_tps == pytest.approx(150.0)
    # The interval length matters, not the number of polls.
    r = d.update(snap(gen=500), 4.0)
    assert r.generation_tps_raw == 100.0


def test_prompt_rate_counts_only_locally_computed_tokens() -> None:
    d = RateDeriver(alpha=1.0)
    d.update(snap(prompt=0, local=0, cached=0), 0.0)
    # 1000 prompt tokens arrived, 900 of them from the prefix cache: only 100 were prefilled.
    r = d.update(snap(prompt=1000, local=100, cached=900), 1.0)
    assert r.prompt_source == "local_compute"
    assert r.prompt_tps == 100.0


def test_prompt_rate_falls_back_to_total_without_by_source_family() -> None:
    d = RateDeriver(alpha=1.0)
    d.update(snap(prompt=0), 0.0)
    r = d.update(snap(prompt=400), 2.0)
    assert r.prompt_source == "total"
    assert r.prompt_tps == 200.0


def test_spike_guard_holds_a_single_outlier_then_accepts_a_new_level() -> None:
    d = RateDeriver(alpha=0.5, spike_factor=3.0, spike_floor=1000.0)
    d.update(snap(local=0), 0.0)
    d.update(snap(local=500), 1.0)  # EMA 500
    r = d.update(snap(local=500 + 80_000), 2.0)  # one chunked-prefill completion spike
    assert r.spike_held
    assert r.prompt_tps == 500.0
    assert r.prompt_tps_raw == 80_000.0
    r = d.update(snap(local=80_500 + 600), 3.0)
    assert not r.spike_held
    assert r.prompt_tps == pytest.approx(550.0)
    # A sustained higher level is not a spike: the second high sample in a row is taken.
    d.update(snap(local=81_100 + 5000), 4.0)
    r = d.update(snap(local=86_100 + 5000), 5.0)
    assert not r.spike_held
    assert r.prompt_tps is not None and r.prompt_tps > 550.0


def test_spike_floor_lets_real_rates_through_from_zero() -> None:
    d = RateDeriver(alpha=0.5)
    d.update(snap(gen=0), 0.0)
    d.update(snap(gen=10), 1.0)  # EMA 10
    r = d.update(snap(gen=10 + 2000), 2.0)  # 2000 > 3×10 but below the 50k floor: real
    assert not r.spike_held
    assert r.generation_tps == pytest.approx(1005.0)


def test_idle_engine_snaps_throughput_to_zero() -> None:
    d = RateDeriver(alpha=0.35)
    d.update(snap(gen=0), 0.0)
    d.update(snap(gen=1000), 1.0)
    r = d.update(snap(gen=1000, running=0), 2.0)
    assert r.generation_tps == 0.0
    # Busy but nothing produced in this interval (a long prefill): decay, not zero.
    d2 = RateDeriver(alpha=0.5)
    d2.update(snap(gen=0), 0.0)
    d2.update(snap(gen=1000), 1.0)
    assert d2.update(snap(gen=1000, running=2), 2.0).generation_tps == 500.0


def test_counter_reset_rebaselines_and_keeps_the_ema() -> None:
    d = RateDeriver(alpha=1.0)
    d.update(snap(gen=10_000, queries=100, hits=50), 0.0)
    d.update(snap(gen=10_100, queries=200, hits=100), 1.0)
    # The engine restarted: counters start from zero again.
    r = d.update(snap(gen=5, queries=10, hits=0), 2.0)
    assert r.reset
    assert r.generation_tps == 100.0  # held, not a huge negative rate
    assert r.generation_tps_raw is None
    assert r.prefix_hit_window is None  # the window starts over
    r = d.update(snap(gen=55, queries=20, hits=10), 3.0)
    assert not r.reset
    assert r.generation_tps == 50.0
    assert r.prefix_hit_window == pytest.approx(1.0)


def test_prefix_hit_rate_window_and_cumulative() -> None:
    d = RateDeriver(window_s=10.0)
    d.update(snap(queries=1000, hits=0), 0.0)
    r = d.update(snap(queries=2000, hits=500), 5.0)
    assert r.prefix_hit_window == pytest.approx(0.5)
    assert r.prefix_hit_total == pytest.approx(0.25)
    r = d.update(snap(queries=3000, hits=1500), 10.0)
    assert r.prefix_hit_window == pytest.approx(0.75)  # 1500/2000 since t=0
    # At t=15 the baseline is t=5, the last point at or before the window start.
    r = d.update(snap(queries=3000, hits=1500), 15.0)
    assert r.prefix_hit_window == pytest.approx(1000 / 1000)
    r = d.update(snap(queries=3000, hits=1500), 30.0)
    assert r.prefix_hit_window is None  # no queries in the window: no rate to show
    assert r.prefix_hit_total == pytest.approx(0.5)


def test_ttft_and_itl_window_means() -> None:
    d = RateDeriver(window_s=60.0)
    d.update(snap(ttft=(10.0, 10), itl=(5.0, 1000)), 0.0)
    r = d.update(snap(ttft=(10.0 + 3 * 0.2, 13), itl=(5.0 + 100 * 0.02, 1100)), 1.0)
    assert r.ttft_window == pytest.approx(0.2)  # the old slow requests do not count
    assert r.itl_window == pytest.approx(0.02)
    r = d.update(snap(ttft=(10.6, 13), itl=(7.0, 1100)), 2.0)
    assert r.ttft_window == pytest.approx(0.2)  # still within the window


def test_spec_decode_acceptance_and_length() -> None:
    d = RateDeriver()
    r = d.update(snap(spec=(28, 68, 56)), 0.0)
    assert r.spec_acceptance_total == pytest.approx(56 / 68)
    assert r.spec_acceptance_length_total == pytest.approx(1 + 56 / 28)
    assert r.spec_acceptance_window is None
    r = d.update(snap(spec=(38, 98, 71)), 1.0)
    assert r.spec_acceptance_window == pytest.approx(15 / 30)
    assert r.spec_acceptance_length_window == pytest.approx(1 + 15 / 10)


def test_no_spec_decode_means_no_acceptance() -> None:
    d = RateDeriver()
    d.update(snap(), 0.0)
    r = d.update(snap(gen=10), 1.0)
    assert r.spec_acceptance_total is None
    assert r.spec_acceptance_length_window is None


def test_rates_serialise_to_plain_json_types() -> None:
    d = RateDeriver()
    d.update(snap(), 0.0)
    data = d.update(snap(gen=10), 1.0).as_dict()
    assert set(data) >= {"prompt_tps", "generation_tps", "prefix_hit_window", "ttft_window",
                         "itl_window", "spec_acceptance_window", "reset"}
    assert all(v is None or isinstance(v, bool | int | float | str) for v in data.values())

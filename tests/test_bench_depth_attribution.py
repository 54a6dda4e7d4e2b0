"""Depth rows never report nonsense pp when other traffic moves the prefix-cache counters."""

from __future__ import annotations

import pytest

from vllmstack.bench.client.client import RequestResult
from vllmstack.bench.runs.depth_runs import _cached_tokens
from vllmstack.bench.runs.session import Overhead, pp_estimate
from vllmstack.observe.metrics import parse_metrics


def snapshot(hits: int):  # type: ignore[no-untyped-def]
    return parse_metrics(
        "# TYPE vllm:prefix_cache_hits counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n')


def test_a_delta_larger_than_the_prompt_is_someone_elses_traffic() -> None:
    result = RequestResult(prompt_tokens=1100)
    assert _cached_tokens(snapshot(0), snapshot(1024), result) == 1024
    assert _cached_tokens(snapshot(0), snapshot(50_000), result) is None


def test_the_servers_own_per_request_count_wins() -> None:
    result = RequestResult(prompt_tokens=1100, cached_tokens=1088)
    assert _cached_tokens(snapshot(0), snapshot(50_000), result) == 1088


def test_pp_is_never_negative_or_from_nothing() -> None:
    overhead = Overhead(ttft_s=0.02, prompt_tokens=16)
    assert pp_estimate(overhead, [(-500, 0.1)]).pp_tps is None
    assert pp_estimate(overhead, [(0, 0.1)]).pp_tps is None
    assert pp_estimate(None, [(2016, 0.12)]).pp_tps is None
    one = pp_estimate(overhead, [(2016, 0.12)]).pp_tps
    assert one is not None
    assert one.mean == pytest.approx(2000 / 0.1) and one.min == one.max

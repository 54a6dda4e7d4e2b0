from __future__ import annotations

import math

import pytest

from vllmstack.bench.client.stats import percentile, relative_error, summarize
from vllmstack.workload.ladders import LadderError, conc_ladder, depth_cap, depth_ladder


def test_percentiles_use_the_linear_method_other_tools_use() -> None:
    # numpy.percentile(range(1, 11), q) gives these (its default "linear" method).
    values = [float(v) for v in range(1, 11)]
    expected = {0: 1.0, 50: 5.5, 90: 9.1, 99: 9.91, 100: 10.0}
    for q, want in expected.items():
        assert percentile(values, q) == pytest.approx(want)
    assert percentile([7.0], 99) == 7.0


def test_summary_has_mean_spread_and_percentiles_and_ignores_missing() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0, float("nan")])
    assert s is not None
    assert s["mean"] == 2.5
    assert s["std"] == pytest.approx(math.sqrt(1.25))
    assert (s["min"], s["max"], s["n"]) == (1.0, 4.0, 4.0)
    assert s["p50"] == 2.5
    assert summarize([]) is None
    assert relative_error(101.0, 100.0) == pytest.approx(0.01)


def test_depth_ladder_is_powers_of_two_plus_the_top_rung() -> None:
    # 32768 window, pp 2048, tg 128, margin 256: cap = 30336
    assert depth_cap(32768, 2048, 128, 256) == 30336
    assert depth_ladder(32768, 2048, 128, margin=256) == [
        0, 1024, 2048, 4096, 8192, 16384, 30336]


def test_depth_ladder_top_rung_not_repeated_and_tiny_windows() -> None:
    # cap exactly a power of two: no duplicate rung
    assert depth_ladder(4096 + 100 + 28 + 0, 100, 28, margin=0) == [0, 1024, 2048, 4096]
    # window only fits the prompt: depth 0 only... plus the small cap
    assert depth_ladder(3000, 2048, 128, margin=256) == [0, 568]
    assert depth_ladder(2432, 2048, 128, margin=256) == [0]


def test_depth_ladder_errors_name_the_numbers() -> None:
    with pytest.raises(LadderError, match="do not fit in max_model_len 2048"):
        depth_ladder(2048, 2048, 128)
    with pytest.raises(LadderError, match="power of two"):
        depth_ladder(65536, 2048, 128, first=1000)


@pytest.mark.parametrize(("seqs", "ladder"), [
    (1, [1]), (2, [1, 2]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]), (32, [1, 2, 4, 8, 16, 32]),
])
def test_conc_ladder(seqs: int, ladder: list[int]) -> None:
    assert conc_ladder(seqs) == ladder


def test_conc_ladder_rejects_zero() -> None:
    with pytest.raises(LadderError):
        conc_ladder(0)

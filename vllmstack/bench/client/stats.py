"""Summary statistics for timing samples: mean, spread and percentiles."""

from __future__ import annotations

import math
from collections.abc import Sequence

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linear between closest ranks.

    This is numpy's default ("linear") method, so numbers agree with other tools' p50/p90/p99.
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    frac = rank - low
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * frac)


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """mean, std (population), min, max, p50, p90, p99 and n; None when there are no values."""
    clean = sorted(v for v in values if v is not None and math.isfinite(v))
    if not clean:
        return None
    n = len(clean)
    mean = math.fsum(clean) / n
    var = math.fsum((v - mean) ** 2 for v in clean) / n
    out = {"mean": mean, "std": math.sqrt(var), "min": clean[0], "max": clean[-1]}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(clean, q)
    out["n"] = float(n)
    return out


def relative_error(measured: float, truth: float) -> float:
    """(measured - truth) / truth; the sign says which way the measurement leans."""
    if truth == 0:
        raise ValueError("relative error against a zero truth")
    return (measured - truth) / truth

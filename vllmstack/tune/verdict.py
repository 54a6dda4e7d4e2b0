"""The tuner's decisions, apart from any GPU: the numeric gate, the keep rule, the budget, and
which entries a written file holds. kernel_bench.py (on the GPU) and tuning.py (writing the
files) both use these, and the unit tests drive them with made-up numbers.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# A candidate's error against the fp32 reference may exceed the stock config's by rounding noise
# (another accumulation order), never by a factor: GATE_FACTOR x stock, or stock + GATE_SLACK.
GATE_FACTOR, GATE_SLACK = 2.0, 0.005
# The stock config itself must be this close, else the harness (inputs, reference) is wrong and
# no candidate can be judged: fp8 activations cost a few percent in MoE, rounding ~0.2 % in dense.
STOCK_MAX_ERROR = 0.1
# An entry replaces vLLM's own only when it is this much faster in the re-run.
MIN_GAIN = 0.05


def relative_error(diff_norm: float, ref_norm: float) -> float:
    """||out - ref|| / ||ref|| (Frobenius); a NaN or inf output is infinitely wrong."""
    if not (math.isfinite(diff_norm) and math.isfinite(ref_norm)) or ref_norm <= 0:
        return math.inf
    return diff_norm / ref_norm


def gate_limit(stock_error: float) -> float:
    return max(GATE_FACTOR * stock_error, stock_error + GATE_SLACK)


def passes_gate(error: float, stock_error: float) -> bool:
    """A candidate may be timed only when its numbers are as right as the stock config's."""
    return math.isfinite(error) and error <= gate_limit(stock_error)


def stock_is_sane(stock_error: float) -> bool:
    return math.isfinite(stock_error) and stock_error <= STOCK_MAX_ERROR


def gain(stock_us: float, tuned_us: float) -> float:
    """Speed-up of tuned over stock: 0.05 means the stock time is 5 % longer."""
    if tuned_us <= 0 or not math.isfinite(tuned_us) or not math.isfinite(stock_us):
        return 0.0
    return stock_us / tuned_us - 1.0


def keep_entry(rerun_stock_us: list[float], rerun_tuned_us: list[float],
               min_gain: float = MIN_GAIN) -> bool:
    """Keep a batch size's tuned entry only when it still wins by `min_gain` when stock and tuned
    are timed again, in turns (the first pass picked the best of many, which favours lucky noise)."""
    if not rerun_stock_us or not rerun_tuned_us:
        return False
    return gain(statistics.median(rerun_stock_us), statistics.median(rerun_tuned_us)) >= min_gain


@dataclass
class Budget:
    """Seconds for the whole run, shared out as it goes: each part gets an equal share of what is
    left, so a part that finishes early leaves its time to the ones after it."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def left(self) -> float:
        return max(0.0, self.seconds - (self.clock() - self.start))

    def share(self, parts_left: int) -> float:
        return self.left() / max(1, parts_left)

    def deadline(self, parts_left: int) -> float:
        """When the next part must stop, on this budget's clock."""
        return self.clock() + self.share(parts_left)

    def used(self) -> float:
        return self.clock() - self.start


@dataclass
class EntryVerdict:
    m: int
    stock_us: float
    tuned_us: float
    gain: float
    kept: bool
    stock: dict[str, Any]
    tuned: dict[str, Any]
    tried: int
    space: int
    rejected: int
    failed: int
    budget_cut: bool

    def as_json(self) -> dict[str, Any]:
        return {"batch_size": self.m, "stock_us": round(self.stock_us, 2),
                "tuned_us": round(self.tuned_us, 2), "gain": round(self.gain, 4), "kept": self.kept,
                "stock_config": self.stock, "tuned_config": self.tuned, "tried": self.tried,
                "space": self.space, "rejected_by_gate": self.rejected, "failed_to_run": self.failed,
                "budget_cut": self.budget_cut}


def judge(row: Mapping[str, Any], min_gain: float = MIN_GAIN) -> EntryVerdict | None:
    """One batch size of kernel_bench's result: its re-run times and whether the entry is kept
    (None when the batch size produced no timed candidate)."""
    rerun = row.get("rerun") or {}
    stock_runs = [float(x) for x in rerun.get("stock_us") or []]
    tuned_runs = [float(x) for x in rerun.get("best_us") or []]
    if not stock_runs or not tuned_runs or not row.get("best"):
        return None
    stock_us, tuned_us = statistics.median(stock_runs), statistics.median(tuned_runs)
    same = row.get("best") == row.get("stock_tile")
    kept = not same and keep_entry(stock_runs, tuned_runs, min_gain)
    return EntryVerdict(int(row["m"]), stock_us, tuned_us, gain(stock_us, tuned_us), kept,
                        dict(row.get("stock") or {}), dict(row["best"]), int(row.get("tried", 0)),
                        int(row.get("space", 0)), int(row.get("rejected", 0)),
                        int(row.get("failed", 0)), bool(row.get("budget_cut")))


def file_entries(verdicts: list[EntryVerdict], shipped: Mapping[int, Mapping[str, Any]] | None,
                 ) -> dict[int, dict[str, Any]] | None:
    """The batch-size entries of the file to write, or None when nothing won.

    vLLM reads one file per shape and picks the nearest batch size in it, and our file shadows the
    one vLLM ships. So the file carries vLLM's own choice for every batch size that did not win
    (its shipped entries, and the stock config measured at our other sizes) and the tuned tile
    only where it won: a kept file changes nothing but the winning sizes.
    """
    if not any(v.kept for v in verdicts):
        return None
    entries: dict[int, dict[str, Any]] = {int(m): dict(c) for m, c in (shipped or {}).items()}
    for v in verdicts:
        entries[v.m] = dict(v.tuned if v.kept else v.stock)
    return dict(sorted(entries.items()))

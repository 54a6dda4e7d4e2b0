"""The typed bench row: every field round-trips, stored history (old rows included) reads, a newer
row version or a wrong type is refused by name, and a new metric is one field."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT

from vllmstack.bench.client.row import (
    ROW_VERSION,
    VERSION_KEY,
    BenchRow,
    RowError,
    RowRoofline,
    Stat,
    rows_of,
)
from vllmstack.bench.client.stats import summarize
from vllmstack.bench.report import history
from vllmstack.bench.report.report import build_report, render_markdown

STORED = ROOT / "benchmarks" / "gpu" / "2026-12-01-h200-roofline" / "bench_history.jsonl"


def sample(hint: Any, seed: int) -> Any:
    """A value of the field type `hint` that is not None (and differs per field)."""
    choices = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = choices[-1] if len(choices) > 1 else choices[0]  # the richer shape of a union
    if kind is int:
        return seed
    if kind is float:
        return seed + 0.25
    if kind is str:
        return f"text {seed}"
    if typing.get_origin(kind) is tuple:
        return (f"a{seed}", f"b{seed}")
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return kind(**{f.name: sample(hints[f.name], seed * 10 + n)
                       for n, f in enumerate(dataclasses.fields(kind))})
    raise AssertionError(f"no sample for {hint!r}: teach this test the new field type")


def full_row() -> BenchRow:
    hints = typing.get_type_hints(BenchRow)
    return BenchRow(**{f.name: sample(hints[f.name], n) for n, f in enumerate(dataclasses.fields(BenchRow))
                       if f.name != "extra"}, extra={"note": "kept"})


def test_every_field_round_trips_through_stored_json() -> None:
    row = full_row()
    assert all(getattr(row, f.name) is not None for f in dataclasses.fields(BenchRow))
    stored = json.loads(json.dumps(row.to_json(), allow_nan=False))
    assert BenchRow.from_json(stored, "test") == row
    # One key per field, named as the field: no second list of keys to keep in step.
    names = [f.name for f in dataclasses.fields(BenchRow) if f.name != "extra"]
    assert list(stored) == [*names, "note", VERSION_KEY]
    assert stored[VERSION_KEY] == ROW_VERSION
    assert stored["token_source"] == ["a17", "b17"]  # a tuple is stored as JSON's list


def test_the_stats_are_what_summarize_gives() -> None:
    values = [3.0, 1.0, 2.0, float("nan")]
    stat = Stat.of(values)
    assert stat is not None and stat.to_json() == summarize(values)
    assert Stat.of([]) is None
    # The pp estimate has no percentiles: they are not written.
    assert Stat(mean=1.0, std=0.1, min=0.9, max=1.1, n=3.0).to_json() == {
        "mean": 1.0, "std": 0.1, "min": 0.9, "max": 1.1, "n": 3.0}


def test_the_stored_h200_history_reads_and_writes_back_the_same_keys() -> None:
    records = history.read_records(STORED)
    assert records and all(VERSION_KEY not in row for rec in records for row in rec["results"])
    for number, record in enumerate(records, start=1):
        rows = rows_of(record, f"{STORED.name} record {number}")
        for row, stored in zip(rows, record["results"], strict=True):
            assert row.to_json() == {**stored, VERSION_KEY: ROW_VERSION}
    first = rows_of(records[0], "h200")[0]
    assert first.pp_tps is None and first.pp_note == "below resolution"
    assert first.tg_tps is not None and first.tg_tps.mean == pytest.approx(215.3, abs=0.1)
    assert first.roofline == RowRoofline(card="NVIDIA_H200", decode_limit_tps=343.6,
                                         decode_pct=62.7, prefill_limit_tps=70715.3)


def stat(mean: float) -> dict[str, float]:
    return {"mean": mean, "std": 0.5, "min": mean - 1, "max": mean + 1, "p50": mean, "p90": mean,
            "p99": mean, "n": 3.0}


# Rows as the runs wrote them before the row version existed: a two-phase depth row, a conc row.
OLD_DEPTH = {"pp": 128, "tg": 32, "depth": 32768, "concurrency": 1, "requests": 2, "errors": 0,
             "ttft_ms": stat(80.0), "ttfr_ms": stat(79.0), "pp_tps": stat(9000.0),
             "pp_marginal_ms": stat(14.0), "pp_uncertainty_ms": 0.4, "pp_note": None,
             "tg_tps": stat(98.0), "itl_ms": stat(10.2), "e2e_ms": stat(400.0),
             "prompt_tokens": stat(160.0), "completion_tokens": stat(32.0),
             "token_source": ["usage-final", "usage-per-chunk"], "mode": "two-phase",
             "ctx_pp_tps": stat(60000.0), "cache_hit_tokens": stat(32768.0),
             "roofline": {"card": None, "note": "unknown card X"}}
OLD_CONC = {"pp": 512, "tg": 64, "depth": 0, "concurrency": 4, "requests": 40, "errors": 1,
            "ttft_ms": stat(30.0), "tg_tps": stat(50.0), "duration_s": 30.0, "window_s": 28.5,
            "total_tg_tps": 190.5, "requests_per_s": 1.3, "roofline": None}


def test_old_depth_and_conc_lines_read(tmp_path: Path) -> None:
    path = history.history_path(tmp_path, "depth")
    with path.open("w") as handle:  # a line exactly as an older checkout appended it
        handle.write(json.dumps({"kind": "depth", "id": "old", "schema_version": 1,
                                 "results": [OLD_DEPTH]}) + "\n")
    (depth,) = rows_of(history.read_records(path)[0], "old depth")
    assert depth.mode == "two-phase" and depth.token_source == ("usage-final", "usage-per-chunk")
    assert depth.ctx_pp_tps is not None and depth.ctx_pp_tps.mean == 60000.0
    assert depth.to_json() == {**OLD_DEPTH, VERSION_KEY: ROW_VERSION}
    conc = BenchRow.from_json(OLD_CONC, "old conc")
    assert conc.total_tg_tps == 190.5 and conc.requests_per_s == 1.3
    # Keys an older row never had read as None (and a null roofline is left out when written).
    assert conc.ttfr_ms is None and conc.pp_note is None and conc.roofline is None
    assert "roofline" not in conc.to_json() and conc.to_json()["ttfr_ms"] is None
    # NaN, which old records may hold, is read (the report shows it as missing).
    nan = BenchRow.from_json({**OLD_CONC, "tg_tps": {"mean": math.nan}}, "nan")
    assert nan.tg_tps is not None and math.isnan(nan.tg_tps.mean)
    text = render_markdown("conc", [{"ts": 1.8e9, "model": "m",
                                     "results": [{**OLD_CONC, "tg_tps": {"mean": math.nan}}]}])
    assert "| 4 | 190.5 | - | 30/30 |" in text


def test_a_row_of_a_newer_version_is_refused_by_name(tmp_path: Path) -> None:
    newer = {**OLD_CONC, VERSION_KEY: ROW_VERSION + 1}
    with pytest.raises(RowError) as caught:
        BenchRow.from_json(newer, "conc_history.jsonl record abc, row 1")
    assert caught.value.cause.startswith("conc_history.jsonl record abc, row 1: the row is of "
                                         f"row_version {ROW_VERSION + 1}, newer than this checkout")
    assert caught.value.fix is not None and "git pull" in caught.value.fix
    for bad in ("2", True, -1, 1.0):
        with pytest.raises(RowError, match=f"key '{VERSION_KEY}' holds"):
            BenchRow.from_json({**OLD_CONC, VERSION_KEY: bad}, "here")
    # The report skips the record, naming the file, the record and why; the others still show.
    path = history.history_path(tmp_path, "conc")
    history.append_record(path, {"kind": "conc", "id": "new", "results": [newer]})
    history.append_record(path, {"kind": "conc", "id": "old", "results": [OLD_CONC]})
    warnings: list[str] = []
    text, _ = build_report(tmp_path, ["conc"], warn=warnings.append)
    assert "## conc history (1 record)" in text and "| 190.5 |" in text
    assert any(f"conc record new, row 1: the row is of row_version {ROW_VERSION + 1}" in w
               and "conc_history.jsonl" in w for w in warnings)


@pytest.mark.parametrize(("row", "message"), [
    ({"pp": "128"}, "here: key 'pp' holds str '128', not a whole number"),
    ({"pp": 128.0}, "here: key 'pp' holds float 128.0, not a whole number"),
    ({"errors": True}, "here: key 'errors' holds bool True, not a whole number"),
    ({"ttft_ms": [1, 2]}, "here: key 'ttft_ms' holds list [1, 2], not a JSON object"),
    ({"ttft_ms": {"std": 1.0}}, "here: key 'ttft_ms' has no key 'mean'"),
    ({"tg_tps": {"mean": 1.0, "p99": "x"}}, "here: key 'tg_tps.p99' holds str 'x', not a number"),
    ({"token_source": [1]}, "here: key 'token_source' holds list [1], not a text or a list of texts"),
    ({"roofline": {"card": 5}}, "here: key 'roofline.card' holds int 5, not a text"),
    (["not", "a", "row"], "here: the row holds list"),
])
def test_a_key_of_the_wrong_type_is_named(row: Any, message: str) -> None:
    with pytest.raises(RowError) as caught:
        BenchRow.from_json(row, "here")
    assert caught.value.cause.startswith(message)
    assert caught.value.fix is not None and "delete the record" in caught.value.fix


@dataclass(frozen=True, slots=True, kw_only=True)
class WithNewMetric(BenchRow):
    """What adding a metric is: one field, nothing else."""

    ttfb_ms: Stat | None = None


def test_a_new_metric_is_one_field() -> None:
    row = WithNewMetric(pp=128, tg=32, ttfb_ms=Stat(mean=1.5))
    stored = row.to_json()
    assert stored["ttfb_ms"] == {"mean": 1.5}
    assert WithNewMetric.from_json(stored, "new") == row
    # A row written before the field reads as None, and writes back without the key.
    old = WithNewMetric.from_json(OLD_CONC, "old")
    assert old.ttfb_ms is None and "ttfb_ms" not in old.to_json()
    # A checkout without the field keeps the key it does not know and writes it back.
    older = BenchRow.from_json(stored, "older checkout")
    assert older.extra == {"ttfb_ms": {"mean": 1.5}} and older.to_json() == stored

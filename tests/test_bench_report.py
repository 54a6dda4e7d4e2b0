from __future__ import annotations

from pathlib import Path

from vllmstack.bench.report import history
from vllmstack.bench.report.png import decode_png, read_png_size
from vllmstack.bench.report.report import build_report, chart_series, render_chart, render_markdown


def stat(mean: float, std: float = 0.0) -> dict[str, float]:
    return {"mean": mean, "std": std, "p50": mean, "p90": mean, "p99": mean * 1.5}


def bench_record(tg: float) -> dict[str, object]:
    return {"kind": "bench", "ts": 1_800_000_000.0, "profile": "qwen3.8-27b", "model": "q",
            "results": [{"pp": 2048, "tg": 128, "depth": 0, "concurrency": 1, "errors": 0,
                         "ttft_ms": stat(210.0, 3.0), "pp_tps": stat(9800.0, 40.0),
                         "tg_tps": stat(tg, 0.2), "itl_ms": stat(1000 / tg)}]}


def test_bench_table_shows_mean_and_spread() -> None:
    text = render_markdown("bench", [bench_record(50.0)])
    assert "| pp | tg | TTFT ms | pp t/s | tg t/s |" in text
    # No roofline in this record (a CPU run, or one from before it existed): "-".
    assert "| 2048 | 128 | 210.0 ± 3.0 | 9800 ± 40 | 50.00 ± 0.20 | 20.00/30.00 | - | 0 |" in text


def test_probe_and_empty_tables() -> None:
    records = [{"kind": "probe", "ts": 1.0, "model": "m", "name": "thinkoff", "verdict": "fail",
                "checks": [{"name": "stream equals non-stream", "verdict": "fail"},
                           {"name": "answer in content", "verdict": "pass"}]}]
    text = render_markdown("probe", records)
    assert "| thinkoff | FAIL | stream equals non-stream |" in text
    assert "No records yet." in render_markdown("conc", [])


def test_bench_chart_has_one_series_per_shape_over_time() -> None:
    records = [bench_record(50.0), bench_record(52.0), bench_record(49.0)]
    x_label, y_label, series = chart_series("bench", records)
    assert series == [("pp2048 tg128", [(0.0, 50.0), (1.0, 52.0), (2.0, 49.0)])]
    png = render_chart("bench", x_label, y_label, series)
    assert read_png_size(png) == (900, 520)
    canvas = decode_png(png)
    colored = sum(1 for y in range(520) for x in range(0, 900, 3)
                  if canvas.get(x, y) == (31, 119, 180))
    assert colored > 100  # the line was drawn in the first series colour


def test_report_counts_unreadable_lines(tmp_path: Path) -> None:
    path = history.history_path(tmp_path, "bench")
    history.append_record(path, bench_record(50.0))
    with path.open("a") as handle:
        handle.write('{"torn\n')
    text, charts = build_report(tmp_path, ["bench"], chart_dir=tmp_path / "charts")
    assert "## bench history (1 record)" in text
    assert "1 unreadable line(s) in bench_history.jsonl skipped: lines 2" in text
    assert charts == [tmp_path / "charts" / "bench.png"]


def test_malformed_record_is_skipped_with_a_warning(tmp_path: Path) -> None:
    path = history.history_path(tmp_path, "bench")
    history.append_record(path, bench_record(50.0))
    history.append_record(path, {"kind": "bench", "id": "bad-results", "results": 5})
    history.append_record(path, {"kind": "bench", "id": "bad-stat",
                                 "results": [{"pp": 1, "ttft_ms": {"mean": "fast"}}]})
    history.append_record(path, bench_record(52.0))
    depth = history.history_path(tmp_path, "depth")
    history.append_record(depth, {"kind": "depth", "id": "no-depth", "results": [{"mode": "x"}]})
    warnings: list[str] = []
    text, charts = build_report(tmp_path, ["bench", "depth"], chart_dir=tmp_path / "charts",
                                warn=warnings.append)
    assert "## bench history (2 records)" in text
    assert "50.00 ± 0.20" in text and "52.00 ± 0.20" in text
    assert "2 malformed record(s) in bench_history.jsonl skipped" in text
    assert any("bench record bad-results: TypeError: results is not a list" in w
               for w in warnings)
    # The typed row names the record, the row and the key that is wrong.
    assert any("bench record bad-stat, row 1: key 'ttft_ms.mean' holds str 'fast', not a number"
               in w and "bench_history.jsonl" in w for w in warnings)
    assert any("depth record no-depth, row 1: a depth row without the key 'depth'" in w
               for w in warnings)
    assert charts == [tmp_path / "charts" / "bench.png"]  # the good records still chart


def test_pp_below_resolution_is_shown_as_such() -> None:
    record = bench_record(50.0)
    row = record["results"][0]  # type: ignore[index]
    row.update(pp_tps=None, pp_note="below resolution")
    assert "| below resolution |" in render_markdown("bench", [record])

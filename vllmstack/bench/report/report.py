"""Markdown tables and PNG charts from benchmark history.

A record that cannot be rendered (a field of the wrong type, a row that is not an object: a
hand-edited file, a record from a tool with another schema) is skipped with a warning that names
it and the reason; the rest of the report is still written.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllmstack.bench.client.row import BenchRow, RowError, Stat, mean_of
from vllmstack.bench.report import history, roofline
from vllmstack.bench.report.png import GLYPH_H, Canvas, Color, text_width

SERIES_COLORS: list[Color] = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14),
                              (148, 103, 189), (140, 86, 75), (227, 119, 194), (23, 190, 207)]


def _when(record: dict[str, Any]) -> str:
    ts = record.get("ts") or record.get("started")
    if not isinstance(ts, (int, float)):
        return "?"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def _mean(stat: Stat | None, fmt: str = ".1f") -> str:
    value = mean_of(stat)
    return "-" if value is None else format(value, fmt)


def _pct(stat: Stat | None, q: str, fmt: str = ".1f") -> str:
    value = getattr(stat, q) if stat is not None else None
    return "-" if value is None else format(value, fmt)


def _spread(stat: Stat | None, fmt: str = ".1f") -> str:
    if mean_of(stat) is None or stat is None:
        return "-"
    return f"{format(stat.mean, fmt)} ± {format(stat.std or 0.0, fmt)}"


def _pp(row: BenchRow, mean_only: bool = False) -> str:
    """pp t/s with its uncertainty, or why there is no number ("below resolution")."""
    if row.pp_tps is not None:
        return _mean(row.pp_tps, ".0f") if mean_only else _spread(row.pp_tps, ".0f")
    return row.pp_note or "-"


def short_tokens(n: int) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    if n >= 1000:
        return f"{n / 1024:.1f}K"
    return str(n)


def _table(header: Sequence[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _results(rec: dict[str, Any], where: str) -> list[BenchRow]:
    rows = rec.get("results", [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError("results is not a list of objects")
    return [BenchRow.from_json(row, f"{where}, row {n}") for n, row in enumerate(rows, start=1)]


def _depth(row: BenchRow, where: str) -> int:
    if row.depth is None:
        raise RowError(f"{where}: a depth row without the key 'depth'",
                       "correct or delete the record: a depth row says which depth it measured")
    return row.depth


def record_rows(kind: str, rec: dict[str, Any], where: str | None = None) -> list[list[str]]:
    """The table rows of one record; raises (TypeError, ValueError: RowError naming the key)
    when malformed. `where` names the record in that error."""
    where = where or f"{kind} record"
    rows: list[list[str]] = []
    if kind == "bench":
        for row in _results(rec, where):
            rows.append([_when(rec), str(rec.get("profile") or "-"), str(rec.get("model")),
                         str(row.pp), str(row.tg), _spread(row.ttft_ms), _pp(row),
                         _spread(row.tg_tps, ".2f"),
                         f"{_pct(row.itl_ms, 'p50', '.2f')}/{_pct(row.itl_ms, 'p99', '.2f')}",
                         roofline.cell(row), str(row.errors or 0)])
    elif kind == "depth":
        for n, row in enumerate(_results(rec, where), start=1):
            rows.append([_when(rec), str(rec.get("model")),
                         short_tokens(_depth(row, f"{where}, row {n}")),
                         row.mode or "-", _mean(row.ttft_ms), _pp(row, True),
                         _mean(row.ctx_pp_tps, ".0f"), _mean(row.tg_tps, ".2f"),
                         _pct(row.itl_ms, "p99", ".2f")])
    elif kind == "conc":
        for row in _results(rec, where):
            total = row.total_tg_tps
            rows.append([_when(rec), str(rec.get("model")), str(row.concurrency),
                         f"{total:.1f}" if total is not None else "-",
                         _mean(row.tg_tps, ".2f"),
                         f"{_pct(row.ttft_ms, 'p50', '.0f')}/{_pct(row.ttft_ms, 'p99', '.0f')}",
                         _pct(row.itl_ms, "p99", ".2f"), str(row.requests),
                         str(row.errors or 0)])
    else:  # probe, stability
        checks = rec.get("checks", [])
        if not isinstance(checks, list):
            raise TypeError("checks is not a list")
        failed = [str(c["name"]) for c in checks if c.get("verdict") == "fail"]
        rows.append([_when(rec), str(rec.get("model")), str(rec.get("name")),
                     str(rec.get("verdict", "?")).upper(), ", ".join(failed) or "-"])
    return rows


HEADERS = {
    "bench": ["when", "profile", "model", "pp", "tg", "TTFT ms", "pp t/s", "tg t/s",
              "ITL p50/p99 ms", "% roofline", "failed"],
    "depth": ["when", "model", "depth", "mode", "TTFT ms", "pp t/s", "ctx pp t/s", "tg t/s",
              "ITL p99 ms"],
    "conc": ["when", "model", "c", "total tg t/s", "tg t/s per request", "TTFT p50/p99 ms",
             "ITL p99 ms", "requests", "failed"],
}
PROBE_HEADER = ["when", "model", "name", "verdict", "failed checks"]


def render_markdown(kind: str, records: list[dict[str, Any]],
                    skipped: list[str] | None = None) -> str:
    """One markdown section for a history kind (records oldest first).

    Records that cannot be rendered are left out; `skipped` collects one line per such record.
    """
    rows: list[list[str]] = []
    shown = 0
    for number, rec in enumerate(records, start=1):
        name = rec.get("id") if isinstance(rec.get("id"), str) else f"#{number}"
        try:
            rows.extend(record_rows(kind, rec, f"{kind} record {name}"))
            shown += 1
        except RowError as exc:  # names the record and the key itself
            if skipped is not None:
                skipped.append(exc.cause)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if skipped is not None:
                skipped.append(f"{kind} record {name}: {exc.__class__.__name__}: {exc}")
    title = f"## {kind} history ({shown} record{'s' if shown != 1 else ''})"
    if not shown:
        return title + "\n\nNo records yet."
    return f"{title}\n\n{_table(HEADERS.get(kind, PROBE_HEADER), rows)}"


def chart_series(kind: str, records: list[dict[str, Any]], last: int = 5
                 ) -> tuple[str, str, list[tuple[str, list[tuple[float, float]]]]]:
    """(x label, y label, [(series label, [(x, y)])]) for a kind; empty when nothing to plot."""
    series: list[tuple[str, list[tuple[float, float]]]] = []
    if kind in ("depth", "conc"):
        for rec in records[-last:]:
            points = []
            for row in _plottable(rec):
                if kind == "depth":
                    x, y = row.depth, mean_of(row.tg_tps)
                else:
                    x, y = row.concurrency, row.total_tg_tps
                if x is not None and y is not None and math.isfinite(y):
                    points.append((float(x), y))
            if points:
                series.append((f"{_when(rec)} {rec.get('model')}", sorted(points)))
        if kind == "depth":
            return "context depth (tokens)", "decode t/s", series
        return "concurrency", "total decode t/s", series
    if kind == "bench":
        by_shape: dict[str, list[tuple[float, float]]] = {}
        for index, rec in enumerate(records):
            for row in _plottable(rec):
                tg = mean_of(row.tg_tps)
                if tg is not None:
                    label = f"pp{row.pp} tg{row.tg}"
                    by_shape.setdefault(label, []).append((float(index), tg))
        series = sorted(by_shape.items())
        return "run (oldest to newest)", "decode t/s", series
    return "", "", []


def _plottable(rec: dict[str, Any]) -> list[BenchRow]:
    try:
        return _results(rec, "chart")
    except (TypeError, ValueError):
        return []  # already reported by the table


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / max(1, ticks)
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * power:
            return m * power
    return 10 * power


def _label(value: float) -> str:
    if value >= 1024 and float(value).is_integer():
        return short_tokens(int(value))
    if value >= 100 or float(value).is_integer():
        return f"{value:.0f}"
    return f"{value:.1f}"


def render_chart(title: str, x_label: str, y_label: str,
                 series: list[tuple[str, list[tuple[float, float]]]],
                 width: int = 900, height: int = 520) -> bytes:
    """A line chart PNG. X is categorical (sorted distinct x values, evenly spaced), so power-of-
    two ladders read well; Y starts at zero."""
    canvas = Canvas(width, height)
    ink, grid = (40, 40, 40), (225, 225, 225)
    left, right, top, bottom = 70, 20, 40, 60 + 14 * len(series)
    plot_w, plot_h = width - left - right, height - top - bottom
    if plot_w < 50 or plot_h < 50:
        raise ValueError("chart too small for its legend")
    canvas.text(left, 12, title, ink, 2)
    xs = sorted({x for _, pts in series for x, _ in pts})
    y_max = max((y for _, pts in series for _, y in pts), default=1.0) or 1.0
    step = _nice_step(y_max)
    y_top = step * math.ceil(y_max / step)

    def to_px(x: float, y: float) -> tuple[int, int]:
        i = xs.index(x)
        px = left + (plot_w * i // max(1, len(xs) - 1) if len(xs) > 1 else plot_w // 2)
        py = top + plot_h - int(plot_h * (y / y_top))
        return px, py

    tick = 0.0
    while tick <= y_top + 1e-9:
        py = top + plot_h - int(plot_h * (tick / y_top))
        canvas.line(left, py, left + plot_w, py, grid)
        label = _label(tick)
        canvas.text(left - 8 - text_width(label), py - GLYPH_H // 2, label, ink)
        tick += step
    canvas.line(left, top, left, top + plot_h, ink)
    canvas.line(left, top + plot_h, left + plot_w, top + plot_h, ink)
    for x in xs:
        px, _ = to_px(x, 0)
        canvas.line(px, top + plot_h, px, top + plot_h + 4, ink)
        label = _label(x)
        canvas.text(px - text_width(label) // 2, top + plot_h + 8, label, ink)
    canvas.text(left + plot_w // 2 - text_width(x_label) // 2, top + plot_h + 22, x_label, ink)
    canvas.text(8, top - 14, y_label, ink)
    for n, (name, pts) in enumerate(series):
        color = SERIES_COLORS[n % len(SERIES_COLORS)]
        pixels = [to_px(x, y) for x, y in pts]
        for (x0, y0), (x1, y1) in itertools.pairwise(pixels):
            canvas.line(x0, y0, x1, y1, color, thickness=2)
        for px, py in pixels:
            canvas.dot(px, py, color, 3)
        ly = top + plot_h + 40 + n * 14
        canvas.fill_rect(left, ly, left + 10, ly + 8, color)
        canvas.text(left + 16, ly, name[:100], ink)
    return canvas.to_png()


def build_report(folder: Path, kinds: Sequence[str], *, last: int = 20,
                 chart_dir: Path | None = None,
                 warn: Callable[[str], None] | None = None) -> tuple[str, list[Path]]:
    """Markdown for the given kinds (last N records each) and the PNG charts written.

    `warn` hears about every unreadable line and skipped record (the markdown notes them too).
    """
    sections = ["# Benchmark report"]
    charts: list[Path] = []
    for kind in kinds:
        path = history.history_path(folder, kind)
        content = history.read_file(path)
        records = content.records[-last:]
        skipped: list[str] = []
        section = render_markdown(kind, records, skipped)
        if content.skipped:
            note = (f"{content.skipped} unreadable line(s) in {path.name} skipped: "
                    f"lines {', '.join(map(str, content.skipped_lines[:10]))}")
            section += f"\n\n({note})"
            if warn is not None:
                warn(note)
        if skipped:
            section += (f"\n\n({len(skipped)} malformed record(s) in {path.name} skipped: "
                        + "; ".join(skipped[:5]) + ")")
            for line in skipped:
                if warn is not None:
                    warn(f"skipped malformed {line} (in {path})")
        if chart_dir is not None:
            x_label, y_label, series = chart_series(kind, records)
            if series:
                chart_dir.mkdir(parents=True, exist_ok=True)
                out = chart_dir / f"{kind}.png"
                out.write_bytes(render_chart(f"{kind}: {y_label}", x_label, y_label, series))
                charts.append(out)
                section += f"\n\n![{kind} chart]({out.name})"
        sections.append(section)
    return "\n\n".join(sections) + "\n", charts

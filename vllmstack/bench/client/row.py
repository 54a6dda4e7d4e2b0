"""A bench row: what one measured shape (pp, tg, depth, concurrency) of a bench, depth or conc run
gave, as the runs build it and every reader takes it (the report and its roofline, the depth-decay
probe, bench-vs, the dashboard).

A new metric is one field of `BenchRow` plus its measurement in the run that takes it: the JSON
key is the field's name and the reader is the field's type (`to_json` and `from_json` walk the
fields), so no list of keys is kept anywhere else. A field added later is `None` by default, is
written only when it holds a value (no stored row changes) and reads as `None` from the rows
written before it. Adding a field needs no new ROW_VERSION (an older checkout keeps a key it does
not know in `extra` and writes it back unchanged); changing what a key means, its unit or its type
does: bump ROW_VERSION and read the old form in `from_json`. Rows from before the version key are
version 0 and read as version 1. A row of a newer version is refused with the record it came from,
rather than read as if its keys meant what they mean here.

`Stat` is what `stats.summarize` produces (mean, std, min, max, p50/p90/p99, n; the pp estimate
has no percentiles), `RowRoofline` the share of the card's limits a row reached.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from vllmstack.bench.client.stats import summarize
from vllmstack.core.errors import StackError

ROW_VERSION = 1
VERSION_KEY = "row_version"
# The history kinds whose records' `results` are bench rows.
ROW_KINDS = ("bench", "depth", "conc")
FIX = ("the row was edited by hand or written by another tool: correct it, or delete the record "
       "(the dashboard's history table, or remove its line from the .jsonl file)")


class RowError(StackError, ValueError):
    """A stored bench row that cannot be read: the key, where it came from, and the fix."""


# The metadata of a field every row has carried since rows were first written: its key is written
# also when it is None (`"pp_tps": null` says "no estimate"), so the stored JSON stays what it was.
# Every other optional field is left out while it is None.
ALWAYS: Mapping[str, bool] = {"always": True}


def _describe(value: object) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 60 else shown[:59] + '…'}"


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return {"int": "a whole number", "float": "a number", "str": "a text"}.get(
            hint.__name__, f"an object ({hint.__name__})")
    return "a list of texts"  # tuple[str, ...], the only other shape a field has


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The fields' types, evaluated once per class (the annotations are strings here)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _read(hint: Any, value: object, where: str, path: str) -> Any:
    """`value` as the field type `hint` (None stays None); RowError naming `path` otherwise."""
    if value is None:
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        choices = [a for a in typing.get_args(hint) if a is not type(None)]
        for choice in choices:
            try:
                return _read(choice, value, where, path)
            except RowError:
                if len(choices) == 1:
                    raise
        raise RowError(f"{where}: key {path!r} holds {_describe(value)}, not "
                       + " or ".join(_type_name(c) for c in choices), FIX)
    if isinstance(hint, type) and issubclass(hint, JsonShape):
        return hint.read_json(value, where, path)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    # NaN and infinities stay: old records may hold them (the dashboard shows them as missing).
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    if typing.get_origin(hint) is tuple and isinstance(value, list) \
            and all(isinstance(v, str) for v in value):
        return tuple(value)
    if hint not in (int, float, str) and typing.get_origin(hint) is not tuple:
        # A field of a type this reader cannot read: the class is wrong, not the data.
        raise TypeError(f"field {path!r} has a type the row reader does not know: {hint!r}")
    raise RowError(f"{where}: key {path!r} holds {_describe(value)}, not {_type_name(hint)}", FIX)


class JsonShape:
    """`to_json`/`read_json` derived from a dataclass's fields: one key per field, read back as
    the field's type. A field whose metadata says `extra` holds the keys no field names."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        extra: Mapping[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata.get("extra"):
                extra = value
            elif value is not None or f.metadata.get("always"):
                out[f.name] = (value.to_json() if isinstance(value, JsonShape)
                               else list(value) if isinstance(value, tuple) else value)
        return {**out, **{k: v for k, v in extra.items() if k not in out}}

    @classmethod
    def read_json(cls, data: object, where: str, path: str = "") -> Self:
        inside = f"key {path!r}" if path else "the row"
        if not isinstance(data, Mapping):
            raise RowError(f"{where}: {inside} holds {_describe(data)}, not a JSON object", FIX)
        hints = _hints(cls)
        values: dict[str, Any] = {}
        known: set[str] = set()
        extra_field = None
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.metadata.get("extra"):
                extra_field = f.name
                continue
            known.add(f.name)
            key = f"{path}.{f.name}" if path else f.name
            if f.name in data:
                values[f.name] = _read(hints[f.name], data[f.name], where, key)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RowError(f"{where}: {inside} has no key {f.name!r}", FIX)
        if extra_field is not None:
            values[extra_field] = {k: v for k, v in data.items()
                                   if k not in known and k != VERSION_KEY}
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stat(JsonShape):
    """A distribution as `stats.summarize` gives it; the pp estimate carries mean (the estimate),
    std (its uncertainty), min/max (its interval) and n only."""

    mean: float
    std: float | None = None
    min: float | None = None
    max: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    n: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Stat | None:
        """The summary of `values` (non-finite ones left out); None when none are left."""
        summary = summarize(list(values))
        if summary is None:
            return None
        return cls(mean=summary["mean"], std=summary["std"], min=summary["min"],
                   max=summary["max"], p50=summary["p50"], p90=summary["p90"],
                   p99=summary["p99"], n=summary["n"])


def mean_of(stat: Stat | None) -> float | None:
    """The mean when there is a finite one (an old record may hold NaN)."""
    return stat.mean if stat is not None and math.isfinite(stat.mean) else None


@dataclass(frozen=True, slots=True, kw_only=True)
class RowRoofline(JsonShape):
    """How much of the card's limits a row reached (`report/roofline.row_roofline`); `card` None
    with a `note` when the card is not in the table."""

    card: str | None = field(default=None, metadata=ALWAYS)
    note: str | None = None
    decode_limit_tps: float | None = None
    decode_pct: float | None = None
    prefill_limit_tps: float | None = None
    prefill_pct: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRow(JsonShape):
    """One measured shape. The first group is what every run kind writes; then the depth run's
    (mode; ctx_pp_tps and cache_hit_tokens when two-phase), the concurrency run's, the roofline."""

    pp: int | None = field(default=None, metadata=ALWAYS)
    tg: int | None = field(default=None, metadata=ALWAYS)
    depth: int | None = field(default=None, metadata=ALWAYS)
    concurrency: int | None = field(default=None, metadata=ALWAYS)
    requests: int | None = field(default=None, metadata=ALWAYS)
    errors: int | None = field(default=None, metadata=ALWAYS)
    ttft_ms: Stat | None = field(default=None, metadata=ALWAYS)
    ttfr_ms: Stat | None = field(default=None, metadata=ALWAYS)
    pp_tps: Stat | None = field(default=None, metadata=ALWAYS)
    pp_marginal_ms: Stat | None = field(default=None, metadata=ALWAYS)
    pp_uncertainty_ms: float | None = field(default=None, metadata=ALWAYS)
    pp_note: str | None = field(default=None, metadata=ALWAYS)
    tg_tps: Stat | None = field(default=None, metadata=ALWAYS)
    itl_ms: Stat | None = field(default=None, metadata=ALWAYS)
    e2e_ms: Stat | None = field(default=None, metadata=ALWAYS)
    prompt_tokens: Stat | None = field(default=None, metadata=ALWAYS)
    completion_tokens: Stat | None = field(default=None, metadata=ALWAYS)
    # Where the token counts came from; several when the requests differed.
    token_source: str | tuple[str, ...] | None = field(default=None, metadata=ALWAYS)
    mode: str | None = None  # depth: cold | blended | two-phase
    ctx_pp_tps: Stat | None = None  # depth, two-phase: the context load's prefill rate
    cache_hit_tokens: Stat | None = None  # depth, two-phase: prompt tokens the cache served
    duration_s: float | None = None  # conc: closed-loop time per level
    window_s: float | None = None  # conc: the steady window the totals are over
    total_tg_tps: float | None = None  # conc: tokens in the window over its length
    requests_per_s: float | None = None  # conc
    roofline: RowRoofline | None = None  # on a GPU platform, set by `runs.execute`
    # Keys no field names (a row of a later version of this code, a hand-added note): kept and
    # written back as they were.
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False, metadata={"extra": True})

    def to_json(self) -> dict[str, Any]:
        """Today's keys (and any kept `extra`), plus the row version."""
        return {**JsonShape.to_json(self), VERSION_KEY: ROW_VERSION}

    @classmethod
    def from_json(cls, data: object, where: str) -> BenchRow:
        """A stored row, of this version or an older one (a missing key is None). RowError, naming
        the key and `where` (the file and record), for a row of a newer version or a key of the
        wrong type."""
        if isinstance(data, Mapping) and VERSION_KEY in data:
            version = data[VERSION_KEY]
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise RowError(f"{where}: key {VERSION_KEY!r} holds {_describe(version)}, not a "
                               "whole number of 0 or more", FIX)
            if version > ROW_VERSION:
                raise RowError(
                    f"{where}: the row is of row_version {version}, newer than this checkout "
                    f"reads ({ROW_VERSION}): a later vllmstack wrote it, and its keys may mean "
                    "something else here",
                    "update this checkout (git pull) to read it; nothing here rewrites the row")
        return cls.read_json(data, where)


def rows_of(record: Mapping[str, Any], where: str) -> list[BenchRow]:
    """The bench rows of a history record (`results`), each read with `BenchRow.from_json`."""
    results = record.get("results")
    if not isinstance(results, list):
        raise RowError(f"{where}: key 'results' holds {_describe(results)}, not a list of rows", FIX)
    return [BenchRow.from_json(row, f"{where}, row {number}")
            for number, row in enumerate(results, start=1)]

"""Where a boot's time went: the phases of an engine's start, read from its log.

vLLM stamps each line `INFO 11-29 16:10:03 [file.py:12]` (the engine's local time, no year, whole
seconds); llama-server stamps `0.00.149.576` (minutes, seconds, ms, us since its process started).
A line that names a phase (serve.boot_markers, texts from real logs: the 0.27.1 captures and H200
boots, the 0.32 CPU engine's, llama-server's, all in tests/data, and vLLM's and llama.cpp's source)
either *marks* a phase (it is in progress at that line: from there on, the time is that phase's)
or *ends* one (it ran up to that line: the time since the previous phase stopped is its). A line
that says how long its phase took (`Model loading took ... 1.59 seconds`, `torch.compile took
13.66 s in total`) moves that phase's start back: finer than the seconds the stamps have. A phase
that comes back (two workers, kernel warm-up before and after graph capture) adds up under its
name. Time no line claims (after a phase ended, before the next one is named) is `other`, and so
is every second of a log whose lines the table does not know: vLLM changes its lines between
releases, and an unknown line must never be an error.

The phases add up to the wall time by construction: every boundary lies between the boot's start
and its end. With the times `up` measures (when it launched the engine, when /health said 200,
the warm-up) the log's clock is matched to the host's (its offset from UTC is a whole number of
quarter hours: a container may run in another time zone), `starting` is launch to the first log
line (imports, and the container's start), and the wall is what `up` measured. A log whose clock
does not fit that boot (its first line before the launch, its server up after /health answered:
another boot's log) keeps its phases' lengths, and the rest of what `up` measured is `other`.
"""

from __future__ import annotations

import calendar
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vllmstack.serve.boot_markers import (
    BOOT_OVER,
    DIALECTS,
    LLAMACPP,
    LLAMACPP_STAMP,
    OTHER,
    STARTING,
    VLLM,
    VLLM_STAMP,
    WARM_UP,
    Dialect,
    Marker,
)
from vllmstack.serve.diagnosis import ANSI, PROCESS_PREFIX

# How far out of order the lines of vLLM's processes come (a second or two, seen).
REORDER_S = 5.0
# How far a boot's stamps may lie outside what `up` measured (whole seconds, clocks apart).
ANCHOR_SLACK_S = 3.0
# How far before a boot's first vLLM line its import-time lines may lie.
PRELUDE_S = 60.0
# A time zone's offset from UTC: whole quarter hours, at most 14 h.
QUARTER_HOUR_S, MAX_OFFSET_S = 900.0, 14 * 3600.0
# A year with a 29 February, for a log without any date to take the year from.
LEAP_YEAR = 2000
LINE_CHARS = 200  # a phase keeps the line that placed it, this long at most
# The phases and the wall agree within this share (the acceptance rule).
AGREE_SHARE = 0.05


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float  # seconds after the boot's start
    seconds: float
    line: str = ""  # the log line that placed it
    logged_s: float | None = None  # the engine's own figure for it, where it logs one

    def as_json(self) -> dict[str, object]:
        return {"name": self.name, "start_s": round(self.start_s, 3),
                "seconds": round(self.seconds, 3), "line": self.line, "logged_s": self.logged_s}


@dataclass(frozen=True)
class Boot:
    """One boot, phase by phase. `compile`: "cold" (torch.compile compiled: its cache missed),
    "warm" (it loaded everything from its cache), None (no torch.compile: eager, llama.cpp)."""

    engine: str | None  # whose lines these are: "vllm", "llamacpp"; None: no known stamp
    phases: tuple[Phase, ...]
    wall_s: float
    compile: str | None = None
    complete: bool = True  # the log reaches the server's start (else: the boot so far)
    launched: float | None = None  # epoch seconds `up` launched the engine, when it did
    notes: tuple[str, ...] = ()

    @property
    def sum_s(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def agrees(self) -> bool:
        """The phases add up to the wall within AGREE_SHARE."""
        return abs(self.sum_s - self.wall_s) <= AGREE_SHARE * max(self.wall_s, 1e-9)

    def seconds_of(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.name == name)

    @classmethod
    def from_json(cls, data: object) -> Boot:
        """A boot as `as_json` wrote it (state.json, boot.json, a history row); ValueError
        naming the first field that is not what it writes."""
        if not isinstance(data, dict):
            raise ValueError(f"is {type(data).__name__}, not an object")
        phases = data.get("phases")
        if not isinstance(phases, list):
            raise ValueError("has no list of phases")
        read = [Phase(_text(p, "name"), _number(p, "start_s"), _number(p, "seconds"),
                      _text(p, "line"), _number(p, "logged_s", optional=True))
                for p in phases]
        engine, compile_ = data.get("engine"), data.get("compile")
        notes, launched = data.get("notes") or [], data.get("launched")
        if not (engine is None or isinstance(engine, str)) or compile_ not in (None, "cold", "warm") \
                or not isinstance(notes, list) or not all(isinstance(n, str) for n in notes) \
                or not isinstance(data.get("complete", True), bool):
            raise ValueError("has an engine, compile, complete or notes field no `up` writes")
        return cls(engine, tuple(read), _number(data, "wall_s"), compile_,
                   bool(data.get("complete", True)),
                   _number(data, "launched", optional=True) if launched is not None else None,
                   tuple(notes))

    def as_json(self) -> dict[str, object]:
        return {"engine": self.engine, "wall_s": round(self.wall_s, 3),
                "sum_s": round(self.sum_s, 3), "compile": self.compile, "complete": self.complete,
                "launched": self.launched, "notes": list(self.notes),
                "phases": [p.as_json() for p in self.phases]}


@dataclass
class _Record:
    at: float  # seconds on the log's clock (a line without a stamp has the one before it)
    stamped: bool
    text: str
    raw: str


@dataclass
class _Seg:
    name: str
    start: float
    end: float | None  # None: still in progress
    line: str
    seen: float  # the last line that named it
    explicit: bool = False  # a line said it ended


@dataclass
class _Walk:
    origin: float
    segs: list[_Seg] = field(default_factory=list)
    logged: dict[str, float] = field(default_factory=dict)
    cache: set[str] = field(default_factory=set)

    @property
    def current(self) -> _Seg | None:
        return self.segs[-1] if self.segs and self.segs[-1].end is None else None

    def floor_of(self, index: int) -> float:
        """How far back segment `index` may start: to the previous one's last line when that one
        was open (it ended only because this one began), else to where it ended."""
        if index == 0:
            return self.origin
        before = self.segs[index - 1]
        assert before.end is not None
        return before.seen if not before.explicit else before.end

    def backdate(self, index: int, since: float) -> None:
        seg = self.segs[index]
        start = max(self.floor_of(index), min(seg.start, since))
        seg.start = start
        if index and not self.segs[index - 1].explicit:
            self.segs[index - 1].end = start

    def mark(self, name: str, at: float, since: float, line: str) -> None:
        current, last = self.current, (self.segs[-1] if self.segs else None)
        if current is not None and current.name == name:
            current.seen = max(current.seen, at)
            self.backdate(len(self.segs) - 1, since)
            return
        if current is None and last is not None and last.name == name:
            last.end, last.seen, last.explicit = None, at, False  # another worker, same phase
            return
        if current is not None:
            start = max(current.seen, since)
            current.end = start
        else:
            start = max(last.end if last is not None and last.end is not None else self.origin,
                        since)
        self.segs.append(_Seg(name, start, None, line, at))

    def end(self, name: str, at: float, since: float | None, line: str) -> None:
        current, last = self.current, (self.segs[-1] if self.segs else None)
        if last is not None and last.name == name:  # in progress, or just ended (another worker)
            last.end, last.seen, last.explicit = max(at, last.end or at), at, True
            if since is not None:
                self.backdate(len(self.segs) - 1, since)
            return
        if any(s.name == name for s in self.segs):
            return  # a straggler: another worker's, after the boot moved on
        if current is not None:
            start = max(current.seen, since if since is not None else current.seen)
            current.end = start
        else:
            floor = last.end if last is not None and last.end is not None else self.origin
            start = max(floor, since if since is not None else floor)
        self.segs.append(_Seg(name, min(start, at), at, line, at, explicit=True))


def measure_boot(lines: Sequence[str], *, launched: float | None = None, ready: float | None = None,
                 warmup_s: float | None = None, engine: str | None = None) -> Boot:
    """The last boot in `lines`, phase by phase. `launched`/`ready`: epoch seconds `up` started
    the engine and saw /health answer 200; `warmup_s`: its warm-up request. `engine`: whose log
    it is (vllm, llamacpp); found from the stamps when None. Never raises on a line."""
    dialect = DIALECTS.get(engine or "") or _detect(lines)
    if dialect is None:
        return _unplaced(lines, launched, ready, warmup_s)
    records = _records(lines, dialect, launched or ready)
    start, stop, complete = _bounds(records, dialect)
    boot = records[start:stop + 1]
    stamped = [r for r in boot if r.stamped]
    if not stamped:
        return _unplaced(lines, launched, ready, warmup_s, engine=dialect.engine)
    relative = dialect.process_clock
    walk = _Walk(origin=0.0 if relative else stamped[0].at)
    for record in boot:
        _place(walk, record, dialect.markers)
    end_at = boot[-1].at
    notes: list[str] = []
    if not complete:
        notes.append("the log ends before the server started: the boot so far")
    shift, anchored = _anchor(relative, stamped[0].at, end_at, launched, ready)
    if anchored or launched is None or ready is None:
        zero = launched if anchored and launched is not None else walk.origin + shift
        first = max(0.0, stamped[0].at + shift - zero)
        end = max(first, ready - zero if anchored and ready is not None else end_at + shift - zero)
        phases = _phases(walk, shift - zero, first, end)
        if first > 0:
            phases.insert(0, Phase(STARTING, 0.0, first, _short(stamped[0].raw)))
    else:
        # Measured, but the log's clock is not this boot's: its phases keep their lengths.
        notes.append("the log's clock does not match this boot's (another boot's log?): what "
                     "the log does not cover is `other`")
        span = end_at - walk.origin
        end = ready - launched
        phases = _fill_unmatched(_phases(walk, -walk.origin, 0.0, span), end)
        if span > end * (1 + AGREE_SHARE):
            notes.append("the log spans more time than this boot took: not this boot's log?")
    if warmup_s is not None:
        phases.append(Phase(WARM_UP, end, warmup_s))
    compile_ = "cold" if "miss" in walk.cache else "warm" if "hit" in walk.cache else None
    return Boot(dialect.engine, tuple(phases), end + (warmup_s or 0.0), compile_, complete,
                launched, tuple(notes))


def _detect(lines: Sequence[str]) -> Dialect | None:
    """Whose log it is, by its stamps; None when no line has one the stack reads."""
    process_clock = False
    for line in lines:
        text = ANSI.sub("", line)
        if VLLM_STAMP.search(text):
            return VLLM
        process_clock = process_clock or bool(LLAMACPP_STAMP.match(text))
    return LLAMACPP if process_clock else None


def _records(lines: Sequence[str], dialect: Dialect, anchor: float | None) -> list[_Record]:
    out: list[_Record] = []
    year, previous_month, last = _first_year(lines, anchor), 0, 0.0
    for raw in lines:
        text = ANSI.sub("", raw).rstrip()
        stamped_at: float | None = None
        if dialect.process_clock:
            match = LLAMACPP_STAMP.match(text)
            if match:
                minutes, seconds, ms, us = (int(g) for g in match.groups())
                stamped_at = minutes * 60 + seconds + ms / 1e3 + us / 1e6
                text = text[match.end():]
        else:
            match = VLLM_STAMP.search(text)
            if match:
                month, day, hour, minute, second = (int(g) for g in match.groups()[:5])
                if previous_month == 12 and month == 1:
                    year += 1  # new year's eve: the stamps have no year
                previous_month = month
                # A whole-second stamp is the second's start: the line came 0.5 s later on average.
                frac = float(match.group(6)) if match.group(6) else 0.5
                try:
                    stamped_at = calendar.timegm((year, month, day, hour, minute, second, 0, 0,
                                                  0)) + frac
                except (ValueError, OverflowError):  # no calendar has it: an unstamped line
                    stamped_at = None
                text = text[match.end():]
            while prefix := PROCESS_PREFIX.match(text):
                text = text[prefix.end():]
        # llama-server's clock restarts with each process (a new boot, `_bounds`); vLLM's lines
        # of several processes may come a second out of order: time never runs back by that
        # much. A clock further back is another boot's (a container restarted), taken as it is.
        at = last if stamped_at is None else (
            stamped_at if dialect.process_clock or stamped_at < last - REORDER_S
            else max(stamped_at, last))
        last = at
        out.append(_Record(at, stamped_at is not None, text, raw))
    return out


def _first_year(lines: Sequence[str], anchor: float | None) -> int:
    """The year of the log's first stamp: the anchor's (UTC), one less when the log starts in
    December and the anchor is in January (a boot over new year), one more the other way (a
    time zone ahead of UTC on 1 January)."""
    if anchor is None:
        return LEAP_YEAR
    when = time.gmtime(anchor)
    for line in lines:
        match = VLLM_STAMP.search(ANSI.sub("", line))
        if match:
            month = int(match.group(1))
            if month == 12 and when.tm_mon == 1:
                return when.tm_year - 1
            if month == 1 and when.tm_mon == 12:
                return when.tm_year + 1
            break
    return when.tm_year


def _match(text: str, markers: Sequence[Marker]) -> Marker | None:
    return next((m for m in markers if m.pattern.search(text)), None)


def _bounds(records: Sequence[_Record], dialect: Dialect) -> tuple[int, int, bool]:
    """First and last index of the log's last boot, and whether it reached the server's start."""
    markers = dialect.markers
    begin = 0
    if dialect.process_clock:
        stamps = [(i, r.at) for i, r in enumerate(records) if r.stamped]
        for (_, before), (index, at) in itertools.pairwise(stamps):
            if at < before:
                begin = index
    else:
        starts = [i for i, r in enumerate(records) if (m := _match(r.text, markers)) and m.boot]
        if starts:
            begin = starts[-1]
            first_at = records[begin].at
            # The boot's import-time lines just before it belong to it; another boot's do not.
            while begin > 0 and _prelude(records[begin - 1], first_at, markers):
                begin -= 1
    for index in range(begin, len(records)):
        marker = _match(records[index].text, markers)
        if marker is not None and marker.ready:
            return begin, _ready_end(records, index, markers), True
    return begin, len(records) - 1, False


def _prelude(record: _Record, first_at: float, markers: Sequence[Marker]) -> bool:
    """Whether a line before a boot's first line is its own (import time), not another boot's."""
    marker = _match(record.text, markers)
    return (not BOOT_OVER.search(record.raw) and record.at >= first_at - PRELUDE_S
            and not (marker is not None and marker.ready))


def _ready_end(records: Sequence[_Record], index: int, markers: Sequence[Marker]) -> int:
    """The last of the ready lines that follow one another (uvicorn's has no stamp; vLLM's
    `HTTP server started` right after it has)."""
    end = index
    for look in range(index + 1, min(index + 6, len(records))):
        marker = _match(records[look].text, markers)
        if marker is not None and marker.ready:
            end = look
    return end


def _place(walk: _Walk, record: _Record, markers: Sequence[Marker]) -> None:
    marker = _match(record.text, markers)
    if marker is None:
        return
    took = float(m.group("s")) if marker.took and (m := marker.pattern.search(record.text)) else None
    since = record.at - took if took is not None else record.at
    line = _short(record.raw)
    if marker.cache:
        walk.cache.add(marker.cache)
    if marker.ends:
        walk.end(marker.ends, record.at, since if took is not None else None, line)
        if marker.logged and took is not None:
            walk.logged[marker.ends] = max(walk.logged.get(marker.ends, 0.0), took)
    if marker.marks:
        walk.mark(marker.marks, record.at, since if not marker.ends else record.at, line)
        if marker.logged and took is not None and not marker.ends:
            walk.logged[marker.marks] = max(walk.logged.get(marker.marks, 0.0), took)


def _anchor(relative: bool, first_at: float, end_at: float, launched: float | None,
            ready: float | None) -> tuple[float, bool]:
    """What to add to a log time to get epoch seconds, and whether the log is this boot's."""
    if relative:
        return (launched or 0.0), launched is not None
    if ready is not None:
        at, epoch = end_at, ready
    elif launched is not None:
        at, epoch = first_at, launched
    else:
        return 0.0, False
    offset = round((at - epoch) / QUARTER_HOUR_S) * QUARTER_HOUR_S
    if abs(offset) > MAX_OFFSET_S:
        return 0.0, False
    # The boot's lines lie between the launch and /health's 200 (give or take a whole-second
    # stamp); a first line long before the launch is an earlier boot's log (the new engine has
    # not written yet), which a zone's offset would otherwise swallow.
    if launched is not None and first_at - offset < launched - ANCHOR_SLACK_S:
        return 0.0, False
    if ready is not None and end_at - offset > ready + ANCHOR_SLACK_S:
        return 0.0, False
    return -offset, True


def _phases(walk: _Walk, shift: float, first: float, end: float) -> list[Phase]:
    """The walk's segments on the boot's clock (`shift` added), clamped to [first, end], the
    gaps as `other`, merged by name in order of first appearance."""
    def clamp(at: float) -> float:
        return min(max(at + shift, first), end)

    pieces: list[tuple[str, float, float, str]] = []
    cursor = first
    for seg in walk.segs:
        start, stop = clamp(seg.start), clamp(seg.end if seg.end is not None else end - shift)
        start = max(start, cursor)
        if start > cursor:
            pieces.append((OTHER, cursor, start, ""))
        if stop > start or seg.line:
            pieces.append((seg.name, start, max(stop, start), seg.line))
        cursor = max(cursor, stop)
    if end > cursor:
        pieces.append((OTHER, cursor, end, ""))
    merged: dict[str, Phase] = {}
    for name, start, stop, line in pieces:
        if name in merged:
            merged[name] = replace(merged[name], seconds=merged[name].seconds + stop - start)
        elif stop > start or name != OTHER:
            merged[name] = Phase(name, start, stop - start, line, walk.logged.get(name))
    return list(merged.values())


def _fill_unmatched(phases: list[Phase], end: float) -> list[Phase]:
    """A log whose clock does not match: the rest of what `up` measured cannot be placed, so it
    is `other`, before the log's phases."""
    missing = end - sum(p.seconds for p in phases)
    if missing <= 0:
        return phases
    moved = [replace(p, start_s=p.start_s + missing) for p in phases if p.name != OTHER]
    other = sum(p.seconds for p in phases if p.name == OTHER) + missing
    return [Phase(OTHER, 0.0, other), *moved]


def _unplaced(lines: Sequence[str], launched: float | None, ready: float | None,
              warmup_s: float | None, engine: str | None = None) -> Boot:
    """A log without a known stamp: all of the measured time is `other` (nothing to place)."""
    wall = (ready - launched) if (ready is not None and launched is not None) else 0.0
    phases = [Phase(OTHER, 0.0, wall)] if wall > 0 else []
    if warmup_s is not None:
        phases.append(Phase(WARM_UP, wall, warmup_s))
    note = (f"none of its {len(lines)} lines carries a time the stack reads: nothing placed"
            if lines else "the engine's log is empty")
    return Boot(engine, tuple(phases), wall + (warmup_s or 0.0), None, False, launched, (note,))


def _number(data: object, key: str, *, optional: bool = False) -> Any:
    value = data.get(key) if isinstance(data, dict) else None
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"has {key} {value!r}, not a number of seconds")
    return float(value)


def _text(data: object, key: str) -> str:
    value = data.get(key, "") if isinstance(data, dict) else None
    if not isinstance(value, str):
        raise ValueError(f"has {key} {value!r}, not a text")
    return value


def _short(line: str) -> str:
    text = ANSI.sub("", line).strip()
    return text if len(text) <= LINE_CHARS else text[:LINE_CHARS - 1] + "…"

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from vllmstack.bench.report import history


def _writer(path: str, worker: int, count: int) -> None:
    for i in range(count):
        # Large-ish payloads make interleaving likely if the append were not atomic.
        history.append_record(Path(path), {"worker": worker, "i": i, "pad": "x" * 3000})


def test_history_path_names_file_per_kind(tmp_path: Path) -> None:
    assert history.history_path(tmp_path, "bench") == tmp_path / "bench_history.jsonl"
    with pytest.raises(history.HistoryError, match="unknown history kind"):
        history.history_path(tmp_path, "nope")


def test_append_stamps_id_ts_and_schema(tmp_path: Path) -> None:
    path = history.history_path(tmp_path, "bench")
    stored = history.append_record(path, {"profile": "r9700"})
    assert len(stored["id"]) == 32
    assert stored["schema_version"] == history.SCHEMA_VERSION
    assert isinstance(stored["ts"], float)
    again = history.append_record(path, {"id": "fixed", "ts": 1.0, "schema_version": 0})
    assert (again["id"], again["ts"], again["schema_version"]) == ("fixed", 1.0, 0)
    assert [r["id"] for r in history.read_records(path)] == [stored["id"], "fixed"]


def test_concurrent_appends_from_processes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "bench_history.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 40)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = path.read_text().splitlines()
    assert len(lines) == 240
    parsed = [json.loads(line) for line in lines]  # every line parses on its own
    seen = {(r["worker"], r["i"]) for r in parsed}
    assert seen == {(w, i) for w in range(6) for i in range(40)}
    assert len({r["id"] for r in parsed}) == 240


def test_torn_and_garbage_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "probe_history.jsonl"
    history.append_record(path, {"n": 1})
    with path.open("ab") as handle:
        handle.write(b'{"n": 2, "half')  # a writer killed mid-line
        handle.write(b"\n[1, 2]\n\xff\xfe\n")
    history.append_record(path, {"n": 3})
    result = history.read_file(path)
    assert [r["n"] for r in result.records] == [1, 3]
    assert result.skipped == 3
    assert result.skipped_lines == [2, 3, 4]
    assert [r["n"] for r in history.read_records(path)] == [1, 3]


def test_rotation_keeps_one_previous_generation(tmp_path: Path) -> None:
    path = tmp_path / "conc_history.jsonl"
    for i in range(30):
        history.append_record(path, {"i": i, "pad": "y" * 200}, max_bytes=2000)
    assert path.stat().st_size <= 2000
    rotated = history.rotated_path(path)
    assert rotated.name == "conc_history.jsonl.1"
    current = [r["i"] for r in history.read_records(path)]
    both = [r["i"] for r in history.read_records(path, include_rotated=True)]
    assert current and current[-1] == 29
    assert both == sorted(both)  # oldest first across generations
    assert both[-len(current):] == current
    assert len(both) > len(current)


def test_delete_and_clear(tmp_path: Path) -> None:
    path = tmp_path / "depth_history.jsonl"
    ids = [history.append_record(path, {"i": i})["id"] for i in range(3)]
    assert history.delete_record(path, ids[1]) is True
    assert history.delete_record(path, ids[1]) is False
    assert [r["i"] for r in history.read_records(path)] == [0, 2]
    assert history.clear(path) == 2
    assert history.read_records(path) == []
    assert history.clear(tmp_path / "missing_history.jsonl") == 0


def test_unserialisable_record_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(history.HistoryError, match="cannot be stored as JSON"):
        history.append_record(tmp_path / "bench_history.jsonl", {"x": float("nan")})

"""burn without engines: the unstable flag, PASS/FAIL from the runs, the table and its files."""

from __future__ import annotations

from pathlib import Path

from vllmstack.bench.client.client import RequestResult
from vllmstack.bench.client.row import Stat
from vllmstack.bench.fleet.burn import render, summarize_runs, table_row, unstable, write_markdown


def run(tps: float, tokens: int = 100, ttft_s: float = 0.05, error: str | None = None
        ) -> RequestResult:
    """A streamed request of `tokens` one-token chunks decoding at `tps`."""
    result = RequestResult(t_sent=0.0, t_first_token=ttft_s, error=error)
    result.chunk_times = [ttft_s + i / tps for i in range(tokens)]
    result.chunk_tokens = [1] * tokens
    return result


def test_a_spread_over_ten_percent_of_the_mean_is_unstable() -> None:
    assert not unstable(Stat(mean=100.0, std=10.0))  # exactly 10 %: not over
    assert unstable(Stat(mean=100.0, std=10.5))
    assert not unstable(None) and not unstable(Stat(mean=0.0, std=1.0))
    steady = summarize_runs([run(100), run(101), run(99)])
    assert steady["status"] == "PASS" and steady["unstable"] is False
    shaky = summarize_runs([run(60), run(100), run(140)])
    assert shaky["status"] == "PASS" and shaky["unstable"] is True
    assert table_row({"profile": "p", "engine": "vllm", **shaky})[3].endswith(" unstable")
    assert not table_row({"profile": "p", "engine": "vllm", **steady})[3].endswith("unstable")


def test_a_failed_measured_run_fails_the_row_with_its_reason() -> None:
    row = summarize_runs([run(100), run(100, error="HTTP 500: engine dead")])
    assert row["status"] == "FAIL"
    assert row["diagnosis"] == "1 of 2 runs failed: HTTP 500: engine dead"
    assert row["tps"]["n"] == 1  # the numbers of the good run stay
    one_token = summarize_runs([run(100, tokens=1)])
    assert one_token["status"] == "FAIL" and "no decode rate" in one_token["diagnosis"]


def record() -> dict[str, object]:
    stats = summarize_runs([run(50), run(52), run(48)])
    return {"started": 1_790_000_000.0, "platform": "nvidia",
            "options": {"runs": 3, "warmup": 2, "max_tokens": 200},
            "rows": [{"profile": "a", "engine": "vllm", "load_s": 41.2, "load_kind": "cold",
                      **stats},
                     {"profile": "b", "engine": "llamacpp", "status": "FAIL", "tps": None,
                      "diagnosis": "model file not found: /m/b.gguf", "fix": "invoke gguf-convert",
                      "load_s": None}]}


def test_the_table_has_one_row_per_profile() -> None:
    text = render(record())
    assert "· nvidia · 1/2 PASS" in text
    assert "| a | vLLM | PASS | 50.0 ± 1.6 | 48.0 | 52.0 | 50.0 | 41.2 | - |" in text
    assert "| b | llama.cpp | FAIL: model file not found: /m/b.gguf | - | - | - | - | - | - |" in text
    warm = table_row({"profile": "c", "engine": "vllm", "load_s": 3.0, "load_kind": "warm"})
    assert warm[-2:] == ["-", "3.0"]
    assert "* b: fix: invoke gguf-convert" in text


def test_markdown_appends_to_the_days_file_and_replaces_the_latest(tmp_path: Path) -> None:
    first = write_markdown(tmp_path, record())
    second = write_markdown(tmp_path, record())
    assert first == second and [p.name for p in first][1] == "burn-latest.md"
    dated, latest = first
    assert dated.name.startswith("burn-20") and dated.read_text().count("## ") == 2
    assert latest.read_text().count("## ") == 1

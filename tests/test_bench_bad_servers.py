"""The benchmark client against servers that misbehave: every command ends by --timeout, and a
wrong answer is a failure that says what came, never a traceback or an "ok".

Driven through the same CLI entry the invoke tasks and the dashboard use, against the simulator's
faults (tests/simulator/server.py: keepalive, trickle, html-page, wrong-types, usage-overcount,
SIM_TEXTLESS_TOKENS).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from simulator.fixture import run_simulator

from vllmstack.bench.cli import main
from vllmstack.bench.runs.session import OVERHEAD_SAMPLES
from vllmstack.core.paths import Project

FAST = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "5", "SIM_ITL_MS": "2"}
ARGV = ["--served-model-name", "sim", "--max-model-len", "8192"]


def run(url: str, tokenizer: Path, folder: Path, *args: str) -> tuple[int, str, float]:
    out = io.StringIO()
    started = time.monotonic()
    code = main([*args, "--url", url, "--model", "sim", "--tokenizer", str(tokenizer),
                 "--history-dir", str(folder)], environ={}, project=Project(folder), out=out)
    return code, out.getvalue(), time.monotonic() - started


@pytest.mark.parametrize("fault", [{"SIM_FAULT": "keepalive", "SIM_KEEPALIVE_MS": "200"},
                                   {"SIM_FAULT": "trickle", "SIM_TRICKLE_MS": "20"}])
def test_timeout_is_a_total_deadline_for_bench_probe_and_stability(
        fault: dict[str, str], tokenizer_file: Path, tmp_path: Path) -> None:
    with run_simulator(env={**FAST, **fault}, argv=ARGV) as sim:
        code, text, took = run(sim.url, tokenizer_file, tmp_path, "bench", "--timeout", "1.5",
                               "--runs", "1")
        assert code == 1
        assert "timed out: no complete response within 1.5 s (--timeout)" in text
        assert took < 8  # one request, then the run stops: bytes kept arriving all along
        code, text, took = run(sim.url, tokenizer_file, tmp_path, "probe", "tool-truncation",
                               "--timeout", "1.5")
        assert code == 2 and "timed out" in text and took < 8
        code, text, took = run(sim.url, tokenizer_file, tmp_path, "stability", "smoke",
                               "--timeout", "1.5")
        assert code == 1 and "timed out" in text and took < 10


def test_an_html_page_says_what_came(tokenizer_file: Path, tmp_path: Path) -> None:
    with run_simulator(env={**FAST, "SIM_FAULT": "html-page"}, argv=ARGV) as sim:
        code, text, _ = run(sim.url, tokenizer_file, tmp_path, "bench", "--runs", "1")
        assert code == 1
        assert ("HTTP 200 with text/html instead of an event stream: a page titled "
                "'Sign in - Example Proxy'") in text
        code, text, _ = run(sim.url, tokenizer_file, tmp_path, "probe", "thinkoff")
        assert code == 2 and "text/html instead of a JSON answer" in text
    assert "Traceback" not in text


def test_wrong_types_are_request_errors_with_the_reason(tokenizer_file: Path,
                                                        tmp_path: Path) -> None:
    with run_simulator(env={**FAST, "SIM_FAULT": "wrong-types"}, argv=ARGV) as sim:
        code, text, _ = run(sim.url, tokenizer_file, tmp_path, "bench", "--runs", "1")
        assert code == 1
        assert "malformed stream event: usage is a number 5, expected an object" in text
        code, text, _ = run(sim.url, tokenizer_file, tmp_path, "stability", "smoke", "--json")
        record = json.loads(text)
        assert record["verdict"] == "fail"
        notes = " ".join(c["value"] for c in record["checks"])
        assert "malformed answer: choices is a string 'abc', expected a list" in notes
    assert "AttributeError" not in text and "Traceback" not in text


def test_usage_over_max_tokens_is_never_ok(tokenizer_file: Path, tmp_path: Path) -> None:
    with run_simulator(env={**FAST, "SIM_FAULT": "usage-overcount"}, argv=ARGV) as sim:
        code, text, _ = run(sim.url, tokenizer_file, tmp_path, "bench", "--runs", "1")
        assert code == 1
        assert "invalid result: the server reported 2 completion tokens for max_tokens 1" in text
        code, text, _ = run(sim.url, tokenizer_file, tmp_path, "stability", "smoke", "--json")
    record = json.loads(text)
    assert record["verdict"] == "fail"
    assert any("invalid result" in c["value"] for c in record["checks"])


def test_textless_first_token_is_measured_from_usage(tokenizer_file: Path,
                                                     tmp_path: Path) -> None:
    # The H200 run: a one-token request whose token was a stripped "</think>" made bench,
    # bench-depth and bench-conc abort with "no token arrived for a one-token request".
    env = {**FAST, "SIM_TEXTLESS_TOKENS": "1", "SIM_TOKENIZER": str(tokenizer_file)}
    with run_simulator(env=env, argv=ARGV) as sim:
        code, text, _ = run(sim.url, tokenizer_file, tmp_path, "bench", "--runs", "2",
                            "--pp", "256", "--tg", "16", "--json")
    assert code == 0, text
    (row,) = json.loads(text)["results"]
    assert row["errors"] == 0 and row["completion_tokens"]["mean"] == 16
    assert row["ttft_ms"]["mean"] > 5


def test_a_failed_run_says_why_never_none(tokenizer_file: Path, tmp_path: Path) -> None:
    # The overhead requests and the warm-up pass; the first measured run is dropped.
    drop = OVERHEAD_SAMPLES + 2
    env = {**FAST, "SIM_FAULT": "drop-requests", "SIM_DROP_EVERY": str(drop)}
    with run_simulator(env=env, argv=ARGV) as sim:
        code, text, _ = run(sim.url, tokenizer_file, tmp_path, "bench", "--runs", "2",
                            "--pp", "128", "--tg", "8")
    assert code == 1
    assert "run 1/2: FAILED: connection failed: server closed the connection without a " \
           "response" in text
    assert "None" not in text

"""The dashboard's polling state: payloads, the ring, backoff while the engine is down."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllmstack.dashboard.live import LiveMetrics

DATA = Path(__file__).parent / "data"


def text(name: str) -> str:
    return (DATA / f"metrics-{name}.txt").read_text()


def counters(gen: float, running: int = 1) -> str:
    lab = '{engine="0",model_name="m"}'
    return (f"# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{lab} {gen}\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{lab} {running}\n")


def test_backoff_doubles_while_down_and_resets_when_up() -> None:
    live = LiveMetrics("http://e", interval=1.0, max_backoff=8.0)
    assert live.next_delay() == 1.0
    delays = []
    for i in range(6):
        live.record(None, float(i), "refused")
        delays.append(live.next_delay())
    assert delays == [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    live.record(text("idle"), 10.0)
    assert live.next_delay() == 1.0


def test_down_payload_keeps_the_outage_start_and_last_model() -> None:
    live = LiveMetrics("http://e")
    live.record(text("load"), 1.0)
    first = live.record(None, 2.0, "refused")
    second = live.record(None, 4.0, "refused")
    assert first["down_since"] == 2.0 and second["down_since"] == 2.0
    assert second["model"] == "tiny"
    assert second["engine_up"] is False and second["kv_cache_usage"] is None
    up = live.record(text("load"), 6.0)
    assert "down_since" not in up


def test_outage_starts_the_rates_over() -> None:
    live = LiveMetrics("http://e")
    live.record(counters(0), 0.0)
    assert live.record(counters(100), 1.0)["generation_tps"] == 100.0
    live.record(None, 2.0, "refused")
    # Back after 10 s with 5000 more tokens: not "500 t/s across the gap", a fresh baseline.
    after = live.record(counters(5100), 11.0)
    assert after["generation_tps_raw"] is None
    assert live.record(counters(5300), 12.0)["generation_tps_raw"] == 200.0


def test_malformed_metrics_count_as_down_with_the_parser_message() -> None:
    live = LiveMetrics("http://e")
    payload = live.record("vllm:num_requests_running{engine=0 banana\n", 1.0)
    assert payload["engine_up"] is False
    assert "cannot parse /metrics" in payload["error"]


def test_ring_is_bounded_and_points_are_short() -> None:
    live = LiveMetrics("http://e", ring_size=5)
    for i in range(8):
        live.record(counters(i * 10), float(i))
    points = live.history()
    assert len(points) == 5 and points[0]["ts"] == 3.0
    assert points[-1]["tg"] == pytest.approx(10.0)
    assert live.history(2) == points[-2:]


def test_spec_decode_flag_and_capacity_from_capture() -> None:
    live = LiveMetrics("http://e")
    spec = live.record(text("spec-decode"), 1.0)
    assert spec["spec_decode"] is True
    assert spec["spec_acceptance_total"] == pytest.approx(56 / 68)
    assert spec["num_gpu_blocks"] == 1798278
    plain = LiveMetrics("http://e").record(text("load"), 1.0)
    assert plain["spec_decode"] is False
    assert plain["kv_tokens_used"] == round(0.0005094057339152247 * 28896432)

"""Parsing vLLM's /metrics text, against real vLLM 0.27.1 captures (tests/data/metrics-*.txt)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllmstack.observe.metrics import (
    LIVE_FAMILIES,
    MetricsError,
    MetricsSnapshot,
    fetch_metrics,
    metrics_url,
    parse_metrics,
)

DATA = Path(__file__).parent / "data"


def capture(name: str) -> str:
    return (DATA / f"metrics-{name}.txt").read_text()


@pytest.fixture(params=[None, LIVE_FAMILIES], ids=["full", "live-only"])
def parse(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Every reading test runs on the full parse and on the fast filtered parse."""
    only = request.param
    return lambda text: parse_metrics(text, only=only)


def test_load_capture_gauges_and_counters(parse) -> None:  # type: ignore[no-untyped-def]
    snap = parse(capture("load"))
    assert snap.requests_running == 16.0
    assert snap.requests_waiting == 0.0
    assert snap.kv_cache_usage == pytest.approx(0.0005094057339152247)
    assert snap.prompt_tokens == 10353.0
    # The by-source family splits prompt tokens: only local_compute was prefilled.
    assert snap.prompt_tokens_local_compute == 10305.0
    assert snap.value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 48.0
    assert snap.generation_tokens == 4554.0
    assert snap.prefix_cache_queries == 10353.0
    assert snap.prefix_cache_hits == 48.0
    assert snap.ttft_count == 21.0
    assert snap.ttft_sum == pytest.approx(6.662025213241577)
    assert snap.itl_count == 4533.0
    assert snap.model_name == "tiny"


def test_counter_by_family_name_and_label_sum(parse) -> None:  # type: ignore[no-untyped-def]
    snap = parse(capture("load"))
    # prometheus_client names the counter family without `_total`; both spellings work.
    assert snap.value("vllm:generation_tokens") == snap.value("vllm:generation_tokens_total")
    # Without a label filter, labelled samples are summed.
    assert snap.value("vllm:prompt_tokens_by_source_total") == 10305.0 + 48.0 + 0.0
    # A label value no sample carries is "absent", not zero.
    assert snap.value("vllm:prompt_tokens_by_source_total", source="nonexistent") is None
    assert snap.value("vllm:no_such_metric") is None


def test_cache_config_labels(parse) -> None:  # type: ignore[no-untyped-def]
    snap = parse(capture("idle"))
    info = snap.labels_of("vllm:cache_config_info")
    assert info is not None
    assert info["block_size"] == "16"
    assert info["num_gpu_blocks"] == "1806027"
    assert info["kv_cache_size_tokens"] == "28896432"
    assert snap.cache_config["cache_dtype"] == "auto"


def test_spec_decode_counters(parse) -> None:  # type: ignore[no-untyped-def]
    snap = parse(capture("spec-decode"))
    assert snap.spec_decode_drafts == 28.0
    assert snap.spec_decode_draft_tokens == 68.0
    assert snap.spec_decode_accepted_tokens == 56.0
    no_spec = parse(capture("load"))
    assert no_spec.spec_decode_draft_tokens is None


def test_full_parse_keeps_histogram_buckets() -> None:
    snap = parse_metrics(capture("after"))
    assert snap.value("vllm:time_to_first_token_seconds_bucket", le="+Inf") == 21.0
    # A histogram whose name really ends in `_total` keeps its sum/count samples.
    assert snap.value("vllm:iteration_tokens_total_count") is not None
    assert snap.value("python_gc_objects_collected_total", generation="0") is not None


def test_filtered_parse_drops_what_the_live_view_does_not_need() -> None:
    snap = parse_metrics(capture("after"), only=LIVE_FAMILIES)
    assert snap.value("vllm:time_to_first_token_seconds_bucket", le="+Inf") is None
    assert snap.value("python_gc_objects_collected_total") is None
    assert not any(name.endswith("_created") for name in snap.samples)
    assert snap.itl_count == 6531.0


def test_absent_families_are_none() -> None:
    snap = parse_metrics("")
    assert snap == MetricsSnapshot({})
    assert snap.kv_cache_usage is None
    assert snap.prompt_tokens_local_compute is None
    assert snap.cache_config == {}
    assert snap.model_name is None


def test_old_vllm_names_are_a_fallback() -> None:
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
        "# TYPE vllm:gpu_prefix_cache_hits_total counter\n"
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 7\n'
        "# TYPE vllm:time_per_output_token_seconds histogram\n"
        'vllm:time_per_output_token_seconds_sum{model_name="m"} 2.0\n'
        'vllm:time_per_output_token_seconds_count{model_name="m"} 4\n'
    )
    snap = parse_metrics(text, only=LIVE_FAMILIES)
    assert snap.kv_cache_usage == 0.25
    assert snap.prefix_cache_hits == 7.0
    assert snap.itl_sum == 2.0 and snap.itl_count == 4.0


def test_kv_usage_is_averaged_across_data_parallel_engines() -> None:
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 5\n'
    )
    snap = parse_metrics(text)
    assert snap.kv_cache_usage == pytest.approx(0.4)
    assert snap.requests_running == 8.0
    assert snap.value("vllm:num_requests_running", engine="1") == 5.0


def test_malformed_text_is_a_clear_error() -> None:
    with pytest.raises(MetricsError, match="cannot parse /metrics"):
        parse_metrics("vllm:num_requests_running{engine=0 banana\n")


def test_metrics_url() -> None:
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/metrics") == "http://h:8000/metrics"


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def served() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("H", (_Handler,), {"body": capture("load").encode()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_fetch_metrics_over_http(served: tuple[str, type[_Handler]]) -> None:
    url, _ = served
    assert fetch_metrics(url).requests_running == 16.0
    assert fetch_metrics(url + "/metrics", only=LIVE_FAMILIES).generation_tokens == 4554.0


def test_fetch_metrics_http_error_names_url_and_status(served: tuple[str, type[_Handler]]) -> None:
    url, handler = served
    handler.status = 503
    with pytest.raises(MetricsError, match=r"/metrics answered HTTP 503"):
        fetch_metrics(url)


def test_fetch_metrics_refused_names_url() -> None:
    with pytest.raises(MetricsError, match=r"cannot reach http://127.0.0.1:9/metrics"):
        fetch_metrics("http://127.0.0.1:9", timeout=0.5)


def test_cache_layout_of_attention_only_captures(parse) -> None:  # type: ignore[no-untyped-def]
    plain = parse(capture("after")).cache_layout
    assert (plain.block_size, plain.mamba_cache_mode, plain.prefix_caching) == (16, "none", True)
    assert not plain.hybrid and not plain.spec_decode
    assert parse(capture("spec-decode")).cache_layout.spec_decode  # drafts counter exposed


def test_cache_layout_without_cache_config_info() -> None:
    layout = MetricsSnapshot({}).cache_layout
    assert (layout.block_size, layout.mamba_cache_mode, layout.prefix_caching) == (None,) * 3
    assert not layout.hybrid

"""The engine simulator answers like the captured vLLM 0.27.1: shapes, texts, metric names."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from simulator.client import call, stream
from simulator.fixture import SimProcess, run_simulator
from simulator.server import load_config, parse_serve_argv

# Copies of shared/reference/vllm-captures (real vLLM 0.27.1 output), kept with the tests.
CAPTURES = Path(__file__).resolve().parent / "data"
# The command line of the captured server (boot.log), minus the GPU-only flags.
CAPTURED_ARGV = [
    "vllm", "serve", "/models/tiny-qwen3", "--served-model-name", "tiny", "--port", "8000",
    "--max-model-len", "4096", "--attention-backend", "TRITON_ATTN",
    "--gpu-memory-utilization", "0.2", "--max-num-seqs", "16", "--enable-prefix-caching",
    "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
]
FAST = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "1", "SIM_ITL_MS": "1"}
WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}]


def captured(case: str, kind: str = "line") -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (CAPTURES / "http-exchanges.jsonl").open()]
    return [r for r in rows if r["case"] == case and r["kind"] == kind]


def captured_events(case: str) -> list[dict[str, Any]]:
    return [json.loads(r["line"].removeprefix("data: ")) for r in captured(case)
            if r["line"] != "data: [DONE]"]


def shape(value: Any) -> Any:
    """Keys (in order) and value types, recursively: what a client's parser depends on."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


def without_delta(event: dict[str, Any]) -> dict[str, Any]:
    choices = [{**c, "delta": {}} for c in event["choices"]]
    return {**event, "choices": choices}


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with run_simulator(env=FAST, argv=CAPTURED_ARGV) as process:
        yield process


def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, **extra}


USER = [{"role": "user", "content": "Tell me about the sea"}]


# -- argv ---------------------------------------------------------------------------------------

def test_argv_of_a_real_serve_command_is_understood() -> None:
    flags = parse_serve_argv([*CAPTURED_ARGV, "--speculative-config",
                              '{"method":"mtp","num_speculative_tokens":2}', "--max_num_seqs=8"])
    cfg = load_config([*CAPTURED_ARGV, "--speculative-config",
                       '{"method":"mtp","num_speculative_tokens":2}', "--max_num_seqs=8",
                       "--unknown-flag", "x", "--enforce-eager"], {})
    assert flags["model"] == "/models/tiny-qwen3"
    assert (cfg.name, cfg.model, cfg.port) == ("tiny", "/models/tiny-qwen3", 8000)
    assert cfg.max_model_len == 4096
    assert cfg.max_num_seqs == 8  # last one wins, underscores work, as in vLLM
    assert cfg.prefix_caching and cfg.reasoning_parser == "qwen3"
    assert cfg.num_spec_tokens == 2


def test_human_readable_lengths_and_env_overrides() -> None:
    assert load_config(["--max-model-len", "32k"], {}).max_model_len == 32000
    assert load_config(["--max-model-len", "32K"], {}).max_model_len == 32768
    cfg = load_config(["--max-num-seqs", "4", "--no-enable-prefix-caching"],
                      {"SIM_MAX_NUM_SEQS": "2"})
    assert cfg.max_num_seqs == 2 and not cfg.prefix_caching
    assert load_config(["--speculative-config.num_speculative_tokens", "3"],
                       {}).num_spec_tokens == 3


def test_bad_sim_setting_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    from simulator.fixture import SERVER

    done = subprocess.run([sys.executable, str(SERVER)], env={"SIM_FAULT": "explode"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "SIM_FAULT='explode' is not one of" in done.stderr
    assert "Traceback" not in done.stderr


# -- simple endpoints ---------------------------------------------------------------------------

def test_models_has_the_captured_fields(sim: SimProcess) -> None:
    real = json.loads((CAPTURES / "models.json").read_text())
    ours = call(sim.url, "/v1/models").json()
    assert shape(ours) == shape(real)
    card = ours["data"][0]
    assert (card["id"], card["root"], card["max_model_len"], card["owned_by"]) == (
        "tiny", "/models/tiny-qwen3", 4096, "vllm")


def test_version_health_ping_load(sim: SimProcess) -> None:
    assert call(sim.url, "/version").body == (CAPTURES / "version.json").read_bytes()
    health = call(sim.url, "/health")
    assert (health.status, health.body) == (200, b"")
    assert call(sim.url, "/ping").status == 200
    assert call(sim.url, "/ping", body={}).status == 200
    assert call(sim.url, "/load").json() == {"server_load": 0}


def test_unknown_route_is_404(sim: SimProcess) -> None:
    reply = call(sim.url, "/v2/nothing")
    assert reply.status == 404 and reply.json() == {"detail": "Not Found"}


# -- chat -----------------------------------------------------------------------------------------

def test_streamed_chat_with_reasoning_has_the_captured_chunk_shapes(sim: SimProcess) -> None:
    real = captured_events("chat_stream")
    got = stream(sim.url, "/v1/chat/completions",
                 chat(USER, max_tokens=48, stream_options={"include_usage": True}))
    assert got.status == 200
    assert got.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert got.lines[-1][1] == "data: [DONE]"
    events = got.events()
    assert shape(events[0]) == shape(real[0])      # role chunk
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert shape(events[1]) == shape(real[1])      # a reasoning token
    assert shape(without_delta(events[-2])) == shape(without_delta(real[-2]))  # finish: length
    assert shape(events[-1]) == shape(real[-1])    # usage chunk
    # thinking first (SIM_REASONING_TOKENS, 16 by default), then the answer
    kinds = [list(e["choices"][0]["delta"]) for e in events[1:-1]]
    assert kinds == [["reasoning"]] * 16 + [["content"]] * 32
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 48
    assert usage["total_tokens"] == usage["prompt_tokens"] + 48
    assert len(events) == 1 + 48 + 1


def test_thinking_off_streams_content_with_usage_in_every_chunk(sim: SimProcess) -> None:
    real = captured_events("chat_stream_thinkoff")
    got = stream(sim.url, "/v1/chat/completions", chat(
        USER, max_tokens=24, chat_template_kwargs={"enable_thinking": False},
        stream_options={"include_usage": True, "continuous_usage_stats": True})).events()
    assert [shape(e) for e in got[:2]] == [shape(e) for e in real[:2]]
    assert shape(got[-2]) == shape(real[-2]) and shape(got[-1]) == shape(real[-1])
    tokens = got[1:-1]
    assert all("content" in e["choices"][0]["delta"] for e in tokens)
    assert [e["usage"]["completion_tokens"] for e in tokens] == list(range(1, 25))


def test_thinking_off_adds_the_empty_think_block_to_the_prompt(sim: SimProcess) -> None:
    # The captured Qwen3 template adds 4 tokens (<think>\n\n</think>\n\n): 26 -> 30 in the capture.
    on = call(sim.url, "/v1/chat/completions", chat(USER, max_tokens=2)).json()
    off = call(sim.url, "/v1/chat/completions",
               chat(USER, max_tokens=2, reasoning_effort="none")).json()
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + 4
    assert off["choices"][0]["message"]["content"]
    assert off["choices"][0]["message"]["reasoning"] is None


def test_non_streamed_chat_has_the_captured_shape(sim: SimProcess) -> None:
    real = json.loads(captured("chat_nonstream", "response")[0]["body"])
    # 16 tokens: all of them thinking (SIM_REASONING_TOKENS), so content is null as captured
    ours = call(sim.url, "/v1/chat/completions", chat(USER, max_tokens=16)).json()
    assert shape(ours) == shape(real)
    assert ours["usage"]["completion_tokens"] == 16
    assert ours["choices"][0]["message"]["content"] is None


def test_streamed_and_non_streamed_text_agree(sim: SimProcess) -> None:
    body = chat(USER, max_tokens=20, chat_template_kwargs={"enable_thinking": False})
    whole = call(sim.url, "/v1/chat/completions", body).json()
    parts = stream(sim.url, "/v1/chat/completions", body).events()
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in parts)
    assert text == whole["choices"][0]["message"]["content"]


def test_text_is_deterministic_and_not_a_loop(sim: SimProcess) -> None:
    body = chat(USER, max_tokens=200, chat_template_kwargs={"enable_thinking": False})
    first = call(sim.url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    second = call(sim.url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert first["content"] == second["content"]
    words = first["content"].split()
    fourgrams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    assert len(set(fourgrams)) == len(fourgrams)


def test_stop_after_gives_finish_reason_stop_unless_ignore_eos() -> None:
    with run_simulator(env={**FAST, "SIM_STOP_AFTER": "5"}, argv=["--served-model-name", "m"]) \
            as sim:
        body = chat(USER, max_tokens=50)
        body.pop("model")
        stopped = call(sim.url, "/v1/chat/completions", body).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["usage"]["completion_tokens"] == 6  # five words and the EOS token
        full = call(sim.url, "/v1/chat/completions", {**body, "ignore_eos": True}).json()
        assert full["choices"][0]["finish_reason"] == "length"
        assert full["usage"]["completion_tokens"] == 50


def test_tool_call_when_the_prompt_names_a_tool(sim: SimProcess) -> None:
    messages = [{"role": "user", "content": "Please use get_weather for Paris"}]
    body = chat(messages, tools=WEATHER_TOOL, max_tokens=200,
                chat_template_kwargs={"enable_thinking": False})
    whole = call(sim.url, "/v1/chat/completions", body).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("chatcmpl-tool-")
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "sim", "unit": "c"}
    events = stream(sim.url, "/v1/chat/completions", body).events()
    deltas = [e["choices"][0]["delta"].get("tool_calls") for e in events]
    calls = [c for d in deltas if d for c in d]
    assert calls[0]["function"]["name"] == "get_weather"
    streamed_args = "".join(c["function"].get("arguments", "") for c in calls)
    assert streamed_args == tool_call["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_no_tool_call_when_the_prompt_does_not_ask(sim: SimProcess) -> None:
    body = chat(USER, tools=WEATHER_TOOL, max_tokens=8,
                chat_template_kwargs={"enable_thinking": False})
    message = call(sim.url, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"]


# -- completions ----------------------------------------------------------------------------------

def test_streamed_completion_has_the_captured_shapes(sim: SimProcess) -> None:
    real = captured_events("completions_stream")
    got = stream(sim.url, "/v1/completions", {"model": "tiny", "prompt": "The sea is",
                                              "max_tokens": 16,
                                              "stream_options": {"include_usage": True}})
    events = got.events()
    assert [shape(e) for e in events[:1]] == [shape(e) for e in real[:1]]
    assert shape(events[-2]) == shape(real[-2]) and shape(events[-1]) == shape(real[-1])
    assert events[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 19,
                                   "completion_tokens": 16}


def test_completion_accepts_token_ids(sim: SimProcess) -> None:
    reply = call(sim.url, "/v1/completions", {"prompt": [1, 2, 3, 4, 5], "max_tokens": 4}).json()
    assert reply["usage"]["prompt_tokens"] == 5
    assert reply["choices"][0]["finish_reason"] == "length"


# -- errors (byte-for-byte where the capture allows) ----------------------------------------------

@pytest.mark.parametrize("case", ["chat_empty_tools", "chat_empty_tools_none"])
def test_empty_tools_is_the_captured_400(sim: SimProcess, case: str) -> None:
    real = captured(case, "response")[0]
    extra = {"tool_choice": "none"} if case.endswith("_none") else {}
    reply = call(sim.url, "/v1/chat/completions", chat(USER, tools=[], **extra))
    assert (reply.status, reply.body.decode()) == (real["code"], real["body"])


def test_unknown_model_is_the_captured_404(sim: SimProcess) -> None:
    real = captured("chat_bad_model", "response")[0]
    reply = call(sim.url, "/v1/chat/completions", {**chat(USER), "model": "nope"})
    assert (reply.status, reply.body.decode()) == (real["code"], real["body"])
    assert "Error with model error=ErrorInfo(message='The model `nope` does not exist.'" in \
        sim.wait_for_log("does not exist")


def test_prompt_over_the_window_is_the_captured_400(sim: SimProcess) -> None:
    real = captured("chat_too_long", "response")[0]
    # 4081 words + 5 (message markup) + 3 (generation prompt) = 4089 prompt tokens, as captured
    messages = [{"role": "user", "content": " ".join(["word"] * 4081)}]
    reply = call(sim.url, "/v1/chat/completions", chat(messages, max_tokens=8))
    assert (reply.status, reply.body.decode()) == (real["code"], real["body"])


def test_invalid_json_is_a_400_error_body(sim: SimProcess) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=b"{not json",
                 headers={"content-type": "application/json"})
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 400 and body["error"]["type"] == "BadRequestError"


# -- metrics --------------------------------------------------------------------------------------

def families(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, flags=re.M))


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        named = line.startswith(name + "{") or line.startswith(name + " ")
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_metric_families_of_the_capture_are_all_present(sim: SimProcess) -> None:
    call(sim.url, "/v1/models")
    call(sim.url, "/v1/chat/completions", chat(USER, max_tokens=2))
    ours = call(sim.url, "/metrics")
    assert ours.headers["content-type"].startswith("text/plain")
    real = families((CAPTURES / "metrics-after.txt").read_text())
    missing = real - families(ours.body.decode())
    assert not missing


def test_spec_decode_families_appear_only_with_a_speculative_config() -> None:
    real = families((CAPTURES / "metrics-spec-decode.txt").read_text())
    spec_argv = ["--served-model-name", "tiny", "--speculative-config",
                 '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}']
    with run_simulator(env={**FAST, "SIM_TOKENS_PER_CHUNK": "3"}, argv=spec_argv) as sim:
        call(sim.url, "/v1/completions", {"prompt": "a b c", "max_tokens": 7})
        text = call(sim.url, "/metrics").body.decode()
    assert not real - families(text)
    # 7 tokens = the first token alone, then steps of 3: two drafts of 3, both 2 accepted
    assert sample(text, "vllm:spec_decode_num_drafts_total") == 2
    assert sample(text, "vllm:spec_decode_num_draft_tokens_total") == 6
    assert sample(text, "vllm:spec_decode_num_accepted_tokens_total") == 4
    assert sample(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    assert sample(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 0
    plain = call_metrics_without_spec()
    assert "vllm:spec_decode" not in plain


def call_metrics_without_spec() -> str:
    with run_simulator(env=FAST) as sim:
        return call(sim.url, "/metrics").body.decode()


def test_counters_count_what_was_served() -> None:
    with run_simulator(env=FAST, argv=["--served-model-name", "m", "--max-model-len", "2048"]) \
            as sim:
        usages = []
        for n in (3, 5, 7):
            usages.append(call(sim.url, "/v1/completions",
                               {"prompt": f"number {n} here", "max_tokens": n}).json()["usage"])
        text = call(sim.url, "/metrics").body.decode()
    assert sample(text, "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert sample(text, "vllm:generation_tokens_total") == 15
    assert sample(text, "vllm:request_success_total", finished_reason="length") == 3
    assert sample(text, "vllm:time_to_first_token_seconds_count") == 3
    assert sample(text, "vllm:request_prompt_tokens_bucket", le="2000.0") == 3
    assert 'model_name="m"' in text and 'engine="0"' in text
    assert sample(text, "vllm:cache_config_info", kv_cache_size_tokens="16384") == 1


def test_repeated_multi_turn_prefix_hits_the_prefix_cache(sim: SimProcess) -> None:
    before = call(sim.url, "/metrics").body.decode()
    history = [{"role": "system", "content": " ".join(f"rule{i}" for i in range(60))},
               {"role": "user", "content": "first question"}]
    first = call(sim.url, "/v1/chat/completions",
                 chat(history, max_tokens=20, chat_template_kwargs={"enable_thinking": False}))
    answer = first.json()["choices"][0]["message"]["content"]
    history += [{"role": "assistant", "content": answer},
                {"role": "user", "content": "second question"}]
    second = call(sim.url, "/v1/chat/completions",
                  chat(history, max_tokens=4, chat_template_kwargs={"enable_thinking": False}))
    after = call(sim.url, "/metrics").body.decode()
    hits = (sample(after, "vllm:prefix_cache_hits_total")
            - sample(before, "vllm:prefix_cache_hits_total"))
    first_prompt = first.json()["usage"]["prompt_tokens"]
    # at least every full 16-token block of the first prompt is reused by the second
    assert hits >= (first_prompt // 16) * 16 > 0
    assert hits < second.json()["usage"]["prompt_tokens"]
    assert hits % 16 == 0


def test_prefix_caching_off_means_no_queries() -> None:
    with run_simulator(env=FAST, argv=["--no-enable-prefix-caching"]) as sim:
        for _ in range(2):
            call(sim.url, "/v1/completions", {"prompt": "x " * 100, "max_tokens": 2})
        text = call(sim.url, "/metrics").body.decode()
    assert sample(text, "vllm:prefix_cache_queries_total") == 0
    assert sample(text, "vllm:cache_config_info", enable_prefix_caching="False") == 1


def test_access_log_lines_like_uvicorn(sim: SimProcess) -> None:
    call(sim.url, "/v1/models")
    log = sim.wait_for_log('"GET /v1/models HTTP/1.1" 200 OK')
    assert re.search(r'\(APIServer pid=\d+\) INFO:     127\.0\.0\.1:\d+ - "GET /v1/models '
                     r'HTTP/1\.1" 200 OK', log)


def test_every_served_name_is_listed_and_accepted() -> None:
    with run_simulator(env=FAST, argv=["/models/x", "--served-model-name", "a", "b"]) as sim:
        ids = [card["id"] for card in call(sim.url, "/v1/models").json()["data"]]
        answer = call(sim.url, "/v1/completions", {"model": "b", "prompt": "x", "max_tokens": 1})
        metrics = call(sim.url, "/metrics").body.decode()
    assert ids == ["a", "b"]
    assert answer.status == 200 and answer.json()["model"] == "a"
    assert 'model_name="a"' in metrics

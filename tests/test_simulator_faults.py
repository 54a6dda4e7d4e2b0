"""The engine simulator boots, stops and fails the way vLLM does, so the stack can be tested on it."""

from __future__ import annotations

import http.client
import json
import signal
import time

import pytest
from helpers import wait_for
from simulator.client import call, stream
from simulator.fixture import SimProcess, health_status, run_simulator

FAST = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "1", "SIM_ITL_MS": "1"}
CORE_FAILED = "Engine core initialization failed. See root cause above. Failed core proc(s): {}"
KV_ERROR = "ValueError: No available memory for the cache blocks."


def chat_body(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": max_tokens,
            **extra}


# -- boot and shutdown ----------------------------------------------------------------------------

def test_refuses_connections_while_loading_then_health_is_200() -> None:
    with run_simulator(env={"SIM_BOOT_SECONDS": "1.5"}, wait=False) as sim:
        sim.wait_for_log("Loading model from scratch")  # booting: bound, not listening yet
        assert sim.proc.poll() is None
        assert health_status(sim.url) is None  # connection refused, not an HTTP status
        started = time.monotonic()
        wait_for(lambda: health_status(sim.url) == 200, timeout=10, what="/health 200")
        assert time.monotonic() - started < 3
        log = sim.wait_for_log("Application startup complete.")
    assert f"Starting vLLM server on http://127.0.0.1:{sim.port}" in log
    assert log.index("Starting vLLM server") < log.index("Application startup complete.")
    assert "GPU KV cache size: 32,768 tokens" in log
    assert "Maximum concurrency for 4,096 tokens per request: 8.00x" in log


def test_sigterm_exits_zero_within_a_second() -> None:
    with run_simulator(env=FAST) as sim:
        # a stream in flight must not hold the exit up
        import threading

        threading.Thread(target=stream, args=(sim.url, "/v1/completions",
                                              {"prompt": "x", "max_tokens": 100000 // 100}),
                         daemon=True).start()
        wait_for(lambda: call(sim.url, "/load").json()["server_load"] >= 1, what="the stream")
        started = time.monotonic()
        sim.proc.send_signal(signal.SIGTERM)
        code = sim.wait_exit(timeout=5)
        elapsed = time.monotonic() - started
        log = sim.log_text()
    assert code == 0 and elapsed < 1.0
    assert "[shutdown] EngineCore: trigger received signal=SIGTERM" in log
    assert "Application shutdown complete." in log


@pytest.mark.parametrize("fault", ["crash-at-boot", "crash-loop"])
def test_crash_at_boot_prints_the_root_cause_and_exits_1_without_listening(fault: str) -> None:
    for _attempt in range(2 if fault == "crash-loop" else 1):
        with run_simulator(env={"SIM_FAULT": fault, "SIM_BOOT_SECONDS": "0.5"},
                           wait=False) as sim:
            assert health_status(sim.url) is None
            assert sim.wait_exit(timeout=10) == 1
            log = sim.log_text()
        assert KV_ERROR in log
        assert CORE_FAILED in log
        # the root cause comes before the generic line, as in fail-no-kv-memory.log
        assert log.index(KV_ERROR) < log.index(CORE_FAILED)
        assert "Application startup complete." not in log


def test_crash_log_line_is_configurable() -> None:
    text = "ValueError: To serve at least one request with the model's max seq len (131072)"
    with run_simulator(env={"SIM_FAULT": "crash-at-boot", "SIM_BOOT_SECONDS": "0",
                            "SIM_FAULT_LOG": text}, wait=False) as sim:
        assert sim.wait_exit(timeout=10) == 1
        log = sim.log_text()
    assert f"[core.py:1349] {text}" in log and CORE_FAILED in log
    assert KV_ERROR not in log


def test_hang_prints_boot_lines_and_never_listens() -> None:
    with run_simulator(env={"SIM_FAULT": "hang", "SIM_BOOT_SECONDS": "0.2"}, wait=False) as sim:
        sim.wait_for_log("Loading model from scratch")
        time.sleep(1.0)
        assert sim.proc.poll() is None
        assert health_status(sim.url) is None
        assert "Application startup complete." not in sim.log_text()


def test_die_after_gives_503_and_500_then_exits() -> None:
    env = {**FAST, "SIM_FAULT": "die-after", "SIM_DIE_AFTER_S": "1", "SIM_DEAD_LINGER_S": "1.5",
           "SIM_ITL_MS": "20"}
    with run_simulator(env=env) as sim:
        assert call(sim.url, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status == 200
        # a stream that is still running when the engine dies gets vLLM's error event
        cut = stream(sim.url, "/v1/completions", {"prompt": "x", "max_tokens": 500})
        assert cut.status == 200
        error = cut.events()[-1]
        assert error["error"]["type"] == "InternalServerError"
        assert error["error"]["code"] == 500
        assert cut.lines[-1][1] == "data: [DONE]"
        assert health_status(sim.url) == 503
        failed = call(sim.url, "/v1/chat/completions", chat_body(2))
        assert failed.status == 500
        assert failed.json()["error"]["message"].startswith("EngineCore encountered an issue.")
        assert sim.wait_exit(timeout=5) == 1
        log = sim.log_text()
    assert "EngineDeadError" in log


def test_token_loop_repeats_an_ngram() -> None:
    env = {**FAST, "SIM_FAULT": "token-loop", "SIM_LOOP_AFTER": "10", "SIM_LOOP_NGRAM": "3"}
    with run_simulator(env=env) as sim:
        text = call(sim.url, "/v1/completions",
                    {"prompt": "loop", "max_tokens": 40}).json()["choices"][0]["text"]
    words = text.split()
    assert len(words) == 40
    tail = words[7:]
    assert all(tail[i] == tail[i % 3] for i in range(len(tail)))
    assert len(set(words[:10])) > 3


def test_drop_requests_closes_every_nth_connection_without_an_answer() -> None:
    with run_simulator(env={**FAST, "SIM_FAULT": "drop-requests", "SIM_DROP_EVERY": "2"}) as sim:
        outcomes = []
        for _ in range(4):
            try:
                outcomes.append(call(sim.url, "/v1/completions",
                                     {"prompt": "x", "max_tokens": 2}).status)
            except (http.client.RemoteDisconnected, ConnectionError):
                outcomes.append(None)
        assert call(sim.url, "/health").status == 200  # other endpoints are not counted
    assert outcomes == [200, None, 200, None]


def test_stream_mismatch_streams_other_text_than_the_plain_answer() -> None:
    body = chat_body(12)
    with run_simulator(env=FAST) as sim:
        plain = call(sim.url, "/v1/chat/completions", body).json()["choices"][0]["message"]
        streamed = stream(sim.url, "/v1/chat/completions", body).events()
    same = "".join(e["choices"][0]["delta"].get("content", "") for e in streamed[1:])
    assert same == plain["content"]
    with run_simulator(env={**FAST, "SIM_FAULT": "stream-mismatch"}) as sim:
        plain = call(sim.url, "/v1/chat/completions", body).json()["choices"][0]["message"]
        streamed = stream(sim.url, "/v1/chat/completions", body).events()
    other = "".join(e["choices"][0]["delta"].get("content", "") for e in streamed[1:])
    assert other != plain["content"]
    assert len(other.split()) == len(plain["content"].split()) == 12


TOOLS = [{"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}}}}}]


def tool_arguments(sim: SimProcess, max_tokens: int) -> tuple[str, str, str, str]:
    body = chat_body(max_tokens, tools=TOOLS, tool_choice="required")
    whole = call(sim.url, "/v1/chat/completions", body).json()["choices"][0]
    events = stream(sim.url, "/v1/chat/completions", body).events()
    calls = [c for e in events for c in (e["choices"][0]["delta"].get("tool_calls") or [])]
    streamed = "".join(c["function"].get("arguments", "") for c in calls)
    plain = whole["message"]["tool_calls"][0]["function"]["arguments"]
    return plain, streamed, whole["finish_reason"], events[-1]["choices"][0]["finish_reason"]


def test_tool_truncation_drops_partial_arguments_only_when_not_streaming() -> None:
    argv = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    # the header of the call is 13 tokens, so 18 tokens cut the arguments
    with run_simulator(env=FAST, argv=argv) as sim:
        plain, streamed, finish, stream_finish = tool_arguments(sim, 18)
    assert plain == streamed != "" and finish == stream_finish == "length"
    with run_simulator(env={**FAST, "SIM_FAULT": "tool-truncation"}, argv=argv) as sim:
        plain, streamed, finish, stream_finish = tool_arguments(sim, 18)
        full_plain, full_streamed, full_finish, _ = tool_arguments(sim, 200)
    assert plain == "" and streamed != "" and finish == stream_finish == "length"
    assert full_plain == full_streamed == '{"query": "sim", "limit": 1}'
    assert full_finish == "tool_calls"


# -- bad-server faults and shapes the benchmark client must survive -------------------------------

def test_keepalive_fault_sends_comments_forever_and_frees_the_slot() -> None:
    env = {**FAST, "SIM_FAULT": "keepalive", "SIM_KEEPALIVE_MS": "50"}
    with run_simulator(env=env, argv=["--max-num-seqs", "1"]) as sim:
        conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=5)
        conn.request("POST", "/v1/chat/completions",
                     body=json.dumps({**chat_body(4), "stream": True}).encode(),
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        lines = [response.readline() for _ in range(8)]
        conn.close()  # the client gives up; the server must notice and free the one slot
        assert lines[0].startswith(b"data: ") and b'"role":"assistant"' in lines[0]
        assert lines.count(b": ping\n") >= 3
        assert not any(b"[DONE]" in line for line in lines)
        wait_for(lambda: 'num_requests_running{engine="0",model_name="sim"} 0.0'
                 in call(sim.url, "/metrics").body.decode(), timeout=5, what="the slot to be freed")


def test_trickle_fault_sends_a_stream_one_byte_at_a_time() -> None:
    env = {**FAST, "SIM_FAULT": "trickle", "SIM_TRICKLE_MS": "1"}
    with run_simulator(env=env) as sim:
        conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
        conn.request("POST", "/v1/chat/completions",
                     body=json.dumps({**chat_body(2), "stream": True}).encode(),
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        assert response.getheader("transfer-encoding") == "chunked"
        sizes = []
        while True:
            size_line = response.fp.readline()
            size = int(size_line, 16)
            if size == 0:
                break
            sizes.append(size)
            response.fp.read(size + 2)
        conn.close()
    assert len(sizes) > 300 and set(sizes) == {1}  # every byte its own chunk


def test_html_wrong_types_and_overcount_faults() -> None:
    with run_simulator(env={**FAST, "SIM_FAULT": "html-page"}) as sim:
        reply = call(sim.url, "/v1/chat/completions", chat_body(4))
        assert reply.status == 200 and reply.headers["content-type"].startswith("text/html")
        assert b"<title>Sign in - Example Proxy</title>" in reply.body
        assert call(sim.url, "/v1/models").status == 200  # only generation is behind the page
    with run_simulator(env={**FAST, "SIM_FAULT": "wrong-types"}) as sim:
        assert call(sim.url, "/v1/chat/completions", chat_body(4)).json()["choices"] == "abc"
        chunks = stream(sim.url, "/v1/chat/completions", chat_body(2)).events()
        assert [c.get("usage") for c in chunks[1:3]] == [5, 5]
    with run_simulator(env={**FAST, "SIM_FAULT": "usage-overcount"}) as sim:
        usage = call(sim.url, "/v1/chat/completions", chat_body(4)).json()["usage"]
        assert usage["completion_tokens"] == 8


def test_textless_tokens_count_in_usage_but_send_no_text() -> None:
    env = {**FAST, "SIM_TEXTLESS_TOKENS": "1"}
    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with run_simulator(env=env) as sim:
        one = stream(sim.url, "/v1/chat/completions", chat_body(1, **options)).events()
        # role chunk, then one finish chunk with no text but usage 1 (vLLM sends an empty
        # DeltaMessage when the parser swallowed the token), then the usage chunk
        assert one[1]["choices"][0]["delta"] == {}
        assert one[1]["choices"][0]["finish_reason"] == "length"
        assert one[1]["usage"]["completion_tokens"] == 1
        several = stream(sim.url, "/v1/chat/completions", chat_body(4, **options)).events()
        token_chunks = [c for c in several[1:] if c["choices"]]
        assert token_chunks[0]["usage"]["completion_tokens"] == 2  # the silent one + the next


def test_hybrid_cache_reports_its_mode_and_resumes_only_at_saved_states() -> None:
    env = {**FAST, "SIM_MAMBA_CACHE_MODE": "align"}
    argv = ["--block-size", "16", "--speculative-config",
            '{"method": "mtp", "num_speculative_tokens": 2}']
    words = " ".join(f"w{i}" for i in range(100))  # about 105 prompt tokens with the template
    with run_simulator(env=env, argv=argv) as sim:
        metrics = call(sim.url, "/metrics").body.decode()
        assert 'mamba_cache_mode="align"' in metrics and 'block_size="16"' in metrics

        def hits() -> float:
            text = call(sim.url, "/metrics").body.decode()
            line = next(ln for ln in text.splitlines()
                        if ln.startswith("vllm:prefix_cache_hits_total"))
            return float(line.rsplit(" ", 1)[1])

        body = {"messages": [{"role": "user", "content": words}], "max_tokens": 1}
        first = call(sim.url, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
        before = hits()
        longer = {"messages": [{"role": "user", "content": words},
                               {"role": "assistant", "content": "ok"},
                               {"role": "user", "content": "and then?"}], "max_tokens": 1}
        call(sim.url, "/v1/chat/completions", longer)
        # The state was saved one block before the last whole block of the first prompt.
        assert hits() - before == (first // 16 - 1) * 16

"""The stream parser and the per-request measurements, fed with vLLM-shaped SSE bytes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllmstack.bench.client import RequestResult, _StreamState, chat_body, normalize_base_url

HEAD = '"id":"chatcmpl-8d8a","object":"chat.completion.chunk","created":1795968669,"model":"tiny"'
# Shapes copied from vLLM 0.27.1 (reference capture): the role chunk carries content "", then
# reasoning deltas, a finish chunk, the usage-only chunk and [DONE].
ROLE = ('data: {' + HEAD + ',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        '"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}')


def token(text: str, field: str = "reasoning", finish: str | None = None,
          usage: int | None = None, ids: list[int] | None = None) -> str:
    choice: dict[str, Any] = {"index": 0, "delta": {field: text}, "logprobs": None,
                              "finish_reason": finish, "token_ids": ids}
    chunk: dict[str, Any] = json.loads("{" + HEAD + "}")
    chunk["choices"] = [choice]
    if usage is not None:
        chunk["usage"] = {"prompt_tokens": 26, "total_tokens": 26 + usage,
                          "completion_tokens": usage}
    return "data: " + json.dumps(chunk, separators=(",", ":"))


def final_usage(n: int) -> str:
    return ('data: {' + HEAD + ',"choices":[],"usage":{"prompt_tokens":26,"total_tokens":'
            f'{26 + n},"completion_tokens":{n}}},"system_fingerprint":"vllm-0.27.1"}}')


def feed(events: list[tuple[float, str]], *, tokenizer: Any = None,
         split: int | None = None) -> RequestResult:
    """Feed (time, event line) pairs; `split` cuts every event's bytes into pieces that size."""
    result = RequestResult(t_sent=0.0)
    state = _StreamState(result)
    for t, line in events:
        data = (line + "\n\n").encode()
        if split:
            for i in range(0, len(data), split):
                state.feed(data[i:i + split], t)
        else:
            state.feed(data, t)
    state.finish(events[-1][0])
    state.close(tokenizer)
    result.t_end = events[-1][0]
    return result


def test_role_only_chunk_is_not_the_first_token() -> None:
    events = [(0.100, ROLE), (0.300, token(" 27")), (0.320, token("57")), (0.340, token("ex")),
              (0.341, final_usage(3)), (0.342, "data: [DONE]")]
    r = feed(events)
    assert r.ok
    assert r.ttfr_s == pytest.approx(0.100)
    assert r.ttft_s == pytest.approx(0.300)
    assert r.reasoning == " 2757ex"
    assert r.chunk_tokens == [1, 1, 1]
    assert r.token_source == "usage-final"
    assert r.decode_tps == pytest.approx(2 / 0.040)
    assert r.itl_samples_s() == pytest.approx([0.020, 0.020])


def test_per_chunk_usage_gives_exact_counts_for_multi_token_chunks() -> None:
    # continuous_usage_stats: cumulative completion_tokens in every chunk; MTP-style 3 per step
    events = [(0.0, ROLE), (0.2, token("a", "content", usage=1))]
    t, n = 0.2, 1
    for _ in range(10):
        t += 0.030
        n += 3
        events.append((t, token("b c d", "content", usage=n)))
    events += [(t, final_usage(n)), (t, "data: [DONE]")]
    r = feed(events)
    assert r.token_source == "usage-per-chunk"
    assert r.tokens == 31
    assert r.decode_tokens == 30
    assert r.decode_tps == pytest.approx(100.0)  # 3 tokens / 30 ms, not 1 / 30 ms
    assert r.itl_samples_s() == pytest.approx([0.010] * 30)
    assert r.chunk_gaps_s() == pytest.approx([0.030] * 10)


def test_final_usage_only_spreads_tokens_evenly_without_bias() -> None:
    # MTP-like: the prefill's one token, then 4 per step, and only a final usage. Spreading
    # the final count evenly over every chunk would say +2.4 %; so would interpolating times.
    events = [(0.0, ROLE), (0.2, token("v", "content"))]
    t = 0.2
    for _ in range(31):
        t += 0.080
        events.append((t, token("w x y z", "content")))
    events += [(t, final_usage(125)), (t, "data: [DONE]")]
    r = feed(events)
    assert r.token_source == "usage-final"
    assert r.chunk_tokens == [1] + [4] * 31
    assert r.decode_tps == pytest.approx(124 / (31 * 0.080))
    assert r.decode_tps == pytest.approx(50.0)
    assert r.itl_samples_s() == pytest.approx([0.020] * 124)


def test_token_ids_win_over_usage() -> None:
    events = [(0.0, ROLE), (0.1, token("a", "content", usage=1, ids=[5])),
              (0.2, token("bc", "content", usage=3, ids=[6, 7])), (0.2, final_usage(3)),
              (0.2, "data: [DONE]")]
    r = feed(events)
    assert r.token_source == "token_ids"
    assert r.chunk_tokens == [1, 2]


def test_no_usage_counts_with_the_tokenizer_never_with_chunks() -> None:
    class Words:
        def encode(self, text: str, add_special_tokens: bool = False) -> Any:
            return type("E", (), {"ids": text.split()})()

    events = [(0.0, ROLE), (0.1, token("one two", "content")),
              (0.2, token(" three four", "content")), (0.2, "data: [DONE]")]
    r = feed(events, tokenizer=Words())
    assert r.token_source == "tokenizer"
    assert r.tokens == 4
    assert r.chunk_tokens == [1, 3]
    r = feed(events)
    assert r.token_source == "none"
    assert r.chunk_tokens == []
    assert r.decode_tps is None


def test_byte_splits_anywhere_give_identical_results() -> None:
    events = [(0.0, ROLE), (0.2, token("héllo", "content", usage=1)),
              (0.25, token(" wörld", "content", usage=2)), (0.25, final_usage(2)),
              (0.25, "data: [DONE]")]
    whole = feed(events)
    for split in (1, 2, 3, 7, 50):
        part = feed(events, split=split)
        assert part.content == whole.content == "héllo wörld"
        assert part.chunk_tokens == whole.chunk_tokens
        assert part.ttft_s == whole.ttft_s


def test_tool_call_deltas_are_merged() -> None:
    def call(delta: dict[str, Any]) -> str:
        chunk = json.loads("{" + HEAD + "}")
        chunk["choices"] = [{"index": 0, "delta": {"tool_calls": [delta]}}]
        return "data: " + json.dumps(chunk)

    events = [(0.0, ROLE),
              (0.1, call({"index": 0, "id": "c1", "type": "function",
                          "function": {"name": "get_weather"}})),
              (0.2, call({"index": 0, "function": {"arguments": '{"city": '}})),
              (0.3, call({"index": 0, "function": {"arguments": '"Paris"}'}})),
              (0.3, "data: [DONE]")]
    r = feed(events)
    assert r.tool_calls == [{"id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert r.ttft_s == pytest.approx(0.1)  # a tool-call delta is output too


def test_error_event_and_missing_done_are_failures() -> None:
    err = 'data: {"error":{"message":"EngineCore encountered an issue.","code":500}}'
    r = feed([(0.0, ROLE), (0.1, token("a", "content")), (0.2, err), (0.2, "data: [DONE]")])
    assert not r.ok and "EngineCore encountered an issue" in (r.error or "")
    result = RequestResult()
    state = _StreamState(result)
    state.feed((ROLE + "\n\n").encode(), 0.1)
    state.finish(0.2)
    assert not state.done  # the client marks this "stream ended without [DONE]"


def test_chat_body_asks_for_exact_length_and_per_chunk_usage() -> None:
    body = chat_body("m", [{"role": "user", "content": "x"}], 64, extra={"seed": 1})
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert (body["ignore_eos"], body["min_tokens"], body["max_tokens"]) == (True, 64, 64)
    assert body["seed"] == 1
    plain = chat_body("m", [], 8, exact=False, stream=False)
    assert "ignore_eos" not in plain and "stream_options" not in plain


def test_base_url_normalisation() -> None:
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    with pytest.raises(Exception, match="http"):
        normalize_base_url("h:8000")

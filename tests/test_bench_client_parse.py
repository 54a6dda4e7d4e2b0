"""The stream parser and the per-request measurements, fed with vLLM-shaped SSE bytes, and with
the shapes bad servers send instead."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllmstack.bench.client.client import chat_body, normalize_base_url
from vllmstack.bench.client.stream import RequestResult, StreamState, check_against_request

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
    state = StreamState(result)
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


class Words:
    """A tokenizer with one token per word (the `tokenizers` encode() shape)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        return type("E", (), {"ids": text.split()})()


def test_no_usage_counts_with_the_tokenizer_never_with_chunks() -> None:
    events = [(0.0, ROLE), (0.1, token("one two", "content")),
              (0.2, token(" three four", "content")), (0.2, "data: [DONE]")]
    r = feed(events, tokenizer=Words())
    assert r.token_source == "tokenizer"
    assert r.tokens == 4
    assert r.chunk_tokens == [2, 2]  # the first chunk's own text says it held two
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
    state = StreamState(result)
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


def test_first_chunk_of_several_tokens_is_counted_from_its_text() -> None:
    # Only a final usage, 4 tokens per chunk from the first chunk on: 32 chunks, 128 tokens.
    # Counting the first chunk as one token spreads 127 over 31 chunks and overstates decode
    # by (k-1)/(N-k) = 3/124 = +2.4 %; its text, tokenized, says 4.
    events = [(0.0, ROLE), (0.2, token("a b c d", "content"))]
    t = 0.2
    for _ in range(31):
        t += 0.080
        events.append((t, token(" w x y z", "content")))
    events += [(t, final_usage(128)), (t, "data: [DONE]")]
    exact = feed(events, tokenizer=Words())
    assert exact.chunk_tokens == [4] * 32
    assert exact.decode_tps == pytest.approx(124 / (31 * 0.080))  # 50 t/s, the server's rate
    # A tokenizer that splits differently from the server (two per word) is scaled to the
    # server's count: it only says how the tokens are shared out.
    class Halves:
        def encode(self, text: str, add_special_tokens: bool = False) -> Any:
            return type("E", (), {"ids": [w for word in text.split() for w in (word, word)]})()

    assert feed(events, tokenizer=Halves()).chunk_tokens == [4] * 32
    blind = feed(events)  # no tokenizer loaded: one token assumed, the documented bias
    assert blind.decode_tps == pytest.approx(127 / (31 * 0.080))
    assert blind.decode_tps / exact.decode_tps - 1 == pytest.approx(3 / 124)


def test_textless_one_token_answer_is_timed_by_its_usage_chunk() -> None:
    # vLLM with a reasoning parser: the only token was "</think>", stripped; the finish chunk has
    # content "" and (with continuous usage) completion_tokens 1.
    finish = token("", "content", finish="length", usage=1)
    events = [(0.0, ROLE.replace('"finish_reason":null}]', '"finish_reason":null}],'
                                 '"usage":{"prompt_tokens":26,"completion_tokens":0}')),
              (0.030, finish), (0.031, final_usage(1)), (0.031, "data: [DONE]")]
    r = feed(events)
    assert r.ok and r.ttft_s == pytest.approx(0.030)
    assert r.tokens == 1 and r.token_source == "usage-per-chunk"


def test_textless_one_token_answer_with_only_a_final_usage() -> None:
    events = [(0.0, ROLE), (0.030, token("", "content", finish="length")),
              (0.032, final_usage(1)), (0.032, "data: [DONE]")]
    r = feed(events)
    assert r.ok and r.ttft_s == pytest.approx(0.032)  # the chunk that carries the count
    assert r.tokens == 1 and r.token_source == "usage-final"
    assert r.why == "ok"


def test_no_token_at_all_says_why() -> None:
    r = feed([(0.0, ROLE), (0.1, "data: [DONE]")])
    assert r.ok and r.t_first_token is None
    assert "no token arrived" in r.why


@pytest.mark.parametrize(("event", "reason"), [
    ('{"choices":"abc"}', "choices is a string 'abc', expected a list"),
    ('{"choices":[5]}', "choices[0] is a number 5, expected an object"),
    ('{"choices":[{"delta":"x"}]}', "choices[0].delta is a string 'x', expected an object"),
    ('{"choices":[{"delta":{"content":7}}]}', "delta.content is a number 7, expected a string"),
    ('{"choices":[],"usage":5}', "usage is a number 5, expected an object"),
    ('{"choices":[],"usage":{"completion_tokens":"7"}}',
     "usage.completion_tokens is a string '7', expected a whole number"),
    ('{"choices":[],"usage":{"prompt_tokens":-3}}',
     "usage.prompt_tokens is a number -3, expected a whole number"),
    ('{"choices":[{"delta":{"tool_calls":{"a":1}}}]}', "delta.tool_calls is an object"),
    ('{"choices":[{"delta":{"content":"a"},"token_ids":3}]}', "token_ids is a number 3"),
    ('[1,2]', "stream event is a list [1, 2], expected a JSON object"),
    ('{not json', "unparsable stream event"),
])
def test_wrong_shapes_are_a_request_error_with_the_reason(event: str, reason: str) -> None:
    r = feed([(0.0, ROLE), (0.1, "data: " + event), (0.2, token("later", "content")),
              (0.3, "data: [DONE]")])
    assert not r.ok
    assert reason in (r.error or "")
    assert "later" not in r.content  # nothing after the bad event was taken in


def test_counts_that_go_down_or_change_are_invalid() -> None:
    down = feed([(0.0, ROLE), (0.1, token("a", "content", usage=3)),
                 (0.2, token("b", "content", usage=2)), (0.3, "data: [DONE]")])
    assert "usage.completion_tokens went down from 3 to 2" in (down.error or "")
    final_lower = feed([(0.0, ROLE), (0.1, token("a", "content", usage=5)), (0.2, final_usage(4)),
                        (0.3, "data: [DONE]")])
    assert "went down from 5 to 4" in (final_lower.error or "")
    prompt = token("b", "content", usage=2).replace('"prompt_tokens":26', '"prompt_tokens":30')
    changed = feed([(0.0, ROLE), (0.1, token("a", "content", usage=1)), (0.2, prompt),
                    (0.3, "data: [DONE]")])
    assert "prompt_tokens changed mid-stream from 26 to 30" in (changed.error or "")


def test_more_tokens_than_max_tokens_is_an_invalid_result() -> None:
    r = feed([(0.0, ROLE), (0.1, token("a", "content", usage=1)),
              (0.2, token("b c", "content", usage=9)), (0.3, "data: [DONE]")])
    assert r.ok
    check_against_request(r, chat_body("m", [], 8))
    assert r.error == "invalid result: the server reported 9 completion tokens for max_tokens 8"
    fine = feed([(0.0, ROLE), (0.1, token("a", "content", usage=8)), (0.3, "data: [DONE]")])
    check_against_request(fine, chat_body("m", [], 8))
    assert fine.ok


def test_comments_and_other_fields_are_ignored_and_a_huge_event_is_linear() -> None:
    text = "x" * 300_000
    big = token(text, "content", usage=1)
    events = [(0.0, ": keep-alive"), (0.0, ROLE), (0.05, "event: message\nid: 7\nretry: 10"),
              (0.1, big), (0.1, "data: [DONE]")]
    r = feed(events, split=7)  # ~43k reads for the big event; a re-join per read is quadratic
    assert r.ok and r.content == text and r.tokens == 1


def burst_stream(ttft: float, gap: float, n: int = 128) -> list[tuple[float, str]]:
    """vLLM's per-chunk-usage stream: the role chunk, then n one-token chunks `gap` apart."""
    events = [(ttft, ROLE)]
    for i in range(1, n + 1):
        events.append((ttft + (i - 1) * gap, token(" it", usage=i)))
    end = events[-1][0]
    return [*events, (end, final_usage(n)), (end, "data: [DONE]")]


def test_a_stream_released_in_one_burst_has_no_decode_rate() -> None:
    # Recorded shape (vLLM 0.32 CPU build on 2 cores, API server starved): all 128 chunks,
    # each with its cumulative usage, within 1 ms after 252 ms.
    held = feed(burst_stream(0.2519, 0.000007))
    assert held.ok and held.tokens == 128 and held.burst
    paced = feed(burst_stream(0.0176, 0.0025))
    assert not paced.burst and paced.decode_tps == pytest.approx(400, rel=0.01)
    short = feed(burst_stream(0.1, 0.000007, n=4))  # too few chunks to tell
    assert not short.burst


def test_a_fast_stream_that_arrives_a_few_chunks_at_a_time_keeps_its_decode_rate() -> None:
    # Recorded gaps (llama.cpp, tiny F16 GGUF, 2 cores, 2026-12-04; its own timings said 3,405
    # t/s): the first chunks came together, then one every 0.3 ms. A median under 0.1 ms once
    # read as a held stream, and the row lost its decode rate.
    gaps_ms = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.309, 0.292, 0.298, 0.299, 0.305, 0.275,
               0.336]
    events, t = [(0.012, ROLE), (0.012, token(" it", usage=1))], 0.012
    for i, gap in enumerate(gaps_ms, start=2):
        t += gap / 1e3
        events.append((t, token(" it", usage=i)))
    r = feed([*events, (t, final_usage(16)), (t, "data: [DONE]")])
    assert sorted(r.chunk_gaps_s())[len(gaps_ms) // 2] < 1e-4  # what the median saw
    assert r.ok and r.tokens == 16 and not r.burst
    assert r.decode_tps == pytest.approx(15 / (sum(gaps_ms) / 1e3), rel=0.01)  # ~7,000 t/s


def test_burst_requests_are_left_out_of_decode_and_said() -> None:
    from vllmstack.bench.runs.session import summarize_results

    class Quiet:
        overhead = None

        def __init__(self) -> None:
            self.warnings: list[str] = []

        def warn(self, text: str) -> None:
            self.warnings.append(text)

    session = Quiet()
    results = [feed(burst_stream(0.018, 0.0025)), feed(burst_stream(0.25, 0.000007)),
               feed(burst_stream(0.019, 0.0025))]
    row = summarize_results(session, results, pp=256, tg=128, depth=0, concurrency=1)  # type: ignore[arg-type]
    assert row.requests == 3 and row.errors == 0
    assert row.tg_tps is not None and row.ttft_ms is not None
    assert row.tg_tps.n == 2 and row.tg_tps.max == pytest.approx(400, rel=0.01)
    assert row.ttft_ms.n == 3  # the wait a user saw stays in TTFT
    assert len(session.warnings) == 1 and "1 of 3 requests" in session.warnings[0]
    assert "one burst" in session.warnings[0]

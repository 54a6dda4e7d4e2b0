"""The per-request measurements every benchmark is built from, and the SSE parser that fills them.

Definitions (chosen so that a server sending the role chunk early, several tokens per chunk or
tokens without text cannot distort them):
* TTFT: request sent -> arrival of the first chunk carrying content, reasoning or tool-call text,
  or carrying tokens that have no text (a thinking marker the reasoning parser stripped, a
  special token): those show up as a rise of per-chunk `usage.completion_tokens`, or, with only a
  final usage, as the final usage chunk itself. A role-only chunk is not a token; its arrival is
  kept separately as TTFR (a diagnostic).
* Tokens per chunk come from `token_ids` or from per-chunk cumulative `usage`
  (`continuous_usage_stats`); with only a final `usage` the first chunk counts its text's share of
  the tokens when a tokenizer is loaded (else one), and the rest are spread evenly over the later
  chunks; never from counting chunks.
* Decode t/s: tokens after the first token chunk / (last token chunk - first token chunk). With one
  token per chunk that is (N - 1) / (t_N - t_1).
* ITL: each chunk's arrival gap divided evenly over the tokens it carried (a per-token sample per
  token), so MTP / speculative chunks do not look like stalls.

A server that sends something else is named, never crashed on: an event that is not JSON, JSON of
the wrong shape (`choices: "abc"`, `usage: 5`, counts as strings) or usage that contradicts
itself (counts going down, a prompt that changes size mid-stream) ends the request with the
reason, and the client closes the stream. Lines are split in one pass over each read, so a server
trickling one huge event byte by byte costs linear time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_EVENT = 16 << 20  # one SSE event; a chunk of a real stream is ~300 bytes
BURST_MIN_CHUNKS, BURST_GAP_S = 8, 1e-4  # see RequestResult.burst


@dataclass
class RequestResult:
    """Everything measured for one streamed request. Times are `time.perf_counter()` seconds."""

    t_sent: float = 0.0
    t_first_event: float | None = None  # first chunk with choices, even role-only (TTFR)
    t_first_token: float | None = None
    t_end: float = 0.0
    status: int = 0
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # token-carrying chunks only
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk, when known
    token_source: str = "none"  # token_ids | usage-per-chunk | usage-final | tokenizer | none
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stopped: bool = False  # ended early on purpose (probes), not a failure
    # llama-server's own `timings` object (prompt_per_second, predicted_per_second, ...), which
    # it puts on the last chunk of a stream; None from servers that send none (vLLM).
    server_timings: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def why(self) -> str:
        """Why this request gave no measurement (the error, or what was missing)."""
        if self.error:
            return self.error
        if self.t_first_token is None:
            return ("no token arrived: the stream carried no text and no usage counts "
                    "(is this a chat model endpoint?)")
        return "ok"

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first_token is None else self.t_first_token - self.t_sent

    @property
    def ttfr_s(self) -> float | None:
        return None if self.t_first_event is None else self.t_first_event - self.t_sent

    @property
    def decode_tokens(self) -> int:
        """Tokens after the first token chunk (those the decode rate is measured over)."""
        return self.tokens - self.chunk_tokens[0] if self.chunk_tokens else 0

    @property
    def decode_span_s(self) -> float:
        if len(self.chunk_times) < 2:
            return 0.0
        return self.chunk_times[-1] - self.chunk_times[0]

    @property
    def decode_tps(self) -> float | None:
        span = self.decode_span_s
        if span <= 0 or self.decode_tokens <= 0:
            return None
        return self.decode_tokens / span

    @property
    def burst(self) -> bool:
        """The tokens came in one burst: the server held the stream back and let it go at once.

        No engine streams one sequence faster than a token per 0.1 ms on average, so a stream
        that many chunks long and that short was queued behind something (seen with vLLM's CPU
        build on 2 cores: an API server starved by the engine's busy-waiting processes sent 128
        chunks within 1 ms). The mean, not the median: a fast engine's chunks often arrive a few
        at a time (llama.cpp with a tiny model on 2 cores: 8 of 15 gaps under 1 µs, the rest
        0.3 ms), and its decode rate over the whole span is still the rate it decoded at."""
        gaps = self.chunk_gaps_s()
        return len(gaps) >= BURST_MIN_CHUNKS and self.decode_span_s / len(gaps) < BURST_GAP_S

    def itl_samples_s(self) -> list[float]:
        """One inter-token latency per decoded token (chunk gap shared by its tokens)."""
        out: list[float] = []
        times, counts = self.chunk_times, self.chunk_tokens
        for i in range(1, min(len(times), len(counts))):
            k = counts[i]
            if k <= 0:
                continue
            gap = (times[i] - times[i - 1]) / k
            out.extend([gap] * k)
        return out

    def chunk_gaps_s(self) -> list[float]:
        """Arrival gaps between token-carrying chunks (what per-chunk tools call ITL)."""
        t = self.chunk_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]

    def text(self) -> str:
        return self.reasoning + self.content

    def summary(self) -> dict[str, Any]:
        """Compact per-request record (for history, probes and stability tables)."""
        return {
            "ok": self.ok,
            "error": self.error,
            "status": self.status,
            "ttft_ms": None if self.ttft_s is None else self.ttft_s * 1000,
            "ttfr_ms": None if self.ttfr_s is None else self.ttfr_s * 1000,
            "decode_tps": self.decode_tps,
            "tokens": self.tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "token_source": self.token_source,
            "finish_reason": self.finish_reason,
            "e2e_ms": (self.t_end - self.t_sent) * 1000 if self.t_end else None,
        }


class StreamShapeError(ValueError):
    """A stream event of the wrong shape; the message says which field and what came."""


def describe(value: Any) -> str:
    """`a string 'abc'`, `a number 5`: what came where something else was expected."""
    kinds = {str: "a string", bool: "a boolean", int: "a number", float: "a number",
             list: "a list", dict: "an object", type(None): "null"}
    text = json.dumps(value)[:40] if not isinstance(value, str) else repr(value[:40])
    return f"{kinds.get(type(value), type(value).__name__)} {text}"


def _count(obj: dict[str, Any], key: str, where: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StreamShapeError(f"{where}.{key} is {describe(value)}, expected a whole number")
    return value


def _text(obj: dict[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    raise StreamShapeError(f"{where}.{key} is {describe(value)}, expected a string")


class StreamState:
    """Incremental SSE + chunk parser for one response; kept minimal because it runs per chunk."""

    __slots__ = (
        "broken", "content", "data", "data_len", "done", "first_text", "last_count",
        "last_usage_tokens", "partial", "partial_len", "per_chunk_usage", "reasoning", "result",
        "saw_token_ids", "textless", "tool_parts",
    )

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.partial: list[bytes] = []  # the current line, while its end has not arrived
        self.partial_len = 0
        self.data: list[bytes] = []  # data: lines of the current event
        self.data_len = 0
        self.done = False
        self.broken = False  # a fatal problem: nothing more is parsed, the caller closes
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_parts: dict[int, dict[str, Any]] = {}
        self.last_usage_tokens = 0  # cumulative count at the last token chunk
        self.last_count: int | None = None  # the last completion_tokens seen in any chunk
        self.per_chunk_usage = False
        self.saw_token_ids = False
        self.textless = False  # the only tokens were counted by a usage-only chunk
        self.first_text: str | None = None  # text of the first token chunk

    def fail(self, reason: str) -> None:
        if self.result.error is None:
            self.result.error = reason
        self.broken = True

    def feed(self, raw: bytes, now: float) -> None:
        """Split `raw` into lines in one pass; an unfinished line waits for the next read."""
        start, end = 0, len(raw)
        while start < end and not self.broken:
            eol = raw.find(b"\n", start)
            if eol < 0:
                self.partial.append(raw[start:])
                self.partial_len += end - start
                if self.partial_len > MAX_EVENT:
                    self.fail(f"stream line longer than {MAX_EVENT >> 20} MiB")
                return
            if self.partial:
                self.partial.append(raw[start:eol])
                line = b"".join(self.partial)
                self.partial, self.partial_len = [], 0
            else:
                line = raw[start:eol]
            start = eol + 1
            self.line(line, now)

    def line(self, line: bytes, now: float) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            if self.data:
                payload = self.data[0] if len(self.data) == 1 else b"\n".join(self.data)
                self.data, self.data_len = [], 0
                self.event(payload, now)
            return
        if line.startswith(b"data:"):
            value = line[5:]
            if value.startswith(b" "):
                value = value[1:]
            self.data.append(value)
            self.data_len += len(value)
            if self.data_len > MAX_EVENT:
                self.fail(f"stream event larger than {MAX_EVENT >> 20} MiB")
        # Other SSE fields (event:, id:, retry:, ": comments") carry nothing we measure.

    def finish(self, now: float) -> None:
        if self.partial:
            self.feed(b"\n", now)
        if self.data:
            self.feed(b"\n", now)

    def event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.fail(f"unparsable stream event: {payload[:120]!r}")
            return
        if not isinstance(obj, dict):
            self.fail(f"stream event is {describe(obj)}, expected a JSON object")
            return
        try:
            self.chunk(obj, now)
        except StreamShapeError as exc:
            self.fail(f"malformed stream event: {exc}")

    def usage(self, usage: Any) -> int | None:
        """Check and record a chunk's usage; returns its completion_tokens."""
        if not isinstance(usage, dict):
            raise StreamShapeError(f"usage is {describe(usage)}, expected an object")
        result = self.result
        count = usage.get("completion_tokens")
        if count is not None and (type(count) is not int or count < 0):
            _count(usage, "completion_tokens", "usage")  # raises, naming the field
        prompt = usage.get("prompt_tokens")
        if prompt is not None and (type(prompt) is not int or prompt < 0):
            _count(usage, "prompt_tokens", "usage")
        if prompt is not None:
            if result.prompt_tokens is not None and prompt != result.prompt_tokens:
                raise StreamShapeError(f"usage.prompt_tokens changed mid-stream from "
                                       f"{result.prompt_tokens} to {prompt}")
            result.prompt_tokens = prompt
        if count is not None:
            if self.last_count is not None and count < self.last_count:
                raise StreamShapeError(f"usage.completion_tokens went down from "
                                       f"{self.last_count} to {count}")
            self.last_count = count
            result.completion_tokens = count
        details = usage.get("prompt_tokens_details")
        if details is not None:
            if not isinstance(details, dict):
                raise StreamShapeError(f"usage.prompt_tokens_details is {describe(details)}, "
                                       "expected an object")
            cached = _count(details, "cached_tokens", "usage.prompt_tokens_details")
            if cached is not None:
                result.cached_tokens = cached
        return count

    def chunk(self, obj: dict[str, Any], now: float) -> None:
        result = self.result
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            self.fail(f"server error in stream: {msg}")
            return
        raw_usage = obj.get("usage")
        usage_tokens = None if raw_usage is None else self.usage(raw_usage)
        choices = obj.get("choices")
        if choices is None:
            choices = []
        if not isinstance(choices, list):
            raise StreamShapeError(f"choices is {describe(choices)}, expected a list")
        if not choices:
            if "timings" in obj:  # only the closing chunks carry it: no cost per token
                self.timings(obj["timings"])
            if usage_tokens and not result.chunk_times:
                # Tokens without any text (a stripped thinking marker, a special token): the
                # chunk that carries their count is the only trace of them, so it is their time.
                self.textless = True
                result.t_first_token = now
                result.chunk_times.append(now)
                result.chunk_tokens.append(usage_tokens)
                self.last_usage_tokens = usage_tokens
            return
        choice = choices[0]
        if not isinstance(choice, dict):
            raise StreamShapeError(f"choices[0] is {describe(choice)}, expected an object")
        if result.t_first_event is None:
            result.t_first_event = now
        delta = choice.get("delta")
        if delta is None:
            delta = {}
        elif not isinstance(delta, dict):
            raise StreamShapeError(f"choices[0].delta is {describe(delta)}, expected an object")
        carries = False
        # Inline type checks: this runs for every chunk of every stream.
        text = delta.get("content")
        if text is not None and type(text) is not str:
            _text(delta, "content", "delta")  # raises, naming the field
        if text:
            self.content.append(text)
            carries = True
        thought = delta.get("reasoning") or delta.get("reasoning_content")
        if thought is not None and type(thought) is not str:
            _text(delta, "reasoning", "delta")  # whichever of the two is wrong raises
            _text(delta, "reasoning_content", "delta")
        if thought:
            self.reasoning.append(thought)
            carries = True
        calls = delta.get("tool_calls")
        if calls:
            self.merge_tool_calls(calls)
            carries = True
        ids = choice.get("token_ids")
        if ids is not None and not isinstance(ids, list):
            raise StreamShapeError(f"choices[0].token_ids is {describe(ids)}, expected a list")
        if ids:
            carries = True
        finish = _text(choice, "finish_reason", "choices[0]")
        if finish:
            result.finish_reason = finish
            if "timings" in obj:
                self.timings(obj["timings"])
        if not carries and usage_tokens is not None and usage_tokens > self.last_usage_tokens:
            carries = True  # per-chunk usage says tokens came, though none had text
        if not carries:
            return
        if result.t_first_token is None:
            result.t_first_token = now
            self.first_text = (thought or "") + (text or "")
        result.chunk_times.append(now)
        if ids:
            self.saw_token_ids = True
            result.chunk_tokens.append(len(ids))
        elif usage_tokens is not None:
            # Cumulative usage in every chunk: this chunk's tokens are the increase since the last.
            self.per_chunk_usage = True
            result.chunk_tokens.append(usage_tokens - self.last_usage_tokens)
            self.last_usage_tokens = usage_tokens
        else:
            result.chunk_tokens.append(-1)  # unknown yet; settled in `close`

    def timings(self, value: Any) -> None:
        if not isinstance(value, dict):
            raise StreamShapeError(f"timings is {describe(value)}, expected an object")
        self.result.server_timings = value

    def merge_tool_calls(self, calls: Any) -> None:
        if not isinstance(calls, list):
            raise StreamShapeError(f"delta.tool_calls is {describe(calls)}, expected a list")
        for call in calls:
            if not isinstance(call, dict):
                raise StreamShapeError(f"a tool call delta is {describe(call)}, expected an "
                                       "object")
            index = call.get("index", 0)
            if isinstance(index, bool) or not isinstance(index, int):
                raise StreamShapeError(f"tool_calls[].index is {describe(index)}, expected a "
                                       "whole number")
            slot = self.tool_parts.setdefault(index, {"id": None, "name": "", "arguments": ""})
            call_id = _text(call, "id", "tool_calls[]")
            if call_id:
                slot["id"] = call_id
            fn = call.get("function") or {}
            if not isinstance(fn, dict):
                raise StreamShapeError(f"tool_calls[].function is {describe(fn)}, expected an "
                                       "object")
            slot["name"] += _text(fn, "name", "tool_calls[].function") or ""
            slot["arguments"] += _text(fn, "arguments", "tool_calls[].function") or ""

    def close(self, tokenizer: Any = None) -> None:
        """Join texts and settle token counts once the stream has ended."""
        result = self.result
        result.content = "".join(self.content)
        result.reasoning = "".join(self.reasoning)
        result.tool_calls = [self.tool_parts[i] for i in sorted(self.tool_parts)]
        counts = result.chunk_tokens
        if not counts:
            return
        unknown = [i for i, k in enumerate(counts) if k < 0]
        if self.saw_token_ids:
            result.token_source = "token_ids"
        elif self.per_chunk_usage and not unknown:
            result.token_source = "usage-per-chunk"
        elif self.textless:
            result.token_source = "usage-final"
        total = result.completion_tokens
        if unknown:
            if total is None and tokenizer is not None:
                total = _token_count(tokenizer, result.text())
                result.token_source = "tokenizer"
            elif total is not None:
                result.token_source = "usage-final"
            if total is None:
                result.chunk_tokens = []
                result.token_source = "none"
                return
            known = sum(k for k in counts if k >= 0)
            rest = max(0, total - known)
            if unknown[0] == 0 and rest > 0:
                # The first token chunk holds what the prefill produced plus whatever the
                # server merged into it. Its share of the text's tokens says how much, scaled to
                # the server's own count (a re-tokenized text need not match it token for
                # token); without a tokenizer it counts one (prefill yields exactly one token).
                # Counting it as one when it held k would overstate decode t/s by (k-1)/(N-k).
                first = 1
                if tokenizer is not None and self.first_text and result.text():
                    whole = _token_count(tokenizer, result.text())
                    if whole > 0:
                        own = _token_count(tokenizer, self.first_text)
                        first = round(own * total / whole)
                first = max(1, min(first, rest - (len(unknown) - 1)))
                counts[0] = first
                rest -= first
                unknown = unknown[1:]
            if unknown:
                # The rest are spread evenly over the later chunks. For a server sending k per
                # step that is k each, which keeps decode t/s unbiased; interpolating per-token
                # times between chunks (what some tools do) overstates it.
                share, extra = divmod(rest, len(unknown))
                for n, i in enumerate(unknown):
                    counts[i] = share + (1 if n < extra else 0)
            elif rest > 0:
                counts[0] += rest
        elif total is not None and total > sum(counts):
            # Tokens the server counted but never streamed (EOS, stripped markers) end the stream.
            counts[-1] += total - sum(counts)


def _token_count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def check_against_request(result: RequestResult, body: dict[str, Any]) -> None:
    """Mark a result invalid when its counts contradict what was asked for.

    More tokens than `max_tokens` cannot be right whatever the server does with `ignore_eos`;
    a server that stops short of an exact-length request is only a warning (the session says so),
    because some servers ignore vLLM's `ignore_eos`/`min_tokens` extensions.
    """
    if result.error is not None or result.stopped:
        return
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(limit, int) or isinstance(limit, bool):
        return
    produced = max(result.completion_tokens or 0, result.tokens)
    if produced > limit:
        result.error = (f"invalid result: the server reported {produced} completion tokens for "
                        f"max_tokens {limit}")

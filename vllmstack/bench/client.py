"""Streaming chat client and the per-request measurements every benchmark is built from.

Definitions (chosen so that a server sending the role chunk early, or several tokens per chunk,
cannot distort them):
* TTFT: request sent -> arrival of the first chunk carrying content, reasoning or tool-call text.
  A role-only chunk is not a token; its arrival is kept separately as TTFR (a diagnostic).
* Tokens per chunk come from `token_ids` or from per-chunk cumulative `usage`
  (`continuous_usage_stats`); with only a final `usage` the first chunk counts one token and the
  rest are spread evenly over the later chunks; never from counting chunks.
* Decode t/s: tokens after the first token chunk / (last token chunk - first token chunk). With one
  token per chunk that is (N - 1) / (t_N - t_1).
* ITL: each chunk's arrival gap divided evenly over the tokens it carried (a per-token sample per
  token), so MTP / speculative chunks do not look like stalls.

One event loop, one connection pool, and per chunk only a line split and one json.loads: the client
must not be what limits the numbers it reports.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllmstack.bench.http import HTTPClient, HTTPError, HTTPTimeoutError
from vllmstack.core.errors import StackError

DEFAULT_TIMEOUT_S = 600.0


class EndpointError(StackError, RuntimeError):
    """The endpoint could not be used at all (refused, wrong URL, bad model); says what to check."""


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

    @property
    def ok(self) -> bool:
        return self.error is None

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


class _StreamState:
    """Incremental SSE + chunk parser for one response; kept minimal because it runs per chunk."""

    __slots__ = (
        "content", "data", "done", "last_usage_tokens", "pending", "per_chunk_usage",
        "reasoning", "result", "saw_token_ids", "tool_parts",
    )

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.pending = b""
        self.data: list[bytes] = []
        self.done = False
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_parts: dict[int, dict[str, Any]] = {}
        self.last_usage_tokens = 0
        self.per_chunk_usage = False
        self.saw_token_ids = False

    def feed(self, raw: bytes, now: float) -> None:
        buf = self.pending + raw if self.pending else raw
        lines = buf.split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self.data:
                    payload = self.data[0] if len(self.data) == 1 else b"\n".join(self.data)
                    self.data = []
                    self.event(payload, now)
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                if value.startswith(b" "):
                    value = value[1:]
                self.data.append(value)
            # Other SSE fields (event:, id:, retry:, comments) carry nothing we measure.

    def finish(self, now: float) -> None:
        if self.pending:
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
            self.result.error = self.result.error or f"unparsable stream event: {payload[:120]!r}"
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            self.result.error = f"server error in stream: {msg}"
            return
        usage = obj.get("usage")
        usage_tokens = None
        if usage:
            usage_tokens = usage.get("completion_tokens")
            self.result.prompt_tokens = usage.get("prompt_tokens", self.result.prompt_tokens)
            if usage_tokens is not None:
                self.result.completion_tokens = usage_tokens
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.result.cached_tokens = details["cached_tokens"]
        choices = obj.get("choices")
        if not choices:
            return
        result = self.result
        if result.t_first_event is None:
            result.t_first_event = now
        choice = choices[0]
        delta = choice.get("delta") or {}
        carries = False
        text = delta.get("content")
        if text:
            self.content.append(text)
            carries = True
        text = delta.get("reasoning") or delta.get("reasoning_content")
        if text:
            self.reasoning.append(text)
            carries = True
        calls = delta.get("tool_calls")
        if calls:
            self.merge_tool_calls(calls)
            carries = True
        ids = choice.get("token_ids")
        if ids:
            carries = True
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
        if not carries:
            return
        if result.t_first_token is None:
            result.t_first_token = now
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

    def merge_tool_calls(self, calls: list[dict[str, Any]]) -> None:
        for call in calls:
            index = call.get("index", 0)
            slot = self.tool_parts.setdefault(index, {"id": None, "name": "", "arguments": ""})
            if call.get("id"):
                slot["id"] = call["id"]
            fn = call.get("function") or {}
            if fn.get("name"):
                slot["name"] += fn["name"]
            if fn.get("arguments"):
                slot["arguments"] += fn["arguments"]

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
        total = result.completion_tokens
        if unknown:
            if total is None and tokenizer is not None:
                total = len(tokenizer.encode(result.text(), add_special_tokens=False).ids)
                result.token_source = "tokenizer"
            elif total is not None:
                result.token_source = "usage-final"
            if total is None:
                result.chunk_tokens = []
                result.token_source = "none"
                return
            known = sum(k for k in counts if k >= 0)
            rest = max(0, total - known)
            # The first token chunk holds one token (prefill yields exactly one, speculative
            # decoding or not); the rest are spread evenly over the later chunks. For a server
            # sending k per step that is k each, which keeps decode t/s unbiased; interpolating
            # per-token times between chunks (what some tools do) overstates it.
            if unknown[0] == 0 and rest > 0:
                counts[0] = 1
                rest -= 1
                unknown = unknown[1:]
            if unknown:
                share, extra = divmod(rest, len(unknown))
                for n, i in enumerate(unknown):
                    counts[i] = share + (1 if n < extra else 0)
            elif rest > 0:
                counts[0] += rest
        elif total is not None and total > sum(counts):
            # Tokens the server counted but never streamed (EOS, stripped markers) end the stream.
            counts[-1] += total - sum(counts)


def chat_body(
    model: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
    *,
    exact: bool = True,
    stream: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A chat request that asks for per-chunk usage; `exact` makes the output exactly max_tokens."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if exact:
        # vLLM extensions; other servers ignore unknown fields, and the output length is checked.
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    if extra:
        body.update(extra)
    return body


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    text = msg or body.decode("utf-8", "replace").strip()[:300] or "(empty body)"
    return f"HTTP {status}: {text}"


class ChatClient:
    """One pooled HTTP client for an OpenAI-compatible endpoint (see `http` for why not httpx)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tokenizer: Any = None,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = tokenizer
        self._http = HTTPClient(self.base_url, headers=headers, timeout_s=timeout_s,
                                connect_timeout_s=min(timeout_s, 10.0))

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def get_text(self, path: str) -> str:
        try:
            status, body = await self._http.get(path)
        except HTTPError as exc:
            raise EndpointError(f"cannot reach {self.base_url}{path}: {exc}") from exc
        if status != 200:
            raise EndpointError(f"{self.base_url}{path}: {_error_text(status, body)}")
        return body.decode("utf-8", "replace")

    async def get_json(self, path: str) -> Any:
        text = await self.get_text(path)
        try:
            return json.loads(text)
        except ValueError as exc:
            raise EndpointError(f"{self.base_url}{path} did not return JSON") from exc

    async def models(self) -> list[dict[str, Any]]:
        data = await self.get_json("/v1/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list):
            raise EndpointError(f"{self.base_url}/v1/models did not return a model list")
        return models

    async def stream_chat(
        self,
        body: dict[str, Any],
        *,
        result: RequestResult | None = None,
        stop: asyncio.Event | None = None,
    ) -> RequestResult:
        """Send one streamed chat request and time every chunk. Never raises for HTTP trouble.

        Pass `result` to watch chunks arrive while the request runs; set `stop` to end the
        stream early (the result is then marked `stopped`, not failed).
        """
        result = result if result is not None else RequestResult()
        state = _StreamState(result)
        payload = json.dumps(body).encode()
        clock = time.perf_counter
        result.t_sent = clock()
        try:
            async with self._http.request("POST", "/v1/chat/completions", payload) as response:
                result.status = response.status
                if response.status != 200:
                    result.error = _error_text(response.status, await response.read())
                    result.t_end = clock()
                    return result
                if stop is None:
                    await response.stream(state.feed)
                else:
                    def feed_or_stop(data: bytes, now: float) -> None:
                        state.feed(data, now)
                        if stop.is_set() and not result.stopped:
                            result.stopped = True
                            response.abort()

                    try:
                        await response.stream(feed_or_stop)
                    except HTTPError:
                        if not result.stopped:  # closing it ourselves is not a failure
                            raise
                state.finish(clock())
        except HTTPTimeoutError as exc:
            result.error = f"timed out: {exc}"
        except HTTPError as exc:
            result.error = f"connection failed: {exc}"
        result.t_end = clock()
        state.close(self.tokenizer)
        if result.error is None and not state.done and not result.stopped:
            result.error = "stream ended without [DONE] (connection cut or server dropped it)"
        return result

    async def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None, str | None]:
        """Non-streamed chat: (status, parsed body, error text)."""
        payload = dict(body, stream=False)
        payload.pop("stream_options", None)
        try:
            status, raw = await self._http.post("/v1/chat/completions",
                                                json.dumps(payload).encode())
        except HTTPError as exc:
            return 0, None, f"connection failed: {exc}"
        if status != 200:
            return status, None, _error_text(status, raw)
        try:
            data = json.loads(raw)
        except ValueError:
            return status, None, "response is not JSON"
        if not isinstance(data, dict):
            return status, None, "response is not a JSON object"
        return status, data, None


def normalize_base_url(url: str) -> str:
    """Server root without a trailing slash or /v1 (paths are added per call)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise EndpointError(f"--url must start with http:// or https://, got {url!r}")
    return url

"""Streaming chat client: one pooled connection set, the request bodies, the endpoint errors.

What is measured per request, and how a stream is parsed, lives in `stream` (`RequestResult`,
`StreamState`). One event loop, one connection pool, and per chunk only a line split and one
json.loads: the client must not be what limits the numbers it reports.

Every request ends by its total deadline (`--timeout`), whatever the server sends meanwhile; a
200 answer that is not what was asked for (an HTML login page, JSON instead of an event stream)
is a failure that says what came.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Mapping
from typing import Any

from vllmstack.bench.client.http import HTTPClient, HTTPError, HTTPTimeoutError, Response
from vllmstack.bench.client.stream import (
    RequestResult,
    StreamState,
    check_against_request,
    describe,
)
from vllmstack.core.errors import StackError

__all__ = ["DEFAULT_TIMEOUT_S", "ChatClient", "EndpointError", "RequestResult", "chat_body",
           "normalize_base_url"]

DEFAULT_TIMEOUT_S = 600.0
# Kept for callers of the old name (benchmarks/bench_client_overhead.py).
_StreamState = StreamState
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)


class EndpointError(StackError, RuntimeError):
    """The endpoint could not be used at all (refused, wrong URL, bad model); says what to check."""


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


def unexpected_body(status: int, content_type: str, body: bytes, wanted: str) -> str:
    """What came instead of `wanted`: the media type and the page title or the first words."""
    match = _TITLE.search(body[:65536])
    if match:
        shown = " ".join(match.group(1).decode("utf-8", "replace").split())[:120]
        what = f"a page titled {shown!r}"
    else:
        text = " ".join(body[:400].decode("utf-8", "replace").split())[:160]
        what = repr(text) if text else "an empty body"
    return (f"HTTP {status} with {content_type or 'no content type'} instead of {wanted}: "
            f"{what} (is --url the inference server itself, not a proxy or login page?)")


def _is_json(content_type: str) -> bool:
    return content_type in ("", "application/json") or content_type.endswith("+json")


def _answer_shape(data: Any) -> str | None:
    """Why a non-streamed chat answer cannot be read, or None when its shape is usable."""
    if not isinstance(data, dict):
        return f"the answer is {describe(data)}, expected a JSON object"
    choices = data.get("choices")
    if not isinstance(choices, list):
        return f"choices is {describe(choices)}, expected a list"
    for n, choice in enumerate(choices):
        if not isinstance(choice, dict):
            return f"choices[{n}] is {describe(choice)}, expected an object"
        message = choice.get("message")
        if message is not None and not isinstance(message, dict):
            return f"choices[{n}].message is {describe(message)}, expected an object"
        for key in ("content", "reasoning", "reasoning_content"):
            value = (message or {}).get(key)
            if value is not None and not isinstance(value, str):
                return f"choices[{n}].message.{key} is {describe(value)}, expected a string"
        calls = (message or {}).get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function") or {}, dict)
                for c in calls)):
            return f"choices[{n}].message.tool_calls is {describe(calls)}, expected a list"
    usage = data.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            return f"usage is {describe(usage)}, expected an object"
        for key in ("prompt_tokens", "completion_tokens"):
            value = usage.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                return f"usage.{key} is {describe(value)}, expected a whole number"
    return None


class ChatClient:
    """One pooled HTTP client for an OpenAI-compatible endpoint (see `http` for why not httpx)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tokenizer: Any = None,
        keep_alive: bool = True,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._http = HTTPClient(self.base_url, headers=headers, timeout_s=timeout_s,
                                connect_timeout_s=min(timeout_s, 10.0), keep_alive=keep_alive)

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _fetch(self, method: str, path: str, body: bytes | None = None
                     ) -> tuple[int, str, bytes]:
        async with self._http.request(method, path, body) as response:
            return response.status, response.content_type, await response.read()

    async def get_text(self, path: str) -> str:
        try:
            status, ctype, body = await self._fetch("GET", path)
        except HTTPError as exc:
            raise EndpointError(f"cannot reach {self.base_url}{path}: {exc}") from exc
        if status != 200:
            raise EndpointError(f"{self.base_url}{path}: {_error_text(status, body)}")
        if ctype == "text/html":
            raise EndpointError(f"{self.base_url}{path}: "
                                + unexpected_body(status, ctype, body, "the engine's answer"))
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
        if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
            raise EndpointError(f"{self.base_url}/v1/models did not return a model list "
                                "(a JSON object whose data is a list of objects)")
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
        stream early (the result is then marked `stopped`, not failed). A stream of the wrong
        shape is closed at once and the result says why.
        """
        result = result if result is not None else RequestResult()
        state = StreamState(result)
        payload = json.dumps(body).encode()
        clock = time.perf_counter
        result.t_sent = clock()
        try:
            async with self._http.request("POST", "/v1/chat/completions", payload) as response:
                result.status = response.status
                await self._read_stream(response, state, stop)
        except HTTPTimeoutError as exc:
            result.error = result.error or f"timed out: {exc}"
        except HTTPError as exc:
            if not state.broken:  # closing a broken stream ourselves is not the failure
                result.error = result.error or f"connection failed: {exc}"
        result.t_end = clock()
        try:
            state.close(self.tokenizer)
        except Exception as exc:  # the tokenizer is third-party code: name it, do not crash
            result.error = result.error or f"counting tokens failed: {exc}"
        if result.error is None and not state.done and not result.stopped:
            result.error = "stream ended without [DONE] (connection cut or server dropped it)"
        check_against_request(result, body)
        return result

    async def _read_stream(self, response: Response, state: StreamState,
                           stop: asyncio.Event | None) -> None:
        result = state.result
        if response.status != 200:
            result.error = _error_text(response.status, await response.read())
            return
        ctype = response.content_type
        if ctype and ctype != "text/event-stream":
            note = " (does the server ignore \"stream\": true?)" if _is_json(ctype) else ""
            result.error = unexpected_body(response.status, ctype, await response.read(),
                                           "an event stream") + note
            return

        def feed(data: bytes, now: float) -> None:
            state.feed(data, now)
            if state.broken:
                response.abort()
            elif stop is not None and stop.is_set() and not result.stopped:
                result.stopped = True
                response.abort()

        try:
            await response.stream(feed)
        except HTTPError:
            if not result.stopped and not state.broken:
                raise
        state.finish(time.perf_counter())

    async def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None, str | None]:
        """Non-streamed chat: (status, parsed body, error text)."""
        payload = dict(body, stream=False)
        payload.pop("stream_options", None)
        try:
            status, ctype, raw = await self._fetch("POST", "/v1/chat/completions",
                                                   json.dumps(payload).encode())
        except HTTPTimeoutError as exc:
            return 0, None, f"timed out: {exc}"
        except HTTPError as exc:
            return 0, None, f"connection failed: {exc}"
        if status != 200:
            return status, None, _error_text(status, raw)
        if not _is_json(ctype):
            return status, None, unexpected_body(status, ctype, raw, "a JSON answer")
        try:
            data = json.loads(raw)
        except ValueError:
            return status, None, "response is not JSON"
        shape = _answer_shape(data)
        if shape is not None:
            return status, None, f"malformed answer: {shape}"
        limit = payload.get("max_completion_tokens", payload.get("max_tokens"))
        produced = (data.get("usage") or {}).get("completion_tokens")
        if isinstance(limit, int) and isinstance(produced, int) and produced > limit:
            return status, None, (f"invalid result: the server reported {produced} completion "
                                  f"tokens for max_tokens {limit}")
        return status, data, None


def normalize_base_url(url: str) -> str:
    """Server root without a trailing slash or /v1 (paths are added per call)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise EndpointError(f"--url must start with http:// or https://, got {url!r}")
    return url

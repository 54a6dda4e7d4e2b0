"""The official OpenAI Python SDK against `python -m vllmstack.router` (what `invoke router`
runs): the SDK is how most clients talk to the router, so its parsing of the router's answers,
its exception classes, its retries and its timeouts are what a user sees (issue 35).

One router for the module, with a token, a 64 KiB body limit and four profiles of the engine
simulator on the native runtime:

* sim-a serves: thinking and tools on (the qwen3 profile's hermes parser), a 5 ms step, and a
  prefill of 2,000 tokens a second, so a 5,000-word prompt makes a stream that sends nothing for
  2.5 s after its head (the timeout case) while a short one answers at once;
* sim-bad and sim-retry crash at boot with vLLM's "No available memory for the cache blocks"
  error; two of them so that the retry case counts the boots of a profile nothing loaded before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from helpers import ROOT, free_port, simulator_project, wait_for
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionMessageToolCall,
    ChatCompletionToolParam,
)
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall
from test_router import engine_processes

from vllmstack.observe.health import health_status

pytestmark = pytest.mark.slow  # the integration tier: a router process and engine boots (~30 s)

PROFILES = {
    "sim-a": "SIM_BOOT_SECONDS=0.3 SIM_ITL_MS=5 SIM_PREFILL_TPS=2000",
    "sim-bad": "SIM_FAULT=crash-at-boot SIM_BOOT_SECONDS=0.2",
    "sim-retry": "SIM_FAULT=crash-at-boot SIM_BOOT_SECONDS=0.2",
}
TOKEN = "sdk-suite-token-0123456789abcdef0123456789"  # 42 bytes: long enough for any rule
MAX_BODY = 65536
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
    },
}
WEATHER_ARGUMENTS = {"city": "sim", "unit": "celsius"}  # what the simulator fills the schema with
ENGINE_START = "non-default args:"  # vLLM's API server logs it once, as it starts


class Router:
    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "router.out"
        environ = {**os.environ, "PYTHONPATH": str(ROOT), "ROUTER_TOKEN": TOKEN}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllmstack.router", "--project", str(root), "--host",
                 "127.0.0.1", "--port", str(self.port), "--profiles", ",".join(PROFILES)],
                cwd=root, env=environ, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: self.proc.poll() is not None or health_status(self.url) is not None,
                 timeout=60, what="the router listens")
        assert self.proc.poll() is None, self.output()

    def output(self) -> str:
        return self.log.read_text()

    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = requests.get(self.url + "/v1/health", timeout=5, headers={
            "Authorization": f"Bearer {TOKEN}"}).json()
        return data

    def client(self, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=TOKEN, **options)

    def boots(self, profile: str) -> int:
        """How many times the profile's engine was started, from its log (the router appends
        every load's output to it)."""
        log = self.root / "generated" / "router" / f"{profile}.log"
        return log.read_text().count(ENGINE_START) if log.exists() else 0


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    root = simulator_project(tmp_path_factory.mktemp("sdk") / "stack", PROFILES, port=free_port(),
                             settings={"ROUTER_MAX_BODY_BYTES": str(MAX_BODY)})
    # Each engine has its own port (in the profile: .env's would win).
    dotenv = root / ".env"
    dotenv.write_text("".join(line for line in dotenv.read_text().splitlines(keepends=True)
                              if not line.startswith("VLLM_PORT=")))
    for name in PROFILES:
        with (root / "env" / "models" / f"{name}.env").open("a") as handle:
            handle.write(f"VLLM_PORT={free_port()}\n")
    running = Router(root)
    try:
        yield running
    finally:
        if running.proc.poll() is None:
            running.proc.send_signal(signal.SIGTERM)
            try:
                running.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                running.proc.kill()
        for pid in engine_processes(root):  # whatever a failed stop left behind
            os.kill(pid, signal.SIGKILL)


# --- what the SDK parses ---------------------------------------------------------------------


def test_models_list(router: Router) -> None:
    models = router.client().models.list()
    assert [m.id for m in models.data] == list(PROFILES)
    assert {m.object for m in models.data} == {"model"} and {m.owned_by for m in models.data} == {"vllm"}


def test_chat_completion(router: Router) -> None:
    answer = router.client().chat.completions.create(model="sim-a", messages=HELLO, max_tokens=24)
    assert answer.model == "sim-a" and answer.object == "chat.completion"
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 24
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 24


def test_streaming_chat_with_the_final_usage_chunk(router: Router) -> None:
    stream = router.client().chat.completions.create(
        model="sim-a", messages=HELLO, max_tokens=30, stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chunks = list(stream)
    assert len(chunks) >= 30 and {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 30  # one word a token, thinking off: all of it is content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]  # include_usage: a last chunk with no choices and the totals
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 30
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_plain_and_streamed(router: Router) -> None:
    client = router.client()
    answer = client.completions.create(model="sim-a", prompt="once upon a time", max_tokens=12)
    assert answer.object == "text_completion" and answer.model == "sim-a"
    assert len(answer.choices[0].text.split()) == 12 and answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="sim-a", prompt="once upon a time",
                                            max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == answer.choices[0].text  # same seed
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_tool_call_parsed_by_the_sdk_plain_and_streamed(router: Router) -> None:
    client = router.client()
    asked: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "what is the weather? use get_weather"}]
    answer = client.chat.completions.create(model="sim-a", messages=asked, tools=[WEATHER],
                                            tool_choice="auto", max_tokens=200)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and isinstance(calls[0], ChatCompletionMessageToolCall)
    call = calls[0]
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == WEATHER_ARGUMENTS
    # Streamed: the name and id in the first delta, the arguments in pieces after it.
    stream = client.chat.completions.create(model="sim-a", messages=asked, tools=[WEATHER],
                                            tool_choice="required", max_tokens=200, stream=True)
    deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert len(deltas) >= 3 and all(isinstance(d, ChoiceDeltaToolCall) for d in deltas)
    assert {d.index for d in deltas} == {0}
    first = deltas[0]
    assert first.id and first.type == "function" and first.function is not None
    assert first.function.name == "get_weather"
    assert all(d.id is None and d.function is not None and d.function.name is None
               for d in deltas[1:])
    arguments = "".join((d.function.arguments or "") for d in deltas if d.function is not None)
    assert json.loads(arguments) == WEATHER_ARGUMENTS


# --- errors as the SDK's exception classes --------------------------------------------------


def test_an_unknown_model_is_not_found_with_the_message(router: Router) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        router.client(max_retries=0).chat.completions.create(model="nope", messages=HELLO)
    assert raised.value.status_code == 404
    assert "The model `nope` does not exist." in raised.value.message
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "model"
    assert "sim-a, sim-bad, sim-retry" in raised.value.body["message"]


def test_a_body_over_the_limit_is_413(router: Router) -> None:
    big: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * (MAX_BODY // 4)}]
    with pytest.raises(openai.APIStatusError) as raised:
        router.client(max_retries=0).chat.completions.create(model="sim-a", messages=big)
    assert raised.value.status_code == 413
    assert "ROUTER_MAX_BODY_BYTES" in raised.value.message


def test_no_token_is_an_authentication_error(router: Router) -> None:
    for key in ("", "not-the-router-token"):
        client = openai.OpenAI(base_url=router.url + "/v1", api_key=key or "unset", max_retries=0)
        # "": the SDK sends no Authorization header at all
        headers: dict[str, Any] = {"Authorization": openai.Omit()} if not key else {}
        with pytest.raises(openai.AuthenticationError) as raised:
            client.chat.completions.create(model="sim-a", messages=HELLO, extra_headers=headers)
        assert raised.value.status_code == 401 and "ROUTER_TOKEN" in raised.value.message


def test_a_broken_profile_is_503_with_the_diagnosis(router: Router) -> None:
    with pytest.raises(openai.InternalServerError) as raised:
        router.client(max_retries=0).chat.completions.create(model="sim-bad", messages=HELLO)
    error = raised.value
    assert error.status_code == 503 and "sim-bad could not be loaded" in error.message
    assert isinstance(error.body, dict)
    assert "out of memory for the KV cache" in error.body["diagnosis"]["cause"]
    assert "VLLM_GPU_MEM_UTIL" in error.body["diagnosis"]["fix"]
    assert router.client().chat.completions.create(model="sim-a", messages=HELLO,
                                                   max_tokens=2).choices[0].message


# --- retries and timeouts -------------------------------------------------------------------


def test_one_sdk_call_with_retries_boots_a_broken_profile_at_most_once(router: Router) -> None:
    # Issue 35 row 12: a failed load is remembered for ROUTER_LOAD_BACKOFF and answered at once,
    # with Retry-After, so the SDK's own retries (max_retries=2) never boot the profile again.
    client = router.client()
    assert client.chat.completions.create(model="sim-a", messages=HELLO, max_tokens=2).choices
    sent: list[str] = []
    counting = openai.DefaultHttpxClient(
        event_hooks={"request": [lambda request: sent.append(request.url.path)]})
    sdk = router.client(max_retries=2, http_client=counting)
    before = router.boots("sim-retry")
    with pytest.raises(openai.InternalServerError) as raised:
        sdk.chat.completions.create(model="sim-retry", messages=HELLO)
    assert raised.value.status_code == 503 and isinstance(raised.value.body, dict)
    assert "out of memory for the KV cache" in raised.value.body["diagnosis"]["cause"]
    assert sent, "the SDK sent nothing"
    assert router.boots("sim-retry") - before <= 1, f"{len(sent)} requests:\n{router.output()}"
    # Within the back-off a second call is answered at once with the same diagnosis, and the
    # awake model is left alone (the first boot may have put it away: the two do not fit).
    assert client.chat.completions.create(model="sim-a", messages=HELLO, max_tokens=2).choices
    began = time.monotonic()
    with pytest.raises(openai.InternalServerError) as again:
        sdk.chat.completions.create(model="sim-retry", messages=HELLO)
    assert time.monotonic() - began < 2.0
    assert isinstance(again.value.body, dict)
    assert again.value.body["diagnosis"]["cause"] == raised.value.body["diagnosis"]["cause"]
    assert "ROUTER_LOAD_BACKOFF" in again.value.body["diagnosis"]["fix"]
    assert again.value.response.headers.get("retry-after", "").isdigit()
    assert router.boots("sim-retry") - before <= 1, router.output()
    assert router.health()["engines"]["sim-a"]["state"] == "ready"


def test_a_timeout_shorter_than_a_slow_stream_then_the_router_keeps_serving(router: Router) -> None:
    client = router.client()
    assert client.chat.completions.create(model="sim-a", messages=HELLO, max_tokens=2).choices
    # 5,000 words: 2.5 s of prefill before the stream's first byte after its head
    slow: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * 5000}]
    began = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        stream = router.client(timeout=0.5, max_retries=0).chat.completions.create(
            model="sim-a", messages=slow, max_tokens=4, stream=True)
        for _ in stream:
            pass
    assert time.monotonic() - began < 2.0  # the SDK's timeout, not the end of the stream
    # The router let the engine's request go and serves the next one as usual.
    wait_for(lambda: router.health()["inflight"] == 0, timeout=10, what="the cut stream ends")
    answer = client.chat.completions.create(model="sim-a", messages=HELLO, max_tokens=3)
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    assert router.proc.poll() is None

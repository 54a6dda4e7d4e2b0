"""The simulator's timing is the configured truth, so benchmark clients can be checked against it.

One measurement each with generous bounds (the machine is shared); the benchmark helper checks
the 1 % precision with many samples.
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time

from helpers import wait_for
from simulator.client import call, stream
from simulator.fixture import run_simulator


def content_times(lines: list[tuple[float, str]]) -> list[float]:
    """Arrival times of the chunks that carry generated text (not role, usage or [DONE])."""
    out = []
    for t, line in lines:
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            continue
        event = json.loads(payload)
        if not event["choices"]:
            continue
        choice = event["choices"][0]
        delta = choice.get("delta", {})
        if choice.get("text") or delta.get("content") or delta.get("reasoning"):
            out.append(t)
    return out


def test_ttft_and_inter_token_latency_follow_the_settings() -> None:
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "100", "SIM_PREFILL_TPS": "2000",
           "SIM_ITL_MS": "20"}
    with run_simulator(env=env, argv=["--no-enable-prefix-caching"]) as sim:
        prompt = " ".join(["tok"] * 400)  # 400 prompt tokens -> 200 ms of prefill
        got = stream(sim.url, "/v1/completions", {"prompt": prompt, "max_tokens": 51})
    times = content_times(got.lines)
    assert len(times) == 51
    assert abs(times[0] - 0.300) < 0.05
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert abs(statistics.mean(gaps) - 0.020) < 0.002
    # absolute deadlines: the last token lands at TTFT + 50 steps, no drift
    assert abs((times[-1] - times[0]) - 50 * 0.020) < 0.02


def test_role_chunk_comes_early_when_asked() -> None:
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "50", "SIM_ROLE_DELAY_MS": "300",
           "SIM_ITL_MS": "5"}
    with run_simulator(env=env) as sim:
        got = stream(sim.url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    role_at = got.lines[0][0]
    first_token_at = content_times(got.lines)[0]
    assert '"role":"assistant"' in got.lines[0][1]
    assert abs((first_token_at - role_at) - 0.300) < 0.05
    assert abs(first_token_at - 0.350) < 0.06


def test_several_tokens_per_chunk_like_speculative_decoding() -> None:
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "1", "SIM_ITL_MS": "1",
           "SIM_TOKENS_PER_CHUNK": "4"}
    with run_simulator(env=env) as sim:
        events = stream(sim.url, "/v1/completions", {
            "prompt": "go", "max_tokens": 10,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).events()
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == [1, 5, 9, 10]  # the first token alone, then steps of 4
    assert [len(e["choices"][0]["text"].split()) for e in events if e["choices"]] == [1, 4, 4, 1]


def test_max_num_seqs_makes_extra_requests_wait() -> None:
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "10", "SIM_ITL_MS": "10"}
    with run_simulator(env=env, argv=["--max-num-seqs", "2", "--served-model-name", "m"]) as sim:
        durations: list[float] = []

        def one() -> None:
            started = time.monotonic()
            call(sim.url, "/v1/completions", {"prompt": "wait", "max_tokens": 40})
            durations.append(time.monotonic() - started)

        threads = [threading.Thread(target=one) for _ in range(4)]
        for thread in threads:
            thread.start()
        seen: list[str] = []

        def two_waiting() -> bool:  # each request runs 0.4 s: none is done by then
            seen.append(call(sim.url, "/metrics").body.decode())
            return 'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0' in seen[-1]

        wait_for(two_waiting, what="two requests waiting for a slot")
        metrics = seen[-1]
        load = call(sim.url, "/load").json()
        for thread in threads:
            thread.join()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 2.0' in metrics
    assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0' in metrics
    assert load == {"server_load": 4}
    one_request = 0.010 + 39 * 0.010
    assert max(durations) > 1.8 * one_request  # the last two waited for a slot
    assert min(durations) < 1.4 * one_request


def test_prefix_cache_hits_shorten_prefill() -> None:
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "0", "SIM_PREFILL_TPS": "1000",
           "SIM_ITL_MS": "1"}
    prompt = " ".join(f"w{i}" for i in range(320))  # 20 blocks of 16 tokens
    with run_simulator(env=env) as sim:
        cold = content_times(stream(sim.url, "/v1/completions",
                                    {"prompt": prompt, "max_tokens": 1}).lines)[0]
        warm = content_times(stream(sim.url, "/v1/completions",
                                    {"prompt": prompt, "max_tokens": 1}).lines)[0]
    assert abs(cold - 0.320) < 0.05
    assert warm < 0.05  # 304 of 320 tokens came from the cache: 16 computed

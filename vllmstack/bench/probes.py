"""Regression probes: small live experiments that each guard one known failure of a serving stack.

Exit codes: 0 pass, 1 fail, 2 inconclusive (the probe could not reach its question, e.g. the model
made no tool call or the server exposes no prefix-cache counters).

* itl-stall        decoders keep streaming while one huge prompt is prefilled; the choke ratio is
                   p99 of their inter-token gaps during that prefill / p50 before it
* tool-truncation  a tool call cut by max_tokens must look the same streamed and non-streamed
* thinkoff         with thinking turned off (by each supported route) the answer is in `content`,
                   not in reasoning, and the stream says the same as the non-streamed answer
* prefix-cache     a multi-turn chat must reuse the previous turns from the prefix cache
                   (hits measured from /metrics counters)
* multi-image      several large images in one message are accepted and answered (the images are
                   drawn locally; nothing is downloaded)
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from vllmstack.bench.client import ChatClient, EndpointError, RequestResult, chat_body
from vllmstack.bench.png import Canvas, text_width
from vllmstack.bench.prompts import PromptBuilder, load_corpus
from vllmstack.bench.stats import percentile
from vllmstack.bench.verdict import FAIL, INFO, PASS, Verdict
from vllmstack.observe.metrics import MetricsError, MetricsSnapshot, parse_metrics

Progress = Callable[[str], None]
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
# Ways to turn thinking off that a client may use; each must put the answer in `content`.
THINKOFF_ROUTES: dict[str, dict[str, Any]] = {
    "enable_thinking=false": THINKING_OFF,
    "reasoning_effort=none": {"reasoning_effort": "none"},
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


@dataclass
class ProbeContext:
    client: ChatClient
    model: str
    builder: PromptBuilder | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    progress: Progress = print

    def param(self, key: str, default: Any) -> Any:
        value = self.params.get(key)
        return default if value is None else value

    async def metrics(self) -> MetricsSnapshot | None:
        try:
            return parse_metrics(await self.client.get_text("/metrics"))
        except (EndpointError, MetricsError):
            return None


def _message_text(data: dict[str, Any] | None) -> tuple[str, str, list[tuple[str, str]], str]:
    """content, reasoning, [(tool name, arguments)], finish_reason of a non-streamed answer."""
    if not data or not data.get("choices"):
        return "", "", [], ""
    choice = data["choices"][0]
    message = choice.get("message") or {}
    calls = [((c.get("function") or {}).get("name") or "",
              (c.get("function") or {}).get("arguments") or "")
             for c in message.get("tool_calls") or []]
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    return message.get("content") or "", reasoning, calls, choice.get("finish_reason") or ""


def _stream_calls(result: RequestResult) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for c in result.tool_calls]


# --- itl-stall ------------------------------------------------------------------------------


def stall_windows(
    victims: list[RequestResult], fired: float, prefilled: float
) -> tuple[list[float], list[float], list[float]]:
    """Per-token gaps (s) of the victims before, during and after the big prefill.

    A gap belongs to "during" when it overlaps [fired, prefilled]: the gap that spans the end of
    the prefill is the stall itself and must be counted.
    """
    before: list[float] = []
    during: list[float] = []
    after: list[float] = []
    for r in victims:
        times, counts = r.chunk_times, r.chunk_tokens
        for i in range(1, min(len(times), len(counts))):
            k = max(1, counts[i])
            gap = (times[i] - times[i - 1]) / k
            start, end = times[i - 1], times[i]
            if end <= fired:
                before.extend([gap] * k)
            elif start >= prefilled:
                after.extend([gap] * k)
            else:
                during.extend([gap] * k)
    return before, during, after


async def probe_itl_stall(ctx: ProbeContext) -> Verdict:
    v = Verdict("itl-stall")
    if ctx.builder is None:
        return v.inconclusive("needs the model tokenizer (--tokenizer) to size the big prompt")
    seqs = ctx.max_num_seqs or 2
    victims = int(ctx.param("victims", max(1, min(seqs - 1, 8))))
    window = ctx.max_model_len or 8192
    bully_tokens = int(ctx.param("bully_tokens", max(256, min(131072, window - 256))))
    victim_prompt = int(ctx.param("victim_prompt", 256))
    victim_tokens = int(ctx.param("victim_tokens", 2048))
    fire_at = int(ctx.param("fire_at", 32))
    max_choke = float(ctx.param("max_choke", 10.0))
    if bully_tokens + 1 > window:
        return v.inconclusive(f"bully prompt {bully_tokens} does not fit max_model_len {window}")
    if victims + 1 > seqs:
        v.add("slots", f"{victims} victims + 1 > max_num_seqs {seqs}", INFO,
              "the big prompt queues until a victim finishes")
    bully_text = ctx.builder.build(bully_tokens - 64).text  # room for the chat template
    results = [RequestResult() for _ in range(victims)]
    stop = asyncio.Event()
    tasks = []
    for i in range(victims):
        prompt = ctx.builder.build(victim_prompt).text + "\nContinue this text at length."
        body = chat_body(ctx.model, [{"role": "user", "content": prompt}], victim_tokens,
                         extra=THINKING_OFF)
        tasks.append(asyncio.create_task(ctx.client.stream_chat(body, result=results[i],
                                                                stop=stop)))
    try:
        deadline = time.perf_counter() + float(ctx.param("start_timeout_s", 300))
        while min(r.tokens for r in results) < fire_at:
            if any(t.done() for t in tasks) or time.perf_counter() > deadline:
                stop.set()
                await asyncio.gather(*tasks)
                errors = [r.error for r in results if r.error]
                return v.inconclusive("victims did not start streaming: "
                                      + (errors[0] if errors else "finished or timed out early"))
            await asyncio.sleep(0.01)
        ctx.progress(f"{victims} victim(s) streaming; sending the {bully_tokens}-token prompt")
        fired = time.perf_counter()
        bully = await ctx.client.stream_chat(chat_body(
            ctx.model, [{"role": "user", "content": bully_text + "\nWhat is 19*21?"}], 1,
            extra=THINKING_OFF))
        prefilled = bully.t_first_token or time.perf_counter()
        await asyncio.sleep(float(ctx.param("after_s", 1.0)))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not bully.ok:
        return v.inconclusive(f"the big prompt failed: {bully.error}")
    if any(r.t_end and r.t_end < prefilled and not r.stopped for r in results):
        return v.inconclusive("a victim finished before the big prefill ended; raise "
                              "--victim-tokens")
    before, during, after = stall_windows(results, fired, prefilled)
    v.details = {"victims": victims, "bully_tokens": bully.prompt_tokens,
                 "bully_ttft_ms": (prefilled - fired) * 1000,
                 "before_n": len(before), "during_n": len(during), "after_n": len(after)}
    v.add("big prompt", f"{bully.prompt_tokens} tokens, TTFT {(prefilled - fired) * 1000:.0f} ms",
          INFO)
    if len(before) < 10 or not during:
        return v.inconclusive(f"too few samples (before {len(before)}, during {len(during)}); "
                              "raise --bully-tokens or --victim-tokens")
    before.sort()
    during.sort()
    p50_before = percentile(before, 50)
    p99_during = percentile(during, 99)
    choke = p99_during / p50_before if p50_before > 0 else float("inf")
    v.details.update({"p50_before_ms": p50_before * 1000, "p99_during_ms": p99_during * 1000,
                      "max_during_ms": during[-1] * 1000, "choke": choke})
    v.add("victim ITL p50 before", f"{p50_before * 1000:.1f} ms", INFO)
    v.add("victim ITL p99 during", f"{p99_during * 1000:.1f} ms", INFO,
          f"max {during[-1] * 1000:.1f} ms over {len(during)} tokens")
    if after:
        after.sort()
        v.add("victim ITL p50 after", f"{percentile(after, 50) * 1000:.1f} ms", INFO)
    v.expect("choke ratio p99(during)/p50(before)", choke <= max_choke, f"{choke:.2f}",
             f"limit {max_choke:g}")
    return v


# --- tool-truncation --------------------------------------------------------------------------


def _tool_body(model: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    messages = [{"role": "user", "content":
                 "What is the weather in Paris right now, in celsius? Call get_weather."}]
    body = chat_body(model, messages, max_tokens, exact=False, extra=extra)
    body["tools"] = [WEATHER_TOOL]
    body["tool_choice"] = "auto"
    return body


async def probe_tool_truncation(ctx: ProbeContext) -> Verdict:
    v = Verdict("tool-truncation")
    extra = dict(ctx.param("extra_body", THINKING_OFF))
    full = await ctx.client.stream_chat(_tool_body(ctx.model, 1024, extra))
    if not full.ok:
        return v.inconclusive(f"the full tool call failed: {full.error}")
    if not full.tool_calls or not full.tool_calls[0]["name"]:
        return v.inconclusive("the model made no tool call (check --tool-call-parser and "
                              "--enable-auto-tool-choice)")
    total = full.completion_tokens or full.tokens
    v.add("full call", f"{full.tool_calls[0]['name']} {full.tool_calls[0]['arguments'][:40]}",
          INFO, f"{total} tokens")
    cuts = _cut_points(total, full)
    if not cuts:
        return v.inconclusive("the tool call is too short to cut")
    for label, cut in cuts:
        streamed = await ctx.client.stream_chat(_tool_body(ctx.model, cut, extra))
        _status, data, error = await ctx.client.chat(_tool_body(ctx.model, cut, extra))
        if not streamed.ok or error:
            v.add(f"{label} (max_tokens {cut})", streamed.error or error, FAIL)
            continue
        content, _, calls, finish = _message_text(data)
        s_calls = _stream_calls(streamed)
        same = (finish == (streamed.finish_reason or "") and content == streamed.content
                and calls == s_calls)
        leak = "<tool_call>" in content or "<tool_call>" in streamed.content
        detail = "" if same else (f"non-stream {finish}/{calls!r} vs stream "
                                  f"{streamed.finish_reason}/{s_calls!r}")
        v.expect(f"{label} (max_tokens {cut}) parity", same, "same" if same else "DIFFERENT",
                 detail[:200])
        v.expect(f"{label} no <tool_call> leak", not leak, "clean" if not leak else "leaked")
    return v


def _cut_points(total: int, full: RequestResult) -> list[tuple[str, int]]:
    """max_tokens values that cut the call mid-arguments, just before its end, and early."""
    cuts: list[tuple[str, int]] = []
    if total >= 4:
        cuts.append(("mid-arguments", max(2, total * 2 // 3)))
    if total >= 3:
        cuts.append(("just before the end", total - 2))
    if total >= 6:
        cuts.append(("early", max(1, total // 4)))
    seen: set[int] = set()
    unique = []
    for label, cut in cuts:
        if cut not in seen and 0 < cut < total:
            seen.add(cut)
            unique.append((label, cut))
    return unique


# --- thinkoff -----------------------------------------------------------------------------------


async def probe_thinkoff(ctx: ProbeContext) -> Verdict:
    v = Verdict("thinkoff")
    question = str(ctx.param("question", "What is 17*23? Reply with the number only."))
    expect = str(ctx.param("expect", "391"))
    max_tokens = int(ctx.param("max_tokens", 256))
    routes = ctx.param("routes", list(THINKOFF_ROUTES))
    messages = [{"role": "user", "content": question}]
    _, control, error = await ctx.client.chat(
        chat_body(ctx.model, messages, max_tokens, exact=False, stream=False))
    if error:
        return v.inconclusive(f"the control request failed: {error}")
    content, reasoning, _, _ = _message_text(control)
    v.add("control (thinking default)", f"content {len(content)} chars, reasoning "
          f"{len(reasoning)} chars", INFO)
    for route in routes:
        extra = THINKOFF_ROUTES.get(route)
        if extra is None:
            v.add(route, "unknown route", FAIL, f"known: {', '.join(THINKOFF_ROUTES)}")
            continue
        body = chat_body(ctx.model, messages, max_tokens, exact=False, extra=extra)
        _status, data, error = await ctx.client.chat(body)
        if error:
            v.add(f"{route}: request", error, FAIL)
            continue
        content, reasoning, _, _finish = _message_text(data)
        v.expect(f"{route}: answer in content", bool(content.strip()),
                 repr(content.strip()[:40]) if content.strip() else "EMPTY")
        v.expect(f"{route}: no reasoning", not reasoning.strip(),
                 "none" if not reasoning.strip() else f"{len(reasoning)} chars")
        if expect:
            v.add(f"{route}: contains {expect!r}", "yes" if expect in content else "no", INFO,
                  "model quality, not the thinking switch")
        streamed = await ctx.client.stream_chat(body)
        if not streamed.ok:
            v.add(f"{route}: stream", streamed.error, FAIL)
            continue
        same = streamed.content == content and not streamed.reasoning.strip()
        v.expect(f"{route}: stream equals non-stream", same, "same" if same else "DIFFERENT",
                 "" if same else f"{streamed.content[:40]!r} vs {content[:40]!r}")
    return v


# --- prefix-cache -------------------------------------------------------------------------------


async def probe_prefix_cache(ctx: ProbeContext) -> Verdict:
    v = Verdict("prefix-cache")
    turns = int(ctx.param("turns", 4))
    min_reuse = float(ctx.param("min_reuse", 0.5))
    snap = await ctx.metrics()
    if snap is None or snap.prefix_cache_hits is None:
        return v.inconclusive("/metrics has no vllm:prefix_cache_hits counter")
    enabled = snap.cache_config.get("enable_prefix_caching")
    if enabled is not None and enabled.lower() != "true":
        return v.inconclusive("prefix caching is off on this server (enable_prefix_caching="
                              f"{enabled})")
    if ctx.builder is not None:
        opening = ctx.builder.build(int(ctx.param("context_tokens", 1024))).text
    else:
        opening = "\n\n".join(load_corpus()[:6])
    messages: list[dict[str, Any]] = [{"role": "user", "content": opening
                                       + "\n\nRemember the code word LANTERN. Summarise the "
                                         "text above in two sentences."}]
    questions = ["Which topic in the text did you find most interesting, and why?",
                 "Give the text a short title.", "List three places mentioned in the text.",
                 "What was the code word I gave you?"]
    previous_prompt = 0
    reused = reusable = 0.0
    for turn in range(1, turns + 1):
        before = await ctx.metrics()
        _status, data, error = await ctx.client.chat(
            chat_body(ctx.model, messages, int(ctx.param("max_tokens", 64)), exact=False,
                      stream=False, extra=THINKING_OFF))
        after = await ctx.metrics()
        if error or data is None:
            v.add(f"turn {turn}", error, FAIL)
            return v
        prompt_tokens = int((data.get("usage") or {}).get("prompt_tokens") or 0)
        hits = _delta(before, after, "hits")
        queries = _delta(before, after, "queries")
        if hits is None:
            return v.inconclusive("prefix-cache counters disappeared between scrapes")
        if turn == 1:
            v.add("turn 1", f"{prompt_tokens} prompt tokens, {hits:.0f} hits", INFO)
        else:
            reused += hits
            reusable += previous_prompt
            share = hits / previous_prompt if previous_prompt else 0.0
            v.add(f"turn {turn}", f"{hits:.0f}/{previous_prompt} earlier tokens reused "
                  f"({share:.0%})", INFO, f"queries {queries or 0:.0f}")
        previous_prompt = prompt_tokens
        content, _, _, _ = _message_text(data)
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": questions[(turn - 1) % len(questions)]})
    if reusable <= 0:
        return v.inconclusive("no follow-up turns ran")
    rate = reused / reusable
    v.details = {"reused_tokens": reused, "reusable_tokens": reusable, "reuse": rate}
    v.expect("incremental hit rate (turns 2+)", rate >= min_reuse, f"{rate:.0%}",
             f"limit {min_reuse:.0%}")
    return v


def _delta(before: MetricsSnapshot | None, after: MetricsSnapshot | None,
           which: str) -> float | None:
    if before is None or after is None:
        return None
    old = before.prefix_cache_hits if which == "hits" else before.prefix_cache_queries
    new = after.prefix_cache_hits if which == "hits" else after.prefix_cache_queries
    if old is None or new is None:
        return None
    return new - old


# --- multi-image --------------------------------------------------------------------------------


PALETTE = [(200, 60, 60), (60, 140, 200), (70, 170, 90), (210, 160, 40), (140, 80, 180),
           (40, 160, 160), (220, 110, 160), (110, 110, 110)]
WORDS = ["QUARTZ 7391", "HARBOUR 2048", "MAPLE 5120", "LANTERN 8814", "GLACIER 3306",
         "ORCHARD 6675", "BEACON 1429", "COMPASS 9057"]


def make_probe_image(index: int, width: int, height: int) -> bytes:
    """A PNG with a colour gradient, a frame and a large label that a vision model can read."""
    base = PALETTE[index % len(PALETTE)]
    canvas = Canvas(width, height)
    for y in range(height):
        shade = y / max(1, height - 1)
        color = tuple(int(c + (255 - c) * shade * 0.7) for c in base)
        canvas.fill_rect(0, y, width, y + 1, (color[0], color[1], color[2]))
    canvas.fill_rect(0, 0, width, 8, (0, 0, 0))
    canvas.fill_rect(0, height - 8, width, height, (0, 0, 0))
    label = WORDS[index % len(WORDS)]
    scale = max(2, min(width // (text_width(label) + 4), height // 20))
    x = (width - text_width(label, scale)) // 2
    canvas.text(x, height // 2 - 4 * scale, label, (255, 255, 255), scale)
    small = max(2, scale // 3)
    canvas.text(16, 24, f"IMAGE {index + 1}", (0, 0, 0), small)
    return canvas.to_png(level=1)


async def probe_multi_image(ctx: ProbeContext) -> Verdict:
    v = Verdict("multi-image")
    count = int(ctx.param("images", 4))
    width = int(ctx.param("width", 1024))
    height = int(ctx.param("height", 768))
    parts: list[dict[str, Any]] = [{"type": "text", "text":
                                    f"There are {count} images. Read the large words in each "
                                    "image and list them, one line per image."}]
    for i in range(count):
        encoded = base64.b64encode(make_probe_image(i, width, height)).decode()
        parts.append({"type": "image_url",
                      "image_url": {"url": f"data:image/png;base64,{encoded}"}})
    body = chat_body(ctx.model, [{"role": "user", "content": parts}],
                     int(ctx.param("max_tokens", 128)), exact=False, stream=False,
                     extra=THINKING_OFF)
    started = time.perf_counter()
    status, data, error = await ctx.client.chat(body)
    elapsed = time.perf_counter() - started
    if error:
        lowered = error.lower()
        if status == 400 and ("image" in lowered or "multimodal" in lowered):
            return v.inconclusive(f"the model does not take images: {error[:160]}")
        v.add("request", error[:200], FAIL, f"after {elapsed:.1f} s")
        return v
    content, reasoning, _, finish = _message_text(data)
    usage = (data or {}).get("usage") or {}
    v.add("images", f"{count} x {width}x{height} PNG", INFO,
          f"{usage.get('prompt_tokens', '?')} prompt tokens, {elapsed:.1f} s")
    answer = (content or reasoning).strip()
    v.expect("answer", bool(answer), repr(answer[:60]) if answer else "EMPTY",
             f"finish {finish}")
    found = sum(1 for w in WORDS[:count] if w.split()[0].lower() in answer.lower())
    v.add("words read back", f"{found}/{count}", INFO, "model quality, not the serving path")
    return v


PROBES: dict[str, Callable[[ProbeContext], Awaitable[Verdict]]] = {
    "itl-stall": probe_itl_stall,
    "tool-truncation": probe_tool_truncation,
    "thinkoff": probe_thinkoff,
    "prefix-cache": probe_prefix_cache,
    "multi-image": probe_multi_image,
}


async def run_probe(name: str, ctx: ProbeContext) -> Verdict:
    probe = PROBES.get(name)
    if probe is None:
        raise KeyError(f"unknown probe {name!r}; known probes: {', '.join(PROBES)}")
    verdict = await probe(ctx)
    if verdict.verdict == PASS:
        ctx.progress(f"probe {name}: pass")
    return verdict

"""Regression probes: small live experiments that each guard one known failure of a serving stack.

itl-stall lives in `probe_stall`, prefix-cache in `probe_cache`; the shared context in
`probe_base`; their settings are declared in `params`.

Exit codes: 0 pass, 1 fail, 2 inconclusive (the probe could not reach its question, e.g. the model
made no tool call or the server exposes no prefix-cache counters).

* itl-stall        decoders keep streaming while one huge prompt is prefilled; the choke ratio is
                   p99 of their inter-token gaps during that prefill / p50 before it
* tool-truncation  a tool call cut by max_tokens must look the same streamed and non-streamed
* thinkoff         with thinking turned off (by each supported route) the answer is in `content`,
                   not in reasoning, and the stream says the same as the non-streamed answer
* prefix-cache     a multi-turn chat must reuse the previous turns from the prefix cache
                   (hits from /metrics counters, judged against the whole blocks reachable)
* multi-image      several large images in one message are accepted and answered (the images are
                   drawn locally; nothing is downloaded)
* depth-decay      decode t/s at depth 8K, 32K and 64K (capped by the window) as a share of the
                   8K figure; fails below a quarter of the roofline's share at the deepest
                   (`probe_decay`)
"""

from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable
from typing import Any

from vllmstack.bench.client.client import RequestResult, chat_body
from vllmstack.bench.probes.probe_base import THINKING_OFF, ProbeContext, message_text
from vllmstack.bench.probes.probe_cache import probe_prefix_cache
from vllmstack.bench.probes.probe_decay import probe_depth_decay
from vllmstack.bench.probes.probe_stall import probe_itl_stall, stall_windows
from vllmstack.bench.probes.verdict import FAIL, INFO, PASS, Verdict
from vllmstack.bench.report.png import Canvas, text_width

__all__ = ["PROBES", "THINKING_OFF", "ProbeContext", "make_probe_image", "run_probe",
           "stall_windows"]

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


def _stream_calls(result: RequestResult) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for c in result.tool_calls]


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
        content, _, calls, finish = message_text(data)
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
    content, reasoning, _, _ = message_text(control)
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
        content, reasoning, _, _finish = message_text(data)
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
    content, reasoning, _, finish = message_text(data)
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
    "depth-decay": probe_depth_decay,
}


async def run_probe(name: str, ctx: ProbeContext) -> Verdict:
    probe = PROBES.get(name)
    if probe is None:
        raise KeyError(f"unknown probe {name!r}; known probes: {', '.join(PROBES)}")
    verdict = await probe(ctx)
    if verdict.verdict == PASS:
        ctx.progress(f"probe {name}: pass")
    return verdict

"""The conversations `invoke template-check` renders, and what the model replies in them.

A conversation is a list of steps: request messages (dicts, as a client sends them) and
`Reply`s, what the model generates at an assistant turn. At a reply the checker renders the
prompt, writes the reply out as Qwen's models generate it (`generated_text`: reasoning closed by
</think>, content, tool calls in the parser's format, <|im_end|>), and appends what vLLM's
parsers hand back to the client (`echoed_message`), which is what the client sends next turn.

Together the conversations cover: a system message or none, many turns, tool definitions,
tool calls with `content: null`, parallel calls, long tool results (truncation shows), content
as a list of parts (text and an image), non-ASCII text, and both thinking modes.

Below them, the helpers that compare rendered text (`first_difference`, `around`, ...): what a
report shows of a rendering is bytes in repr, so nothing a template writes reaches a terminal raw.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllmstack.checks.tool_formats import ToolCall, read_calls, write_call

# Qwen's ChatML conventions: what the model emits around its reply.
ASSISTANT_HEADER = "<|im_start|>assistant\n"
END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CONTEXT_BYTES = 32  # bytes shown either side of a difference


@dataclass(frozen=True)
class Reply:
    """What the model generates at one assistant turn."""

    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCall, ...] = ()


Step = dict[str, Any] | Reply


@dataclass(frozen=True)
class Conversation:
    name: str
    steps: tuple[Step, ...]
    tools: tuple[dict[str, Any], ...] = ()
    description: str = ""

    @property
    def turns(self) -> int:
        return sum(isinstance(s, Reply) for s in self.steps)


def generated_text(prompt: str, reply: Reply, call_format: str, *, thinking: bool) -> str:
    """The bytes the model produces after `prompt`, end token included.

    A prompt ending in an open <think> gets the reasoning and </think>; one ending in a closed
    block (thinking off) gets the answer only; a prompt with neither gets a whole think block,
    as a Qwen3 model opens one itself (empty when thinking is off: nothing to think)."""
    reasoning = reply.reasoning if thinking else ""
    if prompt.endswith(THINK_OPEN + "\n"):
        text = f"{reasoning}\n{THINK_CLOSE}\n\n"
    elif prompt.rstrip("\n").endswith(THINK_CLOSE):
        text = ""
    else:
        text = f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n"
    body = reply.content
    for call in reply.calls:
        body += ("\n" if body else "") + write_call(call, call_format)
    return text + body + END


def echoed_message(output: str, call_format: str, *, thinking: bool,
                   reasoning_field: str = "reasoning_content",
                   tools: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """The assistant message a client gets back for `output` (the generated text) and sends
    in the next request: vLLM's qwen3 reasoning parser, then the tool parser, as they split it.

    Reasoning: everything before </think> (a generated <think> dropped). Content: the rest, up
    to the first tool call; null when empty. Tool calls: with `arguments` as a JSON string."""
    text = output.removesuffix(END)
    reasoning: str | None = None
    if THINK_OPEN in text:
        text = text.partition(THINK_OPEN)[2]
    if THINK_CLOSE in text:
        reasoning, _, text = text.partition(THINK_CLOSE)
    elif thinking:
        reasoning, text = text, ""
    calls = read_calls(text, call_format, tools) if "<tool_call>" in text else []
    content: str | None = text.split("<tool_call>")[0] if calls else text
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message[reasoning_field] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(calls)]
    return message


def tool_result(call_id: str, content: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _function(name: str, description: str, properties: Mapping[str, Any],
              required: tuple[str, ...]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": dict(properties), "required": list(required)}}}


TOOLS = (
    _function("get_weather", "Current weather and a three-day forecast for a city.",
              {"city": {"type": "string", "description": "City name, e.g. Zürich"},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ("city",)),
    _function("search_docs", "Full-text search over the team's design documents.",
              {"query": {"type": "string"},
               "limit": {"type": "integer", "description": "Most results to return"},
               "filters": {"type": "object", "description": "Field -> required value"}},
              ("query",)),
)

# Long enough that a template cutting tool results short is caught, varied enough (JSON, quotes,
# newlines, non-ASCII) that an escaping mistake shows.
LONG_RESULT = json.dumps({
    "city": "Zürich", "now": {"temp_c": 7.5, "sky": "overcast", "wind_kmh": 14},
    "forecast": [{"day": d, "high_c": 9 + i, "low_c": 2 + i, "note": f"day {i} \"dry\" → mild"}
                 for i, d in enumerate(["Tue", "Wed", "Thu"])],
    "stations": [f"ZH-{n:03d}: reading ok, last update 12:{n % 60:02d}" for n in range(60)],
}, ensure_ascii=False, indent=2)

SEARCH_RESULT = "\n".join(
    f"[{i}] design/{topic}.md: ... the {topic} section explains why the cache keys on the "
    f"full prefix, including the template's own tokens ..." for i, topic in
    enumerate(["prefix-cache", "router", "scheduler", "spec-decode", "kv-layout"], 1))

CORPUS: tuple[Conversation, ...] = (
    Conversation("chat", description="no system message, three turns", steps=(
        {"role": "user", "content": "What is a prefix cache, in one sentence?"},
        Reply("It keeps the attention keys and values of prompt prefixes it has seen, so a "
              "request starting the same way skips recomputing them.",
              "The user wants one sentence. Define it by what it saves."),
        {"role": "user", "content": "And why would a chat template break it?"},
        Reply("If the template renders an earlier turn differently from how the model produced "
              "it, the new prompt stops matching the cached one at that point.\n\nEverything "
              "after the first differing token is computed again.",
              "Think about byte identity of re-rendered history."),
        {"role": "user", "content": "Give me a one-line test for it."},
        Reply("`render(turn k) + reply == render(turn k+1)[:len(render(turn k) + reply)]`",
              "A prefix comparison."),
    )),
    Conversation("system-six-turns", description="a system message and six turns", steps=(
        {"role": "system", "content": "You are a terse assistant. Answer in at most two sentences."},
        *[step for i, (q, a, r) in enumerate([
            ("Name a prime above 100.", "101.", "101 is prime."),
            ("Is 221 prime?", "No: 221 = 13 × 17.", "Try 13: 13 × 17 = 221."),
            ("What is 2^10?", "1024.", "Powers of two."),
            ("Spell 'cache' backwards.", "ehcac.", "c-a-c-h-e reversed."),
            ("Which is larger, 0.1 + 0.2 or 0.3, in binary floating point?",
             "0.1 + 0.2 is slightly larger (0.30000000000000004).", "Rounding error."),
            ("Summarise our chat in five words.", "Primes, powers, strings, floats.", "List topics."),
        ]) for step in ({"role": "user", "content": q}, Reply(a, f"Turn {i + 1}: {r}"))],
    )),
    Conversation("tools", description="tools in the system turn, a call with content null, "
                 "long results, parallel calls", tools=TOOLS, steps=(
        {"role": "system", "content": "You help with weather and documents."},
        {"role": "user", "content": "How is the weather in Zürich?"},
        Reply("", "I need the weather tool for Zürich.",
              (ToolCall("get_weather", {"city": "Zürich", "unit": "celsius"}),)),
        tool_result("call_0", LONG_RESULT),
        Reply("It is 7.5 °C and overcast in Zürich; the next three days stay dry and mild.",
              "Summarise the tool result."),
        {"role": "user", "content": "Find our notes on prefix caching, and the weather in Oslo."},
        Reply("I'll look both up.", "Two independent calls.",
              (ToolCall("search_docs", {"query": "prefix caching", "limit": 5,
                                        "filters": {"folder": "design", "draft": False}}),
               ToolCall("get_weather", {"city": "Oslo"}))),
        tool_result("call_0", SEARCH_RESULT),
        tool_result("call_1", [{"type": "text", "text": "Oslo: -2 °C, light snow."}]),
        Reply("Five design notes mention prefix caching (the first: design/prefix-cache.md). "
              "Oslo has -2 °C and light snow.", "Combine both results."),
    )),
    Conversation("tools-no-system", description="tools without a system message", tools=TOOLS,
                 steps=(
        {"role": "user", "content": "Search the docs for 'router' and show two results."},
        Reply("", "One search call.", (ToolCall("search_docs", {"query": "router", "limit": 2}),)),
        tool_result("call_0", SEARCH_RESULT),
        Reply("Two hits: design/router.md and design/prefix-cache.md.", "Pick two."),
    )),
    Conversation("multimodal", description="content as a list of parts (text and an image)",
                 steps=(
        {"role": "system", "content": [{"type": "text", "text": "Describe images briefly."}]},
        {"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "text", "text": "Answer in one sentence."}]},
        Reply("A single white pixel on a transparent background.", "The image is tiny."),
        {"role": "user", "content": [{"type": "text", "text": "And its colour, as hex?"}]},
        Reply("#FFFFFF.", "White."),
    )),
)


# --- comparing rendered text (what the reports show of it is bytes, repr-quoted) ------------------

def first_difference(expected: str, got: str) -> str:
    """Where two texts part, in UTF-8 bytes, with what each has there."""
    a, b = expected.encode(), got.encode()
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    lo = max(0, at - CONTEXT_BYTES)
    return (f"first difference at byte {at}: expected {a[lo:at + CONTEXT_BYTES]!r}, "
            f"rendered {b[lo:at + CONTEXT_BYTES]!r}")


def around(text: str, at: int) -> str:
    return repr(text.encode()[max(0, at - CONTEXT_BYTES):at + CONTEXT_BYTES])


def short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def longest_prefix_in(text: str, haystack: str) -> int:
    """Bytes of the longest prefix of `text` found in `haystack` (where a cut happened)."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if text[:mid] in haystack else (lo, mid - 1)
    return len(text[:lo].encode())

"""Stability runs: smoke (does it answer at all), stress (sustained load, nothing lost) and long
(long context, output checked for token loops). Each prints a pass/fail table.

Token-loop detection looks at words: the share of word n-grams (6 words) that repeat an earlier
n-gram, and vocabulary richness (distinct / total words). A looping model repeats the same few
n-grams, so the repeat share goes towards 1; ordinary text, even text with a small vocabulary,
rarely repeats a 6-word sequence. Richness is reported (the old stability scripts used it) but
does not decide by default: it falls with length and vocabulary size, not only with loops.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllmstack.bench.client.client import RequestResult, chat_body
from vllmstack.bench.client.stats import summarize
from vllmstack.bench.probes.probes import ProbeContext
from vllmstack.bench.probes.verdict import FAIL, INFO, Verdict
from vllmstack.workload.prompts import load_corpus

Progress = Callable[[str], None]
MODES = ("smoke", "stress", "long")
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
WORD = re.compile(r"\w+", re.UNICODE)
ESSAY_TOPICS = ["lighthouses", "bread", "glaciers", "railway time", "bees", "maps", "tea",
                "printing", "volcanoes", "canals", "libraries", "orchestras", "rivers",
                "observatories", "translation", "soil"]


@dataclass
class LoopCheck:
    words: int
    richness: float  # distinct words / words
    repeat_share: float  # share of n-grams already seen earlier in the text
    looped: bool

    def describe(self) -> str:
        return (f"{self.words} words, richness {self.richness:.2f}, "
                f"repeated {self.repeat_share:.0%} of n-grams")


def check_loop(
    text: str, *, ngram: int = 6, max_repeat_share: float = 0.3, min_richness: float = 0.0,
    min_words: int = 30,
) -> LoopCheck:
    """Decide whether generated text is stuck in a token loop."""
    words = [w.lower() for w in WORD.findall(text)]
    if not words:
        return LoopCheck(0, 0.0, 0.0, False)
    richness = len(set(words)) / len(words)
    grams = [tuple(words[i:i + ngram]) for i in range(len(words) - ngram + 1)]
    seen: set[tuple[str, ...]] = set()
    repeats = 0
    for gram in grams:
        if gram in seen:
            repeats += 1
        else:
            seen.add(gram)
    share = repeats / len(grams) if grams else 0.0
    looped = len(words) >= min_words and (share > max_repeat_share or richness < min_richness)
    return LoopCheck(len(words), richness, share, looped)


# Stability runs talk to the server exactly as probes do.
StabilityContext = ProbeContext


async def run_smoke(ctx: StabilityContext) -> Verdict:
    v = Verdict("smoke")
    try:
        models = await ctx.client.models()
        names = [str(m.get("id")) for m in models]
        v.expect("model listed by /v1/models", ctx.model in names, ", ".join(names))
    except Exception as exc:  # EndpointError and anything the transport raises
        v.add("/v1/models", str(exc)[:120], FAIL)
        return v
    question = [{"role": "user", "content": "Name three colours of the rainbow."}]
    _status, data, error = await ctx.client.chat(
        chat_body(ctx.model, question, 32, exact=False, stream=False, extra=THINKING_OFF))
    if error or not data:
        v.add("non-streamed chat", error, FAIL)
    else:
        message = (data.get("choices") or [{}])[0].get("message") or {}
        text = (message.get("content") or message.get("reasoning") or "").strip()
        v.expect("non-streamed chat answers", bool(text), repr(text[:40]) if text else "EMPTY")
    streamed = await ctx.client.stream_chat(chat_body(ctx.model, question, 32,
                                                      extra=THINKING_OFF))
    if not streamed.ok:
        v.add("streamed chat", streamed.error, FAIL)
    else:
        v.expect("streamed chat answers", bool(streamed.text().strip()),
                 f"{streamed.tokens} tokens, TTFT {(streamed.ttft_s or 0) * 1000:.0f} ms")
        v.expect("exact length honoured (32 tokens)", streamed.completion_tokens == 32,
                 str(streamed.completion_tokens))
    return v


async def run_stress(ctx: StabilityContext) -> Verdict:
    """N workers x M requests; every request must come back complete and be counted."""
    workers = int(ctx.param("workers", 2))
    requests = int(ctx.param("requests", 200))
    max_tokens = int(ctx.param("max_tokens", 256))
    v = Verdict("stress")
    outcomes: dict[tuple[int, int], RequestResult] = {}
    started = time.perf_counter()

    async def worker(w: int) -> None:
        for i in range(requests):
            topic = ESSAY_TOPICS[(w * requests + i) % len(ESSAY_TOPICS)]
            prompt = f"Request {w}-{i}. Write a detailed essay about {topic}."
            body = chat_body(ctx.model, [{"role": "user", "content": prompt}], max_tokens,
                             exact=False, extra=THINKING_OFF)
            body["temperature"] = 0.7
            outcomes[(w, i)] = await ctx.client.stream_chat(body)
            done = len(outcomes)
            if done % max(1, (workers * requests) // 10) == 0:
                ctx.progress(f"stress: {done}/{workers * requests} requests")

    async with asyncio.TaskGroup() as group:
        for w in range(workers):
            group.create_task(worker(w))
    elapsed = time.perf_counter() - started
    expected = workers * requests
    ok = [r for r in outcomes.values() if r.ok]
    failed = [r for r in outcomes.values() if not r.ok]
    # Accounting: the usage the server reported must equal the tokens the stream delivered.
    short = [r for r in ok if r.completion_tokens is not None and r.completion_tokens != r.tokens]
    unfinished = [r for r in ok if not r.finish_reason]
    loops = [r for r in ok if check_loop(r.text()).looped]
    v.expect("requests accounted for", len(outcomes) == expected, f"{len(outcomes)}/{expected}")
    v.expect("requests succeeded", not failed, f"{len(ok)}/{expected}",
             _first_errors(failed))
    v.expect("streams complete (finish_reason set)", not unfinished,
             f"{len(ok) - len(unfinished)}/{len(ok)}")
    v.expect("usage matches streamed tokens", not short, f"{len(ok) - len(short)}/{len(ok)}")
    v.expect("no token loops", not loops, f"{len(loops)} looped")
    tokens = sum(r.tokens for r in ok)
    ttft = summarize([r.ttft_s * 1000 for r in ok if r.ttft_s is not None])
    v.add("throughput", f"{tokens / elapsed:.1f} tokens/s over {elapsed:.0f} s", INFO,
          f"TTFT p50 {ttft['p50']:.0f} ms, p99 {ttft['p99']:.0f} ms" if ttft else "")
    v.details = {"workers": workers, "requests": requests, "ok": len(ok), "failed": len(failed),
                 "elapsed_s": elapsed, "tokens": tokens,
                 "errors": sorted({r.error or "" for r in failed})[:10]}
    return v


def _first_errors(failed: list[RequestResult]) -> str:
    kinds: dict[str, int] = {}
    for r in failed:
        key = (r.error or "?")[:80]
        kinds[key] = kinds.get(key, 0) + 1
    return "; ".join(f"{n}x {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:3])


async def run_long(ctx: StabilityContext) -> Verdict:
    """Long context, long answers: each run must finish and must not loop."""
    v = Verdict("long")
    runs = int(ctx.param("runs", 3))
    max_tokens = int(ctx.param("max_tokens", 1024))
    window = ctx.max_model_len or 8192
    context = int(ctx.param("context_tokens", max(256, min(54000, window // 2))))
    if context + max_tokens + 256 > window:
        context = window - max_tokens - 256
        if context < 256:
            return v.inconclusive(f"max_model_len {window} leaves no room for a long context "
                                  f"and {max_tokens} output tokens; lower --max-tokens")
    v.add("context", f"{context} tokens, {max_tokens} output tokens, {runs} runs", INFO)
    for run in range(1, runs + 1):
        if ctx.builder is not None:
            text = ctx.builder.build(context).text
        else:
            paragraphs = load_corpus()
            text = "\n\n".join(paragraphs[i % len(paragraphs)]
                               for i in range(context // 90))  # ~90 tokens per paragraph
        prompt = (f"Section {run}.\n{text}\n\nWrite a long, detailed essay that connects the "
                  "themes of the passages above.")
        body = chat_body(ctx.model, [{"role": "user", "content": prompt}], max_tokens,
                         exact=False, extra=THINKING_OFF)
        body["temperature"] = float(ctx.param("temperature", 0.5))
        result = await ctx.client.stream_chat(body)
        if not result.ok:
            v.add(f"run {run}", result.error, FAIL)
            continue
        check = check_loop(result.text(), ngram=int(ctx.param("ngram", 6)),
                           max_repeat_share=float(ctx.param("max_repeat_share", 0.3)),
                           min_richness=float(ctx.param("min_richness", 0.0)))
        v.expect(f"run {run}: no token loop", not check.looped,
                 "loop" if check.looped else "ok", check.describe())
        ctx.progress(f"long run {run}/{runs}: {result.prompt_tokens} prompt tokens, "
                     f"{result.tokens} generated, {check.describe()}")
    return v


async def run_stability(mode: str, ctx: StabilityContext) -> Verdict:
    if mode == "smoke":
        return await run_smoke(ctx)
    if mode == "stress":
        return await run_stress(ctx)
    if mode == "long":
        return await run_long(ctx)
    raise KeyError(f"unknown stability mode {mode!r}; use one of {', '.join(MODES)}")

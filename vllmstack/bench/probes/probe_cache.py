"""prefix-cache: a multi-turn chat must reuse the previous turns from the prefix cache.

Hits are measured from the /metrics counters around each turn and judged against what the cache
can reach, not against the whole earlier prompt. vLLM reuses whole blocks only (the block that
holds the last prompt token is always computed), so the reachable prefix of a turn is the earlier
prompt rounded down to `block_size`, which `vllm:cache_config_info` reports. Two cases make it
smaller, both by design:
* With EAGLE/MTP speculative decoding the last matched block is dropped (the draft head needs its
  hidden states recomputed); the probe assumes so whenever spec-decode counters are exposed.
* Hybrid models (Mamba / Gated DeltaNet layers, `mamba_cache_mode` "align") can resume only where
  a layer state was saved: at the last whole block of the earlier prompt (one block earlier with
  EAGLE/MTP). Their blocks are large -- the attention page is stretched to the Mamba page, 416
  tokens on a Qwen3.6-27B at TP=2 -- so a 1,100-token turn reaches 416 tokens, which the old
  judgement (hits / earlier prompt) called a 38 % FAIL.
"""

from __future__ import annotations

from typing import Any

from vllmstack.bench.client.client import chat_body
from vllmstack.bench.probes.probe_base import THINKING_OFF, ProbeContext, message_text
from vllmstack.bench.probes.verdict import FAIL, INFO, Verdict
from vllmstack.observe.metrics import CacheLayout, MetricsSnapshot
from vllmstack.workload.prompts import load_corpus

QUESTIONS = ["Which topic in the text did you find most interesting, and why?",
             "Give the text a short title.", "List three places mentioned in the text.",
             "What was the code word I gave you?"]


def reachable_tokens(layout: CacheLayout, earlier_prompt: int, prompt: int) -> int:
    """The most prompt tokens of this turn the prefix cache can serve from the earlier turn."""
    block = layout.block_size or 1
    drop = block if layout.spec_decode else 0
    # Whole blocks of the shared prefix; the last prompt token is always computed.
    blocks = min(earlier_prompt, max(0, prompt - 1)) // block * block
    if layout.hybrid:
        # The layer state exists only where the earlier prefill stopped on a block boundary.
        blocks = min(blocks, earlier_prompt // block * block - drop)
    return max(0, blocks - (drop if not layout.hybrid else 0))


def describe_layout(layout: CacheLayout) -> str:
    unit = f"{layout.block_size}-token blocks" if layout.block_size else "blocks"
    spec = "; speculative decoding drops the last block" if layout.spec_decode else ""
    if layout.hybrid:
        return f"hybrid ({layout.mamba_cache_mode} mode), reuse in {unit}{spec}"
    return f"reuse in {unit}{spec}"


def _delta(before: MetricsSnapshot | None, after: MetricsSnapshot | None,
           which: str) -> float | None:
    if before is None or after is None:
        return None
    old = before.prefix_cache_hits if which == "hits" else before.prefix_cache_queries
    new = after.prefix_cache_hits if which == "hits" else after.prefix_cache_queries
    if old is None or new is None:
        return None
    return new - old


def _opening(ctx: ProbeContext, layout: CacheLayout) -> str:
    if ctx.builder is None:
        return "\n\n".join(load_corpus()[:6])
    # Big blocks (hybrids) need a longer opening to leave several whole blocks to reuse.
    block = layout.block_size or 16
    default = max(1024, block * (3 + (2 if layout.spec_decode else 0)))
    return ctx.builder.build(int(ctx.param("context_tokens", default))).text


async def probe_prefix_cache(ctx: ProbeContext) -> Verdict:
    v = Verdict("prefix-cache")
    turns = int(ctx.param("turns", 4))
    min_reuse = float(ctx.param("min_reuse", 0.9))
    snap = await ctx.metrics()
    if snap is None or snap.prefix_cache_hits is None:
        return v.inconclusive("/metrics has no vllm:prefix_cache_hits counter")
    layout = snap.cache_layout
    if layout.prefix_caching is False:
        return v.inconclusive("prefix caching is off on this server (enable_prefix_caching="
                              f"{snap.cache_config.get('enable_prefix_caching')})")
    v.add("cache layout", describe_layout(layout), INFO,
          "" if layout.block_size else "no block_size in vllm:cache_config_info: judged per token")
    messages: list[dict[str, Any]] = [{"role": "user", "content": _opening(ctx, layout)
                                       + "\n\nRemember the code word LANTERN. Summarise the "
                                         "text above in two sentences."}]
    previous_prompt = 0
    reused = reachable = 0.0
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
            can = reachable_tokens(layout, previous_prompt, prompt_tokens)
            reused += min(hits, can) if can else 0.0
            reachable += can
            share = f" ({hits / can:.0%})" if can else ""
            v.add(f"turn {turn}", f"{hits:.0f}/{previous_prompt} earlier tokens reused{share}",
                  INFO, f"{can} reachable, queries {queries or 0:.0f}")
        previous_prompt = prompt_tokens
        content, _, _, _ = message_text(data)
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": QUESTIONS[(turn - 1) % len(QUESTIONS)]})
    if reachable <= 0:
        return v.inconclusive("no whole block of an earlier turn was reachable; raise --param "
                              "context_tokens above a few blocks"
                              + (f" of {layout.block_size} tokens" if layout.block_size else ""))
    rate = reused / reachable
    v.details = {"reused_tokens": reused, "reachable_tokens": reachable, "reuse": rate,
                 "block_size": layout.block_size, "mamba_cache_mode": layout.mamba_cache_mode,
                 "spec_decode": layout.spec_decode}
    v.expect("reuse of the reachable prefix (turns 2+)", rate >= min_reuse, f"{rate:.0%}",
             f"limit {min_reuse:.0%}; {describe_layout(layout)}")
    return v

"""`invoke bench`'s client and `vllm bench serve`'s, request by request in turns, on one server.

Run with the python of vLLM's own install (it has vLLM's request function and aiohttp), with
this checkout on PYTHONPATH:

    python paired_clients.py URL MODEL TOKENIZER_JSON PP TG PAIRS OUT.json

Why in turns of one request: on a 2-core machine one client's decode rate moves by 8-15 % from
one round of requests to the next, so two benchmark runs one after the other disagree by as
much whatever their definitions. Alternating single requests (and which client goes first)
puts both clients under the same drift; both get the same prompt with their own cache salt (no
prefix is reused), greedy, exact output length. Each client's numbers are computed its own
way: ours from `RequestResult` (TTFT, decode t/s), theirs as `vllm bench serve` does (TTFT, TPOT
= (latency - TTFT) / (output tokens - 1)); medians are written to OUT.json.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import aiohttp
from tokenizers import Tokenizer  # type: ignore[import-not-found]
from vllm.benchmarks.lib.endpoint_request_func import (  # type: ignore[import-not-found]
    RequestFuncInput,
    async_request_openai_chat_completions,
)

from vllmstack.bench.client import ChatClient, chat_body
from vllmstack.bench.prompts import PromptBuilder

WARMUP = 2
# What `invoke bench` asks beyond vLLM's client, given to it too, so both requests cost the server
# the same: per-chunk usage and min_tokens (its logits processor costs this CPU engine about 5 %
# of decode). The message shape goes the other way (see ours()).
SAME_REQUEST = {"temperature": 0,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def interquartile_mean(values: list[float]) -> float:
    """The mean of the middle half: as robust as a median to a pair hit by a hiccup, and with
    the per-pair spread seen here (sd about 0.12) a third steadier."""
    ordered = sorted(values)
    quarter = len(ordered) // 4
    return statistics.mean(ordered[quarter:len(ordered) - quarter])


async def theirs(session: aiohttp.ClientSession, url: str, model: str, text: str, pp: int,
                 tg: int, salt: str) -> dict[str, float]:
    out = await async_request_openai_chat_completions(RequestFuncInput(
        prompt=text, api_url=f"{url}/v1/chat/completions", prompt_len=pp, output_len=tg,
        model=model, ignore_eos=True,
        extra_body=SAME_REQUEST | {"min_tokens": tg, "cache_salt": salt}), session=session)
    if not out.success:
        raise SystemExit(f"vLLM's client failed: {out.error}")
    return {"ttft_ms": out.ttft * 1000, "tpot_ms": (out.latency - out.ttft) / (out.output_tokens - 1)
            * 1000, "tokens": out.output_tokens, "prompt_tokens": out.prompt_len}


async def ours(client: ChatClient, model: str, text: str, tg: int, salt: str) -> dict[str, float]:
    # The message as vLLM's client sends it, a list of content parts: the server takes longer to
    # render that than a plain string (about 7 ms of TTFT at 2048 tokens here), a cost of the
    # request, not of either client's clock.
    parts = [{"type": "text", "text": text}]
    result = await client.stream_chat(chat_body(model, [{"role": "user", "content": parts}], tg,
                                                extra={"cache_salt": salt}))
    if not result.ok or result.ttft_s is None or result.decode_tps is None:
        raise SystemExit(f"our client failed: {result.why}")
    return {"ttft_ms": result.ttft_s * 1000, "tg_tps": result.decode_tps,
            "tokens": result.tokens, "prompt_tokens": result.prompt_tokens or 0}


async def main(url: str, model: str, tokenizer: str, pp: int, tg: int, pairs: int) -> dict[str, Any]:
    builder = PromptBuilder(Tokenizer.from_file(tokenizer), seed=7)
    mine: list[dict[str, float]] = []
    vllms: list[dict[str, float]] = []
    async with ChatClient(url) as client, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1)) as session:
        for n in range(WARMUP + pairs):
            # One prompt per pair, each request its own cache salt: no prefix is reused, and
            # greedy decoding gives both the same answer, so the server does the same work for
            # each (with two prompts, the answers' text alone moved the pair's ratio by 10 %).
            text = builder.build(pp).text
            a = ours(client, model, text, tg, f"ours-{n}")
            b = theirs(session, url, model, text, pp, tg, f"theirs-{n}")
            first, second = (a, b) if n % 2 == 0 else (b, a)
            got = [await first, await second]
            if n >= WARMUP:
                mine.append(got[0] if n % 2 == 0 else got[1])
                vllms.append(got[1] if n % 2 == 0 else got[0])
    pairs_of = list(zip(mine, vllms, strict=True))
    return {
        "pairs": pairs, "pp": pp, "tg": tg,
        "invoke_bench": {"ttft_ms": statistics.median(r["ttft_ms"] for r in mine),
                         "tg_tps": statistics.median(r["tg_tps"] for r in mine),
                         "completion_tokens": statistics.median(r["tokens"] for r in mine),
                         "prompt_tokens": statistics.median(r["prompt_tokens"] for r in mine)},
        "vllm_bench_serve": {"ttft_ms": statistics.median(r["ttft_ms"] for r in vllms),
                             "tg_tps": 1000 / statistics.median(r["tpot_ms"] for r in vllms),
                             "completion_tokens": statistics.median(r["tokens"] for r in vllms),
                             "prompt_tokens": statistics.median(r["prompt_tokens"] for r in vllms)},
        # Ours over theirs, pair by pair: what the machine did to a pair it did to both, so
        # the middle of these is the agreement (each side's own median above still carries the
        # request-to-request noise: its 1-second windows on this machine differ by 10-20 %).
        "ratios": {
            "ttft_ms": interquartile_mean([a["ttft_ms"] / b["ttft_ms"] for a, b in pairs_of]),
            "tg_tps": interquartile_mean([a["tg_tps"] * b["tpot_ms"] / 1000 for a, b in pairs_of]),
        },
        "requests": {"invoke_bench": mine, "vllm_bench_serve": vllms},
    }


if __name__ == "__main__":
    url, model, tok, pp, tg, pairs, out = sys.argv[1:8]
    record = asyncio.run(main(url, model, tok, int(pp), int(tg), int(pairs)))
    Path(out).write_text(json.dumps(record, indent=1))

"""The quality side of `invoke calibrate-kv --gate`: run in the engine's Python, as
`python -m vllmstack.models.kv_quality_runner MODEL HELDOUT OUT --kv-cache-dtype fp8|auto`.

It loads the model in vLLM itself (offline `LLM`, one process, eager) with the KV cache dtype
asked for, and measures what the cache's precision can change:

* perplexity of held-out text, from vLLM's prompt logprobs (every token scored against the KV of
  the tokens before it);
* long-context recall: a needle (a run of random vocabulary tokens, so neither the filler nor
  the model's training can predict it) is placed at several depths of a long context of held-out
  text, its first tokens are repeated at the end, and greedy decoding must continue it; the score
  is the share of needle tokens reproduced (copying from the cached K/V of an earlier span is what
  attention over a quantized cache has to get right).

It also reports the k/v scales vLLM ended up using per attention layer, so the host can check the
calibrated ones were really loaded. Only stdlib, vLLM and tokenizers are imported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random
import sys
from pathlib import Path
from typing import Any


def _mod(name: str) -> Any:
    return importlib.import_module(name)


def layer_scales(model: Any) -> dict[str, list[float]]:
    """k/v scales of every attention layer of the engine's model: what the kernels are given."""
    return {name: [float(module._k_scale_float), float(module._v_scale_float)]
            for name, module in model.named_modules()
            if hasattr(module, "_k_scale_float") and hasattr(module, "_v_scale_float")}


def loaded_scales(llm: Any) -> dict[str, list[float]]:
    """The scales vLLM ended up using, asked of its worker (LLM.apply_model); the first worker's."""
    found = llm.apply_model(layer_scales)
    return dict(found[0]) if found else {}


def recall_prompts(ids: list[int], *, context: int, needle: int, cue: int, depths: list[float],
                   trials: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (held-out filler with a random-token needle at a depth, then the needle's first
    `cue` tokens) and the needle tokens each must continue with."""
    rng = random.Random(seed)
    pool = sorted(set(ids))
    loop = ids * (context // max(1, len(ids)) + 2)  # held-out text is short: cycle it
    prompts, expected = [], []
    for depth in depths:
        for _ in range(trials):
            tokens = [rng.choice(pool) for _ in range(needle)]
            start = rng.randrange(0, len(ids))
            filler = loop[start:start + context - needle - cue]
            at = int(depth * len(filler))
            prompts.append(filler[:at] + tokens + filler[at:] + tokens[:cue])
            expected.append(tokens[cue:])
    return prompts, expected


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kv_quality_runner")
    parser.add_argument("model", type=Path)
    parser.add_argument("heldout", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    # The tiny trained model's rows are 512 tokens: past that its copy fades (22 % at 1024).
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--needle", type=int, default=16)
    parser.add_argument("--cue", type=int, default=4)
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--trials", type=int, default=40)
    # vLLM's share of the GPU's memory; on its CPU build, of the node's (the host passes less).
    parser.add_argument("--memory-share", type=float, default=0.5)
    parser.add_argument("--attention-backend", default="", help="e.g. TRITON_ATTN (default: vLLM's choice)")
    args = parser.parse_args(argv)
    # One process, so the scales can be read from the model after loading (apply_model).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm = _mod("vllm")
    tokenizer = _mod("tokenizers").Tokenizer.from_file(str(args.model / "tokenizer.json"))
    ids = tokenizer.encode(args.heldout.read_text(encoding="utf-8")).ids
    backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    llm = vllm.LLM(model=str(args.model), kv_cache_dtype=args.kv_cache_dtype, enforce_eager=True,
                   max_model_len=max(args.ppl_tokens, args.context) + 64, seed=0,
                   gpu_memory_utilization=args.memory_share, **backend)
    text_ids = ids[:args.ppl_tokens]
    scored = llm.generate([{"prompt_token_ids": text_ids}],
                          vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    logprobs = scored[0].prompt_logprobs or []
    total = [entry[tok].logprob for tok, entry in zip(text_ids[1:], logprobs[1:], strict=False)
             if entry and tok in entry]
    ppl = math.exp(-sum(total) / len(total)) if total else math.inf
    depths = [float(d) for d in args.depths.split(",")]
    prompts, expected = recall_prompts(ids, context=args.context, needle=args.needle, cue=args.cue,
                                       depths=depths, trials=args.trials)
    # Scored teacher-forced: the whole needle follows the cue in the prompt, and a needle token
    # counts when it is the model's first choice given the true tokens before it. Free-running
    # greedy decoding would let one early miss derail the rest, which made bf16 and fp8 differ by
    # 8 points at a depth on the same prompts by chance alone.
    outputs = llm.generate([{"prompt_token_ids": p + e} for p, e in zip(prompts, expected, strict=True)],
                           vllm.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    recall: dict[str, float] = {}
    for index, depth in enumerate(depths):
        hits = total_tokens = 0
        for k in range(index * args.trials, (index + 1) * args.trials):
            scored = (outputs[k].prompt_logprobs or [])[-len(expected[k]):]
            hits += sum(1 for tok, entry in zip(expected[k], scored, strict=True)
                        if entry and tok in entry and entry[tok].rank == 1)
            total_tokens += len(expected[k])
        recall[str(depth)] = hits / total_tokens
    result = {"kv_cache_dtype": args.kv_cache_dtype, "ppl": ppl, "ppl_tokens": len(total),
              "recall": recall, "recall_mean": sum(recall.values()) / len(recall),
              "context": args.context, "needle": args.needle, "trials": args.trials,
              "scales": loaded_scales(llm), "vllm": str(vllm.__version__),
              "cache_dtype": str(llm.llm_engine.vllm_config.cache_config.cache_dtype)}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("kv_cache_dtype", "ppl", "recall_mean")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

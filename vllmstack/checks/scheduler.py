"""Checks of the scheduler limits: speculative decoding depth and the batch, sequence and length
limits against each other and against the model (context length, Mamba cache blocks).

A new check goes here when it compares max_num_seqs, max_num_batched_tokens, max_model_len or
the speculative config with each other or with the model's facts.
"""

from __future__ import annotations

from vllmstack.checks.context import CheckContext
from vllmstack.config.vllm_args import ArgvError, spec_config
from vllmstack.core.findings import Finding

# MTP with more than one draft token corrupts output from this many concurrent sequences on.
MTP_CORRUPTION_SEQS = 4
# vLLM's gated-delta chunk for hybrid MoE models; a smaller step budget cannot hold one chunk.
MOE_GDN_BLOCK = 2112


def rule_spec_decode(ctx: CheckContext) -> list[Finding]:
    if not ctx.usable("VLLM_SPEC_DECODE", "VLLM_MAX_NUM_SEQS"):
        return []
    try:
        spec = spec_config(ctx.resolved)
    except ArgvError:
        return []  # reported by the argv rule
    if spec is None:
        return []
    out: list[Finding] = []
    drafts = spec.get("num_speculative_tokens")
    seqs = ctx.int("VLLM_MAX_NUM_SEQS") or 0
    method = str(spec.get("method", ""))
    if "mtp" in method and isinstance(drafts, int) and drafts > 1 and seqs >= MTP_CORRUPTION_SEQS:
        out.append(ctx.finding(
            "error", "mtp-depth-vs-seqs", "VLLM_SPEC_DECODE",
            f"MTP with {drafts} draft tokens at max_num_seqs={seqs} (from "
            f"{ctx.src('VLLM_MAX_NUM_SEQS')}) corrupts output from {MTP_CORRUPTION_SEQS} "
            "sequences on (vllm-project/vllm#35288)",
            fix=f'set "num_speculative_tokens": 1, or VLLM_MAX_NUM_SEQS={MTP_CORRUPTION_SEQS - 1}'))
    if drafts is None:
        out.append(ctx.finding(
            "error", "spec-missing-tokens", "VLLM_SPEC_DECODE",
            "the speculative config has no num_speculative_tokens (vLLM requires it for MTP)",
            fix='add "num_speculative_tokens": 1'))
    elif not isinstance(drafts, int) or drafts < 1:
        out.append(ctx.finding("error", "spec-bad-tokens", "VLLM_SPEC_DECODE",
                               f"num_speculative_tokens must be a positive integer, got {drafts!r}",
                               fix='use e.g. "num_speculative_tokens": 1'))
    return out


def rule_scheduler(ctx: CheckContext) -> list[Finding]:
    if not ctx.usable("VLLM_MAX_BATCHED_TOKENS", "VLLM_MAX_NUM_SEQS", "VLLM_MAX_MODEL_LEN",
                      "MAMBA_CACHE_BLOCKS"):
        return []
    out: list[Finding] = []
    batched = ctx.int("VLLM_MAX_BATCHED_TOKENS")
    seqs = ctx.int("VLLM_MAX_NUM_SEQS")
    if batched is not None and seqs is not None and batched < seqs:
        out.append(ctx.finding(
            "error", "batched-below-seqs", "VLLM_MAX_BATCHED_TOKENS",
            f"max_num_batched_tokens ({batched}) must be greater than or equal to max_num_seqs "
            f"({seqs})", fix=f"set VLLM_MAX_BATCHED_TOKENS to at least {seqs}"))
    facts = ctx.facts
    if facts.is_hybrid and facts.is_moe and batched is not None and batched < MOE_GDN_BLOCK:
        out.append(ctx.finding(
            "error", "moe-gdn-block", "VLLM_MAX_BATCHED_TOKENS",
            f"max_num_batched_tokens ({batched}) is below the hybrid MoE gated-delta block size "
            f"({MOE_GDN_BLOCK})", fix="set VLLM_MAX_BATCHED_TOKENS=4096"))
    max_len = ctx.int("VLLM_MAX_MODEL_LEN")
    if max_len and facts.max_position_embeddings and max_len > facts.max_position_embeddings:
        allowed = ctx.resolved.get_bool("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
        out.append(ctx.finding(
            "warning" if allowed else "error", "max-len-over-model", "VLLM_MAX_MODEL_LEN",
            f"max_model_len {max_len} is greater than the model's max_position_embeddings "
            f"{facts.max_position_embeddings} ({facts.sources.get('max_position_embeddings')})",
            fix=f"set VLLM_MAX_MODEL_LEN={facts.max_position_embeddings} or less"))
    known_blocks = ctx.int("MAMBA_CACHE_BLOCKS")
    if facts.is_hybrid and known_blocks and seqs and seqs > known_blocks:
        out.append(ctx.finding(
            "error", "mamba-blocks", "VLLM_MAX_NUM_SEQS",
            f"max_num_seqs ({seqs}) exceeds available Mamba cache blocks ({known_blocks}, "
            f"MAMBA_CACHE_BLOCKS @ {ctx.src('MAMBA_CACHE_BLOCKS')}): each decoding sequence needs "
            "one block and graph capture fails",
            fix=f"set VLLM_MAX_NUM_SEQS={known_blocks} or less, or raise VLLM_GPU_MEM_UTIL"))
    return out

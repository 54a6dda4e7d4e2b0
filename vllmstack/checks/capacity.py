"""Checks that the profile fits the hardware: the cards detected on this host, tensor parallel
against GPUs and attention heads, and weights + KV cache + overhead against each GPU's memory
(the memory projection).

A new check goes here when it weighs a setting against GPU count, VRAM or memory utilization.
"""

from __future__ import annotations

from collections import Counter

from vllmstack.checks.context import CheckContext, pinned
from vllmstack.config.modelinfo import GIB, MIB, estimate_mamba_blocks, kv_bytes_per_token_per_gpu
from vllmstack.core.findings import Finding

# Activations, CUDA/HIP graphs and runtime buffers per GPU, beyond weights and KV cache. A
# deliberately round estimate: the projection is for "clearly won't fit", not for tuning.
OVERHEAD_GIB = 2.0


# A pinned GPU_VRAM_GIB further than this from the card's own figure makes the projection wrong.
VRAM_TOLERANCE = 0.03


def rule_detected_gpus(ctx: CheckContext) -> list[Finding]:
    """What the host's cards are, what was taken from them, and where the platform disagrees."""
    hardware = ctx.hardware
    if hardware is None:
        if ctx.looked_for_gpus and not pinned(ctx.resolved, "GPU_VRAM_GIB"):
            tool = "nvidia-smi" if ctx.get("GPU_VENDOR") == "nvidia" else "the amdgpu driver (sysfs)"
            return [Finding("info", "gpu-not-detected",
                            f"{tool} did not describe this host's GPUs and the platform pins no "
                            "GPU_VRAM_GIB: the memory projection is skipped",
                            fix="run the check on the GPU host, or set GPU_VRAM_GIB and "
                                "GPU_DEVICE_NAME in .env")]
        return []
    used = ctx.used_cards
    kinds = Counter((c.name or "an unknown device", round(c.total_bytes / GIB, 1)) for c in used)
    cards = "; ".join(f"{n} × {name} with {gib:g} GiB" for (name, gib), n in sorted(kinds.items()))
    notes = "; ".join(sorted({c.note for c in used if c.note}))
    taken = (", ".join(f"{k}={v}" for k, v in ctx.detected.items()) + " (the platform does not pin "
             "them)") if ctx.detected else "nothing (the platform pins count, memory and name)"
    out = [Finding("info", "gpu-detected",
                   f"{hardware.source}: {len(hardware.cards)} GPU(s) on this host; the engine gets "
                   f"{cards} ({notes}); taken from the cards: {taken}", key=None,
                   source=hardware.source)]
    tp = ctx.int("VLLM_TP")
    if tp is not None and tp > len(hardware.cards):
        out.append(ctx.finding(
            "error", "tp-over-detected-gpus", "VLLM_TP",
            f"tensor parallel size {tp} needs {tp} GPUs; {hardware.source} sees "
            f"{len(hardware.cards)} on this host", fix=f"set VLLM_TP={len(hardware.cards)}, or use a "
            "platform with fewer GPUs (e.g. nvidia instead of 2xnvidia)"))
    elif "GPU_COUNT" not in ctx.detected and (ctx.int("GPU_COUNT") or 0) > len(hardware.cards):
        out.append(ctx.finding(
            "warning", "gpu-count-differs", "GPU_COUNT",
            f"platform {ctx.resolved.platform} has GPU_COUNT={ctx.get('GPU_COUNT')} but "
            f"{hardware.source} sees {len(hardware.cards)} GPU(s) on this host",
            fix="use the platform that matches this host"))
    vram = ctx.float("GPU_VRAM_GIB")
    card_gib = min(c.total_bytes for c in used) / GIB if used else None
    if ("GPU_VRAM_GIB" not in ctx.detected and vram and card_gib
            and abs(vram - card_gib) > VRAM_TOLERANCE * card_gib):
        out.append(ctx.finding(
            "warning", "gpu-vram-differs", "GPU_VRAM_GIB",
            f"GPU_VRAM_GIB={vram:g} but the card has {card_gib:.1f} GiB ({hardware.source}): the "
            "memory projection uses the pinned value",
            fix=f"remove GPU_VRAM_GIB (at {ctx.src('GPU_VRAM_GIB')}) so the card's figure is used, "
                f"or set it to {card_gib:.1f}"))
    names = {c.name for c in used if c.name}
    name = ctx.get("GPU_DEVICE_NAME")
    if "GPU_DEVICE_NAME" not in ctx.detected and name and len(names) == 1 and name not in names:
        out.append(ctx.finding(
            "warning", "gpu-name-differs", "GPU_DEVICE_NAME",
            f"GPU_DEVICE_NAME={name} but vLLM names this card {next(iter(names))}: tuned configs "
            "are looked up by vLLM's name", fix=f"remove GPU_DEVICE_NAME (at "
            f"{ctx.src('GPU_DEVICE_NAME')}) so the card's name is used, or set it to "
            f"{next(iter(names))}"))
    return out


def rule_parallelism(ctx: CheckContext) -> list[Finding]:
    if not ctx.usable("VLLM_TP", "GPU_COUNT"):
        return []
    out: list[Finding] = []
    tp = ctx.resolved.get_int("VLLM_TP")
    gpus = ctx.int("GPU_COUNT")
    visible_key = "CUDA_VISIBLE_DEVICES" if ctx.get("GPU_VENDOR") == "nvidia" else "HIP_VISIBLE_DEVICES"
    visible = ctx.resolved.get_list(visible_key)
    if ctx.get("GPU_VENDOR") == "none":
        if tp != 1:
            out.append(ctx.finding("error", "tp-without-gpus", "VLLM_TP",
                                   f"tensor parallel {tp} on a platform without GPUs",
                                   fix="set VLLM_TP=1"))
        return out
    if gpus is not None and tp > gpus:
        out.append(ctx.finding(
            "error", "tp-over-gpus", "VLLM_TP",
            f"tensor parallel size {tp} needs {tp} GPUs; platform {ctx.resolved.platform} has "
            f"{gpus} (GPU_COUNT @ {ctx.src('GPU_COUNT')})",
            fix=f"set VLLM_TP={gpus}, or use a platform with {tp} GPUs"))
    elif visible and tp > len(visible):
        out.append(ctx.finding(
            "error", "tp-over-visible", "VLLM_TP",
            f"tensor parallel size {tp} but {visible_key}={','.join(visible)} exposes "
            f"{len(visible)} GPU(s)", fix=f"list {tp} GPUs in {visible_key} or lower VLLM_TP"))
    heads = ctx.facts.num_attention_heads
    if heads and heads % tp:
        out.append(ctx.finding(
            "error", "tp-heads", "VLLM_TP",
            f"Total number of attention heads ({heads}) must be divisible by tensor parallel "
            f"size ({tp})", fix="choose a VLLM_TP that divides the head count"))
    return out


def rule_memory(ctx: CheckContext) -> list[Finding]:
    """Weights + KV at max_model_len + overhead against usable memory per GPU."""
    if not ctx.usable("VLLM_TP", "VLLM_GPU_MEM_UTIL", "VLLM_MAX_MODEL_LEN", "GPU_VRAM_GIB",
                      "VLLM_KV_CACHE_DTYPE", "VLLM_MAX_NUM_SEQS", "MODEL_WEIGHT_GIB"):
        return []
    facts = ctx.facts
    vram = ctx.float("GPU_VRAM_GIB")
    util = ctx.float("VLLM_GPU_MEM_UTIL")
    tp = ctx.resolved.get_int("VLLM_TP")
    max_len = ctx.int("VLLM_MAX_MODEL_LEN")
    out: list[Finding] = []
    if ctx.get("GPU_VENDOR") == "none" or not vram or not util:
        return out
    if util > 0.95 and ctx.resolved.get_bool("UNIFIED_MEMORY"):
        out.append(ctx.finding(
            "warning", "unified-memory-util", "VLLM_GPU_MEM_UTIL",
            f"gpu_memory_utilization {util} on unified memory leaves almost nothing for the OS",
            fix="use 0.85-0.9 on an APU"))
    if facts.weight_gib is None or max_len is None:
        return [*out, Finding("info", "memory-unknown",
                              "no weight size known: memory projection skipped",
                              fix="set MODEL_WEIGHT_GIB in the profile or download the model")]
    usable = vram * util
    weights = facts.weight_gib / tp
    kv_available = usable - weights - OVERHEAD_GIB
    estimated = facts.sources.get("weight_gib", "").startswith("estimated")
    where = (f"{vram:g} GiB × {util:g} = {usable:.1f} GiB usable per GPU; weights "
             f"{facts.weight_gib:g} GiB{' (from the config: no weight files)' if estimated else ''}"
             f" / TP {tp} = {weights:.1f} GiB; overhead ≈ {OVERHEAD_GIB:g} GiB")
    if kv_available <= 0:
        return [*out, ctx.finding(
            "error", "weights-do-not-fit", "VLLM_GPU_MEM_UTIL",
            f"the weights do not fit: {where}; {-kv_available:.1f} GiB short before any KV cache",
            fix="raise VLLM_TP (more GPUs), use a quantized profile, or raise VLLM_GPU_MEM_UTIL")]
    kv_dtype = ctx.resolved.get_str("VLLM_KV_CACHE_DTYPE")
    per_token = kv_bytes_per_token_per_gpu(facts, tp, kv_dtype)
    if per_token is None:
        return out
    mamba = (facts.mamba_state_mib or 0) * MIB / tp * 2  # align mode keeps two state blocks
    need = per_token * max_len + mamba
    if need > kv_available * GIB:
        fit_len = int((kv_available * GIB - mamba) // per_token)
        out.append(ctx.finding(
            "error", "kv-does-not-fit", "VLLM_MAX_MODEL_LEN",
            f"one request at max_model_len {max_len} needs {need / GIB:.1f} GiB of KV cache per "
            f"GPU but only ≈{kv_available:.1f} GiB is left ({where})",
            fix=f"set VLLM_MAX_MODEL_LEN={max(fit_len // 1024 * 1024, 0)} or less"
                + ("" if kv_dtype.startswith("fp8") else ", use VLLM_KV_CACHE_DTYPE=fp8")
                + ", or raise VLLM_GPU_MEM_UTIL"))
        return out
    seqs = ctx.int("VLLM_MAX_NUM_SEQS") or 1
    full = int(kv_available * GIB // need)
    out.append(Finding(
        "info", "memory-projection",
        f"≈{kv_available:.1f} GiB KV cache per GPU: {full} request(s) at the full "
        f"{max_len}-token window ({where})", key="VLLM_MAX_MODEL_LEN",
        source=ctx.src("VLLM_MAX_MODEL_LEN")))
    blocks = estimate_mamba_blocks(facts, tp, kv_dtype, kv_available * GIB)
    if blocks is not None and not ctx.int("MAMBA_CACHE_BLOCKS") and seqs > blocks:
        # An estimate (activation peak and graph memory vary), so a warning; the exact
        # count from a boot log goes in MAMBA_CACHE_BLOCKS and makes this an error.
        out.append(ctx.finding(
            "warning", "mamba-blocks-estimate", "VLLM_MAX_NUM_SEQS",
            f"max_num_seqs ({seqs}) is above the ≈{blocks} Mamba cache blocks these settings "
            "probably give; vLLM then refuses to capture graphs",
            fix=f"set VLLM_MAX_NUM_SEQS to at most {blocks}, or record the block count from the "
                "boot log in MAMBA_CACHE_BLOCKS for an exact check"))
    return out

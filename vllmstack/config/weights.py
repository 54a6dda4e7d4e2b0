"""Weight size from a config.json's geometry, for a model folder that holds no weight files.

Such a folder is served with `--load-format dummy` (vLLM fills random weights at the config's
geometry), or is a config-only copy. The profile's MODEL_WEIGHT_GIB then describes another
checkpoint (often a quantized one), so the projection would be off by the difference: on the
H200 run, a bf16 Qwen3.6-27B geometry with an FP8 profile size projected 7 % too much KV cache.
The count follows the Hugging Face layouts of Qwen2/3 dense and MoE models and the Qwen3.5/3.6
Gated DeltaNet hybrids, MTP layers included; vision towers are counted only roughly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllmstack.config.hfconfig import (
    COUNT,
    LAYERS,
    SIZE,
    VOCAB,
    WIDTH,
    HfConfig,
    LinearAttention,
    expert_count,
    linear_attention,
)

GIB = 1024**3
# Bytes per parameter of the quantized formats (4-bit plus group scales, rounded up).
QUANT_BYTES = {"fp8": 1.0, "awq": 0.56, "gptq": 0.56, "bitsandbytes": 0.56}
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "float8_e4m3fn": 1.0}


def _attention_params(cfg: HfConfig, hidden: int, heads: int) -> int:
    kv = cfg.number("num_key_value_heads", LAYERS) or heads
    head_dim = cfg.number("head_dim", WIDTH) or hidden // heads
    # Qwen3.5/3.6 full-attention layers gate their output: q_proj is twice as wide.
    gated = cfg.flag("attn_output_gate", cfg.has("linear_num_value_heads"))
    q_width = heads * head_dim * (2 if gated else 1)
    return hidden * q_width + 2 * hidden * kv * head_dim + heads * head_dim * hidden


def _linear_attention_params(linear: LinearAttention, hidden: int) -> int:
    k_heads, v_heads, k_dim, v_dim = (linear.key_heads, linear.value_heads, linear.key_dim,
                                      linear.value_dim)
    qkvz = hidden * (2 * k_heads * k_dim + 2 * v_heads * v_dim)
    ba = hidden * 2 * v_heads
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * linear.conv_kernel
    return qkvz + ba + conv + v_heads * v_dim * hidden


def _mlp_params(cfg: HfConfig, hidden: int) -> int:
    experts = expert_count(cfg)
    intermediate = cfg.number("intermediate_size", SIZE) or 0
    if not experts:
        return 3 * hidden * intermediate
    moe = cfg.number("moe_intermediate_size", SIZE)
    moe = intermediate if moe is None else moe
    shared = cfg.number("shared_expert_intermediate_size", SIZE) or 0
    return experts * 3 * hidden * moe + hidden * experts + (3 * hidden * shared + hidden
                                                            if shared else 0)


def _vision_params(cfg: HfConfig) -> int:
    vision = cfg.section("vision_config", top=True)
    if vision is None:
        return 0
    depth = vision.number("depth", COUNT) or vision.number("num_hidden_layers", COUNT) or 0
    width = vision.number("hidden_size", SIZE) or 0
    inner = vision.number("intermediate_size", SIZE)
    inner = 4 * width if inner is None else inner
    return depth * (4 * width * width + 2 * width * inner)


def estimate_params(config: dict[str, Any], path: Path | None = None) -> int | None:
    """Parameters of a checkpoint with this config.json; None if its geometry is incomplete.
    A field that is there but bad is a ModelConfigError naming it and `path`."""
    cfg = HfConfig(config, path)
    hidden, layers = cfg.number("hidden_size", WIDTH), cfg.number("num_hidden_layers", LAYERS)
    vocab = cfg.number("vocab_size", VOCAB)
    heads = cfg.number("num_attention_heads", LAYERS)
    if not (hidden and layers and vocab and heads):
        return None
    # Layers without full attention are Gated DeltaNet layers in a hybrid; elsewhere (sliding
    # window) they hold the same weights as full-attention ones.
    linear = linear_attention(cfg)
    linear_layers = linear.layers if linear is not None else 0
    full = layers - linear_layers
    attention = _attention_params(cfg, hidden, heads)
    mlp = _mlp_params(cfg, hidden)
    total = full * (attention + mlp)
    if linear is not None:
        total += linear_layers * (_linear_attention_params(linear, hidden) + mlp)
    tied = cfg.flag("tie_word_embeddings", False)
    total += vocab * hidden * (1 if tied else 2)
    # MTP draft layers live in the same checkpoint: a full layer each plus the 2h -> h merge.
    mtp = (cfg.number("mtp_num_hidden_layers", COUNT)
           or cfg.number("num_nextn_predict_layers", COUNT) or 0)
    total += mtp * (attention + mlp + 2 * hidden * hidden)
    return total + _vision_params(cfg)


def bytes_per_param(config: dict[str, Any], quant: str | None, path: Path | None = None) -> float:
    if quant and quant in QUANT_BYTES:
        return QUANT_BYTES[quant]
    cfg = HfConfig(config, path)
    # The top level's dtype first: a multimodal checkpoint's towers share it.
    dtype = (cfg.text("torch_dtype", top=True) or cfg.text("dtype", top=True)
             or cfg.text("torch_dtype") or cfg.text("dtype"))
    return DTYPE_BYTES.get(str(dtype), 2.0)


def estimate_weight_gib(config: dict[str, Any], quant: str | None,
                        path: Path | None = None) -> float | None:
    params = estimate_params(config, path)
    if params is None:
        return None
    return round(params * bytes_per_param(config, quant, path) / GIB, 2)

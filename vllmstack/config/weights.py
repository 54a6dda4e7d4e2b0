"""Weight size from a config.json's geometry, for a model folder that holds no weight files.

Such a folder is served with `--load-format dummy` (vLLM fills random weights at the config's
geometry), or is a config-only copy. The profile's MODEL_WEIGHT_GIB then describes another
checkpoint (often a quantized one), so the projection would be off by the difference: on the
H200 run, a bf16 Qwen3.6-27B geometry with an FP8 profile size projected 7 % too much KV cache.
The count follows the Hugging Face layouts of Qwen2/3 dense and MoE models and the Qwen3.5/3.6
Gated DeltaNet hybrids, MTP layers included; vision towers are counted only roughly.
"""

from __future__ import annotations

from typing import Any

from vllmstack.config.hfconfig import full_attention_layers, text_config

GIB = 1024**3
# Bytes per parameter of the quantized formats (4-bit plus group scales, rounded up).
QUANT_BYTES = {"fp8": 1.0, "awq": 0.56, "gptq": 0.56, "bitsandbytes": 0.56}
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "float8_e4m3fn": 1.0}


def _int(cfg: dict[str, Any], key: str, default: int = 0) -> int:
    value = cfg.get(key)
    return int(value) if isinstance(value, int | float) else default


def _attention_params(cfg: dict[str, Any], hidden: int) -> int:
    heads = _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim", hidden // heads if heads else 0)
    # Qwen3.5/3.6 full-attention layers gate their output: q_proj is twice as wide.
    q_width = heads * head_dim * (2 if cfg.get("attn_output_gate", "linear_num_value_heads" in cfg)
                                  else 1)
    return hidden * q_width + 2 * hidden * kv * head_dim + heads * head_dim * hidden


def _linear_attention_params(cfg: dict[str, Any], hidden: int) -> int:
    k_heads, v_heads = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
    k_dim, v_dim = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
    qkvz = hidden * (2 * k_heads * k_dim + 2 * v_heads * v_dim)
    ba = hidden * 2 * v_heads
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * _int(cfg, "linear_conv_kernel_dim", 4)
    return qkvz + ba + conv + v_heads * v_dim * hidden


def _mlp_params(cfg: dict[str, Any], hidden: int) -> int:
    experts = (_int(cfg, "num_experts") or _int(cfg, "n_routed_experts")
               or _int(cfg, "num_local_experts"))
    if not experts:
        return 3 * hidden * _int(cfg, "intermediate_size")
    moe = _int(cfg, "moe_intermediate_size", _int(cfg, "intermediate_size"))
    shared = _int(cfg, "shared_expert_intermediate_size")
    return experts * 3 * hidden * moe + hidden * experts + (3 * hidden * shared + hidden
                                                            if shared else 0)


def _vision_params(config: dict[str, Any]) -> int:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    depth = _int(vision, "depth") or _int(vision, "num_hidden_layers")
    width = _int(vision, "hidden_size")
    inner = _int(vision, "intermediate_size", 4 * width)
    return depth * (4 * width * width + 2 * width * inner)


def estimate_params(config: dict[str, Any]) -> int | None:
    """Parameters of a checkpoint with this config.json; None if its geometry is incomplete."""
    cfg = text_config(config)
    hidden, layers = _int(cfg, "hidden_size"), _int(cfg, "num_hidden_layers")
    vocab = _int(cfg, "vocab_size")
    if not (hidden and layers and vocab and _int(cfg, "num_attention_heads")):
        return None
    # Layers without full attention are Gated DeltaNet layers in a hybrid; elsewhere (sliding
    # window) they hold the same weights as full-attention ones.
    hybrid = "linear_num_value_heads" in cfg
    linear = layers - (full_attention_layers(cfg) or layers) if hybrid else 0
    full = layers - linear
    attention = _attention_params(cfg, hidden)
    mlp = _mlp_params(cfg, hidden)
    total = full * (attention + mlp) + linear * (_linear_attention_params(cfg, hidden) + mlp)
    tied = cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    total += vocab * hidden * (1 if tied else 2)
    # MTP draft layers live in the same checkpoint: a full layer each plus the 2h -> h merge.
    mtp = _int(cfg, "mtp_num_hidden_layers") or _int(cfg, "num_nextn_predict_layers")
    total += mtp * (attention + mlp + 2 * hidden * hidden)
    return total + _vision_params(config)


def bytes_per_param(config: dict[str, Any], quant: str | None) -> float:
    if quant and quant in QUANT_BYTES:
        return QUANT_BYTES[quant]
    inner = config.get("text_config")
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype is None and isinstance(inner, dict):
        dtype = inner.get("torch_dtype") or inner.get("dtype")
    return DTYPE_BYTES.get(str(dtype), 2.0)


def estimate_weight_gib(config: dict[str, Any], quant: str | None) -> float | None:
    params = estimate_params(config)
    if params is None:
        return None
    return round(params * bytes_per_param(config, quant) / GIB, 2)

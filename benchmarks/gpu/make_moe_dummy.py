"""A Qwen3.6-35B-A3B-FP8-shaped model folder for `--load-format dummy` (no weights: vLLM fills
random ones at this geometry), next to the folders ../shared/gpu/make_dummy_models.py makes.

Usage: python make_moe_dummy.py MODELS_DIR  (MODELS_DIR/qwen3.6-27b-dummy must exist: its
tokenizer is reused). The geometry is Qwen3.5-MoE's (vLLM's Qwen3_5MoeTextConfig defaults: 40
layers, every 4th full attention, 256 experts of 512, 8 routed, one shared expert) with the
block-FP8 quantization of the real checkpoint, so the fused-MoE kernel looks up
E=256,N=512,device_name=...,dtype=fp8_w8a8,block_shape=[128,128].json like the real model does.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

LAYERS, INTERVAL = 40, 4


def main(models: Path) -> Path:
    source = models / "qwen3.6-27b-dummy"
    base = json.loads((source / "config.json").read_text())
    text = base["text_config"]
    common = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    # Layers vLLM must keep in bf16: the GDN b/a projection is 2 x 32 wide, below one 128-block
    # (the real checkpoint lists them in modules_to_not_convert too).
    linear = [i for i in range(LAYERS) if (i + 1) % INTERVAL]
    skip = [f"model.layers.{i}.linear_attn.{name}" for i in linear
            for name in ("in_proj_ba", "in_proj_b", "in_proj_a")]
    config = {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "qwen3_5_moe_text", "vocab_size": text["vocab_size"], "hidden_size": 2048,
            "num_hidden_layers": LAYERS, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "full_attention_interval": INTERVAL, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "rope_parameters": text["rope_parameters"], "mtp_num_hidden_layers": 1,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", **common},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128], "modules_to_not_convert": skip},
        **common,
    }
    out = models / "qwen3.6-35b-a3b-dummy"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


if __name__ == "__main__":
    print(main(Path(sys.argv[1])))

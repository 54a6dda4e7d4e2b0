"""A random-weight checkpoint (real safetensors) with a dummy model's geometry and tokenizer.

`--load-format dummy` lets vLLM invent its weights, but llama.cpp needs a file: to compare the two
engines on identical weights, both load this one (vLLM directly, llama.cpp after `invoke
gguf-convert`). Runs on the GPU machine, where torch and transformers are installed.
Usage: python3 make_random_checkpoint.py SRC_DIR (config.json + tokenizer) OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(src: Path, out: Path) -> None:
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

"""The measuring side of `invoke calibrate-kv`: run where the engine runs (its Python has torch and
transformers), as `python -m vllmstack.models.kv_calibrate_runner MODEL CORPUS OUT [--tokens N]`.

It feeds the corpus through the checkpoint in causal chunks and records, per attention layer, the
largest |K| after the key norm and RoPE (what vLLM writes into the cache) and the largest |V|. The
host turns those into k_scale = amax / 448 (the fp8 e4m3 range) and v_scale likewise. Only
stdlib, torch, transformers and tokenizers are imported: no vllmstack settings.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any


def _mod(name: str) -> Any:
    return importlib.import_module(name)


def measure(model_dir: Path, corpus: Path, tokens: int, seq_len: int) -> dict[str, Any]:
    torch, transformers = _mod("torch"), _mod("transformers")
    tokenizer = _mod("tokenizers").Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(corpus.read_text(encoding="utf-8")).ids[:tokens]
    if len(ids) < 2:
        raise SystemExit("the corpus gives fewer than 2 tokens")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    attention = [(name, module) for name, module in model.named_modules() if name.endswith("self_attn")
                 and hasattr(module, "v_proj")]
    if not attention:
        raise SystemExit("no attention layer with a v_proj found: this tuner knows Llama/Qwen layouts")
    amax: dict[str, dict[str, float]] = {name: {"k_amax": 0.0, "v_amax": 0.0} for name, _ in attention}
    current: list[str] = [""]

    def enter(name: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any = None) -> None:
            current[0] = name
        return hook

    def values(name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            amax[name]["v_amax"] = max(amax[name]["v_amax"], float(output.detach().abs().max()))
        return hook

    handles = []
    for name, module in attention:
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.v_proj.register_forward_hook(values(name)))
    # RoPE is applied inside the attention forward by a module-level function: wrap it where the
    # modeling code looks it up, and record the rotated keys of the layer that is running.
    modeling: Any = sys.modules[type(model).__module__]
    if not hasattr(modeling, "apply_rotary_pos_emb"):
        raise SystemExit(f"{type(model).__module__} has no apply_rotary_pos_emb to measure rotated keys at")
    original = modeling.apply_rotary_pos_emb

    def rotary(q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
        q_out, k_out = original(q, k, *args, **kwargs)
        if current[0]:
            entry = amax[current[0]]
            entry["k_amax"] = max(entry["k_amax"], float(k_out.detach().abs().max()))
        return q_out, k_out

    modeling.apply_rotary_pos_emb = rotary
    started = time.monotonic()
    try:
        with torch.no_grad():
            for start in range(0, len(ids), seq_len):
                chunk = torch.tensor([ids[start:start + seq_len]], device=device)
                model(input_ids=chunk)
    finally:
        modeling.apply_rotary_pos_emb = original
        for handle in handles:
            handle.remove()
    return {"layers": amax, "tokens": len(ids), "seq_len": seq_len, "device": device,
            "seconds": round(time.monotonic() - started, 2),
            "versions": {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kv_calibrate_runner")
    parser.add_argument("model", type=Path)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args(argv)
    result = measure(args.model, args.corpus, args.tokens, args.seq_len)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"tokens": result["tokens"], "layers": len(result["layers"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

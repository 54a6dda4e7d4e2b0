"""The training side of `invoke make-model --trained`: run in the engine's Python (torch and
transformers), as `python -m vllmstack.models.train_runner MODEL CORPUS OUT [--max-steps N]`.

It trains the random model `make-model` wrote, in place, on the corpus (the first 90 % of its
tokens; the last 10 % are held out), with AdamW on next-token loss, until the held-out perplexity
is below `--target-ratio` x the vocabulary size (random guessing scores the vocabulary size) or
the steps or minutes run out. The weights go back into model.safetensors under the same names, in
bf16; OUT gets the numbers (initial and final held-out perplexity, steps, seconds). Only stdlib,
torch, transformers, tokenizers and safetensors are imported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any


def _mod(name: str) -> Any:
    return importlib.import_module(name)


def heldout_ppl(torch: Any, model: Any, tokens: Any, seq_len: int) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, tokens.numel() - 1, seq_len):
            chunk = tokens[start:start + seq_len + 1]
            if chunk.numel() < 2:
                break
            out = model(input_ids=chunk[:-1][None])
            logits = out.logits[0].float()
            loss = torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum")
            total, count = total + float(loss), count + chunk.numel() - 1
    model.train()
    return math.exp(total / max(1, count))


def train(model_dir: Path, corpus: Path, *, max_steps: int, max_minutes: float, target_ratio: float,
          seq_len: int, batch: int, lr: float, seed: int) -> dict[str, Any]:
    torch, transformers = _mod("torch"), _mod("transformers")
    torch.manual_seed(seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = _mod("tokenizers").Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = torch.tensor(tokenizer.encode(corpus.read_text(encoding="utf-8")).ids, dtype=torch.long)
    split = int(ids.numel() * 0.9)
    train_ids, held = ids[:split], ids[split:]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    vocab = int(model.config.vocab_size)
    target = target_ratio * vocab
    before = heldout_ppl(torch, model, held, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    started, steps, ppl, history = time.monotonic(), 0, before, []
    model.train()
    while steps < max_steps and (time.monotonic() - started) < max_minutes * 60:
        starts = torch.randint(0, train_ids.numel() - seq_len - 1, (batch,))
        x = torch.stack([train_ids[s:s + seq_len] for s in starts])
        y = torch.stack([train_ids[s + 1:s + seq_len + 1] for s in starts])
        # Warm-up then cosine: a fixed high rate diverges on this small a corpus.
        scale = min(1.0, (steps + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(1.0, steps / max_steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr * max(scale, 0.05)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps += 1
        if steps % 100 == 0:
            ppl = heldout_ppl(torch, model, held, seq_len)
            history.append([steps, round(ppl, 2)])
            print(f"step {steps}: loss {float(loss):.3f}, held-out perplexity {ppl:.1f}", file=sys.stderr,
                  flush=True)
            if ppl < target:
                break
    ppl = heldout_ppl(torch, model, held, seq_len)
    state = {name: tensor.detach().to(torch.bfloat16).contiguous()
             for name, tensor in model.state_dict().items()}
    _mod("safetensors.torch").save_file(state, str(model_dir / "model.safetensors"),
                                        metadata={"format": "pt"})
    return {"vocab": vocab, "random_ppl": vocab, "initial_ppl": round(before, 2), "final_ppl": round(ppl, 2),
            "target_ppl": round(target, 2), "steps": steps, "seconds": round(time.monotonic() - started, 1),
            "train_tokens": int(train_ids.numel()), "heldout_tokens": int(held.numel()),
            "history": history, "seq_len": seq_len, "batch": batch, "lr": lr, "seed": seed,
            "versions": {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="train_runner")
    parser.add_argument("model", type=Path)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--max-minutes", type=float, default=15.0)
    parser.add_argument("--target-ratio", type=float, default=0.05)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = train(args.model, args.corpus, max_steps=args.max_steps, max_minutes=args.max_minutes,
                   target_ratio=args.target_ratio, seq_len=args.seq_len, batch=args.batch, lr=args.lr,
                   seed=args.seed)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("initial_ppl", "final_ppl", "steps", "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

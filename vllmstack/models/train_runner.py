"""The training side of `invoke make-model --trained`: run in the engine's Python (torch and
transformers), as `python -m vllmstack.models.train_runner MODEL CORPUS OUT [--max-steps N]`.

It trains the random model `make-model` wrote, in place, on the corpus: the text before its last
tenth (`split_corpus`; the last tenth is held out, here and in `calibrate-kv --gate`), with AdamW
on next-token loss. Two things are learned, because two things are measured later:

* the language of the corpus (held-out perplexity must end far below the vocabulary size, which
  is what random guessing scores). The bundled corpus is small (about 6,000 tokens), so a 2 M
  parameter model memorizes it within a hundred steps and then grows overconfident on text it has
  not seen; dropout on the residual stream and label smoothing hold that off;
* copying an earlier span of the context (an "induction head"), which is what a long-context
  retrieval probe exercises: some training sequences are a run of random tokens repeated, so the
  only way to predict the repeat is to attend back to it. Copy accuracy is measured as the gate's
  probe does: a random needle at several depths of held-out text, its first tokens as the cue.

Training stops when both targets are met, or the steps or minutes run out; the weights kept are
those of the best evaluation that met the perplexity target (else the best perplexity seen), and
go back into model.safetensors under the same names, in bf16. OUT gets the numbers. Only stdlib,
torch, transformers, tokenizers and safetensors are imported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

HELDOUT_SHARE = 0.1  # the corpus's last tenth: never trained on, never calibrated on


def split_corpus(text: str) -> tuple[str, str]:
    """(training text, held-out text): cut at the first paragraph break after 90 % of the text."""
    at = int(len(text) * (1 - HELDOUT_SHARE))
    brk = text.find("\n\n", at)
    cut = brk if 0 <= brk < len(text) - 1 else at
    return text[:cut], text[cut:]


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
            logits = model(input_ids=chunk[:-1][None]).logits[0].float()
            loss = torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum")
            total, count = total + float(loss), count + chunk.numel() - 1
    model.train()
    return math.exp(total / max(1, count))


def copy_accuracy(torch: Any, model: Any, held: list[int], pool: list[int], *, context: int,
                  needle: int = 16, cue: int = 4, depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9),
                  trials: int = 2, seed: int = 1) -> float:
    """Share of needle tokens greedy decoding reproduces after its cue (the gate's probe, in
    transformers): a random-token needle at each depth of held-out filler."""
    rng = random.Random(seed)
    loop = held * (context // max(1, len(held)) + 2)
    hits = total = 0
    model.eval()
    with torch.no_grad():
        for depth in depths:
            for _ in range(trials):
                tokens = [rng.choice(pool) for _ in range(needle)]
                start = rng.randrange(len(held))
                filler = loop[start:start + context - needle - cue]
                at = int(depth * len(filler))
                prompt = torch.tensor([filler[:at] + tokens + filler[at:] + tokens[:cue]])
                out = model.generate(prompt, max_new_tokens=needle - cue, do_sample=False,
                                     pad_token_id=0)[0, prompt.shape[1]:].tolist()
                hits += sum(1 for a, b in zip(out, tokens[cue:], strict=False) if a == b)
                total += needle - cue
    model.train()
    return hits / max(1, total)


def add_dropout(torch: Any, model: Any, rate: float) -> None:
    """Dropout on what each decoder layer adds to the residual stream and on the embeddings
    (Qwen3 has none of its own besides attention dropout); only active in train mode."""
    def hook(module: Any, args: Any, output: Any) -> Any:
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (torch.nn.functional.dropout(output[0], rate, True), *output[1:])
        return torch.nn.functional.dropout(output, rate, True)
    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(hook)
        layer.self_attn.register_forward_hook(hook)


def batch_of(torch: Any, rng: random.Random, train_ids: Any, pool: list[int], *, batch: int, seq_len: int,
             copy_share: float) -> Any:
    rows = []
    for _ in range(batch):
        if rng.random() < copy_share:
            # A random run, then the same run again: predictable only by looking back at it.
            half = [rng.choice(pool) for _ in range(seq_len // 2 + 1)]
            rows.append(torch.tensor((half + half)[:seq_len + 1]))
        else:
            start = rng.randrange(0, train_ids.numel() - seq_len - 1)
            rows.append(train_ids[start:start + seq_len + 1])
    return torch.stack(rows)


def train(model_dir: Path, corpus: Path, *, max_steps: int, max_minutes: float, target_ratio: float,
          copy_target: float, seq_len: int, batch: int, lr: float, seed: int, dropout: float,
          smoothing: float, copy_share: float, eval_every: int, copy_context: int) -> dict[str, Any]:
    torch, transformers = _mod("torch"), _mod("transformers")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = _mod("tokenizers").Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train_text, held_text = split_corpus(corpus.read_text(encoding="utf-8"))
    train_ids = torch.tensor(tokenizer.encode(train_text).ids, dtype=torch.long)
    held_list = tokenizer.encode(held_text).ids
    held = torch.tensor(held_list, dtype=torch.long)
    pool = sorted(set(train_ids.tolist()))  # ordinary text tokens: no control tokens
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    vocab = int(model.config.vocab_size)
    target = target_ratio * vocab
    add_dropout(torch, model, dropout)
    before = heldout_ppl(torch, model, held, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    started, steps, history = time.monotonic(), 0, []
    best: tuple[tuple[int, float], dict[str, Any], float, float, int] | None = None
    model.train()
    while steps < max_steps and (time.monotonic() - started) < max_minutes * 60:
        rows = batch_of(torch, rng, train_ids, pool, batch=batch, seq_len=seq_len, copy_share=copy_share)
        # Warm-up, then a constant rate: the run stops on its targets, not on a schedule's end.
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (steps + 1) / 50)
        logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 rows[:, 1:].reshape(-1), label_smoothing=smoothing)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps += 1
        if steps % eval_every == 0:
            ppl = heldout_ppl(torch, model, held, seq_len)
            copied = copy_accuracy(torch, model, held_list, pool, context=copy_context)
            history.append([steps, round(ppl, 2), round(copied, 3)])
            print(f"step {steps}: loss {loss.item():.3f}, held-out perplexity {ppl:.1f} "
                  f"(target {target:.0f}), copy accuracy {copied:.2f} ({time.monotonic() - started:.0f} s)",
                  file=sys.stderr, flush=True)
            # Better: meets the perplexity target and copies more; else the lower perplexity.
            rank = (1, copied) if ppl < target else (0, -ppl)
            if best is None or rank > best[0]:
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                best = (rank, state, ppl, copied, steps)
            if ppl < target and copied >= copy_target:
                break
    if best is not None:
        model.load_state_dict(best[1])
    ppl = heldout_ppl(torch, model, held, seq_len)
    copied = copy_accuracy(torch, model, held_list, pool, context=copy_context)
    state = {name: tensor.detach().to(torch.bfloat16).contiguous()
             for name, tensor in model.state_dict().items()}
    _mod("safetensors.torch").save_file(state, str(model_dir / "model.safetensors"),
                                        metadata={"format": "pt"})
    return {"vocab": vocab, "random_ppl": vocab, "initial_ppl": round(before, 2), "final_ppl": round(ppl, 2),
            "target_ppl": round(target, 2), "copy_accuracy": round(copied, 3), "copy_target": copy_target,
            "copy_context": copy_context, "steps": steps, "kept_step": best[4] if best else steps,
            "seconds": round(time.monotonic() - started, 1),
            "train_tokens": int(train_ids.numel()), "heldout_tokens": int(held.numel()),
            "history": history, "seq_len": seq_len, "batch": batch, "lr": lr, "seed": seed,
            "dropout": dropout, "label_smoothing": smoothing, "copy_share": copy_share,
            "versions": {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="train_runner")
    parser.add_argument("model", type=Path)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--max-minutes", type=float, default=15.0)
    parser.add_argument("--target-ratio", type=float, default=0.5)
    parser.add_argument("--copy-target", type=float, default=0.9)
    parser.add_argument("--copy-context", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--copy-share", type=float, default=0.5)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = train(args.model, args.corpus, max_steps=args.max_steps, max_minutes=args.max_minutes,
                   target_ratio=args.target_ratio, copy_target=args.copy_target, seq_len=args.seq_len,
                   batch=args.batch, lr=args.lr, seed=args.seed, dropout=args.dropout,
                   smoothing=args.label_smoothing, copy_share=args.copy_share, eval_every=args.eval_every,
                   copy_context=args.copy_context)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("initial_ppl", "final_ppl", "copy_accuracy", "steps",
                                             "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A small byte-level BPE tokenizer trained on the shipped corpus.

Used where no real model tokenizer exists: the test suite, the accuracy benchmark scripts and the
engine simulator (which counts prompt tokens with the same file, so prompt lengths agree exactly).
Not a stand-in for a model's tokenizer in real benchmarks.
"""

from __future__ import annotations

from pathlib import Path

from vllmstack.workload.prompts import load_corpus


def train_corpus_tokenizer(path: Path, *, vocab_size: int = 1200) -> Path:
    """Train on the corpus and save tokenizer.json at `path`; returns `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(load_corpus(), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path

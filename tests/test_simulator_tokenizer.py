"""With SIM_TOKENIZER the simulator counts prompt tokens with that tokenizer.json, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from simulator.client import call
from simulator.fixture import run_simulator
from simulator.server import THINK_OFF_SUFFIX, Tokenizer, render_chatml

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a serving stack for local GPUs with speculative decoding",
    "prefix caching reuses the blocks of a repeated conversation",
] * 20


def train_tokenizer(path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.save(str(path))
    return path


def test_prompt_tokens_are_exact_with_a_tokenizer_file(tmp_path: Path) -> None:
    path = train_tokenizer(tmp_path / "tokenizer.json")
    from tokenizers import Tokenizer as HFTokenizer

    reference = HFTokenizer.from_file(str(path))
    prompt = "the lazy zebra reuses xylophone blocks of a quick conversation"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "0", "SIM_ITL_MS": "0",
           "SIM_TOKENIZER": str(path)}
    with run_simulator(env=env) as sim:
        text = call(sim.url, "/v1/completions", {"prompt": prompt, "max_tokens": 3}).json()
        chat = call(sim.url, "/v1/chat/completions",
                    {"messages": messages, "max_tokens": 3}).json()
        off = call(sim.url, "/v1/chat/completions",
                   {"messages": messages, "max_tokens": 3,
                    "chat_template_kwargs": {"enable_thinking": False}}).json()
        counted = call(sim.url, "/tokenize", {"prompt": prompt}).json()
    expected = len(reference.encode(prompt).ids)
    assert expected != len(prompt.split())  # the file really decides, not the word rule
    assert text["usage"]["prompt_tokens"] == expected
    assert counted["count"] == expected
    assert counted["tokens"] == reference.encode(prompt).ids
    rendered = render_chatml(messages, None, thinking=True)
    assert chat["usage"]["prompt_tokens"] == len(
        reference.encode(rendered, add_special_tokens=False).ids)
    assert off["usage"]["prompt_tokens"] == len(
        reference.encode(rendered + THINK_OFF_SUFFIX, add_special_tokens=False).ids)


def test_word_rule_without_a_tokenizer() -> None:
    words = Tokenizer("")
    assert words.kind == "words"
    rendered = render_chatml([{"role": "user", "content": "two words"}], None, thinking=True)
    # <|im_start|> user \n two words <|im_end|> \n <|im_start|> assistant \n
    assert len(words.encode(rendered)) == 2 + 5 + 3
    assert len(words.encode(rendered + THINK_OFF_SUFFIX)) == 2 + 5 + 3 + 4
    assert words.encode("a<b  c\n\nd") == ["a", "<", "b", "c", "\n\n", "d"]


def test_missing_tokenizer_file_falls_back_to_the_word_rule(tmp_path: Path) -> None:
    assert Tokenizer(str(tmp_path / "absent.json")).kind == "words"

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllmstack.workload.prompts import (
    PromptBuilder,
    TokenizerError,
    load_corpus,
    load_tokenizer,
    resolve_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_file: Path) -> Any:
    return load_tokenizer(tokenizer_file)


def test_corpus_ships_with_the_package_and_is_real_prose() -> None:
    paragraphs = load_corpus()
    assert len(paragraphs) >= 40
    words = " ".join(paragraphs).split()
    assert len(words) > 3000
    assert len(set(words)) / len(words) > 0.2  # varied text, not a repeated filler


@pytest.mark.parametrize("size", [1, 2, 7, 64, 500, 2048, 9000, 40000])
def test_prompts_have_exactly_the_requested_token_count(tokenizer: Any, size: int) -> None:
    builder = PromptBuilder(tokenizer, seed=size)
    for _ in range(3):
        prompt = builder.build(size)
        assert prompt.tokens == size
        assert len(tokenizer.encode(prompt.text, add_special_tokens=False).ids) == size


def test_every_prompt_starts_with_its_own_marker(tokenizer: Any) -> None:
    builder = PromptBuilder(tokenizer, seed=1)
    prompts = [builder.build(300) for _ in range(20)]
    assert all(p.text.startswith(p.marker) for p in prompts)
    # Cache busting happens at the start: no two prompts share their first 8 characters.
    assert len({p.text[:8] for p in prompts}) == 20


def test_same_seed_gives_the_same_body_text(tokenizer: Any) -> None:
    a = PromptBuilder(tokenizer, seed=5).build(200, marker="[x]")
    b = PromptBuilder(tokenizer, seed=5).build(200, marker="[x]")
    c = PromptBuilder(tokenizer, seed=6).build(200, marker="[x]")
    assert a.text == b.text
    assert a.text != c.text


def test_resolve_tokenizer_file_and_folder(tokenizer_file: Path) -> None:
    assert resolve_tokenizer(str(tokenizer_file), {}) == tokenizer_file
    assert resolve_tokenizer(str(tokenizer_file.parent), {}) == tokenizer_file


def test_resolve_tokenizer_from_the_local_hf_cache_uses_refs_main(tmp_path: Path,
                                                                  tokenizer_file: Path) -> None:
    repo = tmp_path / "hub" / "models--Org--Model"
    for rev in ("old", "abc123"):
        (repo / "snapshots" / rev).mkdir(parents=True)
        (repo / "snapshots" / rev / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    found = resolve_tokenizer("Org/Model", {"HF_HOME": str(tmp_path)})
    assert found == repo / "snapshots" / "abc123" / "tokenizer.json"
    # HOME fallback: ~/.cache/huggingface/hub
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "hub").symlink_to(tmp_path / "hub")
    assert resolve_tokenizer("Org/Model", {"HOME": str(home)}).name == "tokenizer.json"


def test_missing_tokenizer_is_a_clear_error_and_nothing_is_downloaded(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError) as err:
        resolve_tokenizer("Qwen/Qwen3-8B", {"HF_HOME": str(tmp_path), "HOME": str(tmp_path)})
    text = str(err.value)
    assert "not found on this machine" in text
    assert str(tmp_path / "hub" / "models--Qwen--Qwen3-8B") in text
    assert "--tokenizer" in text
    with pytest.raises(TokenizerError, match=r"without tokenizer\.json"):
        resolve_tokenizer(str(tmp_path), {})
    with pytest.raises(TokenizerError, match="no tokenizer given"):
        resolve_tokenizer("", {})


def test_broken_tokenizer_file_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=str(bad)):
        load_tokenizer(bad)

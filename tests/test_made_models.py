"""`invoke make-model tiny`: a complete Qwen3 model folder made here, which the `tiny` profile serves.

What vLLM will read is checked as vLLM reads it: the safetensors header and data, config.json
against the profile's geometry, the tokenizer's special tokens, and the chat template rendered by
Jinja for the thinking switch and tool calls the probes use.
"""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.models.chat_template import CHAT_TEMPLATE
from vllmstack.models.tiny import (
    PRESETS,
    ModelMakerError,
    cached_snapshot,
    hub_repo_folder,
    make_for_stack,
    make_model,
    read_safetensors_header,
    render_made,
)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model in a Hugging Face cache of its own (made once: about 2 s)."""
    cache = tmp_path_factory.mktemp("hf")
    model = make_model("tiny", hf_cache=cache)
    assert model.made and model.folder == cached_snapshot(cache, "vllmstack/tiny-qwen3")
    return model.folder


def render(**kwargs: object) -> str:
    # transformers renders chat templates with these settings and a tojson filter.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env.from_string(CHAT_TEMPLATE).render(**kwargs)


def bf16_values(folder: Path, name: str) -> list[float]:
    header = read_safetensors_header(folder / "model.safetensors")
    start, end = header[name]["data_offsets"]  # type: ignore[misc]
    raw = (folder / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    data = raw[8 + size + start: 8 + size + end]
    return [struct.unpack("<f", b"\0\0" + data[i:i + 2])[0] for i in range(0, len(data), 2)]


def test_the_folder_is_a_qwen3_whose_geometry_the_profile_declares(made: Path, shipped: Project) -> None:
    config = json.loads((made / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    profile = resolve(shipped, platform="cpu", model="tiny")
    assert profile.get("VLLM_MODEL") == PRESETS["tiny"].repo  # what make-model writes is what it serves
    for key, field in [("MODEL_HIDDEN_SIZE", "hidden_size"), ("MODEL_NUM_LAYERS", "num_hidden_layers"),
                       ("MODEL_NUM_ATTENTION_HEADS", "num_attention_heads"),
                       ("MODEL_NUM_KV_HEADS", "num_key_value_heads"), ("MODEL_HEAD_DIM", "head_dim"),
                       ("MODEL_INTERMEDIATE_SIZE", "intermediate_size"),
                       ("MODEL_MAX_POSITION_EMBEDDINGS", "max_position_embeddings")]:
        assert profile.get_int(key) == config[field], key
    assert profile.get_int("VLLM_MAX_MODEL_LEN") <= config["max_position_embeddings"]


def test_weights_are_bf16_tensors_of_the_config_shapes(made: Path) -> None:
    config = json.loads((made / "config.json").read_text())
    header = read_safetensors_header(made / "model.safetensors")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    assert header["model.embed_tokens.weight"]["shape"] == [vocab, hidden]
    assert header["lm_head.weight"]["shape"] == [vocab, hidden]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    layer = "model.layers.1."
    assert header[layer + "self_attn.q_proj.weight"]["shape"] == [q, hidden]
    assert header[layer + "self_attn.k_proj.weight"]["shape"] == [kv, hidden]
    assert header[layer + "mlp.down_proj.weight"]["shape"] == [hidden, config["intermediate_size"]]
    assert {t["dtype"] for t in header.values()} == {"BF16"}
    # The data is contiguous, in order, and exactly fills the file.
    spans = sorted(t["data_offsets"] for t in header.values())  # type: ignore[type-var]
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    raw = (made / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    assert (8 + size) % 8 == 0 and len(raw) == 8 + size + spans[-1][1]
    weights = bf16_values(made, layer + "self_attn.q_proj.weight")
    rms = (sum(w * w for w in weights) / len(weights)) ** 0.5
    assert all(abs(w) < 0.2 for w in weights) and 0.01 < rms < 0.03
    assert set(bf16_values(made, layer + "input_layernorm.weight")) == {1.0}


def test_tokenizer_keeps_qwens_control_tokens_whole_and_the_head_never_emits_them(made: Path) -> None:
    tokenizer = Tokenizer.from_file(str(made / "tokenizer.json"))
    config = json.loads((made / "config.json").read_text())
    assert tokenizer.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tokenizer.encode(text).ids
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tokenizer.token_to_id(token) in ids, token
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    # Greedy output of random weights is one token over and over: never a blank or control token.
    head = bf16_values(made, "lm_head.weight")
    hidden = config["hidden_size"]
    for token in ("<|im_end|>", "<think>", "<tool_call>", "\n", " "):
        token_id = tokenizer.token_to_id(token) if token.startswith("<") else tokenizer.encode(token).ids[0]
        assert set(head[token_id * hidden:(token_id + 1) * hidden]) == {0.0}, repr(token)
    visible = tokenizer.encode("the sea").ids[0]
    assert any(head[visible * hidden:(visible + 1) * hidden])


def test_chat_template_switches_thinking_off_by_both_routes() -> None:
    messages = [{"role": "user", "content": "What is 17*23?"}]
    on = render(messages=messages, add_generation_prompt=True)
    assert on == "<|im_start|>user\nWhat is 17*23?<|im_end|>\n<|im_start|>assistant\n"
    for kwargs in ({"enable_thinking": False}, {"reasoning_effort": "none"}):
        off = render(messages=messages, add_generation_prompt=True, **kwargs)
        assert off == on + "<think>\n\n</think>\n\n", kwargs
    assert render(messages=messages, add_generation_prompt=True, enable_thinking=True) == on


def test_chat_template_renders_tools_calls_and_responses_as_qwen3() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris"}'}},
                        {"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Nice"}}}]},
        {"role": "tool", "content": "20 C"},
        {"role": "tool", "content": "24 C"},
    ]
    text = render(messages=messages, tools=[tool], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in text
    assert ("<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call><|im_end|>\n') in text
    # Consecutive tool results answer in one user turn.
    assert ("<|im_start|>user\n<tool_response>\n20 C\n</tool_response>\n<tool_response>\n24 C\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert text.count("<|im_start|>") == text.count("<|im_end|>") + 1


def test_made_model_is_kept_remade_with_force_and_written_anywhere(tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    first = make_model("tiny", hf_cache=cache)
    again = make_model("tiny", hf_cache=cache)
    assert not again.made and again.folder == first.folder
    assert "already there (use --force" in render_made(again)
    remade = make_model("tiny", hf_cache=cache, force=True)
    assert remade.made and remade.folder == first.folder  # same content, same revision
    repo = hub_repo_folder(cache, "vllmstack/tiny-qwen3")
    assert (repo / "refs" / "main").read_text() == first.folder.name
    assert [p.name for p in repo.iterdir() if p.name.startswith(".making-")] == []
    out = make_model("tiny", out=tmp_path / "models" / "tiny")
    assert sorted(p.name for p in out.folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "vllmstack-model.json"]
    with pytest.raises(ModelMakerError) as err:
        make_model("huge", hf_cache=cache)
    assert err.value.fix == "use one of: tiny"


def test_make_for_stack_writes_into_the_stacks_hf_cache(project: Project, tmp_path: Path) -> None:
    resolved = resolve(project, platform="cpu", model="tiny",
                       overrides=[f"HF_CACHE_DIR={tmp_path / 'hub-cache'}"])
    made = make_for_stack(resolved, {"HOME": str(tmp_path)}, "tiny")
    assert made.folder.is_relative_to(tmp_path / "hub-cache" / "hub" / "models--vllmstack--tiny-qwen3")

from __future__ import annotations

from pathlib import Path

import pytest

from vllmstack.config import migrate
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project

ANCHOR_PROFILE = """\
# qwen3.8-27b from the earlier stack
VLLM_MODEL_ID=Qwen/Qwen3.8-27B-FP8
VLLM_MODEL=/home/philip/models-local/Qwen3.8-27B-FP8-kvscales
VLLM_TOKENIZER=/home/philip/models-local/Qwen3.8-27B-FP8-kvscales
VLLM_SERVED_NAME=qwen3.8-27b
VLLM_GPU_MEM_UTIL=0.95
VLLM_MAX_MODEL_LEN=131072
VLLM_KV_CACHE_DTYPE=fp8
VLLM_MAX_NUM_SEQS=4
VLLM_MAX_BATCHED_TOKENS=1024
VLLM_SPEC_DECODE={"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "TRITON_ATTN"}
PREFIX_CACHE_RETENTION_INTERVAL=1600
VLLM_USE_V2_MODEL_RUNNER=1
HIP_VISIBLE_DEVICES=0,1
FOO_BAR=1
"""


def test_anchor_profile_maps_key_by_key(tmp_path: Path) -> None:
    source = tmp_path / "qwen3.8-27b.env"
    source.write_text(ANCHOR_PROFILE)
    by_key = {m.key: m for m in migrate.map_env_file(source)}
    assert by_key["VLLM_MAX_NUM_SEQS"].target == "same"
    assert "MODELS_DIR" in by_key["VLLM_MODEL"].note
    assert "attention_backend can go" in by_key["VLLM_SPEC_DECODE"].note
    assert by_key["PREFIX_CACHE_RETENTION_INTERVAL"].target == "moved"
    assert by_key["HIP_VISIBLE_DEVICES"].target == "platform"
    assert by_key["FOO_BAR"].target == "unknown"


def test_written_profile_resolves_and_nothing_is_overwritten(project: Project, tmp_path: Path) -> None:
    source = tmp_path / "old.env"
    source.write_text(ANCHOR_PROFILE)
    mappings = migrate.map_env_file(source)
    path = migrate.write_profile(project, "imported", source, mappings, "families/qwen3.6")
    resolved = resolve(project, model="imported")
    assert resolved.get("VLLM_MAX_BATCHED_TOKENS") == "1024"
    assert resolved.get("VLLM_SPEC_DECODE", "").startswith('{"method": "mtp"')
    assert not [p for p in resolved.problems if p.severity == "error"]
    before = path.read_text()
    with pytest.raises(FileExistsError):
        migrate.write_profile(project, "imported", source, mappings)
    assert path.read_text() == before


def test_values_are_written_so_the_resolver_reads_them_back_exactly(
        project: Project, tmp_path: Path) -> None:
    source = tmp_path / "old.env"
    source.write_text("VLLM_EXTRA_ARGS=\"--override-generation-config '{\\\"top_k\\\": 20}'\"\n"
                      "VLLM_SERVED_NAME='it is # not a comment'\n"
                      "VLLM_MODEL=${MODELS_DIR}/m\n"
                      "HF_TOKEN=hf_should_not_travel\n")
    mappings = migrate.map_env_file(source)
    by_key = {m.key: m for m in mappings}
    assert by_key["HF_TOKEN"].target == "secret"
    path = migrate.write_profile(project, "quoted", source, mappings)
    assert "hf_should_not_travel" not in path.read_text()  # env/ is shared; .env keeps tokens
    from vllmstack.config.profiles import read_env_file

    written = {line.key: line.value for line in read_env_file(path, path.name)[0]}
    for key in ("VLLM_EXTRA_ARGS", "VLLM_SERVED_NAME", "VLLM_MODEL"):
        assert written[key] == by_key[key].value


def test_a_value_no_quoting_can_carry_is_refused_before_writing(
        project: Project, tmp_path: Path) -> None:
    source = tmp_path / "old.env"
    for line in ('VLLM_SERVED_NAME="a\\tb"\n', 'VLLM_SERVED_NAME="ends in \\\\"\n'):
        source.write_text(line)  # a tab; a final backslash: no dotenv form reads either back
        mappings = migrate.map_env_file(source)
        with pytest.raises(migrate.ImportEnvError, match=r"VLLM_SERVED_NAME \(line 1"):
            migrate.write_profile(project, "refused", source, mappings)
        assert not (project.env_dir / "models" / "refused.env").exists()


def test_a_file_with_unreadable_lines_is_not_imported_half(tmp_path: Path) -> None:
    source = tmp_path / "old.env"
    source.write_bytes(b"VLLM_MAX_NUM_SEQS=4\nVLLM_SERVED_NAME=caf\xe9\n")
    with pytest.raises(migrate.ImportEnvError) as info:
        migrate.map_env_file(source)
    assert "nothing was imported" in info.value.cause
    assert any("old.env:2" in line for line in info.value.details)

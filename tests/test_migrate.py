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

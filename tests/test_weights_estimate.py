"""Weight size from config.json geometry, checked against what real vLLM loaded on the H200s.

The configs are the `--load-format dummy` models of the H200 run; the logs are that run's boots.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from test_checks import by_code, check

from vllmstack.config.weights import estimate_weight_gib
from vllmstack.core.paths import Project

DATA = Path(__file__).parent / "data"
RUNS = Path(__file__).resolve().parents[1] / "benchmarks/gpu/2026-11-30-h200"


def logged_gib(log: Path, pattern: str) -> float:
    match = re.search(pattern + r" ([\d.]+) GiB", log.read_text())
    assert match, f"{pattern} not in {log}"
    return float(match.group(1))


@pytest.mark.parametrize(("config", "log", "tp"), [
    ("qwen3.6-27b-h200-dummy.json", DATA / "boot-tp2-hybrid-eager.log", 2),
    ("qwen3-0.6b-h200-dummy.json", RUNS / "small-0.6b/engine.log", 1),
])
def test_estimate_matches_what_vllm_loaded(config: str, log: Path, tp: int) -> None:
    estimate = estimate_weight_gib(json.loads((DATA / "configs" / config).read_text()), None)
    assert estimate is not None
    loaded = logged_gib(log, "Model loading took")
    # vLLM logs per GPU; the hybrid's MTP layer and untied embeddings are part of the 23.27 GiB.
    assert estimate / tp == pytest.approx(loaded, rel=0.02)


def test_quantized_config_counts_a_byte_per_parameter() -> None:
    config = json.loads((DATA / "configs" / "qwen3.6-27b-h200-dummy.json").read_text())
    bf16 = estimate_weight_gib(config, None)
    fp8 = estimate_weight_gib(config, "fp8")
    assert bf16 and fp8 and fp8 == pytest.approx(bf16 / 2, rel=0.01)
    assert estimate_weight_gib({"hidden_size": 8}, None) is None  # incomplete geometry


def test_dummy_model_folder_projects_the_kv_cache_vllm_found(project: Project, tmp_path: Path) -> None:
    # The profile's MODEL_WEIGHT_GIB (29.5) is the FP8 checkpoint; the folder holds a bf16
    # geometry and no weights, so the projection must use the folder's own size.
    model = tmp_path / "qwen3.6-27b-dummy"
    model.mkdir()
    shutil.copy(DATA / "configs" / "qwen3.6-27b-h200-dummy.json", model / "config.json")
    findings = check(project, f"VLLM_MODEL={model}", f"MODELS_DIR={tmp_path}",
                     "GPU_VRAM_GIB=139.8", "GPU_COUNT=2", "VLLM_TP=2", "VLLM_GPU_MEM_UTIL=0.95",
                     "VLLM_MAX_MODEL_LEN=32768", model="qwen3.6-27b", platform="2xr9700")
    note = by_code(findings, "memory-projection")
    assert "(from the config: no weight files)" in note.message
    projected = float(re.search(r"≈([\d.]+) GiB KV cache", note.message).group(1))  # type: ignore[union-attr]
    real = logged_gib(DATA / "boot-tp2-hybrid-eager.log", "Available KV cache memory:")
    assert projected == pytest.approx(real, rel=0.02)
    # With weight files present, their size on disk wins over the estimate.
    (model / "model.safetensors").write_bytes(b"\0" * 1024)
    again = by_code(check(project, f"VLLM_MODEL={model}", f"MODELS_DIR={tmp_path}",
                          "GPU_VRAM_GIB=139.8", "VLLM_MAX_MODEL_LEN=32768",
                          model="qwen3.6-27b"), "memory-projection")
    assert "from the config" not in again.message and "weights 0 GiB" in again.message

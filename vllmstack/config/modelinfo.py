"""Model facts for checks: from config.json when the model is on disk, else from the profile.

Nothing is downloaded. A model is "on disk" when VLLM_MODEL is a local folder, or when its
Hugging Face id (VLLM_MODEL_ID, else VLLM_MODEL) has a snapshot in the local HF cache.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.config.hfconfig import (
    LAYERS,
    POSITIONS,
    SIZE,
    WIDTH,
    HfConfig,
    ModelConfigError,
    expert_count,
    full_attention_layers,
    linear_attention,
    quant_method,
    read_config,
)
from vllmstack.config.profiles import Resolved
from vllmstack.config.weights import estimate_weight_gib
from vllmstack.core.paths import home_dir

GIB = 1024**3
MIB = 1024**2
# Profile keys that carry geometry, and the ModelFacts field each fills.
PROFILE_FACTS = {
    "MODEL_KIND": "kind",
    "MODEL_NUM_LAYERS": "num_layers",
    "MODEL_FULL_ATTENTION_LAYERS": "full_attention_layers",
    "MODEL_NUM_ATTENTION_HEADS": "num_attention_heads",
    "MODEL_NUM_KV_HEADS": "num_kv_heads",
    "MODEL_HEAD_DIM": "head_dim",
    "MODEL_HIDDEN_SIZE": "hidden_size",
    "MODEL_INTERMEDIATE_SIZE": "intermediate_size",
    "MODEL_NUM_EXPERTS": "num_experts",
    "MODEL_MOE_INTERMEDIATE_SIZE": "moe_intermediate_size",
    "MODEL_MAX_POSITION_EMBEDDINGS": "max_position_embeddings",
    "MODEL_WEIGHT_GIB": "weight_gib",
    "MODEL_MAMBA_STATE_MIB": "mamba_state_mib",
    "MODEL_QUANT": "quant",
}


@dataclass
class ModelFacts:
    kind: str | None = None
    num_layers: int | None = None
    full_attention_layers: int | None = None
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_experts: int | None = None
    moe_intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    weight_gib: float | None = None
    mamba_state_mib: float | None = None
    quant: str | None = None
    # field -> where it came from ("config.json at PATH" or "MODEL_X @ file:line")
    sources: dict[str, str] = field(default_factory=dict)
    model_dir: Path | None = None
    # Why config.json gave no facts (load_model_facts(strict=False)); None when it did or is absent.
    config_problem: ModelConfigError | None = None

    @property
    def is_hybrid(self) -> bool:
        return bool(self.kind and self.kind.startswith("hybrid"))

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts) or (self.kind or "").endswith("moe")


def hf_hub_dir(environ: Mapping[str, str], hf_cache_setting: str | None = None) -> Path:
    """The hub folder of the local Hugging Face cache, as huggingface_hub would pick it."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"])
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]) / "hub"
    if hf_cache_setting:
        return Path(hf_cache_setting).expanduser() / "hub"
    return home_dir(environ) / ".cache" / "huggingface" / "hub"


def profile_hf_cache(resolved: Resolved) -> str | None:
    """HF_CACHE_DIR, else HOST_CACHE_DIR/huggingface (as the engine's mounts use them); None when
    the profile leaves both to the default, which the usual lookup already covers."""
    if resolved.get("HF_CACHE_DIR"):
        return str(Path(resolved.get_str("HF_CACHE_DIR")).expanduser())
    if resolved.get("HOST_CACHE_DIR"):
        return str(Path(resolved.get_str("HOST_CACHE_DIR")).expanduser() / "huggingface")
    return None


def is_local_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~"))


def locate_model_dir(
    name: str, environ: Mapping[str, str], hf_cache_setting: str | None = None
) -> Path | None:
    """A local folder for `name` (a path, or an HF id with a snapshot in the cache), else None."""
    if not name:
        return None
    if is_local_path(name):
        path = Path(name).expanduser()
        return path if path.is_dir() else None
    repo = hf_hub_dir(environ, hf_cache_setting) / ("models--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip()
        if pinned.is_dir():
            return pinned
    candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return candidates[0] if candidates else None


def facts_from_config(config: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """Geometry from a Hugging Face config.json (dense, MoE, and GDN/Mamba hybrids).

    A field that is there must be what vLLM reads it as (hfconfig: ModelConfigError naming the
    key and `path`); one that is missing stays unknown, as the checks treat it."""
    cfg = HfConfig(config, path)
    out: dict[str, Any] = {}
    layers = cfg.number("num_hidden_layers", LAYERS)
    heads = cfg.number("num_attention_heads", LAYERS)
    hidden = cfg.number("hidden_size", WIDTH)
    out["num_layers"] = layers
    out["num_attention_heads"] = heads
    out["hidden_size"] = hidden
    kv_heads = cfg.number("num_key_value_heads", LAYERS)
    out["num_kv_heads"] = heads if kv_heads is None else kv_heads
    head_dim = cfg.number("head_dim", WIDTH)
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads or None
    out["head_dim"] = head_dim
    out["intermediate_size"] = cfg.number("intermediate_size", SIZE)
    experts = expert_count(cfg)
    out["num_experts"] = experts
    out["moe_intermediate_size"] = cfg.number("moe_intermediate_size", SIZE) or 0
    out["max_position_embeddings"] = cfg.number("max_position_embeddings", POSITIONS)

    out["full_attention_layers"] = full_attention_layers(cfg)
    linear = linear_attention(cfg)
    if linear is not None:
        conv_dim = linear.key_dim * linear.key_heads * 2 + linear.value_dim * linear.value_heads
        # Qwen3.5-style checkpoints keep the recurrent state in fp32 (mamba_ssm_dtype).
        ssm_bytes = 4 if (cfg.text("mamba_ssm_dtype") or "float32") == "float32" else 2
        per_layer = (conv_dim * (linear.conv_kernel - 1) * 2
                     + linear.value_heads * linear.value_dim * linear.key_dim * ssm_bytes)
        out["mamba_state_mib"] = round(per_layer * linear.layers / MIB, 1)
    hybrid = linear is not None
    out["kind"] = ("hybrid" if hybrid else "dense") + ("-moe" if hybrid and experts else "")
    if not hybrid and experts:
        out["kind"] = "moe"
    method = quant_method(cfg)
    if method is not None:
        out["quant"] = {"fp8": "fp8", "awq": "awq", "gptq": "gptq"}.get(method, method)
    return {k: v for k, v in out.items() if v is not None}


def weight_gib_on_disk(model_dir: Path) -> float | None:
    files = list(model_dir.glob("*.safetensors")) or list(model_dir.glob("*.bin"))
    if not files:
        return None
    total = 0
    for file in files:
        # A dangling link or an unreadable file weighs nothing here; the engine names it.
        with contextlib.suppress(OSError):
            total += file.resolve().stat().st_size
    return total / GIB


def load_model_facts(resolved: Resolved, environ: Mapping[str, str], *,
                     strict: bool = True) -> ModelFacts:
    """Profile geometry first, then config.json (when on disk) wins field by field.

    A config.json that cannot be used (hfconfig.read_config) or holds a bad field raises
    ModelConfigError; with `strict=False` (the checks, which report it as a finding) it is kept
    in `facts.config_problem` instead, and the config gives no facts at all."""
    facts = ModelFacts()
    for key, attr in PROFILE_FACTS.items():
        raw = resolved.get(key)
        if raw is None or raw == "":
            continue
        value: Any = raw
        try:
            if attr in ("weight_gib", "mamba_state_mib"):
                value = float(raw)
            elif attr not in ("kind", "quant"):
                value = int(raw)
        except ValueError:
            continue  # a bad value is reported by the schema check
        setattr(facts, attr, value)
        facts.sources[attr] = f"{key} @ {resolved.source(key)}"

    name = resolved.get_str("VLLM_MODEL")
    hf_cache = profile_hf_cache(resolved)
    model_dir = locate_model_dir(name, environ, hf_cache)
    if model_dir is None and resolved.get_str("VLLM_MODEL_ID"):
        model_dir = locate_model_dir(resolved.get_str("VLLM_MODEL_ID"), environ, hf_cache)
    override = resolved.get_str("VLLM_HF_CONFIG_PATH")
    config_dir = Path(override).expanduser() if override else model_dir
    facts.model_dir = model_dir
    # A config folder that is not there is the files check's finding, not a read error.
    config_path = config_dir / "config.json" if config_dir and config_dir.is_dir() else None
    on_disk = weight_gib_on_disk(model_dir) if model_dir is not None else None
    found: dict[str, Any] = {}
    estimate = None
    try:
        config = read_config(config_path) if config_path is not None else None
        if config is not None:
            found = facts_from_config(config, config_path)
            if model_dir is not None and not on_disk:
                # A folder with a config and no weights is served with --load-format dummy: its
                # geometry and dtype decide the size, not the profile's (other, often
                # quantized) checkpoint: so the config's own quantization, not MODEL_QUANT.
                estimate = estimate_weight_gib(config, found.get("quant"), config_path)
    except ModelConfigError as exc:
        if strict:
            raise
        facts.config_problem, found, estimate = exc, {}, None
    for attr, value in found.items():
        setattr(facts, attr, value)
        facts.sources[attr] = f"config.json at {config_path}"
    if on_disk:
        facts.weight_gib = round(on_disk, 2)
        facts.sources["weight_gib"] = f"weights on disk at {model_dir}"
    elif estimate:
        facts.weight_gib = estimate
        facts.sources["weight_gib"] = (
            f"estimated from config.json at {config_path} (no weight files in {model_dir})")
    return facts


def kv_bytes_per_token_per_gpu(facts: ModelFacts, tp: int, kv_dtype: str) -> int | None:
    """KV cache bytes one token takes on one GPU (full-attention layers only)."""
    if not (facts.full_attention_layers and facts.num_kv_heads and facts.head_dim):
        return None
    per_rank = max(1, facts.num_kv_heads // tp)
    return facts.full_attention_layers * per_rank * facts.head_dim * 2 * dtype_bytes(kv_dtype)


def dtype_bytes(kv_dtype: str) -> int:
    """Bytes per KV element; the 4-bit and 8-bit formats are rounded up to one byte (plus scales),
    so the projection errs on the side of "does not fit"."""
    return 2 if kv_dtype in ("auto", "bfloat16", "float16") else 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def estimate_mamba_blocks(
    facts: ModelFacts, tp: int, kv_dtype: str, kv_available_bytes: float
) -> int | None:
    """Rough block count of a hybrid model's shared KV/Mamba pool (vLLM's page alignment).

    The attention block size grows until an attention page holds a Mamba page; layers are
    grouped by the smaller layer-type count; one block spans every layer of a group.
    """
    if not (facts.is_hybrid and facts.mamba_state_mib and facts.num_layers
            and facts.full_attention_layers and facts.num_kv_heads and facts.head_dim):
        return None
    linear_layers = facts.num_layers - facts.full_attention_layers
    if linear_layers <= 0:
        return None
    mamba_page = facts.mamba_state_mib * MIB / linear_layers / tp
    per_token = max(1, facts.num_kv_heads // tp) * facts.head_dim * 2 * dtype_bytes(kv_dtype)
    align = 16
    block_tokens = align * math.ceil(mamba_page / (align * per_token))
    page = block_tokens * per_token
    group_size = min(facts.full_attention_layers, linear_layers)
    bytes_per_block = group_size * page
    return int(kv_available_bytes // bytes_per_block) if bytes_per_block else None

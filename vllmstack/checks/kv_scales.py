"""The fp8 KV-cache scales a model folder carries (`invoke calibrate-kv` makes them).

With VLLM_KV_CACHE_DTYPE=fp8 and a calibrated copy as VLLM_MODEL, `up` (which refuses on error
findings) will not start on scales that are zero or not finite, nor on a copy whose source
checkpoint changed since it was measured: the fix is `invoke calibrate-kv`, which rebuilds it. A
model without any KV scales gets a warning: vLLM then quantizes with scale 1.0.

The helpers below are also what `models/kv_calibration.py` writes and judges with.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllmstack.checks.context import CheckContext
from vllmstack.core.findings import Finding

SIDECAR = "vllmstack-kv-calibration.json"


def source_revision(folder: Path) -> str:
    """A Hugging Face snapshot's revision (its folder name under snapshots/); for any other
    folder a hash of config.json and each weight file's name, size and mtime (hashing tens of GB
    of weights before every `up` would cost minutes)."""
    if folder.parent.name == "snapshots":
        return folder.name
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name == "config.json":
            digest.update(path.read_bytes())
        elif path.suffix in (".safetensors", ".bin") or path.name.endswith(".index.json"):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return "local-" + digest.hexdigest()[:16]


def scale_problems(scales: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every scale must be a finite number above zero (a zero scale divides by zero in the cache)."""
    if not scales:
        return ["no attention layer was measured"]
    bad = []
    for layer, pair in scales.items():
        for key in ("k_scale", "v_scale"):
            value = pair.get(key)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                bad.append(f"{layer}.{key}={value!r}")
    return [f"{len(bad)} scale(s) zero, negative or not finite: {', '.join(bad[:4])}"] if bad else []


def read_sidecar(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / SIDECAR).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _has_kv_scales(folder: Path) -> bool:
    """A checkpoint that brings its own KV scales: an FP8 one, or a kv_cache_scheme."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True  # unreadable: rule_files_exist and vLLM say so
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and (quant.get("kv_cache_scheme") is not None
                                        or str(quant.get("quant_method", "")).lower() == "fp8")


def rule_kv_scales(ctx: CheckContext) -> list[Finding]:
    kv_dtype = ctx.get("VLLM_KV_CACHE_DTYPE")
    folder = ctx.facts.model_dir
    if not kv_dtype.startswith("fp8") or folder is None:
        return []
    key, source = "VLLM_MODEL", ctx.resolved.source("VLLM_MODEL")
    fix = f"invoke calibrate-kv --model {ctx.resolved.profile} (it rebuilds the calibrated copy)"
    sidecar = read_sidecar(folder)
    if sidecar is None:
        if _has_kv_scales(folder):
            return []
        return [Finding("warning", "kv-scales-default", f"fp8 KV cache on {folder}, which carries no KV "
                        "scales: vLLM quantizes K and V with scale 1.0 (clipping beyond 448)", key, source,
                        f"invoke calibrate-kv --model {ctx.resolved.profile}, then serve the copy it writes")]
    problems = scale_problems(sidecar.get("scales") or {})
    if problems:
        return [Finding("error", "kv-scales-unusable", f"the calibrated copy {folder} has unusable KV "
                        f"scales: {'; '.join(problems)}", key, source, fix)]
    original = Path(str(sidecar.get("source") or ""))
    if not (original / "config.json").is_file():
        return [Finding("error", "kv-calibration-stale", f"the checkpoint {original} that {folder} was "
                        "calibrated from is gone (its files are linked, not copied)", key, source, fix)]
    now = source_revision(original)
    if now != sidecar.get("source_revision"):
        return [Finding("error", "kv-calibration-stale", f"{original} changed since {folder} was "
                        f"calibrated ({sidecar.get('source_revision')} -> {now}): its scales describe "
                        "other weights", key, source, fix)]
    return []

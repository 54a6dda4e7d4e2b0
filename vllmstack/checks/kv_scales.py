"""The fp8 KV-cache scales a model folder carries (`invoke calibrate-kv` makes them).

With VLLM_KV_CACHE_DTYPE=fp8 and a calibrated copy as VLLM_MODEL (set by hand, or by `up` for
VLLM_KV_SCALES=calibrated), `up` (which refuses on error findings) will not start on scales that
are zero or not finite, nor on a copy whose source checkpoint is gone. A copy whose source changed
is rebuilt by `up` before these rules run, so `check` only warns of it. A model without any KV
scales gets a warning: vLLM then quantizes with scale 1.0.

The copy, its sidecar and the freshness rules are tune/kv_copy.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllmstack.checks.context import CheckContext
from vllmstack.core.cpu import describe_isa
from vllmstack.core.findings import Finding
from vllmstack.image.cpu import fp8_kv_serves, is_cpu_platform
from vllmstack.tune.kv_copy import (
    KV_SCALES_KEY,
    CalibrationError,
    plan_calibration,
    read_sidecar,
    scale_problems,
    source_revision,
)


def _has_kv_scales(folder: Path) -> bool:
    """A checkpoint that brings its own KV scales: an FP8 one, or a kv_cache_scheme."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True  # unreadable: rule_files_exist and vLLM say so
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and (quant.get("kv_cache_scheme") is not None
                                        or str(quant.get("quant_method", "")).lower() == "fp8")


CONTAINER_RUNTIMES = ("compose", "compose-v1", "podman")


def _calibrated_setting(ctx: CheckContext, folder: Path | None) -> list[Finding]:
    """VLLM_KV_SCALES=calibrated: what `up` will serve, and what stops it."""
    if ctx.resolved.get_str(KV_SCALES_KEY) != "calibrated" or not ctx.usable(KV_SCALES_KEY):
        return []
    kv_dtype = ctx.resolved.get_str("VLLM_KV_CACHE_DTYPE")
    if not kv_dtype.startswith("fp8"):
        return [ctx.finding("error", "kv-scales-not-fp8", KV_SCALES_KEY,
                            f"{KV_SCALES_KEY}=calibrated serves a copy whose config.json declares an "
                            f"fp8 KV cache, but VLLM_KV_CACHE_DTYPE is {kv_dtype}",
                            f"set VLLM_KV_CACHE_DTYPE=fp8, or {KV_SCALES_KEY}=checkpoint")]
    found = []
    if ctx.get("VLLM_HF_CONFIG_PATH"):
        found.append(ctx.finding(
            "error", "kv-scales-config-replaced", "VLLM_HF_CONFIG_PATH",
            "the calibrated copy's config.json is what makes vLLM load its KV scales, and "
            "VLLM_HF_CONFIG_PATH replaces it: the scales would not be used",
            f"unset VLLM_HF_CONFIG_PATH, or set {KV_SCALES_KEY}=checkpoint"))
    if ctx.runtime in CONTAINER_RUNTIMES and not ctx.get("MODELS_DIR"):
        found.append(ctx.finding(
            "error", "kv-calibration-needs-models-dir", KV_SCALES_KEY,
            f"{KV_SCALES_KEY}=calibrated on {ctx.runtime} needs MODELS_DIR: the calibrated copy goes "
            "there, the one host folder the engine container sees at its own path",
            "set MODELS_DIR in .env (a folder for local model copies, on the file system of the HF "
            "cache so that the copy can hard-link the checkpoint's files)"))
    if folder is not None and read_sidecar(folder) is None:
        try:
            target = plan_calibration(ctx.project, ctx.resolved, ctx.environ).target
        except CalibrationError as exc:
            found.append(ctx.finding("error", "kv-calibration-impossible", "VLLM_MODEL", exc.cause, exc.fix))
        else:
            found.append(ctx.finding(
                "info", "kv-calibration-served", KV_SCALES_KEY,
                f"`up` serves the calibrated copy {target}: it measures the scales first when the "
                "copy is missing or stale (minutes), and uses it as it is when fresh", None))
    return found


def _runs_the_cpu_build(ctx: CheckContext) -> bool:
    """Whether the engine is vLLM's CPU build: natively the +cpu install (not a command of the
    user's own), in a container the platform's own image (an image the profile or the user
    names, such as the engine simulator, may be anything)."""
    if ctx.runtime == "native":
        return ctx.get("NATIVE_ENGINE_VERSION").endswith("+cpu") and not ctx.get("NATIVE_ENGINE_COMMAND")
    source = ctx.resolved.source("VLLM_IMAGE") or "default"
    return source == "default" or source.startswith("env/platforms/")


def rule_cpu_fp8_kv(ctx: CheckContext) -> list[Finding]:
    """vLLM's CPU build keeps an fp8 KV cache only on x86 with AVX-512 or AMX (image/cpu.py,
    fp8_kv_serves); the engine runs on this host's CPU natively and in a container alike, so a
    CPU without them is refused here instead of in the engine's attention backend a boot later."""
    dtype = ctx.get("VLLM_KV_CACHE_DTYPE")
    if not is_cpu_platform(ctx.resolved) or not dtype.startswith("fp8") or \
            not ctx.usable("VLLM_KV_CACHE_DTYPE") or not _runs_the_cpu_build(ctx):
        return []
    flags = set(ctx.host_cpu_flags())
    if not flags or fp8_kv_serves(flags):
        return []  # unknown flags: not held against it
    return [ctx.finding(
        "error", "cpu-fp8-kv", "VLLM_KV_CACHE_DTYPE",
        f"VLLM_KV_CACHE_DTYPE={dtype} on vLLM's CPU build needs AVX-512 or AMX (its cpu_attn "
        f"backend refuses it otherwise: \"FP8 KV cache on CPU requires x86 with AVX-512 or AMX.\"), "
        f"and this CPU has {describe_isa(flags)}",
        "serve it with VLLM_KV_CACHE_DTYPE=auto on this host (the calibrated copy's scales are "
        "then unused), or on a CPU with AVX-512/AMX or a GPU")]


def rule_kv_scales(ctx: CheckContext) -> list[Finding]:
    folder = ctx.facts.model_dir
    found = _calibrated_setting(ctx, folder)
    if not ctx.get("VLLM_KV_CACHE_DTYPE").startswith("fp8") or folder is None:
        return found
    key, source = "VLLM_MODEL", ctx.resolved.source("VLLM_MODEL")
    fix = f"invoke calibrate-kv --model {ctx.resolved.profile} (it rebuilds the calibrated copy)"
    sidecar = read_sidecar(folder)
    if sidecar is None:  # the checkpoint itself
        if found or _has_kv_scales(folder):
            return found  # VLLM_KV_SCALES=calibrated: `up` serves the copy, not this folder
        return [Finding("warning", "kv-scales-default", f"fp8 KV cache on {folder}, which carries no "
                        "KV scales: vLLM quantizes K and V with scale 1.0 (clipping beyond 448)", key,
                        source, f"set {KV_SCALES_KEY}=calibrated (`up` then calibrates a copy and "
                        f"serves it), or run invoke calibrate-kv --model {ctx.resolved.profile}")]
    # A calibrated copy. A zero scale is refused, never re-measured: that would hide what wrote it.
    problems = scale_problems(sidecar.get("scales") or {})
    if problems:
        return [*found, Finding("error", "kv-scales-unusable", f"the calibrated copy {folder} has "
                                f"unusable KV scales: {'; '.join(problems)}", key, source,
                                f"invoke calibrate-kv --model {ctx.resolved.profile} --force")]
    original = Path(str(sidecar.get("source") or ""))
    if not (original / "config.json").is_file():
        return [*found, Finding("error", "kv-calibration-stale", f"the checkpoint {original} that "
                                f"{folder} was calibrated from is gone (its files are linked, not "
                                "copied)", key, source, fix)]
    now = source_revision(original)
    if now == sidecar.get("source_revision"):
        return found
    changed = (f"{original} changed since {folder} was calibrated ({sidecar.get('source_revision')} "
               f"-> {now}): its scales describe other weights")
    # A warning, not an error: `up` repairs it, but costs minutes there the user should expect.
    return [*found, Finding("warning", "kv-calibration-stale", changed + "; `up` measures them again "
                            "and rebuilds the copy before the engine starts", key, source, None)]

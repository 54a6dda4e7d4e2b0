"""Checks of the GPU vendor's runtime settings: HSA override, AITER, ROCm variables on NVIDIA.

A new check goes here when it is about GPU_VENDOR / GPU_ARCH and the vendor-specific environment
(HSA_*, HIP_*, VLLM_ROCM_*) or an attention backend that only some archs have.
"""

from __future__ import annotations

from vllmstack.checks.context import CheckContext
from vllmstack.core.findings import Finding

# Archs the ROCm images compile kernels for (PYTORCH_ROCM_ARCH of vLLM's ROCm base).
IMAGE_ARCHS = {"gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1200", "gfx1201",
               "gfx1150", "gfx1151"}
# Where AITER has kernels at all: CK paths on gfx9, its Triton kernels on RDNA4.
AITER_ARCH_PREFIXES = ("gfx9", "gfx120")


def rule_rocm(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    values = ctx.resolved.values
    override = values.get("HSA_OVERRIDE_GFX_VERSION")
    if override is not None and not override.value.strip():
        out.append(ctx.finding(
            "error", "hsa-override-empty", "HSA_OVERRIDE_GFX_VERSION",
            "HSA_OVERRIDE_GFX_VERSION is set but empty: the HSA runtime then finds no GPU at all",
            fix="delete the line, or set a version such as 11.0.0"))
    elif override is not None and ctx.is_amd and ctx.arch in IMAGE_ARCHS:
        out.append(ctx.finding(
            "warning", "hsa-override-unneeded", "HSA_OVERRIDE_GFX_VERSION",
            f"{ctx.arch} has its own kernels in the image; the override makes vLLM's arch checks "
            "and the loaded kernels disagree", fix="delete HSA_OVERRIDE_GFX_VERSION"))
    if ctx.is_amd and ctx.arch and ctx.arch not in IMAGE_ARCHS and override is None:
        out.append(ctx.finding(
            "warning", "hsa-override-missing", "GPU_ARCH",
            f"{ctx.arch} has no kernels in the ROCm images; without an override no kernel loads",
            fix="set HSA_OVERRIDE_GFX_VERSION=11.0.0 (RDNA3) in the platform layer"))
    aiter_on = ctx.resolved.get_bool("VLLM_ROCM_USE_AITER")
    has_aiter = ctx.is_amd and ctx.arch.startswith(AITER_ARCH_PREFIXES)
    backend = ctx.get("ATTENTION_BACKEND")
    if backend.startswith("ROCM_AITER") and not has_aiter:
        out.append(ctx.finding(
            "error", "aiter-backend-unsupported", "ATTENTION_BACKEND",
            f"attention backend {backend} needs AITER, which has no kernels for "
            f"{ctx.arch or ctx.get('GPU_VENDOR')}",
            fix="use ATTENTION_BACKEND=TRITON_ATTN (or leave it empty)"))
    elif aiter_on and not has_aiter:
        out.append(ctx.finding(
            "warning", "aiter-no-effect", "VLLM_ROCM_USE_AITER",
            f"AITER is enabled but has no path on {ctx.arch or ctx.get('GPU_VENDOR')}: it does nothing",
            fix="remove VLLM_ROCM_USE_AITER* from this platform's layers"))
    if ctx.get("GPU_VENDOR") == "nvidia":
        rocm_keys = [k for k in values if k.startswith(("HIP_", "HSA_", "ROCR_"))]
        if rocm_keys:
            out.append(ctx.finding("warning", "rocm-env-on-nvidia", rocm_keys[0],
                                   f"ROCm variables on an NVIDIA platform: {', '.join(rocm_keys)}",
                                   fix="remove them; use CUDA_VISIBLE_DEVICES"))
    return out

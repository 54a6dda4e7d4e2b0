"""Checks of the known RDNA4 (gfx1201, Radeon AI PRO R9700) failures, before boot (issue 39).

Each rule names the thread it comes from; docs/troubleshooting.md ("RDNA4") has the symptoms.
* TP >= 2 without NCCL_PROTO=Simple deadlocks in RCCL's LL protocol (ROCm/rocm-systems#5480,
  vllm-project/vllm#40980), unless the image's RCCL carries the fix (none does yet).
* A fp8 KV cache on the AITER unified-attention backend: vllm-project/vllm#46192 says that path
  takes bf16/fp16 KV only; the AITER the stack pins (v0.1.24.post1) serves fp8 KV on gfx1201
  (shared/reference/seeds/r9700-serving-readme.txt: the live qwen3.8-27b profile).
* An image built for other archs aborts silently on the first kernel launch (ROCm/aiter#5229, the
  bench rig's README in shared/reference/seeds): `image_arch_findings` reads the build labels.
MTP with concurrency (vllm-project/vllm#35288) is scheduler.py's `mtp-depth-vs-seqs`, and an
HSA override on gfx1201 rocm.py's `hsa-override-unneeded`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from vllmstack.checks.context import CheckContext
from vllmstack.config.profiles import Resolved
from vllmstack.core.findings import Finding
from vllmstack.image.build import PIN_LABEL, ROCM_RELEASE_LABEL
from vllmstack.runtime.engine_env import engine_environment

# The archs whose RCCL picks the LL protocol by itself (rcclGetProtoForGfx12, ROCm/rocm-systems#5480).
LL_DEADLOCK_ARCH_PREFIX = "gfx12"
# The first ROCm release whose RCCL carries the gfx12 LL memory-ordering fixes (rocm-systems
# #6966/#7183). None: no public release up to ROCm 7.2.4 has them (issue 39), so no image passes.
FIRST_FIXED_RCCL: tuple[int, int] | None = None
RCCL_SOURCES = "ROCm/rocm-systems#5480, vllm-project/vllm#40980"
UNIFIED_ATTN = "ROCM_AITER_UNIFIED_ATTN"
# The first AITER release whose unified attention serves a fp8 KV cache on gfx1201: the seed
# R9700 stack runs fp8 KV on it with v0.1.24.post1; vllm#46192 (June 2026) found bf16/fp16 only.
FP8_KV_AITER = (0, 1, 24)
AITER_TAG = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")
ARCH_SOURCES = "ROCm/aiter#5229; shared/reference/seeds/vllm-vs-llamacpp-bench-rig.txt"


def rccl_carries_fix(labels: Mapping[str, str] | None) -> bool:
    """The image says its ROCm release, and that release's RCCL has the LL fix."""
    built = (labels or {}).get(ROCM_RELEASE_LABEL, "")
    match = re.fullmatch(r"(\d+)\.(\d+)", built)
    return (FIRST_FIXED_RCCL is not None and match is not None
            and (int(match.group(1)), int(match.group(2))) >= FIRST_FIXED_RCCL)


def rule_rccl_ll_protocol(ctx: CheckContext) -> list[Finding]:
    tp = ctx.int("VLLM_TP") or 1
    if not (ctx.is_amd and ctx.arch.startswith(LL_DEADLOCK_ARCH_PREFIX) and tp >= 2):
        return []
    proto = engine_environment(ctx.resolved, ctx.schema).get("NCCL_PROTO", "")
    if avoids_ll(proto):
        return []
    return [ctx.finding(
        "error", "rccl-ll-deadlock", "NCCL_PROTO" if proto else "VLLM_TP",
        f"{ctx.arch} at VLLM_TP={tp} without NCCL_PROTO=Simple: RCCL picks its LL protocol for "
        "small all-reduces on gfx12, and that path lacks gfx12's memory-ordering fixes, so the "
        f"engine hangs at 100 % GPU with no log line ({RCCL_SOURCES}; no public RCCL release up "
        "to ROCm 7.2.4 has the fix)",
        fix="set NCCL_PROTO=Simple in the platform layer (env/platforms/2xr9700.env does)")]


def rule_fp8_kv_backend(ctx: CheckContext) -> list[Finding]:
    dtype = ctx.get("VLLM_KV_CACHE_DTYPE")
    backend = ctx.get("ATTENTION_BACKEND")
    if not (ctx.is_amd and ctx.arch.startswith("gfx12") and dtype.startswith("fp8")
            and backend == UNIFIED_ATTN):
        return []
    ref = ctx.get("AITER_REF")
    match = AITER_TAG.match(ref)
    if match and tuple(int(g) for g in match.groups()) >= FP8_KV_AITER:
        return []
    known = match is not None
    return [ctx.finding(
        "error" if known else "warning", "fp8-kv-unified-attn", "VLLM_KV_CACHE_DTYPE",
        f"VLLM_KV_CACHE_DTYPE={dtype} with {UNIFIED_ATTN} on {ctx.arch}: AITER's unified attention "
        f"takes bf16/fp16 KV only before v{'.'.join(map(str, FP8_KV_AITER))} (vllm-project/vllm"
        f"#46192, ROCm/aiter#3294); AITER_REF={ref or '(unset)'} "
        + ("is older" if known else "is not a release tag, so it cannot be told"),
        fix="set VLLM_KV_CACHE_DTYPE=bfloat16, or pin AITER_REF=v0.1.24.post1 or newer")]


def image_arch_findings(resolved: Resolved, labels: Mapping[str, str] | None) -> list[Finding]:
    """The engine image's build labels against the card: an image built for other archs has no
    code objects for it, and the engine dies at its first kernel launch with only `Failed core
    proc(s): {}` to show. No label (not built by `invoke build`, or no image): unknown, quiet."""
    arch = resolved.get_raw("GPU_ARCH").strip()
    built = (labels or {}).get(PIN_LABEL + "gpu_arch")
    if resolved.get_str("GPU_VENDOR") != "amd" or not arch or built is None:
        return []
    archs = [a for a in re.split(r"[;,\s]+", built) if a]
    if arch in archs:
        return []
    override = resolved.get_raw("HSA_OVERRIDE_GFX_VERSION").strip()
    image = resolved.get_str("VLLM_IMAGE")
    return [Finding(
        "error", "image-lacks-arch",
        f"{image} was built for {', '.join(archs) or 'no arch'}, not {arch}: it has no {arch} "
        "code objects, so the first kernel launch aborts the engine core silently (the API "
        f"server only says `Failed core proc(s): {{}}`; {ARCH_SOURCES})"
        + (f"; HSA_OVERRIDE_GFX_VERSION={override} helps only where the ISA matches" if override
           else ""),
        key="GPU_ARCH", source=resolved.source("GPU_ARCH"),
        fix=f"invoke build --platform {resolved.platform} (builds for GPU_ARCH={arch}), or set "
            "VLLM_IMAGE to an image built for it")]


def avoids_ll(proto: str) -> bool:
    """NCCL_PROTO as NCCL reads it: a comma list of LL, LL128, Simple to allow, or after `^` to
    leave out. Only a value that keeps plain LL out avoids the deadlock."""
    text = proto.strip()
    excluded = text.startswith("^")
    names = {p.strip().lower() for p in text.lstrip("^").split(",") if p.strip()}
    return ("ll" in names) if excluded else bool(names) and "ll" not in names


def with_image_labels(findings: list[Finding], resolved: Resolved,
                      labels: Mapping[str, str] | None) -> list[Finding]:
    """`check`'s findings once the engine image's labels are read: its arch findings added, and
    the LL-deadlock error dropped where the image's RCCL carries the fix (none does yet)."""
    kept = [f for f in findings if not (f.code == "rccl-ll-deadlock" and rccl_carries_fix(labels))]
    return kept + image_arch_findings(resolved, labels)

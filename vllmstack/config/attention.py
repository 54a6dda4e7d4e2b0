"""The attention backends a fix may offer, and the wording that never offers the one a profile
already uses (issue 39: the depth-decay probe told a TRITON_ATTN profile to try TRITON_ATTN).

The names are vLLM's registry enum (vllm/v1/attention/backends/registry.py; the members are in
shared/reference/vllm-facts.md, "Attention backend names in the enum"). The probe's verdicts and
the boot diagnosis both word their advice through `offer_backends`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

UNIFIED_AITER = "ROCM_AITER_UNIFIED_ATTN"
# What to try instead when a backend is slow or broken, first choice first, per GPU_VENDOR. On
# AMD, ROCM_ATTN (the ROCm default, first in rocm.py's priorities) comes last: it is the path
# whose decode collapses at long context on gfx1201 (vllm-project/vllm#46192).
ALTERNATIVES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "nvidia": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"),
    "amd": ("TRITON_ATTN", UNIFIED_AITER, "ROCM_ATTN"),
})


def other_backends(candidates: Sequence[str], current: str | None) -> list[str]:
    """The candidates without the one in use (ATTENTION_BACKEND; empty: vLLM's own choice)."""
    used = (current or "").strip().upper()
    return [name for name in candidates if name != used]


def offer_backends(candidates: Sequence[str], current: str | None) -> str:
    """`ATTENTION_BACKEND=A, B or C` of the candidates the profile does not use, saying so where
    it already uses one of them; "" where none is left."""
    offered = other_backends(candidates, current)
    if not offered:
        return ""
    names = offered[0] if len(offered) == 1 else ", ".join(offered[:-1]) + " or " + offered[-1]
    used = (current or "").strip().upper()
    already = f" (it uses {used} already)" if used in candidates else ""
    return f"ATTENTION_BACKEND={names}{already}"

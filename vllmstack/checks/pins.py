"""Checks of the build pins and source overlays: vLLM ref vs version, the torch wheels' ROCm
suffix vs the base image, the full build's own pins, and overlays locked to another vLLM ref.

A new check goes here when it compares versions that must move together (.env.example pins,
image labels, overlays/).
"""

from __future__ import annotations

import re
from pathlib import Path

from vllmstack.checks.context import CheckContext
from vllmstack.core.findings import Finding
from vllmstack.image import build, patches

FULL_BUILD_IMAGE = "localhost/vllm-fullbuild:latest"
VERSION_TAG = re.compile(r"^v?(\d+\.\d+\.\d+(?:(?:rc|\.post|\.dev)\d+)?)$")
ROCM_SUFFIX = re.compile(r"\+rocm(\d+\.\d+(?:\.\d+)?)")
IMAGE_ROCM = re.compile(r":(\d+\.\d+(?:\.\d+)?)")


def rule_pins(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    if ctx.get("VLLM_IMAGE") == FULL_BUILD_IMAGE and ctx.is_amd:
        # The engine image is built here: everything the build needs must be there.
        out += build.pin_findings(ctx.project, ctx.resolved)
    ref, version = ctx.get("VLLM_REF"), ctx.get("VLLM_VERSION")
    match = VERSION_TAG.match(ref)
    if match and version and match.group(1) != version:
        out.append(ctx.finding(
            "error", "pin-vllm-mismatch", "VLLM_VERSION",
            f"VLLM_REF={ref} ({ctx.src('VLLM_REF')}) is release {match.group(1)} but "
            f"VLLM_VERSION={version}", fix=f"set VLLM_VERSION={match.group(1)} (bump both together)"))
    image_match = IMAGE_ROCM.search(ctx.get("ROCM_IMAGE").rsplit("/", 1)[-1])
    torch_match = ROCM_SUFFIX.search(ctx.get("TORCH_VERSION"))
    if image_match and torch_match and not _same_version(image_match.group(1), torch_match.group(1)):
        out.append(ctx.finding(
            "error", "pin-rocm-mismatch", "TORCH_VERSION",
            f"TORCH_VERSION is built for ROCm {torch_match.group(1)} but ROCM_IMAGE is ROCm "
            f"{image_match.group(1)}", fix="pick torch wheels whose +rocm suffix matches the image"))
    if torch_match:
        for key in ("TORCHVISION_VERSION", "TORCHAUDIO_VERSION"):
            other = ROCM_SUFFIX.search(ctx.get(key))
            if other and not _same_version(other.group(1), torch_match.group(1)):
                out.append(ctx.finding(
                    "error", "pin-rocm-mismatch", key,
                    f"{key} is built for ROCm {other.group(1)}, TORCH_VERSION for "
                    f"{torch_match.group(1)}", fix="use the same +rocm suffix for all torch wheels"))
    return out


def _same_version(a: str, b: str) -> bool:
    def norm(v: str) -> tuple[int, ...]:
        parts = [int(p) for p in v.split(".")]
        return tuple(parts + [0] * (3 - len(parts)))
    return norm(a) == norm(b)


def rule_overlays(ctx: CheckContext) -> list[Finding]:
    """Overlays replace vLLM files wholesale: one made for another ref silently reverts code."""
    try:
        overlays = patches.load_overlays(ctx.project)
    except (ValueError, OSError) as exc:
        return [Finding("error", "overlay-manifest", str(exc), fix="fix the overlay manifest")]
    out: list[Finding] = []
    pin = ctx.get("VLLM_REF")
    for overlay in overlays:
        if not Path(overlay.file).is_file():
            out.append(Finding("error", "overlay-missing", f"overlay file {overlay.file} is missing",
                               fix="restore it or remove it from the manifest"))
        elif pin and overlay.ref != pin and ctx.runtime == "native":
            # Overlays are mounted into containers; the native runtime runs the installed vLLM
            # as it is, so another version there is no reason to fail.
            out.append(ctx.finding(
                "info", "overlay-ref-mismatch", "VLLM_REF",
                f"overlay {overlay.name} is locked to vLLM {overlay.ref}, VLLM_REF={pin}: not "
                "applied by the native runtime, so it does not matter here (it would for a "
                "container)", fix="before a container run: invoke verify-patches, then re-derive "
                "the overlay from the new upstream file"))
        elif pin and overlay.ref != pin:
            out.append(ctx.finding(
                "error", "overlay-ref-mismatch", "VLLM_REF",
                f"overlay {overlay.name} is locked to vLLM {overlay.ref} but VLLM_REF={pin}: it "
                "would replace newer upstream code", fix="invoke verify-patches, then re-derive the "
                "overlay from the new upstream file and update its manifest"))
    return out

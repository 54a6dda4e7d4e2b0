"""Which engine a profile runs (ENGINE=vllm | llamacpp) and what follows from it.

The lifecycle is engine-neutral: it asks this module for the engine's name, its image and, for
llama.cpp, the backend its `llama-server` must be built for. Argv builders live beside it
(`vllm_args.py`, `llamacpp_args.py`).
"""

from __future__ import annotations

from vllmstack.config.profiles import Resolved

VLLM = "vllm"
LLAMACPP = "llamacpp"
# How each engine is named to people (tables, guards, status).
DISPLAY = {VLLM: "vLLM", LLAMACPP: "llama.cpp"}
# The llama.cpp backend a platform's GPU vendor needs when LLAMACPP_BACKEND is left empty.
BACKEND_FOR_VENDOR = {"nvidia": "cuda", "amd": "rocm", "none": "cpu"}


def engine_of(resolved: Resolved) -> str:
    """The profile's engine (ENGINE; empty means vLLM)."""
    return resolved.get_str("ENGINE") or VLLM


def display_name(engine: str) -> str:
    return DISPLAY.get(engine, engine)


def llamacpp_backend(resolved: Resolved) -> str:
    """LLAMACPP_BACKEND, else the one the platform's GPU vendor needs (cuda, rocm, cpu)."""
    chosen = resolved.get_str("LLAMACPP_BACKEND")
    return chosen or BACKEND_FOR_VENDOR.get(resolved.get_str("GPU_VENDOR"), "cpu")


def engine_image(resolved: Resolved) -> str:
    """The container image of the profile's engine (compose runtime)."""
    if engine_of(resolved) == LLAMACPP:
        return llamacpp_image_name(resolved)
    return resolved.get_str("VLLM_IMAGE")


def llamacpp_image_name(resolved: Resolved) -> str:
    """LLAMACPP_IMAGE, empty by default: the image is then named after the pinned ref and the
    backend it is built for, which follows from the platform."""
    return (resolved.get_str("LLAMACPP_IMAGE")
            or f"localhost/llamacpp:{resolved.get_str('LLAMACPP_REF')}-{llamacpp_backend(resolved)}")

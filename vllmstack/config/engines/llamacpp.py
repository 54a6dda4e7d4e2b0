"""llama.cpp (ENGINE=llamacpp): `llama-server --model FILE ...` from the schema's llamacpp-flag
keys, built from the pinned source for the platform's backend."""

from __future__ import annotations

from pathlib import Path

from vllmstack.config.engines.kind import EngineKind, Placement
from vllmstack.config.llamacpp_args import MODEL_KEY, build_llamacpp_argv
from vllmstack.config.profiles import Resolved
from vllmstack.config.vllm_args import ServeCommand

ENTRYPOINT = ("llama-server",)
# The llama.cpp backend a platform's GPU vendor needs when LLAMACPP_BACKEND is left empty.
BACKEND_FOR_VENDOR = {"nvidia": "cuda", "amd": "rocm", "none": "cpu"}
# The POST routes that name their model: tools/server/server.cpp at LLAMACPP_REF (its
# ctx_http.post lines), less the admin paths and those naming no model.
ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
    "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/rerank",
    "/v1/rerank", "/v1/audio/transcriptions"})
# A llama.cpp image holds one static server: far smaller than vLLM's, and so is its build.
IMAGE_GIB, BUILD_GIB = 2.0, 6.0


def llamacpp_backend(resolved: Resolved) -> str:
    """LLAMACPP_BACKEND, else the one the platform's GPU vendor needs (cuda, rocm, cpu)."""
    chosen = resolved.get_str("LLAMACPP_BACKEND")
    return chosen or BACKEND_FOR_VENDOR.get(resolved.get_str("GPU_VENDOR"), "cpu")


def llamacpp_image_name(resolved: Resolved) -> str:
    """LLAMACPP_IMAGE, empty by default: the image is then named after the pinned ref and the
    backend it is built for, which follows from the platform."""
    return (resolved.get_str("LLAMACPP_IMAGE")
            or f"localhost/llamacpp:{resolved.get_str('LLAMACPP_REF')}-{llamacpp_backend(resolved)}")


def build(resolved: Resolved, placement: Placement) -> ServeCommand:
    command = build_llamacpp_argv(resolved, host=placement.host, models_dir=placement.models_dir)
    command.argv = placement.place(command.argv)
    return command


def model_label(resolved: Resolved) -> str:
    return resolved.get_raw(MODEL_KEY)


def draft_label(resolved: Resolved) -> str:
    kinds = resolved.get_raw("LLAMACPP_SPEC_TYPE")
    draft = resolved.get_raw("LLAMACPP_DRAFT_MODEL")
    if not kinds and not draft:
        return "-"
    what = ", ".join(part for part in (kinds, Path(draft).name if draft else "") if part)
    return f"{what} ×{resolved.get_int('LLAMACPP_DRAFT_MAX')}"


def foreign_setting(key: str, becomes: str | None) -> bool:
    # All of llama.cpp's keys are its own; of vLLM's, VLLM_PORT and a few more serve both.
    return becomes == "vllm-flag"


KIND = EngineKind(
    name="llamacpp", display="llama.cpp", entrypoint=ENTRYPOINT, model_key=MODEL_KEY,
    image_key="LLAMACPP_IMAGE", image=llamacpp_image_name, build=build, model_label=model_label,
    draft_label=draft_label, foreign_setting=foreign_setting, loading_503=True, sleeps=False,
    model_file=True, vllm_cli=False,
    # llama-server closes the connection after every streamed response without a `Connection:
    # close` header (its chunked content provider returns false at the end, which cpp-httplib
    # treats as an error: tools/server/server-http.cpp, b9993), so a request sent on it meanwhile
    # is lost: one connection per request.
    keep_alive=False, gpus_from_argv=False, routes=ROUTES, image_gib=(IMAGE_GIB, BUILD_GIB))

"""vLLM (ENGINE=vllm, the default): `vllm serve MODEL ...` from the schema's vllm-flag keys."""

from __future__ import annotations

import json
from pathlib import Path

from vllmstack.config.engines.kind import EngineKind, Placement
from vllmstack.config.profiles import Resolved
from vllmstack.config.vllm_args import (
    CONTAINER_CHAT_TEMPLATES,
    MODEL_KEY,
    ServeCommand,
    build_serve_argv,
)

ENTRYPOINT = ("vllm", "serve")
# The POST routes that name their model: the route list vLLM 0.27.1 prints at boot (launcher.py
# "Route:" lines; ../shared/reference/vllm-captures/boot.log), plus the routes it adds for a
# pooling model (vllm/entrypoints/pooling: embeddings, pooling, classify, score, rerank) and a
# speech-to-text one (openai/speech_to_text: audio). Left out: the dev and admin paths, the
# render/batch/control extras, and the routes naming no model.
ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
    "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/pooling",
    "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
    "/v1/audio/transcriptions", "/v1/audio/translations"})


def build(resolved: Resolved, placement: Placement) -> ServeCommand:
    command = build_serve_argv(resolved, host=placement.host,
                               chat_template_dir=placement.chat_template_dir or CONTAINER_CHAT_TEMPLATES)
    command.argv = placement.place(command.argv)
    return command


def model_label(resolved: Resolved) -> str:
    return resolved.get_str(MODEL_KEY)


def draft_label(resolved: Resolved) -> str:
    raw = resolved.get_raw("VLLM_SPEC_DECODE")
    if not raw:
        return "-"
    try:
        config = json.loads(raw)
    except ValueError:
        return raw  # `check` names the bad JSON; a table shows what was written
    if not isinstance(config, dict):
        return raw
    method = config.get("method") or (Path(str(config["model"])).name if config.get("model")
                                      else "draft")
    depth = config.get("num_speculative_tokens")
    return f"{method} ×{depth}" if depth else str(method)


def foreign_setting(key: str, becomes: str | None) -> bool:
    return key.startswith("LLAMACPP_")


KIND = EngineKind(
    name="vllm", display="vLLM", entrypoint=ENTRYPOINT, model_key=MODEL_KEY,
    image_key="VLLM_IMAGE", image=lambda resolved: resolved.get_str("VLLM_IMAGE"), build=build,
    model_label=model_label, draft_label=draft_label, foreign_setting=foreign_setting,
    loading_503=False, sleeps=True, model_file=False, vllm_cli=True, keep_alive=True,
    gpus_from_argv=True, routes=ROUTES)

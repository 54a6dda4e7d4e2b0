"""The `vllm serve` argv of every shipped model profile on every shipped platform, byte for byte.

tests/data/serve_argv_golden.json was generated from the argv builder before its flag table
moved into schema.yaml; any change to the argv a profile produces shows up here. ENGINE=llamacpp
profiles record llama-server's argv (config/llamacpp_args.py) instead of vLLM's. When a change
is intended, regenerate the file and review its diff:

  VLLMSTACK_REGEN_GOLDEN=1 python3 -m pytest -q tests/test_argv_golden.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from helpers import copy_project

from vllmstack.config.engines.kind import Placement
from vllmstack.config.engines.table import engine_kind
from vllmstack.config.profiles import list_profiles, resolve
from vllmstack.config.vllm_args import ArgvError
from vllmstack.core.paths import Project

GOLDEN = Path(__file__).resolve().parent / "data" / "serve_argv_golden.json"
ENVIRON = {"HOME": "/home/golden"}
# Settings that exercise the builder's special cases (bools, JSON, args, spec decode) beyond
# what the shipped profiles set, each on one profile that has spec decode and one that has not.
VARIANTS: dict[str, list[str]] = {
    "plain": [],
    # VLLM_PORT= gave `--port 8000` before the schema default (8180, what compose publishes)
    # became the one fallback; that is the one intended change to this file since it was made.
    "switches": ["VLLM_ENABLE_PREFIX_CACHING=false", "VLLM_ENFORCE_EAGER=true",
                 "VLLM_CHAT_TEMPLATE=tool.jinja", "VLLM_TOKENIZER=", "VLLM_PORT=",
                 "ATTENTION_BACKEND=TRITON_ATTN"],
    "args": ["VLLM_EXTRA_ARGS=--async-scheduling --max-num-seq 3",
             "VLLM_PROFILER_ARGS='--profiler-config {\"a\": 1}'",
             "VLLM_GENERATION_CONFIG={\"top_k\":  5}", "VLLM_ENABLE_PREFIX_CACHING="],
    "spec-backend": ['VLLM_SPEC_DECODE={"method": "mtp", "attention_backend": "FLASH_ATTN"}',
                     "ATTENTION_BACKEND=TRITON_ATTN"],
}
VARIANT_MODELS = ("qwen3.8-27b", "qwen3.8-27b-awq")
# ENGINE=llamacpp profiles name their GGUF relative to MODELS_DIR, which no shipped layer sets.
LLAMACPP_SETS = ["MODELS_DIR=/models"]
# The llama-server builder's special cases: a bool switched off, a draft model (relative and
# absolute), a layer count, extra args, an empty value that drops a flag the profile set.
LLAMACPP_VARIANTS: dict[str, list[str]] = {
    "switches": ["LLAMACPP_KV_UNIFIED=false", "LLAMACPP_GPU_LAYERS=20", "LLAMACPP_CTX=",
                 "LLAMACPP_CACHE_TYPE_K=q8_0", "LLAMACPP_CACHE_TYPE_V=q8_0", "VLLM_PORT=8999"],
    "draft": ["LLAMACPP_DRAFT_MODEL=Qwen3-0.6B-Q8_0.gguf", "LLAMACPP_SPEC_TYPE=draft-simple",
              "LLAMACPP_DRAFT_MAX=4", "LLAMACPP_N_CPU_MOE=2",
              "LLAMACPP_EXTRA_ARGS=--cache-ram 0 --chat-template-kwargs '{\"enable_thinking\": false}'"],
    "absolute": ["LLAMACPP_MODEL=/srv/gguf/model.gguf", "LLAMACPP_DRAFT_MODEL=/srv/gguf/draft.gguf",
                 "LLAMACPP_THREADS=8"],
}
LLAMACPP_VARIANT_MODELS = ("qwen3.6-27b-gguf",)


def _argv(project: Project, platform: str, model: str, sets: list[str]) -> dict[str, Any]:
    resolved = resolve(project, platform=platform, model=model, overrides=sets, environ=ENVIRON)
    if engine_kind(resolved).model_file:
        resolved = resolve(project, platform=platform, model=model,
                           overrides=[*LLAMACPP_SETS, *sets], environ=ENVIRON)
    try:
        command = engine_kind(resolved).build(resolved, Placement())  # a container's argv
    except ArgvError as exc:
        return {"error": str(exc)}
    return {"argv": command.argv, "notes": [f"{n.severity} {n.code}" for n in command.notes]}


def current(project: Project) -> dict[str, Any]:
    profiles = list_profiles(project)
    platforms = [p.name for p in profiles if p.kind == "platform"]
    models = [p.name for p in profiles if p.kind == "model"]
    out: dict[str, Any] = {}
    for model in models:
        for platform in platforms:
            out[f"{model} on {platform}"] = _argv(project, platform, model, [])
    for model in VARIANT_MODELS:
        for name, sets in VARIANTS.items():
            out[f"{model} on 2xr9700 ({name})"] = _argv(project, "2xr9700", model, sets)
    for model in LLAMACPP_VARIANT_MODELS:
        for name, sets in LLAMACPP_VARIANTS.items():
            out[f"{model} on nvidia ({name})"] = _argv(project, "nvidia", model, sets)
    return out


def test_every_profile_on_every_platform_builds_the_recorded_argv(tmp_path: Path) -> None:
    # A copy without .env: the pins of .env.example, whatever this checkout's .env says.
    project = Project(copy_project(tmp_path / "stack"))
    got = current(project)
    if os.environ.get("VLLMSTACK_REGEN_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    want = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert sorted(got) == sorted(want)
    changed = {k: (want[k], got[k]) for k in want if got[k] != want[k]}
    assert changed == {}

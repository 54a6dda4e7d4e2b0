"""The `vllm serve` argv of every shipped model profile on every shipped platform, byte for byte.

tests/data/serve_argv_golden.json was generated from the argv builder before its flag table
moved into schema.yaml; any change to the argv a profile produces shows up here. When a change
is intended, regenerate the file and review its diff:

  VLLMSTACK_REGEN_GOLDEN=1 python3 -m pytest -q tests/test_argv_golden.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from helpers import copy_project

from vllmstack.config.profiles import list_profiles, resolve
from vllmstack.config.vllm_args import ArgvError, build_serve_argv
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


def _argv(project: Project, platform: str, model: str, sets: list[str]) -> dict[str, Any]:
    resolved = resolve(project, platform=platform, model=model, overrides=sets, environ=ENVIRON)
    try:
        command = build_serve_argv(resolved)
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

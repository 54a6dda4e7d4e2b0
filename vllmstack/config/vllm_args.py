"""The `vllm serve` argv, built by one function from resolved settings.

Rules that used to live in YAML interpolation tricks live here:
  * spec decode implies --no-async-scheduling (async scheduling + spec decode corrupts output);
  * an empty optional value drops its flag;
  * JSON-valued settings are parsed and re-serialised, so a malformed value never reaches vLLM;
  * the draft model gets the platform's attention backend unless the spec config names one.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import as_bool
from vllmstack.core.findings import Finding

CONTAINER_CHAT_TEMPLATES = "/app/chat-templates"
# Flags whose value is a plain setting: (key, flag). Empty values drop the flag.
VALUE_FLAGS: tuple[tuple[str, str], ...] = (
    ("VLLM_SERVED_NAME", "--served-model-name"),
    ("VLLM_TOKENIZER", "--tokenizer"),
    ("VLLM_MODEL_REVISION", "--revision"),
    ("VLLM_HF_CONFIG_PATH", "--hf-config-path"),
    ("VLLM_MAX_MODEL_LEN", "--max-model-len"),
    ("VLLM_MAX_BATCHED_TOKENS", "--max-num-batched-tokens"),
    ("VLLM_MAX_NUM_SEQS", "--max-num-seqs"),
    ("VLLM_GPU_MEM_UTIL", "--gpu-memory-utilization"),
    ("VLLM_KV_CACHE_DTYPE", "--kv-cache-dtype"),
    ("VLLM_TP", "--tensor-parallel-size"),
    ("VLLM_DTYPE", "--dtype"),
    ("ATTENTION_BACKEND", "--attention-backend"),
)
JSON_FLAGS: tuple[tuple[str, str], ...] = (
    ("VLLM_LIMIT_MM_PER_PROMPT", "--limit-mm-per-prompt"),
    ("VLLM_GENERATION_CONFIG", "--override-generation-config"),
)
ARGS_KEYS = ("VLLM_TOOL_CHOICE", "VLLM_PROFILER_ARGS", "VLLM_EXTRA_ARGS")


class ArgvError(ValueError):
    """A setting cannot be turned into a flag (bad JSON, bad shell words)."""


@dataclass
class ServeCommand:
    argv: list[str]
    notes: list[Finding] = field(default_factory=list)

    def shell(self) -> str:
        return shlex.join(self.argv)


def _json_value(resolved: Resolved, key: str) -> dict[str, Any] | None:
    raw = (resolved.get(key) or "").strip()
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ArgvError(f"{key} is not valid JSON ({exc.msg}) at {resolved.source(key)}") from exc
    if not isinstance(value, dict):
        raise ArgvError(f"{key} must be a JSON object at {resolved.source(key)}")
    return value


def spec_config(resolved: Resolved) -> dict[str, Any] | None:
    """The speculative-decoding config, or None when spec decode is off."""
    return _json_value(resolved, "VLLM_SPEC_DECODE")


def build_serve_argv(
    resolved: Resolved,
    *,
    host: str = "0.0.0.0",
    chat_template_dir: str = CONTAINER_CHAT_TEMPLATES,
) -> ServeCommand:
    """Build `vllm serve MODEL ...` for the engine container (or a native process)."""
    notes: list[Finding] = []
    model = resolved.get("VLLM_MODEL") or ""
    if not model:
        raise ArgvError("VLLM_MODEL is empty: no model to serve")
    argv = ["vllm", "serve", model]
    for key, flag in VALUE_FLAGS:
        value = (resolved.get(key) or "").strip()
        if value:
            argv += [flag, value]
    argv += ["--host", host, "--port", resolved.get("VLLM_PORT") or "8000"]

    template = (resolved.get("VLLM_CHAT_TEMPLATE") or "").strip()
    if template:
        argv += ["--chat-template", f"{chat_template_dir}/{template}"]
    for key, flag in JSON_FLAGS:
        parsed = _json_value(resolved, key)
        if parsed is not None:
            argv += [flag, json.dumps(parsed, separators=(",", ":"))]

    caching = resolved.get("VLLM_ENABLE_PREFIX_CACHING")
    if caching is not None and caching.strip() != "":
        argv.append("--enable-prefix-caching" if as_bool(caching) else "--no-enable-prefix-caching")
    if as_bool(resolved.get("VLLM_ENFORCE_EAGER")):
        argv.append("--enforce-eager")

    spec: dict[str, Any] | None = spec_config(resolved)
    if spec is not None:
        backend = (resolved.get("ATTENTION_BACKEND") or "").strip()
        if backend and "attention_backend" not in spec:
            # The MTP head has attention layers of its own; without this it auto-selects a
            # backend that can differ from the target model's.
            spec = {**spec, "attention_backend": backend}
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
        argv.append("--no-async-scheduling")
        notes.append(
            Finding("info", "spec-implies-no-async",
                    "spec decode is on, so --no-async-scheduling was added (async scheduling "
                    "with spec decode corrupts output)",
                    key="VLLM_SPEC_DECODE", source=resolved.source("VLLM_SPEC_DECODE"))
        )

    for key in ARGS_KEYS:
        raw = resolved.get(key) or ""
        try:
            words = shlex.split(raw)
        except ValueError as exc:
            raise ArgvError(f"{key} is not valid shell words ({exc}) at {resolved.source(key)}") from exc
        if "--async-scheduling" in words and spec is not None:
            words = [w for w in words if w != "--async-scheduling"]
            notes.append(
                Finding("warning", "async-with-spec-removed",
                        f"{key} asked for --async-scheduling while spec decode is on; removed",
                        key=key, source=resolved.source(key),
                        fix=f"drop --async-scheduling from {key}")
            )
        argv += words
    return ServeCommand(argv, notes)

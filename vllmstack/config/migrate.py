"""`invoke import-env`: read an operator's profile from the earlier just/compose stack and say
what maps where here (most keys carry over unchanged), optionally writing a model profile."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from vllmstack.config.profiles import read_env_file
from vllmstack.config.schema import Schema, is_engine_env_name, load_schema
from vllmstack.core.paths import Project

# Keys that were values in the old stack but are decided elsewhere here.
MOVED = {
    "MODEL_PROFILE": "select it with --model or MODEL_PROFILE in .env",
    "PREFIX_CACHE_RETENTION_INTERVAL": "no dedicated key: add --prefix-cache-retention-interval N "
                                       "to VLLM_EXTRA_ARGS if your vLLM has the flag "
                                       "(`invoke check --deep` tells)",
}
HOME_PATH = re.compile(r"^(/home/[^/]+|/root)/")


@dataclass(frozen=True)
class Mapping:
    key: str
    value: str
    line: int
    target: str  # "same" | "platform" | "moved" | "engine-env" | "unknown"
    note: str


def map_env_file(path: Path, schema: Schema | None = None) -> list[Mapping]:
    schema = schema or load_schema()
    lines, _ = read_env_file(path, path.name)
    out: list[Mapping] = []
    for line in lines:
        key, value = line.key, line.value
        spec = schema.get(key)
        if key in MOVED:
            out.append(Mapping(key, value, line.line, "moved", MOVED[key]))
        elif spec is not None and spec.becomes == "container-env" and key.startswith(
                ("HIP_", "ROCR_", "HSA_", "NCCL_", "VLLM_ROCM_", "PYTORCH_ROCM")):
            out.append(Mapping(key, value, line.line, "platform",
                               "kept; it usually belongs in a platform layer (env/platforms/)"))
        elif spec is not None:
            out.append(Mapping(key, value, line.line, "same", _note_for(key, value, spec.becomes)))
        elif is_engine_env_name(key):
            out.append(Mapping(key, value, line.line, "engine-env",
                               "not in the schema: passed to the engine's environment as is"))
        else:
            guess = schema.closest(key)
            out.append(Mapping(key, value, line.line, "unknown",
                               f"not known here{f' (did you mean {guess}?)' if guess else ''}; "
                               "dropped"))
    return out


def _note_for(key: str, value: str, becomes: str) -> str:
    notes = [f"same key ({becomes})"]
    if HOME_PATH.match(value):
        notes.append("a path under a home folder: set MODELS_DIR in .env and write "
                     "${MODELS_DIR}/... so the profile works on other hosts")
    if key == "VLLM_SPEC_DECODE" and value.strip():
        try:
            spec = json.loads(value)
        except json.JSONDecodeError:
            notes.append("not valid JSON: fix it before use")
        else:
            if isinstance(spec, dict) and "attention_backend" in spec:
                notes.append("attention_backend can go: the stack adds the platform's "
                             "ATTENTION_BACKEND to the draft model")
    return "; ".join(notes)


def render_mapping(mappings: list[Mapping]) -> str:
    width = max((len(m.key) for m in mappings), default=10)
    return "\n".join(f"{m.key:<{width}}  {m.target:<10}  {m.note}" for m in mappings)


def write_profile(project: Project, name: str, source: Path, mappings: list[Mapping],
                  extends: str | None = None) -> Path:
    """Write env/models/NAME.env from the model-scope keys; never overwrite a file."""
    path = project.env_dir / "models" / f"{name}.env"
    if path.exists():
        raise FileExistsError(f"{path} exists; choose another --name (nothing was overwritten)")
    kept = [m for m in mappings if m.target in ("same", "engine-env")]
    body = [f"# Imported from {source} by `invoke import-env`; review, then run `invoke check "
            f"--model {name}`.", f"PROFILE_DESCRIPTION=Imported from {source.name}"]
    if extends:
        body.append(f"EXTENDS={extends}")
    body += [f"{m.key}={_quote(m.value)}" for m in kept if m.key not in ("EXTENDS",
                                                                         "PROFILE_DESCRIPTION")]
    path.write_text("\n".join(body) + "\n")
    return path


def _quote(value: str) -> str:
    return f"'{value}'" if any(c in value for c in " #\"{}") and "'" not in value else value

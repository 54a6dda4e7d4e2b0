"""The known-keys schema: type, default, range, description and where each key ends up."""

from __future__ import annotations

import difflib
import json
import math
import shlex
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

# llamacpp-flag: a llama-server flag (vllmstack/config/llamacpp_args.py builds that argv).
KINDS = ("vllm-flag", "llamacpp-flag", "container-env", "build-arg", "stack")
TYPES = ("str", "int", "float", "bool", "json", "args", "path", "list")
TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Key:
    name: str
    type: str
    description: str
    becomes: str
    default: str | None = None
    choices: tuple[str, ...] | None = None
    min: float | None = None
    max: float | None = None
    required: bool = False
    flag: str | None = None


class SchemaError(ValueError):
    """The schema file itself is malformed (a bug in the stack, not user input)."""


@dataclass(frozen=True)
class Schema:
    keys: dict[str, Key]

    def get(self, name: str) -> Key | None:
        return self.keys.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.keys

    def closest(self, name: str) -> str | None:
        """The known key a typo most likely meant."""
        hits = difflib.get_close_matches(name, list(self.keys), n=1, cutoff=0.75)
        return hits[0] if hits else None

    def defaults(self) -> dict[str, str]:
        return {k.name: k.default for k in self.keys.values() if k.default is not None}


def _default_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def load_schema(text: str | None = None) -> Schema:
    """Parse the schema (the packaged schema.yaml unless `text` is given)."""
    if text is None:
        text = resources.files("vllmstack.config").joinpath("schema.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    keys: dict[str, Key] = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise SchemaError(f"schema entry {name} is not a mapping")
        unknown = set(spec) - {
            "type", "description", "becomes", "default", "choices", "min", "max", "required",
            "flag",
        }
        if unknown:
            raise SchemaError(f"schema entry {name} has unknown fields {sorted(unknown)}")
        if spec.get("type") not in TYPES or spec.get("becomes") not in KINDS:
            raise SchemaError(f"schema entry {name} needs a valid type and becomes")
        choices = spec.get("choices")
        keys[name] = Key(
            name=name,
            type=spec["type"],
            description=str(spec.get("description", "")).strip(),
            becomes=spec["becomes"],
            default=_default_text(spec.get("default")),
            choices=tuple(str(c) for c in choices) if choices is not None else None,
            min=spec.get("min"),
            max=spec.get("max"),
            required=bool(spec.get("required", False)),
            flag=spec.get("flag"),
        )
    return Schema(keys)


def validate_value(key: Key, raw: str) -> str | None:
    """Return a problem with `raw` for `key` (without the key name), or None when it is fine."""
    if key.type == "int":
        try:
            number: float = int(raw)
        except ValueError:
            return f"expects a whole number, got {raw!r}"
        return _range_problem(key, number)
    if key.type == "float":
        try:
            number = float(raw)
        except ValueError:
            return f"expects a number, got {raw!r}"
        if not math.isfinite(number):
            # float() accepts nan/inf, and nan passes every range comparison.
            return f"expects a finite number, got {raw!r}"
        return _range_problem(key, number)
    if key.type == "bool":
        if raw.lower() not in TRUE_WORDS | FALSE_WORDS:
            return f"expects true/false (1/0), got {raw!r}"
        return None
    if key.type == "json":
        if raw == "":
            return None
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as exc:
            return f"is not valid JSON ({exc.msg} at column {exc.colno}): {raw}"
        except RecursionError:  # nested a few thousand deep: Python's parser gives up
            return "is JSON nested too deep to read (thousands of levels)"
        if not isinstance(parsed, dict):
            return f"must be a JSON object {{...}}, got {type(parsed).__name__}"
        return None
    if key.type == "args":
        try:
            shlex.split(raw)
        except ValueError as exc:
            return f"is not valid shell words ({exc}): {raw}"
        return None
    if key.choices is not None and raw not in key.choices:
        allowed = ", ".join(repr(c) for c in key.choices)
        return f"must be one of {allowed}, got {raw!r}"
    return None


def _range_problem(key: Key, number: float) -> str | None:
    if key.min is not None and number < key.min:
        return f"must be at least {key.min:g}, got {number:g}"
    if key.max is not None and number > key.max:
        return f"must be at most {key.max:g}, got {number:g}"
    return None


# Unknown keys that look like runtime knobs are passed to the engine's environment
# (with a warning), so trying a new upstream variable needs no schema change.
ENGINE_ENV_PREFIXES = (
    "VLLM_", "HIP_", "HSA_", "ROCR_", "ROCM_", "NCCL_", "RCCL_", "PYTORCH_", "TORCH_", "AITER_",
    "TRITON_", "CUDA_", "NVIDIA_", "AMD_", "MIOPEN_", "HF_", "OMP_", "GPU_",
)


def is_engine_env_name(name: str) -> bool:
    return name.startswith(ENGINE_ENV_PREFIXES)


def as_bool(raw: str | None) -> bool:
    return raw is not None and raw.strip().lower() in TRUE_WORDS


def as_list(raw: str | None) -> list[str]:
    if not raw:
        return []
    return [part.strip() for part in raw.split(",") if part.strip()]

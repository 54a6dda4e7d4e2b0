"""The `vllm serve` argv, built by one function from resolved settings.

Which setting becomes which flag is written once, as the `flag:` of each vllm-flag key in
schema.yaml; `flag_table` reads it from there. Rules that used to live in YAML interpolation
tricks live here:
  * spec decode implies --no-async-scheduling (async scheduling + spec decode corrupts output);
  * an empty optional value drops its flag;
  * JSON-valued settings are parsed and re-serialised, so a malformed value never reaches vLLM;
  * the draft model gets the platform's attention backend unless the spec config names one.
"""

from __future__ import annotations

import functools
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema, SchemaError, load_schema
from vllmstack.core.errors import StackError
from vllmstack.core.findings import Finding

CONTAINER_CHAT_TEMPLATES = "/app/chat-templates"

# Keys the builder writes by a rule of its own; their flag names still come from schema.yaml.
MODEL_KEY = "VLLM_MODEL"                         # the positional argument (flag: model)
CHAT_TEMPLATE_KEY = "VLLM_CHAT_TEMPLATE"         # a file name under the chat-template folder
SPEC_KEY = "VLLM_SPEC_DECODE"                    # JSON + the draft's backend + no async scheduling
PREFIX_CACHING_KEY = "VLLM_ENABLE_PREFIX_CACHING"  # true: flag, false: --no-<flag>, empty: neither
EAGER_KEY = "VLLM_ENFORCE_EAGER"                 # the flag only when true
BACKEND_KEY = "ATTENTION_BACKEND"                # also handed to the draft model
RULE_KEYS = (CHAT_TEMPLATE_KEY, SPEC_KEY, PREFIX_CACHING_KEY, EAGER_KEY)
# Not settings' flags: the listening address, and what spec decode forces.
PORT_KEY = "VLLM_PORT"
HOST_FLAG = "--host"
PORT_FLAG = "--port"
ASYNC_FLAG = "--async-scheduling"
NO_ASYNC_FLAG = "--no-async-scheduling"


@dataclass(frozen=True)
class FlagTable:
    """The `flag:` entries of schema.yaml's vllm-flag keys, grouped by how the builder writes them."""

    flags: Mapping[str, str]                # key -> flag, every key that has a `--` flag
    value: tuple[tuple[str, str], ...]      # (key, flag): the value as is; empty drops the flag
    json: tuple[tuple[str, str], ...]       # (key, flag): a JSON object, re-serialised compactly
    args: tuple[str, ...]                   # keys whose shell words are appended as written

    def flag(self, key: str) -> str:
        return self.flags[key]


def flag_table(schema: Schema | None = None) -> FlagTable:
    """The flag table of `schema` (the packaged schema.yaml, read once, unless given)."""
    return _packaged_table() if schema is None else _read_table(schema)


@functools.cache
def _packaged_table() -> FlagTable:
    return _read_table(load_schema())


def _read_table(schema: Schema) -> FlagTable:
    flags: dict[str, str] = {}
    value: list[tuple[str, str]] = []
    json_flags: list[tuple[str, str]] = []
    args: list[str] = []
    for key in schema.keys.values():
        if key.becomes != "vllm-flag" or key.name == MODEL_KEY:
            continue
        if key.type == "args":
            args.append(key.name)
            continue
        if not key.flag or not key.flag.startswith("--"):
            raise SchemaError(f"schema entry {key.name} becomes a vllm-flag without a --flag")
        flags[key.name] = key.flag
        if key.name in RULE_KEYS:
            continue
        if key.type == "json":
            json_flags.append((key.name, key.flag))
        elif key.type == "bool":
            raise SchemaError(f"schema entry {key.name} is a bool flag, which needs a rule in "
                              "vllmstack/config/vllm_args.py (on only, or on/off)")
        else:
            value.append((key.name, key.flag))
    missing = ([] if MODEL_KEY in schema else [MODEL_KEY]) + [k for k in RULE_KEYS if k not in flags]
    if missing:
        raise SchemaError(f"schema.yaml lacks the vllm-flag keys the argv builder needs: {missing}")
    return FlagTable(MappingProxyType(flags), tuple(value), tuple(json_flags), tuple(args))


def negated(flag: str) -> str:
    """`--enable-x` -> `--no-enable-x` (vLLM's boolean flags take both forms)."""
    return "--no-" + flag.removeprefix("--")


def flag_origins(schema: Schema | None = None) -> dict[str, str]:
    """Flag -> the setting the builder writes it from (for findings that name the key)."""
    table = flag_table(schema)
    origins = {flag: key for key, flag in table.flags.items()}
    origins[negated(table.flag(PREFIX_CACHING_KEY))] = PREFIX_CACHING_KEY
    origins[PORT_FLAG] = PORT_KEY
    origins[NO_ASYNC_FLAG] = SPEC_KEY
    return origins


# The tables as module constants, for importers that read them as such; computed on first use.
if TYPE_CHECKING:
    VALUE_FLAGS: tuple[tuple[str, str], ...]
    JSON_FLAGS: tuple[tuple[str, str], ...]
    ARGS_KEYS: tuple[str, ...]


def __getattr__(name: str) -> object:
    if name == "VALUE_FLAGS":
        return _packaged_table().value
    if name == "JSON_FLAGS":
        return _packaged_table().json
    if name == "ARGS_KEYS":
        return _packaged_table().args
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ArgvError(StackError, ValueError):
    """A setting cannot be turned into a flag (bad JSON, bad shell words)."""


@dataclass
class ServeCommand:
    argv: list[str]
    notes: list[Finding] = field(default_factory=list)

    def shell(self) -> str:
        return shlex.join(self.argv)


def _json_value(resolved: Resolved, key: str) -> dict[str, Any] | None:
    raw = resolved.get_str(key).strip()
    if not raw:
        return None
    where = resolved.source(key)
    fix = f"quote the whole value in single quotes: {key}='{{\"key\": \"value\"}}'"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ArgvError(f"{key} is not valid JSON ({exc.msg}) at {where}", fix) from exc
    except RecursionError:
        raise ArgvError(f"{key} is JSON nested too deep to read at {where}", fix) from None
    if not isinstance(value, dict):
        raise ArgvError(f"{key} must be a JSON object at {where}", fix)
    return value


def spec_config(resolved: Resolved) -> dict[str, Any] | None:
    """The speculative-decoding config, or None when spec decode is off."""
    return _json_value(resolved, SPEC_KEY)


def build_serve_argv(
    resolved: Resolved,
    *,
    host: str = "0.0.0.0",
    chat_template_dir: str = CONTAINER_CHAT_TEMPLATES,
) -> ServeCommand:
    """Build `vllm serve MODEL ...` for the engine container (or a native process)."""
    table = flag_table(resolved.schema)
    notes: list[Finding] = []
    model = resolved.get_str(MODEL_KEY)
    if not model:
        raise ArgvError(f"{MODEL_KEY} is empty: no model to serve",
                        f"set {MODEL_KEY} in env/models/{resolved.profile}.env or with --set")
    argv = ["vllm", "serve", model]
    for key, flag in table.value:
        # Not the schema default: an empty value leaves the flag to vLLM.
        value = resolved.get_raw(key).strip()
        if value:
            argv += [flag, value]
    argv += [HOST_FLAG, host, PORT_FLAG, resolved.get_str(PORT_KEY)]

    template = resolved.get_str(CHAT_TEMPLATE_KEY).strip()
    if template:
        argv += [table.flag(CHAT_TEMPLATE_KEY), f"{chat_template_dir}/{template}"]
    for key, flag in table.json:
        parsed = _json_value(resolved, key)
        if parsed is not None:
            argv += [flag, json.dumps(parsed, separators=(",", ":"))]

    # Empty means vLLM's default here too, not the schema's.
    caching = resolved.get_raw(PREFIX_CACHING_KEY).strip()
    if caching:
        enable = table.flag(PREFIX_CACHING_KEY)
        argv.append(enable if resolved.get_bool(PREFIX_CACHING_KEY) else negated(enable))
    if resolved.get_bool(EAGER_KEY):
        argv.append(table.flag(EAGER_KEY))

    spec: dict[str, Any] | None = spec_config(resolved)
    if spec is not None:
        backend = resolved.get_str(BACKEND_KEY).strip()
        if backend and "attention_backend" not in spec:
            # The MTP head has attention layers of its own; without this it auto-selects a
            # backend that can differ from the target model's.
            spec = {**spec, "attention_backend": backend}
        argv += [table.flag(SPEC_KEY), json.dumps(spec, separators=(",", ":"))]
        argv.append(NO_ASYNC_FLAG)
        notes.append(
            Finding("info", "spec-implies-no-async",
                    f"spec decode is on, so {NO_ASYNC_FLAG} was added (async scheduling "
                    "with spec decode corrupts output)",
                    key=SPEC_KEY, source=resolved.source(SPEC_KEY))
        )

    for key in table.args:
        raw = resolved.get_str(key)
        try:
            words = shlex.split(raw)
        except ValueError as exc:
            raise ArgvError(f"{key} is not valid shell words ({exc}) at {resolved.source(key)}",
                            f"close the quote in {key} (quote a value with spaces as a whole)"
                            ) from exc
        if ASYNC_FLAG in words and spec is not None:
            words = [w for w in words if w != ASYNC_FLAG]
            notes.append(
                Finding("warning", "async-with-spec-removed",
                        f"{key} asked for {ASYNC_FLAG} while spec decode is on; removed",
                        key=key, source=resolved.source(key),
                        fix=f"drop {ASYNC_FLAG} from {key}")
            )
        argv += words
    return ServeCommand(argv, notes)

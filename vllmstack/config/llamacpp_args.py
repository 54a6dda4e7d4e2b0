"""The `llama-server` argv (ENGINE=llamacpp), built by one function from resolved settings.

As for vLLM (vllm_args.py), which setting becomes which flag is written once, as the `flag:` of
each `llamacpp-flag` key in schema.yaml, and the argv follows the file's order. Flag names are
those of the pinned llama.cpp (common/arg.cpp at LLAMACPP_REF, b9993), not of older releases:
the draft model is `--spec-draft-model` and the draft depth `--spec-draft-n-max` there
(`--draft-max` was removed and now aborts the server).
Rules of the builder:
  * a key no layer sets, or sets empty, drops its flag: llama-server's own default applies (the
    schema default of a llamacpp-flag key states that default, for the checks' projections);
  * a relative GGUF path (LLAMACPP_MODEL, LLAMACPP_DRAFT_MODEL) is under MODELS_DIR;
  * the endpoint is the one both engines share: VLLM_PORT (--port), VLLM_SERVED_NAME (--alias);
  * --jinja (chat templates with tools and thinking), --metrics (the stack reads /metrics) and
    --no-webui (an API endpoint, not a chat page) are always on;
  * every value is validated here too, so a bad one never reaches llama-server.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass
from pathlib import Path

from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema, SchemaError, load_schema, validate_value
from vllmstack.config.vllm_args import ArgvError, ServeCommand

FLAG_KIND = "llamacpp-flag"  # the schema `becomes` of llama-server flags
MODEL_KEY = "LLAMACPP_MODEL"
DRAFT_KEY = "LLAMACPP_DRAFT_MODEL"
GPU_LAYERS_KEY = "LLAMACPP_GPU_LAYERS"
PARALLEL_KEY = "LLAMACPP_PARALLEL"
SPEC_TYPE_KEY = "LLAMACPP_SPEC_TYPE"
# GGUF paths: relative ones are resolved under MODELS_DIR (the folder compose mounts).
PATH_KEYS = (MODEL_KEY, DRAFT_KEY)
# The endpoint's settings, read by both engines' argv builders (and required for both).
PORT_KEY = "VLLM_PORT"
NAME_KEY = "VLLM_SERVED_NAME"
BIND_KEY = "VLLM_BIND"
SHARED_KEYS = (NAME_KEY, PORT_KEY, BIND_KEY)
HOST_FLAG, PORT_FLAG, ALIAS_FLAG = "--host", "--port", "--alias"
# Always on; each exists in the pinned server (common/arg.cpp: --jinja/--no-jinja, --metrics,
# --ui/--webui with --no-ui/--no-webui).
ALWAYS_FLAGS = ("--jinja", "--metrics", "--no-webui")
# --n-gpu-layers takes a whole number or one of these words (common/arg.cpp, -ngl).
GPU_LAYER_WORDS = ("auto", "all")
# --spec-type names (common/speculative.cpp of the pinned source, common_speculative_type_names).
SPEC_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "ngram-simple",
              "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


@dataclass(frozen=True)
class LlamacppFlags:
    """The `flag:` entries of schema.yaml's llamacpp-flag keys, in file order."""

    value: tuple[tuple[str, str], ...]  # (key, flag): the value as is; empty drops the flag
    bools: tuple[tuple[str, str], ...]  # (key, flag): true -> flag, false -> --no-<flag>
    args: tuple[str, ...]               # keys whose shell words are appended as written

    def flag(self, key: str) -> str:
        return dict((*self.value, *self.bools))[key]


def llamacpp_flags(schema: Schema | None = None) -> LlamacppFlags:
    """The flag table of `schema` (the packaged schema.yaml, read once, unless given)."""
    return _packaged_flags() if schema is None else _read_flags(schema)


@functools.cache
def _packaged_flags() -> LlamacppFlags:
    return _read_flags(load_schema())


def _read_flags(schema: Schema) -> LlamacppFlags:
    value: list[tuple[str, str]] = []
    bools: list[tuple[str, str]] = []
    args: list[str] = []
    for key in schema.keys.values():
        if key.becomes != FLAG_KIND:
            continue
        if key.type == "args":
            args.append(key.name)
        elif not key.flag or not key.flag.startswith("--"):
            raise SchemaError(f"schema entry {key.name} becomes a llamacpp-flag without a --flag")
        elif key.type == "bool":
            bools.append((key.name, key.flag))
        elif key.type == "json":
            raise SchemaError(f"schema entry {key.name}: llama-server takes no JSON flag values")
        else:
            value.append((key.name, key.flag))
    if MODEL_KEY not in dict(value):
        raise SchemaError(f"schema.yaml lacks {MODEL_KEY}, the llama-server --model key")
    return LlamacppFlags(tuple(value), tuple(bools), tuple(args))


# Where `invoke gguf-convert` writes, and relative GGUF paths are read, when MODELS_DIR is not
# set: beside the stack's other caches (HOST_CACHE_DIR, else ~/.cache), so that a newcomer's
# `gguf-convert tiny` and `up --model tiny-gguf` agree without editing .env first.
DEFAULT_MODELS_SUBDIR = "vllmstack-models"


def default_models_dir(resolved: Resolved, home: Path) -> Path:
    """MODELS_DIR's default for GGUF files (see DEFAULT_MODELS_SUBDIR)."""
    cache = resolved.get("HOST_CACHE_DIR") or str(home / ".cache")
    return Path(cache).expanduser() / DEFAULT_MODELS_SUBDIR


def gguf_path(resolved: Resolved, key: str = MODEL_KEY, *,
              models_dir: str | Path | None = None, home: Path | None = None) -> Path | None:
    """The file a GGUF path setting names: relative paths are under `models_dir` (default
    MODELS_DIR, else `default_models_dir`). None when the setting is empty."""
    raw = resolved.get_raw(key).strip()
    if not raw:
        return None
    path = Path(raw).expanduser()
    if path.is_absolute():
        return path
    base = str(models_dir) if models_dir is not None else resolved.get_str("MODELS_DIR").strip()
    if not base:
        return default_models_dir(resolved, home or Path.home()) / path
    return Path(base).expanduser() / path


def _bad(resolved: Resolved, key: str, problem: str, fix: str) -> ArgvError:
    return ArgvError(f"{key} {problem} ({key} at {resolved.source(key)})", fix)


def _checked(resolved: Resolved, schema: Schema, key: str) -> str:
    """The value a layer set ("" when none did: the schema default is llama-server's own, so
    the flag is left out), refused when llama-server would refuse it."""
    value = "" if resolved.source(key) in (None, "default") else resolved.get_raw(key).strip()
    spec = schema.get(key)
    if not value or spec is None:
        return value
    problem = validate_value(spec, value)
    if problem is not None:
        choices = f"one of {', '.join(spec.choices)}" if spec.choices else f"a {spec.type}"
        raise _bad(resolved, key, problem, f"set {key} to {choices}: {spec.description}")
    # ASCII digits: str.isdigit() also takes '²' and '٣', which llama-server cannot read.
    if key == GPU_LAYERS_KEY and value not in GPU_LAYER_WORDS and not (
            value.isascii() and value.isdigit()):
        raise _bad(resolved, key, f"must be a whole number, auto or all, got {value!r}",
                   f"set {key}=auto (fit to free memory), all, or a layer count such as 99")
    if key == PARALLEL_KEY and value == "0":
        # llama-server: "error: invalid value for n_parallel".
        raise _bad(resolved, key, "is 0, which llama-server refuses",
                   f"set {key}=-1 (auto: 4 slots) or a slot count of 1 or more")
    if key == SPEC_TYPE_KEY:
        unknown = [t for t in (p.strip() for p in value.split(",")) if t not in SPEC_TYPES]
        if unknown:
            raise _bad(resolved, key, f"names unknown speculative type(s) {', '.join(unknown)}",
                       f"use a comma-separated list of: {', '.join(SPEC_TYPES)}")
    return value


def build_llamacpp_argv(
    resolved: Resolved,
    *,
    host: str,
    models_dir: str | Path | None = None,
    binary: str = "llama-server",
) -> ServeCommand:
    """Build `llama-server --model FILE ...` for a native process or the engine container.

    `models_dir` is where MODELS_DIR is seen by the process (compose mounts it at the same path,
    so the default - MODELS_DIR itself - fits both runtimes). Raises ArgvError naming the key and
    the file:line of a value llama-server would refuse.
    """
    schema = resolved.schema or load_schema()
    table = llamacpp_flags(resolved.schema)
    if not resolved.get_raw(MODEL_KEY).strip():
        raise ArgvError(f"{MODEL_KEY} is empty: no GGUF file to serve (ENGINE=llamacpp)",
                        f"set {MODEL_KEY} in env/models/{resolved.profile}.env or with --set "
                        "(a .gguf path; relative paths are under MODELS_DIR)")
    name = resolved.get_str(NAME_KEY).strip()
    if not name:
        raise ArgvError(f"{NAME_KEY} is empty: llama-server needs the model name clients send",
                        f"set {NAME_KEY} in env/models/{resolved.profile}.env or with --set")
    argv = [binary]
    for key, flag in table.value:
        value = _checked(resolved, schema, key)
        if value and key in PATH_KEYS:
            value = str(gguf_path(resolved, key, models_dir=models_dir))
        if value:
            argv += [flag, value]
    for key, flag in table.bools:
        if _checked(resolved, schema, key):
            argv.append(flag if resolved.get_bool(key) else "--no-" + flag.removeprefix("--"))
    port = _checked(resolved, schema, PORT_KEY) or resolved.get_str(PORT_KEY)
    argv += [HOST_FLAG, host, PORT_FLAG, port, ALIAS_FLAG, name, *ALWAYS_FLAGS]
    for key in table.args:
        raw = resolved.get_str(key)
        try:
            argv += shlex.split(raw)
        except ValueError as exc:
            raise _bad(resolved, key, f"is not valid shell words ({exc})",
                       f"close the quote in {key} (quote a value with spaces as a whole)") from exc
    return ServeCommand(argv)

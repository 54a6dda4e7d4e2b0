"""`invoke import-env`: read an operator's profile from the earlier just/compose stack and say
what maps where here (most keys carry over unchanged), optionally writing a model profile."""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from vllmstack.config.profiles import layer_name_problem, read_env_file
from vllmstack.config.schema import Schema, is_engine_env_name, load_schema
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import is_secret_name

# Keys that were values in the old stack but are decided elsewhere here.
MOVED = {
    "MODEL_PROFILE": "select it with --model or MODEL_PROFILE in .env",
    "PREFIX_CACHE_RETENTION_INTERVAL": "no dedicated key: add --prefix-cache-retention-interval N "
                                       "to VLLM_EXTRA_ARGS if your vLLM has the flag "
                                       "(`invoke check --deep` tells)",
}
HOME_PATH = re.compile(r"^(/home/[^/]+|/root)/")
SHOWN_ERRORS = 20  # lines that cannot be read, named one by one; the rest are counted
# Far above any profile (the shipped ones are under 4 KiB); a 50 MB file is not one.
MAX_ENV_BYTES = 1 << 20


class ImportEnvError(StackError):
    """The file to import cannot be read exactly, or the profile cannot be written as asked."""


class ProfileExistsError(ImportEnvError, FileExistsError):
    """--name names a profile that exists: it is never overwritten."""


@dataclass(frozen=True)
class Mapping:
    key: str
    value: str
    line: int
    target: str  # "same" | "platform" | "moved" | "engine-env" | "secret" | "unknown"
    note: str


def map_env_file(path: Path, schema: Schema | None = None) -> list[Mapping]:
    schema = schema or load_schema()
    check_source(path)
    lines, problems = read_env_file(path, path.name)
    errors = [p for p in problems if p.severity == "error"]
    if errors:  # a line read wrongly or dropped would be imported wrongly or silently lost
        shown = [f.render() + (f" ({f.source})" if f.source and not f.key else "")
                 for f in errors[:SHOWN_ERRORS]]
        if len(errors) > SHOWN_ERRORS:  # a binary file had 195,000 of them
            shown.append(f"... and {len(errors) - SHOWN_ERRORS} more line(s) that cannot be read "
                         "(left out)")
        raise ImportEnvError(
            f"{path} has {len(errors)} line(s) that cannot be read exactly; nothing was imported",
            "fix the lines named above, then import again"
            + (" (is it an env file at all?)" if len(errors) > SHOWN_ERRORS else ""),
            details=shown)
    out: list[Mapping] = []
    for line in lines:
        key, value = line.key, line.value
        spec = schema.get(key)
        if is_secret_name(key):
            out.append(Mapping(key, value, line.line, "secret",
                               "a secret: never written into a profile (env/ is shared); "
                               "put it in .env, which stays on this machine"))
        elif key in MOVED:
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


def check_source(path: Path) -> None:
    """The file to import exists and is one: a folder, a FIFO (which blocks the read) or a file
    larger than any env file is refused by what it is (a folder was "does not exist")."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ImportEnvError(f"{path} does not exist", "give the path of the earlier stack's "
                             "env file, e.g. invoke import-env ../old-stack/.env") from None
    except OSError as exc:
        raise ImportEnvError(f"{path} cannot be read ({exc.strerror or exc})",
                             "check the path and its permissions") from None
    if stat.S_ISDIR(info.st_mode):
        raise ImportEnvError(f"{path} is a directory, not an env file",
                             f"give the env file inside it, e.g. invoke import-env {path}/.env")
    if not stat.S_ISREG(info.st_mode):
        raise ImportEnvError(f"{path} is not a regular file (a pipe, socket or device)",
                             "give the path of an env file")
    if info.st_size > MAX_ENV_BYTES:
        raise ImportEnvError(f"{path} is {info.st_size} bytes; an env file is a few kilobytes "
                             f"(the limit here is {MAX_ENV_BYTES})", "give the path of an env file")


def _note_for(key: str, value: str, becomes: str) -> str:
    notes = [f"same key ({becomes})"]
    if HOME_PATH.match(value):
        notes.append("a path under a home folder: set MODELS_DIR in .env and write "
                     "${MODELS_DIR}/... so the profile works on other hosts")
    if key == "VLLM_SPEC_DECODE" and value.strip():
        try:
            spec = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
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
    """Write env/models/NAME.env from the model-scope keys; never overwrite a file.

    NAME is one file name inside env/models/ and EXTENDS a layer inside env/ (never a path
    elsewhere); every value is written so that the resolver reads back exactly what it read
    from the source, or the import is refused naming the key and line."""
    for what, value, nested in (("--name", name, False), ("--extends", extends, True)):
        problem = layer_name_problem(value, nested=nested) if value is not None else None
        if problem:
            raise ImportEnvError(f"{what} {value!r} {problem}",
                                 f"give {what} a plain name, e.g. --name my-model "
                                 "--extends families/qwen3")
    path = project.env_dir / "models" / f"{name}.env"
    kept = [m for m in mappings if m.target in ("same", "engine-env")
            and m.key not in ("EXTENDS", "PROFILE_DESCRIPTION")]
    body = [f"# Imported from {json.dumps(str(source))[1:-1]} by `invoke import-env`; review, "
            f"then run `invoke check --model {name}`.",
            f"PROFILE_DESCRIPTION={_quote(f'Imported from {source.name}') or 'Imported'}"]
    if extends:
        body.append(f"EXTENDS={extends}")
    for mapping in kept:
        quoted = _quote(mapping.value)
        if quoted is None:
            raise ImportEnvError(
                f"{mapping.key} (line {mapping.line} of {source}) holds a control character or "
                "ends in a backslash: no env-file quoting reads it back exactly; nothing was written",
                f"remove {mapping.key} from the file to import and set it by hand afterwards")
        body.append(f"{mapping.key}={quoted}")
    try:  # O_EXCL: an existing profile is never overwritten, not even by a racing import
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ProfileExistsError(f"{path} exists; nothing was overwritten",
                                 "choose another --name (or delete the file first)") from None
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write("\n".join(body) + "\n")
    return path


_BARE = re.compile(r"[A-Za-z0-9._/:,+@-]+")


def _quote(value: str) -> str | None:
    """`value` as the resolver's dotenv parser (python-dotenv) reads it back exactly, or None.

    Bare when plain; else in single quotes (literal there, but python-dotenv decodes \\ and \'
    even in single quotes, so no backslash); else in double quotes with \\ and \" escaped. A
    value ending in a backslash has no exact form (python-dotenv's pattern may take the escaped
    closing quote as \"), nor has a control character. ${NAME} stays as written: the resolver
    expands it, as it did in the source file."""
    if _BARE.fullmatch(value):
        return value
    if value.endswith("\\") or any(ord(c) < 32 or ord(c) == 127 for c in value):
        return None
    if "'" not in value and "\\" not in value:
        return f"'{value}'"
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'

"""What both runtimes give the engine: host folders for the caches, host ids, the environment.

The Compose runtime mounts these folders into the container; the native runtime points the
engine's cache variables at them (per engine version). Either way the engine runs as the
invoking user, so caches are created user-owned before anything else could create them.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vllmstack.config.engines.table import engine_kind
from vllmstack.config.llamacpp_args import default_models_dir
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema, is_engine_env_name
from vllmstack.core.errors import StackError
from vllmstack.core.files import ENV_KEY as ENV_NAME
from vllmstack.core.paths import home_dir

FP8_CONFIG_DIR = "model_executor/layers/quantization/utils/configs"
# Under the engine cache (mounted at /cache/engine in a container): compose.yaml points HOME,
# VLLM_CACHE_ROOT, TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, AITER_JIT_DIR and TMPDIR here.
ENGINE_CACHE_SUBDIRS = ("home", "vllm", "triton", "torchinductor", "aiter/jit", "tmp")
# What `clear-caches` deletes: every folder above but the models, and the native runtime's.
CLEARED_SUBDIRS = ("vllm", "triton", "torchinductor", "aiter", "home", "tmp", "native")


def native_cache_env(cache: Path) -> dict[str, str]:
    """Where a native engine keeps its compile caches and temporary files: all in `cache` (its
    version's folder of the engine cache), as a container's are in /cache/engine.

    TMPDIR too: vLLM writes /tmp/vllm_dist_<hex> at every start (its process group's store,
    from tempfile.gettempdir()), and torch inductor its precompiled headers into
    /tmp/torchinductor_<user> (149 MB at the first boot on the CPU; it ignores
    TORCHINDUCTOR_CACHE_DIR for them). Kept there, the headers are reused by the next boot."""
    return {"VLLM_CACHE_ROOT": str(cache / "vllm"), "TRITON_CACHE_DIR": str(cache / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
            "AITER_JIT_DIR": str(cache / "aiter" / "jit"), "TMPDIR": str(cache / "tmp")}


class CacheDirError(StackError):
    """A cache folder cannot be created, handed to the engine's user or deleted."""


@dataclass
class HostIds:
    uid: int
    gid: int
    render_gid: int | None
    video_gid: int | None


def detect_host_ids(resolved: Resolved, root: Path = Path("/")) -> HostIds:
    """The engine runs as the invoking user; device groups are read from the device nodes."""

    def setting(key: str) -> int | None:
        raw = resolved.get(key)
        return int(raw) if raw and raw.strip().isdigit() else None

    def gid_of(path: str) -> int | None:
        try:
            return (root / path.lstrip("/")).stat().st_gid
        except OSError:
            return None

    render = setting("RENDER_GID")
    if render is None:
        nodes = sorted((root / "dev/dri").glob("renderD*")) if (root / "dev/dri").is_dir() else []
        render = nodes[0].stat().st_gid if nodes else None
    uid, gid = setting("USER_UID"), setting("USER_GID")
    return HostIds(
        uid=uid if uid is not None else os.getuid(),
        gid=gid if gid is not None else os.getgid(),
        render_gid=render,
        video_gid=setting("VIDEO_GID") or gid_of("/dev/kfd"),
    )


@dataclass
class StackPaths:
    hf_cache: Path
    engine_cache: Path
    models_dir: Path | None


def stack_paths(resolved: Resolved, environ: Mapping[str, str]) -> StackPaths:
    """The host folders; `models_dir` is MODELS_DIR, and for a llama.cpp profile without it the
    default folder its relative GGUF paths are read from (llamacpp_args.default_models_dir)."""
    home = home_dir(environ)
    cache = Path(resolved.get("HOST_CACHE_DIR") or home / ".cache").expanduser()
    hf = Path(resolved.get("HF_CACHE_DIR") or cache / "huggingface").expanduser()
    models = resolved.get("MODELS_DIR")
    folder = (Path(models).expanduser() if models else
              default_models_dir(resolved, home) if engine_kind(resolved).model_file else None)
    return StackPaths(hf, cache / "vllmstack-engine", folder)


def ensure_cache_dirs(paths: StackPaths, ids: HostIds, *, dry_run: bool) -> list[str]:
    """Create the mounted cache folders user-owned before compose does (it would make them root's).

    Returns every mkdir and chown done (or, with dry_run, that would be done), one line each.
    Only folders created here are chowned (as root): a folder that exists is the operator's,
    and `up` never changes its owner (HF_CACHE_DIR=/ must not hand the host to USER_UID). An
    existing folder the engine's user cannot write raises CacheDirError with the exact fix.
    """
    done: list[str] = []
    planned: set[Path] = set()  # created by this call (or, in a dry run, would be)
    folders = [paths.hf_cache, paths.engine_cache,
               *(paths.engine_cache / sub for sub in ENGINE_CACHE_SUBDIRS)]
    for folder in folders:
        missing = [p for p in (*reversed(folder.parents), folder)
                   if p not in planned and not p.exists()]
        for path in missing:  # one level at a time, so each created folder is known
            done.append(f"mkdir -p {shlex.quote(str(path))}")
            if os.geteuid() == 0:
                done.append(f"chown {ids.uid}:{ids.gid} {shlex.quote(str(path))}")
            planned.add(path)
            if dry_run:
                continue
            try:
                path.mkdir()
            except FileExistsError:
                continue  # made meanwhile by someone else: theirs, not ours to chown
            except OSError as exc:
                raise CacheDirError(f"cannot create {path}: {exc.strerror}",
                                    f"create it yourself (mkdir -p {shlex.quote(str(folder))}) "
                                    "or point HOST_CACHE_DIR/HF_CACHE_DIR elsewhere") from exc
            if os.geteuid() == 0:
                os.chown(path, ids.uid, ids.gid)
        if folder in planned:
            continue
        stat = folder.stat()
        if not _writable_by(stat, ids):
            raise CacheDirError(
                f"{folder} belongs to uid {stat.st_uid}, and the engine runs as uid {ids.uid}, "
                "which cannot write its caches there (the stack never changes the owner of a "
                "folder it did not create). Fix once: sudo chown -R "
                f"{ids.uid}:{ids.gid} {shlex.quote(str(folder))}",
                "or point HOST_CACHE_DIR/HF_CACHE_DIR at a folder of that user, or set "
                "USER_UID/USER_GID in .env to the user who owns it")
    return done


def _writable_by(stat: os.stat_result, ids: HostIds) -> bool:
    """Whether the engine's user can create files in a folder with this stat (mode bits only)."""
    if ids.uid == 0:
        return True
    if stat.st_uid == ids.uid:
        return bool(stat.st_mode & 0o200)
    if stat.st_gid == ids.gid:
        return bool(stat.st_mode & 0o020)
    return bool(stat.st_mode & 0o002)


def clear_engine_caches(paths: StackPaths, *, dry_run: bool) -> list[str]:
    """Delete the engine's compile and JIT caches (never the Hugging Face cache); one line each."""
    done = []
    for sub in CLEARED_SUBDIRS:
        folder = paths.engine_cache / sub
        if not folder.exists():
            continue
        done.append(f"rm -rf {shlex.quote(str(folder))}")
        if not dry_run:
            try:
                shutil.rmtree(folder)
            except PermissionError as exc:
                raise CacheDirError(f"cannot delete {exc.filename}: it belongs to another user. "
                                   f"Fix once: sudo rm -rf {folder}") from exc
    return done


def engine_environment(resolved: Resolved, schema: Schema) -> dict[str, str]:
    """What the engine process sees: container-env keys, plus unknown engine-looking keys."""
    env: dict[str, str] = {}
    for key, setting in sorted(resolved.values.items()):
        if key == "ENGINE_ENV":
            continue
        spec = schema.get(key)
        passes = spec.becomes == "container-env" if spec else is_engine_env_name(key)
        # An empty value is "unset" (an empty HSA override or device list would hide GPUs;
        # `invoke check` reports the HSA case as an error).
        if passes and setting.value != "":
            env[key] = setting.value
    env.update(engine_env_words(resolved.get_str("ENGINE_ENV"))[0])
    return env


def engine_env_words(text: str) -> tuple[dict[str, str], list[str]]:
    """ENGINE_ENV's KEY=VALUE words, and the words that are not (no '=', or a KEY that is not a
    variable name: `invoke check` reports those, and they never reach the engine)."""
    good: dict[str, str] = {}
    bad: list[str] = []
    try:
        words = shlex.split(text)
    except ValueError:
        return good, bad  # not shell words: validation reports ENGINE_ENV itself
    for word in words:
        key, sep, value = word.partition("=")
        if sep and ENV_NAME.fullmatch(key):
            good[key] = value
        else:
            bad.append(word)
    return good, bad

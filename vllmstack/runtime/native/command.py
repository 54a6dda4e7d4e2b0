"""The native engine's command: the argv and environment the container would get, with host paths."""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllmstack.config.engine import LLAMACPP, engine_of, llamacpp_backend
from vllmstack.config.llamacpp_args import build_llamacpp_argv
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import load_schema
from vllmstack.config.vllm_args import ArgvError, build_serve_argv
from vllmstack.core.paths import Project
from vllmstack.core.runner import format_command
from vllmstack.image import patches
from vllmstack.runtime.engine_env import (
    FP8_CONFIG_DIR,
    engine_environment,
    native_cache_env,
    stack_paths,
)
from vllmstack.runtime.native import install, llamacpp_build
from vllmstack.runtime.native.procs import NativeError
from vllmstack.runtime.native.records import native_folder

IPC_DIR = "ipc"  # under generated/native: the engine's unix sockets (see native_serve_command)


def clear_sockets(folder: Path) -> None:
    """Remove the sockets an ended engine left in `folder` (vLLM leaves its ZMQ sockets behind,
    seven per boot); anything that is not a socket stays."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        try:
            if stat.S_ISSOCK(entry.lstat().st_mode):
                entry.unlink()
        except OSError:
            continue


@dataclass
class NativeCommand:
    argv: list[str]
    env: dict[str, str]  # set on top of the caller's environment
    version: str
    venv: Path | None  # the install-engine environment, when that is what runs
    cache_dirs: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Why this command cannot run although its executable may exist (cause, fix): a llama-server
    # built for another backend than the platform's. Raised where a missing executable is.
    problem: tuple[str, str] | None = None
    # The fix when the executable is missing and the stack installs it (llama.cpp's build).
    install_fix: str | None = None

    def shell(self) -> str:
        """The command as a shell line, tokens masked (it is printed by --dry-run)."""
        return format_command(["env", *(f"{k}={v}" for k, v in sorted(self.env.items())), *self.argv])


def native_serve_command(project: Project, resolved: Resolved, environ: Mapping[str, str], *,
                         folder: Path | None = None) -> NativeCommand:
    """The argv and environment of the native engine: the container's, with host paths.
    `folder`: the engine's own folder (default generated/native), which holds its sockets."""
    if engine_of(resolved) == LLAMACPP:
        return native_llamacpp_command(project, resolved, environ)
    version = install.engine_version(resolved)
    try:
        # The container binds 0.0.0.0 and publishes VLLM_BIND; a host process binds it itself.
        serve = build_serve_argv(resolved, host=resolved.get_str("VLLM_BIND"),
                                 chat_template_dir=str((project.root / "chat-templates").resolve()))
    except ArgvError as exc:
        raise NativeError(str(exc), "fix the value named above (`invoke check` shows them all)") from exc
    try:
        prefix = shlex.split(resolved.get_str("NATIVE_ENGINE_COMMAND"))
    except ValueError as exc:
        raise NativeError(f"NATIVE_ENGINE_COMMAND is not valid shell words ({exc}) at "
                          f"{resolved.source('NATIVE_ENGINE_COMMAND')}", "fix its quoting") from exc
    venv: Path | None = None
    if not prefix:
        if not version:
            raise NativeError("no engine version for the native runtime",
                              "set VLLM_VERSION (or NATIVE_ENGINE_VERSION) in .env")
        venv = install.engine_dir(project, version)
        prefix = [str(venv / "bin" / "vllm")]
    paths = stack_paths(resolved, environ)
    # Compile caches per engine version: a host venv has other torch/Triton/AITER builds than the
    # image, and AITER's JIT modules are not keyed by version. Models are shared with containers.
    cache = paths.engine_cache / "native" / f"vllm-{version or 'custom'}"
    caches = native_cache_env(cache)
    # vLLM's ZMQ sockets go to VLLM_RPC_BASE_PATH (default: TMPDIR), and a unix socket's path
    # has at most 107 bytes: a TMPDIR deep in a cache folder failed the boot ("ipc path ... is
    # longer than 107 characters"). Relative to the engine's working folder (the checkout, which
    # vLLM's processes keep) the path stays short wherever the checkout and the cache are.
    sockets = (folder or native_folder(project)) / IPC_DIR
    # Made before the start: a TMPDIR that does not exist sends tempfile back to /tmp.
    cache_dirs = [paths.hf_cache, *(Path(folder) for folder in caches.values()), sockets]
    env = {
        "HF_HOME": str(paths.hf_cache),
        **caches,
        "VLLM_RPC_BASE_PATH": os.path.relpath(sockets, project.root),
        "VLLM_TUNED_CONFIG_FOLDER": str((project.root / "fused_moe_configs").resolve()),
        # User-site packages (~/.local) would shadow the environment's own.
        "PYTHONNOUSERSITE": "1",
    }
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        # vLLM and torch start helpers (ninja, the compiler driver) by name.
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{environ.get('PATH') or os.defpath}"
    env.update(engine_environment(resolved, load_schema()))
    notes = _unapplied_files(project, resolved, FP8_CONFIG_DIR)
    return NativeCommand([*prefix, *serve.argv[1:]], env, version, venv, cache_dirs, notes)


def native_llamacpp_command(project: Project, resolved: Resolved,
                            environ: Mapping[str, str]) -> NativeCommand:
    """llama-server from `invoke install-engine --engine llamacpp` (built for the platform's backend), or
    LLAMACPP_SERVER; the same argv the container gets, with the host's bind address."""
    ref, backend = resolved.get_str("LLAMACPP_REF"), llamacpp_backend(resolved)
    try:
        prefix = shlex.split(resolved.get_str("LLAMACPP_SERVER"))
    except ValueError as exc:
        raise NativeError(f"LLAMACPP_SERVER is not valid shell words ({exc}) at "
                          f"{resolved.source('LLAMACPP_SERVER')}", "fix its quoting") from exc
    paths = stack_paths(resolved, environ)
    problem: tuple[str, str] | None = None
    install_fix: str | None = None
    if not prefix:
        folder = llamacpp_build.build_dir(project, ref, backend)
        prefix = [str(folder / "bin" / "llama-server")]
        install_fix = f"invoke install-engine --engine llamacpp --backend {backend}"
        problem = llamacpp_build.backend_problem(project, ref, backend)
    try:
        serve = build_llamacpp_argv(resolved, host=resolved.get_str("VLLM_BIND"),
                                    models_dir=paths.models_dir)
    except ArgvError as exc:
        raise NativeError(str(exc), "fix the value named above (`invoke check` shows them all)") from exc
    cache = paths.engine_cache / "native" / f"llamacpp-{ref}-{backend}"
    env = {"HF_HOME": str(paths.hf_cache), "LLAMA_CACHE": str(cache), "TMPDIR": str(cache / "tmp")}
    env.update(engine_environment(resolved, load_schema()))
    return NativeCommand([*prefix, *serve.argv[1:]], env, f"llamacpp-{ref}-{backend}", None,
                         [cache, cache / "tmp"], problem=problem, install_fix=install_fix)


def _unapplied_files(project: Project, resolved: Resolved, fp8_dir: str) -> list[str]:
    """What containers get mounted into vLLM's package that a host process cannot get."""
    notes = []
    try:
        overlays = patches.load_overlays(project)
    except patches.PatchError:
        overlays = []  # `invoke check` reports the malformed manifest
    for overlay in overlays:
        notes.append(f"overlay {overlay.name} ({overlay.target}) is not applied: the native runtime runs "
                     "the installed vLLM as it is (install a build that contains it)")
    device = resolved.get("GPU_DEVICE_NAME") or ""
    tuned = [p for p in sorted((project.root / "fp8_configs").glob("*.json"))
             if device and f"device_name={device}," in p.name]
    if tuned:
        notes.append(f"{len(tuned)} tuned fp8 GEMM config(s) for {device} are not applied natively "
                     f"(containers mount them into vllm/{fp8_dir})")
    return notes


def install_hint(version: str) -> str:
    """How to install the native engine of `version`: vLLM's CPU build comes from the index, a
    source-built CPU wheel (0.31.0+cpu.p<patch hash>) from the image `invoke build` made, anything
    else from a wheel source."""
    if version.endswith("+cpu"):
        return f"invoke install-engine --version {version}"
    if "+cpu." in version:
        return ("invoke install-engine --platform cpu --from-image IMAGE (the image `invoke build "
                f"--platform cpu` made with vLLM {version})")
    return f"invoke install-engine --version {version} (add --wheels DIR for AMD's ROCm wheels)"

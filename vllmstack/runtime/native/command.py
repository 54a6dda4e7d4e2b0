"""The native engine's command: the argv and environment the container would get, with host paths."""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllmstack.config.engines import llamacpp, vllm
from vllmstack.config.engines.kind import Placement
from vllmstack.config.engines.llamacpp import llamacpp_backend
from vllmstack.config.engines.table import engine_kind
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import load_schema
from vllmstack.config.vllm_args import ArgvError, ServeCommand
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


def native_placement(project: Project, resolved: Resolved, environ: Mapping[str, str]) -> Placement:
    """Where a host process runs the profile's engine: it binds VLLM_BIND itself (a container
    binds 0.0.0.0 and publishes VLLM_BIND), reads the checkout's chat templates and MODELS_DIR
    where they are, and starts its environment's executable (or NATIVE_ENGINE_COMMAND /
    LLAMACPP_SERVER). `check`, `up` and the start all build the argv from this one placement."""
    return PLACEMENTS[engine_kind(resolved).name](project, resolved, environ)


def _vllm_placement(project: Project, resolved: Resolved, environ: Mapping[str, str]) -> Placement:
    prefix = _shell_words(resolved, "NATIVE_ENGINE_COMMAND")
    if not prefix:
        version = install.engine_version(resolved)
        if not version:
            raise NativeError("no engine version for the native runtime",
                              "set VLLM_VERSION (or NATIVE_ENGINE_VERSION) in .env")
        prefix = [str(install.engine_dir(project, version) / "bin" / "vllm")]
    return Placement(host=resolved.get_str("VLLM_BIND"),
                     chat_template_dir=str((project.root / "chat-templates").resolve()),
                     program=tuple(prefix))


def _llamacpp_placement(project: Project, resolved: Resolved,
                        environ: Mapping[str, str]) -> Placement:
    prefix = _shell_words(resolved, "LLAMACPP_SERVER")
    if not prefix:
        folder = llamacpp_build.build_dir(project, resolved.get_str("LLAMACPP_REF"),
                                          llamacpp_backend(resolved))
        prefix = [str(folder / "bin" / "llama-server")]
    models = stack_paths(resolved, environ).models_dir
    return Placement(host=resolved.get_str("VLLM_BIND"),
                     models_dir=str(models) if models is not None else None, program=tuple(prefix))


def _shell_words(resolved: Resolved, key: str) -> list[str]:
    try:
        return shlex.split(resolved.get_str(key))
    except ValueError as exc:
        raise NativeError(f"{key} is not valid shell words ({exc}) at {resolved.source(key)}",
                          "fix its quoting") from exc


def _placed_argv(project: Project, resolved: Resolved, environ: Mapping[str, str],
                 command: ServeCommand | None) -> list[str]:
    """The argv `check` built for this placement (what `up` records), else built here."""
    if command is not None:
        return list(command.argv)
    try:
        return engine_kind(resolved).build(resolved, native_placement(project, resolved, environ)).argv
    except ArgvError as exc:
        raise NativeError(str(exc), "fix the value named above (`invoke check` shows them all)") from exc


def native_serve_command(project: Project, resolved: Resolved, environ: Mapping[str, str], *,
                         folder: Path | None = None,
                         command: ServeCommand | None = None) -> NativeCommand:
    """The native engine's argv and environment. `command`: the argv `check` built for the
    native placement (`up` passes it, so what runs is what it recorded); `folder`: the engine's
    own folder (default generated/native), which holds its sockets."""
    return COMMANDS[engine_kind(resolved).name](project, resolved, environ, folder,
                                         _placed_argv(project, resolved, environ, command))


def _vllm_command(project: Project, resolved: Resolved, environ: Mapping[str, str],
                  folder: Path | None, argv: list[str]) -> NativeCommand:
    version = install.engine_version(resolved)
    venv: Path | None = None
    if not resolved.get_str("NATIVE_ENGINE_COMMAND").strip():
        venv = install.engine_dir(project, version)
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
    return NativeCommand(argv, env, version, venv, cache_dirs, notes)


def _llamacpp_command(project: Project, resolved: Resolved, environ: Mapping[str, str],
                      folder: Path | None, argv: list[str]) -> NativeCommand:
    """llama-server from `invoke install-engine --engine llamacpp` (built for the platform's
    backend), or LLAMACPP_SERVER."""
    ref, backend = resolved.get_str("LLAMACPP_REF"), llamacpp_backend(resolved)
    paths = stack_paths(resolved, environ)
    problem: tuple[str, str] | None = None
    install_fix: str | None = None
    if not resolved.get_str("LLAMACPP_SERVER").strip():
        install_fix = f"invoke install-engine --engine llamacpp --backend {backend}"
        problem = llamacpp_build.backend_problem(project, ref, backend)
    cache = paths.engine_cache / "native" / f"llamacpp-{ref}-{backend}"
    env = {"HF_HOME": str(paths.hf_cache), "LLAMA_CACHE": str(cache), "TMPDIR": str(cache / "tmp")}
    env.update(engine_environment(resolved, load_schema()))
    return NativeCommand(argv, env, f"llamacpp-{ref}-{backend}", None,
                         [cache, cache / "tmp"], problem=problem, install_fix=install_fix)


# One entry per engine kind (config/engines): how its host process is placed and started.
PLACEMENTS = {vllm.KIND.name: _vllm_placement, llamacpp.KIND.name: _llamacpp_placement}
COMMANDS = {vllm.KIND.name: _vllm_command, llamacpp.KIND.name: _llamacpp_command}


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

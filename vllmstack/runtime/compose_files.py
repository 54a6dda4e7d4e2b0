"""The per-profile Compose files, rendered as data into the git-ignored generated/ folder.

compose.yaml holds the static services; everything that depends on the profile (the engine
command, its environment, GPU devices, overlay and tuned-config mounts, host paths and ids) is
rendered here (yaml.safe_dump of dicts, never string concatenation), which is what compose runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllmstack.config.engines.table import engine_kind, others
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema, load_schema
from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core.errors import StackError
from vllmstack.core.files import EnvValueError, env_line, write_text
from vllmstack.core.paths import Project
from vllmstack.image import patches
from vllmstack.runtime import flavours
from vllmstack.runtime.engine_env import FP8_CONFIG_DIR, HostIds, StackPaths, engine_environment

ENGINE_SERVICE = "vllm"
DASHBOARD_SERVICE = "dashboard"
# Where a vllmstack-built image exposes the installed vLLM package (a symlink made in the
# runtime stage, recorded as this label), so mounts never hard-code a Python version.
PACKAGE_LABEL = "vllmstack.vllm-package"


# Where compose.yaml mounts the host's caches in the engine container; MODELS_DIR is mounted at
# its own path (build_override).
HF_CACHE_MOUNT = "/cache/huggingface"
ENGINE_CACHE_MOUNT = "/cache/engine"
# Where `beside` mounts this package (read-only) for modules run in the engine container.
PACKAGE_MOUNT = "/opt/vllmstack-src"


def container_path(path: Path, paths: StackPaths) -> str | None:
    """`path` (a host path) as the engine container sees it; None where nothing mounts it."""
    resolved = Path(path).resolve()
    for host, inside in ((paths.hf_cache, HF_CACHE_MOUNT), (paths.engine_cache, ENGINE_CACHE_MOUNT),
                         (paths.models_dir, None)):
        if host is None:
            continue
        root = Path(host).expanduser().resolve()
        if resolved != root and root not in resolved.parents:
            continue
        if inside is None:
            return str(resolved)
        rel = resolved.relative_to(root)
        return inside if rel == Path() else f"{inside}/{rel}"
    return None


def _escape(value: str) -> str:
    """Compose interpolates $ in every string of a compose file; the rendered values are literal."""
    return value.replace("$", "$$")


@dataclass
class Rendered:
    folder: Path
    override: Path
    env_file: Path
    argv_file: Path
    notes: list[str] = field(default_factory=list)


def build_override(
    project: Project,
    resolved: Resolved,
    command: ServeCommand,
    *,
    runtime: str,
    ids: HostIds,
    paths: StackPaths,
    package_dir: str | None,
    schema: Schema | None = None,
    host: flavours.Host | None = None,
    image_present: bool = True,
) -> tuple[dict[str, Any], list[str]]:
    """The per-profile compose override as a dict, and notes on what was left out and why.

    `runtime` picks the runtime's differences (runtime/flavours.py); `host` states the host facts
    they depend on (rootless, SELinux, rlimits), by default those of an ordinary rootful host."""
    schema = schema or load_schema()
    flavour = flavours.FLAVOURS.get(runtime, flavours.COMPOSE_V2)
    host_keys = flavours.host_keys(flavour, host or flavours.Host())
    notes: list[str] = []
    # The kind's first words (`vllm serve`, `llama-server`) as the entrypoint, the rest as the
    # command: the container runs the recorded argv whatever entrypoint the image declares
    # (VLLM_IMAGE may be any image with a `vllm` on its PATH).
    entrypoint = engine_kind(resolved).entrypoint
    service: dict[str, Any] = {
        "entrypoint": list(entrypoint),
        "command": [_escape(a) for a in command.argv[len(entrypoint):]],
        "environment": {k: _escape(v) for k, v in engine_environment(resolved, schema).items()},
        "labels": {
            "vllmstack.profile": resolved.profile,
            "vllmstack.platform": resolved.platform,
            "vllmstack.argv": _escape(json.dumps(command.argv)),
        },
    }
    volumes: list[str] = []
    vendor = resolved.get("GPU_VENDOR")
    if vendor == "amd":
        service["devices"] = ["/dev/kfd", "/dev/dri"]
        groups = [str(g) for g in (ids.video_gid, ids.render_gid) if g is not None]
        service["group_add"] = groups or ["video"]
        # SELinux hosts would otherwise need the device nodes relabelled.
        service["security_opt"] = ["label=disable"]
    elif vendor == "nvidia":
        if flavour.nvidia == "cdi":
            service["devices"] = ["nvidia.com/gpu=all"]
        else:
            service["deploy"] = {"resources": {"reservations": {"devices": [
                {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]}}}
    if paths.models_dir is not None:
        volumes.append(f"{paths.models_dir}:{paths.models_dir}:ro")
    if package_dir:
        volumes += _overlay_mounts(project, package_dir, notes)
        device = resolved.get("GPU_DEVICE_NAME") or ""
        for path in sorted((project.root / "fp8_configs").glob("*.json")):
            if device and f"device_name={device}," in path.name:
                volumes.append(f"{path}:{package_dir}/{FP8_CONFIG_DIR}/{path.name}:ro")
    elif image_present:  # a missing image has no labels at all; `prepare` says it is missing
        notes.append("the engine image has no vllmstack.vllm-package label (not a vllmstack build): "
                     "runtime overlays and fp8 tuned configs are not mounted")
    if volumes:
        service["volumes"] = [_escape(v) for v in volumes]
    dashboard = dashboard_service(resolved, paths)
    for part in (service, dashboard):
        for key, value in host_keys.items():
            # security_opt may already say label=disable (AMD): one list, no duplicates.
            if isinstance(value, list):
                part[key] = sorted({*part.get(key, []), *value})
            else:  # a copy each: one shared dict would be written as a YAML anchor and alias
                part[key] = dict(value) if isinstance(value, dict) else value
    return {"services": {ENGINE_SERVICE: service, DASHBOARD_SERVICE: dashboard}}, notes


def dashboard_service(resolved: Resolved, paths: StackPaths) -> dict[str, Any]:
    """The dashboard's per-profile part: where the engine is, how exposed it is, what runs use."""
    bind = resolved.get_str("DASHBOARD_BIND")
    service: dict[str, Any] = {
        "command": ["python", "-m", "vllmstack.dashboard", "--host", "0.0.0.0", "--port", "3000",
                    # The app sees 0.0.0.0; what users reach is the host address it is published on.
                    "--exposure", _escape(bind),
                    "--engine-url", f"http://{ENGINE_SERVICE}:{resolved.get_int('VLLM_PORT')}",
                    "--history-dir", "/app/benchmarks"],
        "environment": {
            "VLLM_TOKENIZER": _escape(resolved.get("VLLM_TOKENIZER") or resolved.get("VLLM_MODEL") or ""),
            "VLLM_MAX_NUM_SEQS": resolved.get("VLLM_MAX_NUM_SEQS") or "",
        },
    }
    if paths.models_dir is not None:
        service["volumes"] = [_escape(f"{paths.models_dir}:{paths.models_dir}:ro")]
    return service


def _overlay_mounts(project: Project, package_dir: str, notes: list[str]) -> list[str]:
    mounts = []
    for overlay in patches.load_overlays(project):
        target = overlay.target.removeprefix("vllm/")
        mounts.append(f"{Path(overlay.file).resolve()}:{package_dir}/{target}:ro")
        notes.append(f"overlay {overlay.name} -> {overlay.target} (locked to {overlay.ref})")
    return mounts


def interpolation_env(resolved: Resolved, ids: HostIds, paths: StackPaths) -> dict[str, str]:
    """Variables compose.yaml interpolates. Prefixed so that no .env can satisfy them: a bare
    `docker compose up` must fail and say to use invoke."""
    return {
        "VLLMSTACK_VLLM_IMAGE": engine_kind(resolved).image(resolved),
        "VLLMSTACK_DASHBOARD_IMAGE": resolved.get("DASHBOARD_IMAGE") or "",
        "VLLMSTACK_USER_UID": str(ids.uid),
        "VLLMSTACK_USER_GID": str(ids.gid),
        "VLLMSTACK_VLLM_BIND": resolved.get_str("VLLM_BIND"),
        "VLLMSTACK_VLLM_PORT": resolved.get_str("VLLM_PORT"),
        "VLLMSTACK_DASHBOARD_BIND": resolved.get_str("DASHBOARD_BIND"),
        "VLLMSTACK_DASHBOARD_PORT": resolved.get_str("DASHBOARD_PORT"),
        "VLLMSTACK_DASHBOARD_TOKEN": resolved.get_str("DASHBOARD_TOKEN"),
        "VLLMSTACK_HF_CACHE_DIR": str(paths.hf_cache),
        "VLLMSTACK_ENGINE_CACHE_DIR": str(paths.engine_cache),
    }


class RenderError(StackError):
    """A value cannot be written into a generated file exactly (`invoke check` names its source)."""


def write_rendered(
    project: Project,
    resolved: Resolved,
    command: ServeCommand,
    override: dict[str, Any],
    env: dict[str, str],
    notes: list[str],
) -> Rendered:
    """Write generated/ so a run can be read and reproduced by hand.

    Every file is created mode 0600: the env files, the override (engine environment) and the
    argv can hold tokens. compose.env is refused as a whole when one value cannot be carried
    exactly (core.files.env_line), before anything is written.
    """
    try:
        env_text = "".join(env_line(k, v) + "\n" for k, v in env.items())
    except EnvValueError as exc:
        raise RenderError(
            f"generated/compose.env cannot carry {exc}, so Compose would read something else",
            "run `invoke check`: it names the setting and the file:line that set it") from None
    folder = project.generated
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    header = (f"# Rendered by `invoke up` for profile {resolved.profile} on {resolved.platform}.\n"
              "# Do not edit: change env/ or .env and run invoke again.\n")
    override_path = folder / "compose.override.yaml"
    write_text(override_path, header + yaml.safe_dump(override, sort_keys=False, width=1000))
    env_path = folder / "compose.env"
    write_text(env_path, header + env_text)
    argv_path = folder / "vllm-argv.txt"
    write_text(argv_path, command.shell() + "\n")
    write_text(folder / "resolved.env", header + _resolved_text(resolved))
    return Rendered(folder, override_path, env_path, argv_path, notes)


def _resolved_text(resolved: Resolved) -> str:
    """Every setting with the file:line that set it, less the other engine's keys left at their
    defaults: a vLLM profile's record need not list the sixteen llama-server defaults it never
    passes (nor the reverse). One of them that a layer set is kept: it is in the user's files."""
    kind = engine_kind(resolved)
    schema = resolved.schema or load_schema()
    kept, left = [], 0
    for key, setting in sorted(resolved.values.items()):
        spec = schema.get(key)
        if kind.foreign_setting(key, spec.becomes if spec else None) and setting.source == "default":
            left += 1
            continue
        kept.append(_resolved_entry(key, setting.value, setting.source))
    if left:
        shown = " or ".join(other.display for other in others(kind))
        kept.insert(0, f"# Not listed: {left} {shown} settings at their defaults "
                       f"(this profile runs ENGINE={kind.name}).\n")
    return "".join(kept)


def _resolved_entry(key: str, value: str, source: str) -> str:
    """One setting for resolved.env (a record nothing parses back); a value no env file can
    carry exactly is written as a JSON string in a comment, so the file stays data."""
    where = json.dumps(source)[1:-1]  # a comment line must stay one line
    try:
        return f"# {where}\n{env_line(key, value)}\n"
    except EnvValueError as exc:
        return f"# {where}\n# {json.dumps(str(exc))[1:-1]}; as JSON: {json.dumps(value)}\n"


def compose_files(project: Project) -> list[Path]:
    return [project.root / "compose.yaml", project.generated / "compose.override.yaml"]

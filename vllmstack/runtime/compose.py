"""Compose: detect the CLI, render the per-profile part into generated/, build compose argv.

compose.yaml holds the static services; everything that depends on the profile (the engine
command, its environment, GPU devices, overlay and tuned-config mounts, host paths and ids) is
rendered here as data (yaml.safe_dump of dicts, never string concatenation) into the
git-ignored generated/ folder, which is what compose then runs.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema, is_engine_env_name, load_schema
from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core.paths import Project, home_dir
from vllmstack.core.runner import Runner
from vllmstack.runtime.base import MISSING, EngineState

ENGINE_SERVICE = "vllm"
DASHBOARD_SERVICE = "dashboard"
# Where a vllmstack-built image exposes the installed vLLM package (a symlink made in the
# runtime stage, recorded as this label), so mounts never hard-code a Python version.
PACKAGE_LABEL = "vllmstack.vllm-package"
FP8_CONFIG_DIR = "model_executor/layers/quantization/utils/configs"
ENGINE_CACHE_SUBDIRS = ("home", "vllm", "triton", "torchinductor", "aiter/jit")


class ComposeError(RuntimeError):
    """Compose cannot be used as configured; the message says what to do."""


@dataclass(frozen=True)
class ComposeCli:
    runtime: str  # compose | compose-v1 | podman
    base: tuple[str, ...]  # how compose is invoked
    engine: str  # the container CLI for inspect/logs (docker binary or podman)

    def argv(self, project_name: str, files: list[Path], env_file: Path, *args: str) -> list[str]:
        out = [*self.base, "-p", project_name]
        for path in files:
            out += ["-f", str(path)]
        return [*out, "--env-file", str(env_file), *args]


def detect_compose(runner: Runner, docker: str, requested: str = "auto") -> ComposeCli:
    """Pick Compose v2, Compose v1 or Podman (in that order for `auto`)."""
    candidates = {
        "compose": ComposeCli("compose", (docker, "compose"), docker),
        "compose-v1": ComposeCli("compose-v1", ("docker-compose",), docker),
        "podman": ComposeCli("podman", ("podman", "compose"), "podman"),
    }
    if requested not in ("auto", *candidates):
        raise ComposeError(f"unknown runtime {requested!r}: use compose, compose-v1, podman or native")
    order = list(candidates) if requested == "auto" else [requested]
    tried = []
    for name in order:
        cli = candidates[name]
        if runner.run([*cli.base, "version"], mutates=False, timeout=20).ok:
            return cli
        tried.append(" ".join(cli.base))
    raise ComposeError(
        "no working compose found (tried: " + ", ".join(tried) + "). Install Docker Compose v2 "
        "(docker compose), docker-compose, or podman compose; or choose one with --runtime.")


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
    home = home_dir(environ)
    cache = Path(resolved.get("HOST_CACHE_DIR") or home / ".cache").expanduser()
    hf = Path(resolved.get("HF_CACHE_DIR") or cache / "huggingface").expanduser()
    models = resolved.get("MODELS_DIR")
    return StackPaths(hf, cache / "vllmstack-engine", Path(models).expanduser() if models else None)


def ensure_cache_dirs(paths: StackPaths, ids: HostIds, *, dry_run: bool) -> list[str]:
    """Create the mounted cache folders user-owned before compose does (it would make them root's).

    Returns what was done, one line each. Raises ComposeError with the exact fix when a folder
    belongs to someone else and we cannot change that.
    """
    done: list[str] = []
    folders = [paths.hf_cache, paths.engine_cache,
               *(paths.engine_cache / sub for sub in ENGINE_CACHE_SUBDIRS)]
    for folder in folders:
        if not folder.exists():
            done.append(f"mkdir -p {shlex.quote(str(folder))}")
            if not dry_run:
                folder.mkdir(parents=True, exist_ok=True)
                if os.geteuid() == 0:
                    os.chown(folder, ids.uid, ids.gid)
            continue
        owner = folder.stat().st_uid
        if owner != ids.uid:
            if os.geteuid() == 0 and not dry_run:
                os.chown(folder, ids.uid, ids.gid)
                done.append(f"chown {ids.uid}:{ids.gid} {folder}")
            elif os.geteuid() != 0:
                raise ComposeError(
                    f"{folder} belongs to uid {owner}, but the engine runs as uid {ids.uid} and "
                    f"could not write its caches. Fix once: sudo chown -R {ids.uid}:{ids.gid} {folder}")
    return done


def clear_engine_caches(paths: StackPaths, *, dry_run: bool) -> list[str]:
    """Delete the engine's compile and JIT caches (never the Hugging Face cache); one line each."""
    import shutil

    done = []
    for sub in ("vllm", "triton", "torchinductor", "aiter", "home", "native"):
        folder = paths.engine_cache / sub
        if not folder.exists():
            continue
        done.append(f"rm -rf {shlex.quote(str(folder))}")
        if not dry_run:
            try:
                shutil.rmtree(folder)
            except PermissionError as exc:
                raise ComposeError(f"cannot delete {exc.filename}: it belongs to another user. "
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
    for word in shlex.split(resolved.get("ENGINE_ENV") or ""):
        key, sep, value = word.partition("=")
        if sep and key:
            env[key] = value
    return env


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
) -> tuple[dict[str, Any], list[str]]:
    """The per-profile compose override as a dict, and notes on what was left out and why."""
    schema = schema or load_schema()
    notes: list[str] = []
    # The images' entrypoint is `vllm serve`; the command is everything after it.
    service: dict[str, Any] = {
        "command": [_escape(a) for a in command.argv[2:]],
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
        if runtime == "podman":
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
    else:
        notes.append("the engine image has no vllmstack.vllm-package label (not a vllmstack build): "
                     "runtime overlays and fp8 tuned configs are not mounted")
    if volumes:
        service["volumes"] = [_escape(v) for v in volumes]
    return {"services": {ENGINE_SERVICE: service,
                         DASHBOARD_SERVICE: dashboard_service(resolved, paths)}}, notes


def dashboard_service(resolved: Resolved, paths: StackPaths) -> dict[str, Any]:
    """The dashboard's per-profile part: where the engine is, how exposed it is, what runs use."""
    bind = resolved.get("DASHBOARD_BIND") or "127.0.0.1"
    service: dict[str, Any] = {
        "command": ["python", "-m", "vllmstack.dashboard", "--host", "0.0.0.0", "--port", "3000",
                    # The app sees 0.0.0.0; what users reach is the host address it is published on.
                    "--exposure", bind,
                    "--engine-url", f"http://{ENGINE_SERVICE}:{resolved.get('VLLM_PORT') or 8180}",
                    "--history-dir", "/app/benchmarks"],
        "environment": {
            "VLLM_TOKENIZER": _escape(resolved.get("VLLM_TOKENIZER") or resolved.get("VLLM_MODEL") or ""),
            "VLLM_MAX_NUM_SEQS": resolved.get("VLLM_MAX_NUM_SEQS") or "",
        },
    }
    if paths.models_dir is not None:
        service["volumes"] = [f"{paths.models_dir}:{paths.models_dir}:ro"]
    return service


def _overlay_mounts(project: Project, package_dir: str, notes: list[str]) -> list[str]:
    from vllmstack.image import patches

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
        "VLLMSTACK_VLLM_IMAGE": resolved.get("VLLM_IMAGE") or "",
        "VLLMSTACK_DASHBOARD_IMAGE": resolved.get("DASHBOARD_IMAGE") or "",
        "VLLMSTACK_USER_UID": str(ids.uid),
        "VLLMSTACK_USER_GID": str(ids.gid),
        "VLLMSTACK_VLLM_BIND": resolved.get("VLLM_BIND") or "127.0.0.1",
        "VLLMSTACK_VLLM_PORT": resolved.get("VLLM_PORT") or "8180",
        "VLLMSTACK_DASHBOARD_BIND": resolved.get("DASHBOARD_BIND") or "127.0.0.1",
        "VLLMSTACK_DASHBOARD_PORT": resolved.get("DASHBOARD_PORT") or "8083",
        "VLLMSTACK_DASHBOARD_TOKEN": resolved.get("DASHBOARD_TOKEN") or "",
        "VLLMSTACK_HF_CACHE_DIR": str(paths.hf_cache),
        "VLLMSTACK_ENGINE_CACHE_DIR": str(paths.engine_cache),
    }


def write_rendered(
    project: Project,
    resolved: Resolved,
    command: ServeCommand,
    override: dict[str, Any],
    env: dict[str, str],
    notes: list[str],
) -> Rendered:
    """Write generated/ so a run can be read and reproduced by hand."""
    folder = project.generated
    folder.mkdir(parents=True, exist_ok=True)
    header = (f"# Rendered by `invoke up` for profile {resolved.profile} on {resolved.platform}.\n"
              "# Do not edit: change env/ or .env and run invoke again.\n")
    override_path = folder / "compose.override.yaml"
    override_path.write_text(header + yaml.safe_dump(override, sort_keys=False, width=1000))
    env_path = folder / "compose.env"
    env_path.write_text(header + "".join(f"{k}={_dotenv_quote(v)}\n" for k, v in env.items()))
    argv_path = folder / "vllm-argv.txt"
    argv_path.write_text(command.shell() + "\n")
    resolved_path = folder / "resolved.env"
    resolved_path.write_text(header + "".join(
        f"# {s.source}\n{k}={_dotenv_quote(s.value)}\n" for k, s in sorted(resolved.values.items())))
    return Rendered(folder, override_path, env_path, argv_path, notes)


def _dotenv_quote(value: str) -> str:
    if value and all(c.isalnum() or c in "._-/:,+@" for c in value):
        return value
    return "'" + value.replace("'", "'\\''") + "'"


def compose_files(project: Project) -> list[Path]:
    return [project.root / "compose.yaml", project.generated / "compose.override.yaml"]



@dataclass
class ComposeEngine:
    """The engine as the `vllm` service of a Compose project (EngineRuntime)."""

    cli: ComposeCli
    runner: Runner
    project_name: str
    files: list[Path]
    env_file: Path
    service: str = ENGINE_SERVICE
    name: str = "compose"
    # The container id, looked up once per container: `up` polls twice a second and would
    # otherwise list containers on every poll.
    _cid: str | None = field(default=None, repr=False)

    @property
    def flavour(self) -> str:
        return self.cli.runtime

    def compose(self, *args: str) -> list[str]:
        return self.cli.argv(self.project_name, self.files, self.env_file, *args)

    def _label_filter(self, service: str | None = None) -> list[str]:
        out = ["--filter", f"label=com.docker.compose.project={self.project_name}"]
        if service:
            out += ["--filter", f"label=com.docker.compose.service={service}"]
        return out

    def container_id(self) -> str | None:
        if self._cid is None:
            result = self.runner.run([self.cli.engine, "ps", "-aq",
                                      *self._label_filter(self.service)], mutates=False, timeout=30)
            ids = result.stdout.split() if result.ok else []
            self._cid = ids[0] if ids else None
        return self._cid

    def start(self) -> None:
        self._cid = None  # recreated: a new container id
        # Recreate so the restart counter starts at zero and the new command applies.
        result = self.runner.run(self.compose("up", "-d", "--force-recreate", "--no-deps",
                                              self.service), timeout=600)
        if not result.ok:
            raise ComposeError(f"compose could not start the engine:\n{result.stderr.strip()[-1500:]}")

    def state(self) -> EngineState:
        cid = self.container_id()
        if cid is None:
            return MISSING
        result = self.runner.run(
            [self.cli.engine, "inspect", "--format", "{{json .State}}|{{.RestartCount}}", cid],
            mutates=False, timeout=30)
        if not result.ok:
            self._cid = None  # removed meanwhile
            return MISSING
        raw_state, _, restarts = result.stdout.strip().rpartition("|")
        try:
            state = json.loads(raw_state)
        except ValueError:
            return MISSING
        status = str(state.get("Status", "unknown")).lower()
        health = (state.get("Health") or {}).get("Status")
        return EngineState(
            exists=True,
            running=bool(state.get("Running")) and status == "running",
            status=status,
            restart_count=int(restarts) if restarts.strip().isdigit() else 0,
            exit_code=state.get("ExitCode") if not state.get("Running") else None,
            details={"container": cid, "health": health, "started": state.get("StartedAt")},
        )

    def log_lines(self, tail: int = 400) -> list[str]:
        cid = self.container_id()
        if cid is None:
            return []
        result = self.runner.run([self.cli.engine, "logs", "--tail", str(tail), cid],
                                 mutates=False, timeout=30, merge_output=True)
        return result.stdout.splitlines()

    def stop(self) -> None:
        self.runner.run(self.compose("stop", "-t", "10", self.service), timeout=120)

    def remove(self) -> None:
        self._cid = None
        if self.env_file.is_file():
            self.runner.run(self.compose("--profile", "dashboard", "down", "--remove-orphans",
                                         "-t", "20"), timeout=300)
            return
        # Never rendered here (or generated/ was deleted): remove by the project label.
        ids = self.runner.run([self.cli.engine, "ps", "-aq", *self._label_filter()], mutates=False)
        if ids.ok and ids.stdout.split():
            self.runner.run([self.cli.engine, "rm", "-f", *ids.stdout.split()], timeout=120)

    def members(self) -> list[dict[str, Any]]:
        result = self.runner.run([self.cli.engine, "ps", "-a", *self._label_filter(), "--format",
                                  "{{json .}}"], mutates=False, timeout=30)
        out: list[dict[str, Any]] = []
        for line in result.stdout.splitlines() if result.ok else []:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            labels = str(row.get("Labels", ""))
            service = next((part.split("=", 1)[1] for part in labels.split(",")
                            if part.startswith("com.docker.compose.service=")), None)
            out.append({"name": row.get("Names"), "service": service, "state": row.get("State"),
                        "status": row.get("Status"), "image": row.get("Image")})
        return out

    def image_id(self, image: str) -> str | None:
        result = self.runner.run([self.cli.engine, "image", "inspect", "--format", "{{.Id}}", image],
                                 mutates=False, timeout=30)
        return result.stdout.strip() or None if result.ok else None

    def image_exists(self, image: str) -> bool:
        return self.runner.run([self.cli.engine, "image", "inspect", image], mutates=False,
                               timeout=30).ok

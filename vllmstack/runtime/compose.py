"""The Compose runtime: detect the CLI, prepare the rendered files and run the engine service.

`ComposeEngine` implements `EngineRuntime` for Compose v2, Compose v1 and Podman: everything
that only containers need (the image, the cache folders, the rendered override, the AITER
prewarm, the dashboard side-car, logs and exec through compose) lives here, so the serving
layer never asks which runtime it has.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml
from dotenv import dotenv_values

from vllmstack.config.engines.table import engine_kind
from vllmstack.config.profiles import Resolved
from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project, results_folder
from vllmstack.core.runner import Result, Runner
from vllmstack.image import build
from vllmstack.runtime import compose_files, dashboard_image, engine_env, flavours
from vllmstack.runtime.base import MISSING, Beside, EngineState
from vllmstack.runtime.compose_files import (
    DASHBOARD_SERVICE,
    ENGINE_SERVICE,
    PACKAGE_LABEL,
    PACKAGE_MOUNT,
    container_path,
)
from vllmstack.runtime.engine_image import image_label_problems, missing_image_fix

# Builds AITER's JIT core and the unified-attention kernels once, in a throwaway container, so
# the tensor-parallel workers do not race to build them at boot (ModuleNotFoundError, or a
# deadlock on a stale build lock).
AITER_PREWARM = ("import aiter; "
                 "from aiter.ops.triton.unified_attention import unified_attention")
# The image's Python (the venv that has vLLM) first on PATH: a bare `python3` in the
# container is otherwise the system interpreter without vLLM.
EXEC_PREFIX = ('for d in /opt/venv/bin "$(dirname "$(readlink -f /opt/vllm-package 2>/dev/null)" '
               '2>/dev/null)/../../../bin"; do [ -x "$d/python3" ] && PATH="$d:$PATH" && break; '
               'done; exec "$@"')


class ComposeError(StackError):
    """Compose cannot be used as configured; the message says what to do."""


@dataclass(frozen=True)
class ComposeCli:
    runtime: str  # compose | compose-v1 | podman
    base: tuple[str, ...]  # how compose is invoked
    engine: str  # the container CLI for inspect/logs (docker binary or podman)
    # What this runtime does differently (runtime/flavours.py); default: the runtime's usual one.
    flavour: flavours.Flavour | None = None

    @property
    def traits(self) -> flavours.Flavour:
        return self.flavour or flavours.FLAVOURS.get(self.runtime, flavours.COMPOSE_V2)

    def argv(self, project_name: str, files: list[Path], env_file: Path, *args: str) -> list[str]:
        out = [*self.base, "-p", project_name]
        for path in files:
            out += ["-f", str(path)]
        if self.traits.env_file_flag:
            out += ["--env-file", str(env_file)]
        return [*out, *args]


def detect_compose(runner: Runner, docker: str, requested: str = "auto") -> ComposeCli:
    """Pick Compose v2, Compose v1 or Podman (in that order for `auto`).

    Podman: podman-compose itself first (its version decides which arguments it takes), then
    `podman compose` (Podman 4.7+, which hands over to an installed provider)."""
    candidates = {
        "compose": [ComposeCli("compose", (docker, "compose"), docker)],
        "compose-v1": [ComposeCli("compose-v1", ("docker-compose",), docker)],
        "podman": [ComposeCli("podman", ("podman-compose",), "podman"),
                   ComposeCli("podman", ("podman", "compose"), "podman")],
    }
    if requested not in ("auto", *candidates):
        raise ComposeError(f"unknown runtime {requested!r}: use compose, compose-v1, podman or native")
    order = list(candidates) if requested == "auto" else [requested]
    tried = []
    for cli in (c for name in order for c in candidates[name]):
        result = runner.run([*cli.base, "version"], mutates=False, timeout=20)
        if result.ok:
            if cli.runtime == "podman":
                return ComposeCli(cli.runtime, cli.base, cli.engine,
                                  flavours.podman_flavour(result.stdout + result.stderr))
            return cli
        tried.append(" ".join(cli.base))
    raise ComposeError(
        "no working compose found (tried: " + ", ".join(tried) + "). Install Docker Compose v2 "
        "(docker compose), docker-compose, or podman compose; or choose one with --runtime.",
        "install one of them, or run the engine without containers: --runtime native")


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
    # What `prepare` and the dashboard side-car need; absent in tests that only drive compose.
    project: Project | None = None
    resolved: Resolved | None = None
    environ: Mapping[str, str] = field(default_factory=dict)
    out: TextIO = field(default_factory=lambda: sys.stdout)
    # The container id, looked up once per container: `up` polls twice a second and would
    # otherwise list containers on every poll.
    _cid: str | None = field(default=None, repr=False)

    @property
    def flavour(self) -> str:
        return self.cli.runtime

    def compose(self, *args: str) -> list[str]:
        return self.cli.argv(self.project_name, self.files, self.env_file, *args)

    def _compose_env(self) -> dict[str, str] | None:
        """The environment for compose, or None to inherit this one.

        Where compose has no --env-file, the rendered values go on top of this environment (read
        back exactly with python-dotenv, the parser podman-compose itself uses). Where the engine
        fails on a DOCKER_CONFIG folder without config.json (Podman), that variable is dropped."""
        traits = self.cli.traits
        env: dict[str, str] | None = None
        if not traits.env_file_flag:
            values = dotenv_values(self.env_file) if self.env_file.is_file() else {}
            env = {**(self.environ or os.environ),
                   **{k: v for k, v in values.items() if v is not None}}
        if traits.docker_config_needs_file:
            base = env if env is not None else dict(self.environ or os.environ)
            config = base.get("DOCKER_CONFIG")
            if config and not (Path(config) / "config.json").is_file():
                env = {k: v for k, v in base.items() if k != "DOCKER_CONFIG"}
        return env

    def _run_compose(self, *args: str, **kwargs: Any) -> Result:
        return self.runner.run(self.compose(*args), env=self._compose_env(), **kwargs)

    def _profile(self) -> list[str]:
        """--profile dashboard where understood; elsewhere every service is active anyway."""
        return ["--profile", DASHBOARD_SERVICE] if self.cli.traits.profile_flag else []

    def _run_args(self, service: str) -> list[str]:
        """Keys this compose drops silently (flavour.run_args_for), as --podman-run-args."""
        keys = self.cli.traits.run_args_for
        if not keys:
            return []
        merged: dict[str, Any] = {}
        for path in self.files:
            try:
                data = yaml.safe_load(path.read_text()) or {}
            except (OSError, yaml.YAMLError):
                continue
            merged.update({k: v for k, v in ((data.get("services") or {}).get(service) or {}).items()
                           if k in keys})
        args = [f"--ipc={merged['ipc']}"] if "ipc" in merged else []
        args += [f"--group-add={group}" for group in merged.get("group_add") or []]
        args += [f"--userns={merged['userns_mode']}"] if "userns_mode" in merged else []
        return [f"--podman-run-args={shlex.join(args)}"] if args else []

    def container_name(self, service: str) -> str:
        return flavours.container_name(self.cli.traits, self.project_name, service)

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
        result = self._run_compose(*self._run_args(self.service), "up", "-d", "--force-recreate",
                                   "--no-deps", self.service, timeout=600)
        if result.ok and self._did_not_start(self.service):
            result = Result(result.argv, 1, result.stdout, result.stderr)
        if not result.ok:
            image = engine_kind(self.resolved).image(self.resolved) if self.resolved else "the engine image"
            raise ComposeError(
                f"compose could not start the engine:\n{result.stderr.strip()[-1500:]}",
                f"check that the image {image} exists (`invoke build` makes the full-build image) "
                "and that the compose files render: generated/compose.override.yaml")

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
        if self.cli.traits.health_needs_systemd and not Path("/run/systemd/system").is_dir():
            health = None  # no systemd, no health check ever runs: "starting" would be a lie
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
        self._run_compose("stop", "-t", "10", self.service, timeout=120)

    def remove(self) -> None:
        self._cid = None
        if self.env_file.is_file():
            orphans = ["--remove-orphans"] if self.cli.traits.down_remove_orphans else []
            self._run_compose(*self._profile(), "down", *orphans, "-t", "20", timeout=300)
            if self.cli.traits.leaves_network:
                network = self.cli.traits.leaves_network.format(project=self.project_name)
                self.runner.run([self.cli.engine, "network", "rm", network], timeout=60)
            return
        # Never rendered here (or generated/ was deleted): remove by the project label.
        ids = self.runner.run([self.cli.engine, "ps", "-aq", *self._label_filter()], mutates=False)
        if ids.ok and ids.stdout.split():
            self.runner.run([self.cli.engine, "rm", "-f", *ids.stdout.split()], timeout=120)

    def members(self) -> list[dict[str, Any]]:
        array = self.cli.traits.ps_json_array
        result = self.runner.run([self.cli.engine, "ps", "-a", *self._label_filter(), "--format",
                                  "json" if array else "{{json .}}"], mutates=False, timeout=30)
        return [_member(row) for row in _ps_rows(result.stdout if result.ok else "", array)]

    def _did_not_start(self, service: str) -> bool:
        """Where compose exits 0 after a failed `podman run`, whether `service` never started (no
        container, or one left "created"; one that started and exited is the watcher's to diagnose)."""
        if self.cli.traits.exit_status_reliable or getattr(self.runner, "dry_run", False):
            return False
        states = [m["state"] for m in self.members() if m["service"] == service]
        return not states or all(state in ("created", "configured", "initialized") for state in states)

    def image_id(self, image: str) -> str | None:
        result = self.runner.run([self.cli.engine, "image", "inspect", "--format", "{{.Id}}", image],
                                 mutates=False, timeout=30)
        return result.stdout.strip() or None if result.ok else None

    def image_exists(self, image: str) -> bool:
        return self.runner.run([self.cli.engine, "image", "inspect", image], mutates=False,
                               timeout=30).ok

    # -- what only containers need ----------------------------------------------------------------

    def _stack(self) -> tuple[Project, Resolved]:
        if self.project is None or self.resolved is None:
            raise ComposeError("no profile was resolved for this compose runtime")
        return self.project, self.resolved

    def prepare(self, command: ServeCommand, *, dry_run: bool) -> list[str]:
        """Image, cache folders and the rendered files; returns notes on what was left out."""
        project, resolved = self._stack()
        kind = engine_kind(resolved)
        image = kind.image(resolved)
        present = self.image_exists(image)
        if not present:
            missing = ComposeError(f"the engine image {image} does not exist on this host",
                                   missing_image_fix(resolved, image, self.cli.engine))
            if not dry_run:
                raise missing
            # A dry run goes on to show the plan, but says first what the real `up` stops at.
            print(f"(dry run) {missing.cause}: `invoke up` stops here; {missing.fix}",
                  file=self.out)
        labels = build.read_image_labels(self.runner, self.cli.engine, image)
        problem, findings = image_label_problems(project, resolved, labels)
        for finding in findings:
            if finding.severity != "info":
                print(finding.render(), file=self.out)
        if problem is not None and not dry_run:
            raise ComposeError(*problem)
        ids = engine_env.detect_host_ids(resolved)
        paths = engine_env.stack_paths(resolved, self.environ)
        for line in engine_env.ensure_cache_dirs(paths, ids, dry_run=dry_run):
            print(("(dry run) " if dry_run else "") + line, file=self.out)
        override, notes = compose_files.build_override(
            project, resolved, command, runtime=self.cli.runtime, ids=ids, paths=paths,
            package_dir=(labels or {}).get(PACKAGE_LABEL) if kind.vllm_cli else None,
            host=flavours.probe_host(), image_present=present)
        env = compose_files.interpolation_env(resolved, ids, paths)
        rendered = compose_files.write_rendered(project, resolved, command, override, env, notes)
        for note in notes:
            print(f"note: {note}", file=self.out)
        print(f"rendered {_relative(rendered.override, project.root)} and "
              f"{_relative(rendered.env_file, project.root)}", file=self.out)
        if resolved.get_bool("VLLM_ROCM_USE_AITER"):
            self.prewarm_aiter(paths, image, dry_run=dry_run)
        return notes

    def beside(self, command: ServeCommand) -> Beside:
        """A one-off container of the engine service (`compose run --rm --no-deps`): the profile's
        image, devices, user, caches and MODELS_DIR, with this package mounted read-only and
        importable; the files are rendered for `command` before the first run."""
        _, resolved = self._stack()
        image = engine_kind(resolved).image(resolved)
        paths = engine_env.stack_paths(resolved, self.environ)
        rendered: list[bool] = []
        package = Path(__file__).resolve().parents[1]

        def run(args: Sequence[str], writable: Sequence[Path], timeout: float) -> Result:
            if not rendered:
                self.prepare(command, dry_run=self.runner.dry_run)
                rendered.append(True)
            mounts = [f"{package}:{PACKAGE_MOUNT}/vllmstack:ro", *(f"{p}:{p}" for p in writable)]
            flags = [*(word for mount in mounts for word in ("-v", mount)),
                     "-e", f"PYTHONPATH={PACKAGE_MOUNT}", "-e", "PYTHONNOUSERSITE=1"]
            engine_flags = []
            if self.cli.traits.run_flags_through_engine:
                engine_flags, flags = [f"--podman-run-args={shlex.join(flags)}"], []
            return self._run_compose(*self._run_args(ENGINE_SERVICE), *engine_flags, "run", "--rm",
                                     "--no-deps", "-T", *flags, "--entrypoint", "python3",
                                     ENGINE_SERVICE, *args, timeout=timeout)

        identity = {"image": image, "image_id": self.image_id(image) or "(unknown)"}
        return Beside(identity, self.runner.dry_run, lambda path: container_path(path, paths), run)

    def prewarm_aiter(self, paths: engine_env.StackPaths, image: str, *, dry_run: bool) -> None:
        """Once per image: clear stale AITER build locks, then build the JIT kernels."""
        jit = paths.engine_cache / "aiter" / "jit"
        image_id = self.image_id(image) if not dry_run else None
        marker = jit / f".prewarmed-{(image_id or 'unknown').replace(':', '-')}"
        if image_id and marker.is_file():
            return
        # No engine runs now (the guards made sure), so any build lock left is stale.
        for lock in sorted((jit / "build").glob("lock_*")) if (jit / "build").is_dir() else []:
            print(f"{'(dry run) ' if dry_run else ''}removing stale AITER build lock {lock}",
                  file=self.out)
            if not dry_run:
                lock.unlink(missing_ok=True)
        print("prewarming AITER JIT kernels (once per image, cached under "
              f"{paths.engine_cache})", file=self.out)
        result = self._run_compose(*self._run_args(ENGINE_SERVICE), "run", "--rm", "--no-deps", "-T",
                                   "--entrypoint", "python3", ENGINE_SERVICE, "-c", AITER_PREWARM,
                                   capture=False, timeout=3600)
        if not result.ok:
            raise ComposeError(
                "building AITER's JIT kernels failed (see the output above)",
                "check that the image has AITER for this GPU_ARCH (invoke build), or set "
                "VLLM_ROCM_USE_AITER=0 and ATTENTION_BACKEND=TRITON_ATTN")
        if not dry_run:
            jit.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{image}\n")

    def dashboard_up(self) -> None:
        project, resolved = self._stack()
        if not self.env_file.is_file():
            raise ComposeError("the stack was never rendered here", "run `invoke up` first")
        image = resolved.get_str("DASHBOARD_IMAGE")
        if not self.image_exists(image):
            self.build_dashboard_image(project, resolved, image)
        # compose.yaml mounts ./results (the history): made here, as the stack's user, before
        # the engine would make a missing one root's.
        made = not project.results.is_dir()
        results = results_folder(project)
        if made and os.geteuid() == 0:
            ids = engine_env.detect_host_ids(resolved)
            os.chown(results, ids.uid, ids.gid)
        result = self._run_compose(*self._profile(), *self._run_args(DASHBOARD_SERVICE), "up", "-d",
                                   "--no-deps", DASHBOARD_SERVICE, timeout=300)
        if result.ok and self._did_not_start(DASHBOARD_SERVICE):
            result = Result(result.argv, 1, result.stdout, result.stderr)
        if not result.ok:
            raise ComposeError(f"the dashboard did not start: {result.stderr.strip()[-500:]}",
                               "read `invoke logs --service dashboard`, or serve it in the "
                               "foreground: `invoke dashboard`")
        bind = resolved.get_str("DASHBOARD_BIND")
        host = "localhost" if bind in ("127.0.0.1", "0.0.0.0") else bind
        print(f"dashboard at http://{host}:{resolved.get('DASHBOARD_PORT')}", file=self.out)

    def build_dashboard_image(self, project: Project, resolved: Resolved, image: str) -> None:
        """Build Dockerfile.dashboard with the client's default builder (BuildKit or classic)."""
        print(f"building the dashboard image {image} (once)", file=self.out)
        context = dashboard_image.build_context(
            project.root, project.generated / dashboard_image.CONTEXT_DIR)
        # The image must land in the engine's own store: podman builds for Podman.
        builder = self.cli.engine if self.cli.traits.builder == "podman" else resolved.get_str("DOCKER")
        argv = dashboard_image.build_argv(builder, image,
                                          resolved.get_str("DASHBOARD_BASE_IMAGE"), context)
        result = self.runner.run(argv, cwd=project.root, capture=False, timeout=1800)
        if not result.ok:
            raise ComposeError(
                f"building the dashboard image {image} failed (exit {result.returncode}; see the "
                "build output above)",
                "check that DASHBOARD_BASE_IMAGE has python3 with venv and pip, and that pip "
                "reaches its package index")

    def dashboard_down(self) -> None:
        if self.env_file.is_file():
            self._run_compose(*self._profile(), "stop", DASHBOARD_SERVICE, timeout=120)
            if self.cli.traits.has_rm:
                self._run_compose(*self._profile(), "rm", "-f", DASHBOARD_SERVICE, timeout=120)
            else:
                self.runner.run([self.cli.engine, "rm", "-f", self.container_name(DASHBOARD_SERVICE)],
                                timeout=120)

    def log_command(self, *, tail: int, follow: bool, service: str) -> list[str] | None:
        follow_arg = ["-f"] if follow else []
        if self.cli.traits.exec_through_engine:
            return [self.cli.engine, "logs", "--tail", str(tail), *follow_arg,
                    self.container_name(service)]
        return self.compose(*self._profile(), "logs", "--tail", str(tail), *follow_arg, service)

    def exec_command(self, command: Sequence[str], *, tty: bool) -> list[str]:
        inside = ["sh", "-c", EXEC_PREFIX, "sh", *command]
        if self.cli.traits.exec_through_engine:
            return [self.cli.engine, "exec", "-i", *(["-t"] if tty else []),
                    self.container_name(ENGINE_SERVICE), *inside]
        return self.compose("exec", *([] if tty else ["-T"]), ENGINE_SERVICE, *inside)


def _ps_rows(text: str, array: bool) -> list[dict[str, Any]]:
    """`ps --format` output as rows: one JSON array (podman) or one object per line (docker)."""
    try:
        rows = json.loads(text or "[]") if array else [json.loads(line) for line in text.splitlines()
                                                      if line.strip()]
    except ValueError:
        return []
    return [row for row in rows if isinstance(row, dict)]


def _member(row: dict[str, Any]) -> dict[str, Any]:
    """A container for `invoke status`: docker gives comma-joined strings, podman a list and a map."""
    labels = row.get("Labels") or {}
    if not isinstance(labels, dict):
        labels = dict(part.split("=", 1) for part in str(labels).split(",") if "=" in part)
    names = row.get("Names")
    state = row.get("State")
    return {"name": ", ".join(names) if isinstance(names, list) else names,
            "service": labels.get("com.docker.compose.service"),
            "state": state.lower() if isinstance(state, str) else state,
            "status": row.get("Status"), "image": row.get("Image")}


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)

"""What differs between the container runtimes, as data: Compose v2, Compose v1 and Podman.

Each field of `Flavour` is one difference; compose.py and compose_files.py read the fields and
never test a runtime's name. The lifecycle tests (tests/integration/test_lifecycle_docker.py) run
the stack for real on every runtime and found most of them; NVIDIA CDI, rootless Podman and
SELinux cannot run on the test machines and are rendered and unit-tested only
(tests/test_runtime_flavours.py). Tested versions: Compose v2.40.3 and Compose v1 1.29.2 against
Docker Engine 20.10, Podman 4.3.1 with podman-compose 1.0.3 (Debian bookworm).
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

# podman-compose learnt --env-file, --profile and `down --remove-orphans` in 1.0.6; older
# releases (Debian bookworm and Ubuntu 22.04 ship 1.0.3) reject those arguments.
PODMAN_COMPOSE_MODERN = (1, 0, 6)
# Rootful Podman 4.3 raises RLIMIT_NOFILE and RLIMIT_NPROC to 1048576 in every container, which
# fails ("error setting rlimit type 7: operation not permitted") where the caller lacks
# CAP_SYS_RESOURCE (root inside a VM sandbox or a container). Podman runs conmon with an
# RLIMIT_NPROC of at most 32768 there (measured on Podman 4.3.1), so that is the ceiling.
PODMAN_NPROC_CEILING = 32768
CAP_SYS_RESOURCE = 24


@dataclass(frozen=True)
class Flavour:
    """One container runtime's behaviour, field by field."""

    name: str  # the RUNTIME value: compose | compose-v1 | podman
    # Container name Compose gives the first replica (docs and messages; lookups use labels).
    container_name: str
    # Compose reads the rendered env file through --env-file; else the values go into the
    # environment of the compose process (podman-compose < 1.0.6 has no --env-file).
    env_file_flag: bool = True
    # Understands --profile; without it every service is active (podman-compose < 1.0.6
    # ignores `profiles:`), so the dashboard is named explicitly and `down` removes it anyway.
    profile_flag: bool = True
    down_remove_orphans: bool = True
    # The compose exit status says whether a command worked (podman-compose < 1.0.6 exits 0
    # after a failed `podman run`): otherwise `start` checks that the container runs.
    exit_status_reliable: bool = True
    # `logs` and `exec` go to the container CLI with the container's name instead of compose
    # (podman-compose < 1.0.6 exits 0 whatever the command inside returned).
    exec_through_engine: bool = False
    # Has `compose rm` (podman-compose < 1.0.6 has none: the stopped side-car is removed with
    # `podman rm`, or the next `up` would start the old container again).
    has_rm: bool = True
    # `ps --format`: one JSON object per line (docker) or one JSON array (podman); podman's
    # Labels is a map and Names a list, docker's are comma-joined strings.
    ps_json_array: bool = False
    # Podman runs no restart backoff and has no "restarting" state: a crash loop shows as a
    # RestartCount that grows while Status stays "running" (docker: "restarting").
    has_restarting_state: bool = True
    # Podman's health checks need systemd timers; without systemd the status stays "starting".
    health_needs_systemd: bool = False
    # NVIDIA GPUs: Docker's nvidia runtime takes deploy.resources.reservations; Podman takes the
    # CDI device nvidia.com/gpu=all (nvidia-ctk cdi generate) and ignores the reservation.
    nvidia: Literal["deploy", "cdi"] = "deploy"
    # Compose keys the compose implementation drops silently (podman-compose 1.0.3: ipc,
    # group_add, userns_mode); they go onto `podman run` through --podman-run-args instead.
    run_args_for: tuple[str, ...] = ()
    # Rootless Podman maps the host user to root in the container unless --userns=keep-id; with
    # it the engine's files in the caches stay owned by the user.
    keep_id_when_rootless: bool = False
    # Podman labels every container for SELinux, so bind mounts of the user's folders are denied
    # on an SELinux host unless relabelled (:z/:Z) or labelling is off for the container (Docker
    # only labels when its daemon runs with --selinux-enabled). Relabelling would rewrite the
    # context of the user's own HF cache and models folder, and :Z would lock the dashboard out
    # of the cache the engine writes, so the containers run with label=disable instead.
    selinux_label_disable: bool = False
    # Pin nofile/nproc to what the caller may set when it lacks CAP_SYS_RESOURCE (see above).
    clamp_rlimits: bool = False
    # Podman reads registry credentials from $DOCKER_CONFIG/config.json, and `podman run` fails
    # ("stat .../config.json: no such file or directory") when DOCKER_CONFIG names a folder
    # without one (a folder made for Docker CLI plugins): compose then runs without it.
    docker_config_needs_file: bool = False
    # How images are built for this engine: docker with BuildKit, or podman (buildah).
    builder: Literal["buildkit", "podman"] = "buildkit"
    # Compose leaves its default network behind after `down` (podman-compose < 1.0.6).
    leaves_network: str | None = None
    # `compose run` drops its -v volumes ("TODO: handle volumes") and cuts -e values at every
    # '=' (podman-compose 1.0.3): a one-off container's mounts and variables go onto `podman
    # run` through --podman-run-args instead.
    run_flags_through_engine: bool = False


COMPOSE_V2 = Flavour("compose", container_name="{project}-{service}-1")
COMPOSE_V1 = Flavour("compose-v1", container_name="{project}_{service}_1")
PODMAN = Flavour(
    "podman", container_name="{project}_{service}_1", ps_json_array=True,
    has_restarting_state=False, health_needs_systemd=True, nvidia="cdi",
    keep_id_when_rootless=True, selinux_label_disable=True, clamp_rlimits=True,
    docker_config_needs_file=True, builder="podman")
# Debian's podman-compose 1.0.3.
PODMAN_LEGACY = replace(
    PODMAN, env_file_flag=False, profile_flag=False, down_remove_orphans=False,
    exit_status_reliable=False, exec_through_engine=True, has_rm=False,
    run_args_for=("ipc", "group_add", "userns_mode"), leaves_network="{project}_default",
    run_flags_through_engine=True)

FLAVOURS = {f.name: f for f in (COMPOSE_V2, COMPOSE_V1, PODMAN)}


def podman_flavour(version_output: str) -> Flavour:
    """PODMAN or PODMAN_LEGACY from `podman-compose version` output (unknown: the modern one)."""
    match = re.search(r"podman-compose(?:r)? version\s+(\d+)\.(\d+)\.(\d+)", version_output)
    if match and tuple(int(g) for g in match.groups()) < PODMAN_COMPOSE_MODERN:
        return PODMAN_LEGACY
    return PODMAN


@dataclass(frozen=True)
class Host:
    """The host facts the rendering depends on (passed in, so tests can state them)."""

    rootless: bool = False  # the runtime runs as an ordinary user (rootless Podman)
    selinux: bool = False  # SELinux is enforcing or permissive (labels matter)
    cap_sys_resource: bool = True  # may raise resource limits
    nofile: int = 1048576  # hard limits the caller has
    nproc: int = 1048576


def probe_host(proc: Path = Path("/proc/self"), selinux: Path = Path("/sys/fs/selinux/enforce")
               ) -> Host:
    """This process's view: euid, SELinux, CAP_SYS_RESOURCE and its hard rlimits."""
    cap = True
    try:
        for line in (proc / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                cap = bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError):
        pass
    return Host(rootless=os.geteuid() != 0, selinux=selinux.is_file(), cap_sys_resource=cap,
                nofile=resource.getrlimit(resource.RLIMIT_NOFILE)[1],
                nproc=resource.getrlimit(resource.RLIMIT_NPROC)[1])


def container_name(flavour: Flavour, project: str, service: str) -> str:
    return flavour.container_name.format(project=project, service=service)


def host_keys(flavour: Flavour, host: Host) -> dict[str, object]:
    """Compose keys every service of this runtime needs on this host (userns, SELinux, rlimits)."""
    keys: dict[str, object] = {}
    if flavour.keep_id_when_rootless and host.rootless:
        keys["userns_mode"] = "keep-id"
    if flavour.selinux_label_disable and host.selinux:
        keys["security_opt"] = ["label=disable"]
    limits = ulimits(flavour, host)
    if limits:
        keys["ulimits"] = limits
    return keys


def ulimits(flavour: Flavour, host: Host) -> dict[str, int] | None:
    """Resource limits to pin in the container, or None to leave the runtime's own."""
    if not flavour.clamp_rlimits or host.cap_sys_resource or host.rootless:
        return None  # rootless Podman clamps to the caller's limits itself
    return {"nofile": host.nofile, "nproc": min(host.nproc, PODMAN_NPROC_CEILING)}

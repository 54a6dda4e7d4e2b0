"""`invoke doctor` (every host check) and the fast subset `up` runs as guards."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vllmstack.checks.context import pinned
from vllmstack.checks.host.amd import check_cwsr, check_devices, check_dkms, check_kernel, check_rocm
from vllmstack.checks.host.disk import check_disk
from vllmstack.checks.host.gpus import check_gpus
from vllmstack.checks.host.model import DoctorReport, HostCheck, HostView, NodeStat, UserIds, stat_node
from vllmstack.checks.host.tools import (
    check_docker,
    check_nvidia_driver,
    check_nvidia_toolkit,
    check_runtimes,
    runtime_choice,
)
from vllmstack.config.profiles import Resolved
from vllmstack.core.files import JsonFileError, read_json_file
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner

# serve/state.py writes it; read here leniently (doctor reports, it does not refuse).
STATE_FILE = "state.json"


def previous_up(project: Project) -> dict[str, Any]:
    """What the last `up` recorded about its runtime; {} when nothing usable is there."""
    try:
        data = read_json_file(project.generated / STATE_FILE)
    except JsonFileError:  # damaged: up and down name it; doctor only reports
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: data[k] for k in ("runtime", "flavour") if isinstance(data.get(k), str)}


def _gid_pins(resolved: Resolved) -> dict[str, str]:
    return {k: resolved.get_raw(k) for k in ("RENDER_GID", "VIDEO_GID") if pinned(resolved, k)}


def fast_checks(resolved: Resolved, view: HostView, runtime: str | None) -> list[HostCheck]:
    """What `up` checks before every start: sysfs, /dev and /etc reads, plus one nvidia-smi
    query on NVIDIA; no network. `runtime` None: not known yet (see check_devices)."""
    vendor = resolved.get_str("GPU_VENDOR")
    return [check_devices(view, vendor, _gid_pins(resolved), runtime),
            check_gpus(view, resolved),
            check_dkms(view, vendor, fast=True),
            check_cwsr(view, resolved.get_raw("GPU_ARCH").strip())]


def run_doctor(project: Project, resolved: Resolved, environ: Mapping[str, str], runner: Runner,
               *, runtime: str | None = None, root: Path = Path("/"), user: UserIds | None = None,
               node_stat: Callable[[Path], NodeStat | None] = stat_node) -> DoctorReport:
    """Every host prerequisite for this platform, each PASS/WARN/FAIL (SKIP: not this host's
    concern) with what was seen and a fix. `root`, `user` and `node_stat` stand in for the host
    in tests; every program runs through `runner`, read-only."""
    view = HostView(root, runner, user or UserIds.current(), node_stat)
    vendor = resolved.get_str("GPU_VENDOR")
    arch = resolved.get_raw("GPU_ARCH").strip()
    present, choice = runtime_choice(view, resolved, previous_up(project), runtime)
    checks = [
        check_kernel(view, arch),
        check_cwsr(view, arch),
        check_dkms(view, vendor, fast=False),
        check_rocm(view, vendor, arch, resolved.get_int("VLLM_TP"), resolved.get_raw("NCCL_PROTO")),
        check_devices(view, vendor, _gid_pins(resolved), choice.picked),
        check_runtimes(present, choice),
        check_docker(view, resolved, choice),
        check_nvidia_driver(view, vendor),
        check_nvidia_toolkit(view, vendor, choice.picked),
        check_disk(view, resolved, environ, choice),
        check_gpus(view, resolved),
    ]
    return DoctorReport(resolved.platform, vendor, tuple(checks))

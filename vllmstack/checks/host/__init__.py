"""`invoke doctor`: the host prerequisites, each PASS/WARN/FAIL with a fix; `up` runs the fast
subset as guards (serve/guards.py).

Modules: `model` (HostCheck, DoctorReport, HostView: the host as a root folder, a runner and the
user), `amd` (kernel, gfx1151 CWSR, amdgpu-dkms, /dev/kfd and /dev/dri), `gpus` (the GPUs vs the
platform's pins), `tools` (container runtimes and `up`'s pick, docker and buildx, the NVIDIA
driver and container toolkit), `disk` (free space; its docstring explains the thresholds),
`doctor` (run_doctor, fast_checks). Every program runs through the Runner, read-only; sysfs,
/dev and /etc are read under a root passed in, so tests replay recorded hosts (tests/data/host/).

Checks, in report order (id: what): kernel (uname -r; gfx1151: mainline 6.18.4+ or a backport),
cwsr (gfx1151's cwsr_size/ctl_stack_size in the KFD topology), amdgpu-dkms (a DKMS amdgpu masking
the kernel's, FAIL on the known-bad 6.16.13), devices (/dev/kfd, /dev/dri/renderD* for the user
or through group_add; the render gid), runtimes (Compose v2, v1, Podman present; the one `up`
picks and why), docker (client, engine, buildx), nvidia-driver, nvidia-toolkit (nvidia-ctk; a
CDI spec where the runtime uses CDI), disk, gpus (name, arch, VRAM, count vs GPU_* pins).
The fast subset (`guard: true`): devices, gpus, amdgpu-dkms, cwsr.

`--json` (report.as_json()) is a stable contract; `schema` changes only when a field changes
meaning or is removed (new fields may appear):

    {
      "schema": 1,
      "platform": "r9700",            # the resolved platform
      "vendor": "amd",                # GPU_VENDOR: amd | nvidia | none
      "ok": true,                     # no check is FAIL (`invoke doctor` exits 1 otherwise)
      "counts": {"pass": 7, "warn": 1, "fail": 0, "skip": 2},
      "checks": [                     # always these ten ids, in this order
        {"id": "kernel", "title": "kernel",
         "status": "PASS",            # PASS | WARN | FAIL | SKIP (does not apply to this host)
         "detail": "Linux 6.18.22-061822-generic",
         "fix": null,                 # a string for WARN and FAIL
         "guard": false,              # true: `up` runs it (a FAIL there blocks `up`)
         "data": {"release": "6.18.22-061822-generic"}},
        ...
      ]
    }

`data` per id (keys absent from a SKIP): kernel {release}; cwsr {nodes: [{node, arch, cwsr_size,
ctl_stack_size}]}; amdgpu-dkms {loaded_version, module_file, module_version, package};
devices {nodes: [{path, mode, gid, group, user_rw}], render_gid, user, runtime};
runtimes {picked: compose|compose-v1|podman|native|null, reason, present: {compose|compose-v1|
podman: {present, command, version}}}; docker {docker, client, server, buildx}; nvidia-driver
{driver, gpus, compute_capability}; nvidia-toolkit {nvidia_ctk, cdi_specs, needs_cdi}; disk
{mounts: [{mount, free_gib, hard_gib, soft_gib, needs: [{what, path, hard_gib, soft_gib, why}]}]};
gpus {source, cards: [{index, name, vram_gib}], kfd_nodes: [{node, arch, device_id}], pins:
{GPU_COUNT, GPU_VRAM_GIB, GPU_ARCH, GPU_DEVICE_NAME}}.
"""

from __future__ import annotations

from vllmstack.checks.host.doctor import fast_checks, run_doctor
from vllmstack.checks.host.model import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    DoctorReport,
    HostCheck,
    HostView,
    NodeStat,
    UserIds,
    render_doctor,
)

__all__ = ["FAIL", "PASS", "SKIP", "WARN", "DoctorReport", "HostCheck", "HostView", "NodeStat",
           "UserIds", "fast_checks", "render_doctor", "run_doctor"]

"""AMD host checks: the kernel and gfx1151's CWSR fix, a masking amdgpu-dkms, device access,
the ROCm release against the known RDNA4 failures (`check_rocm`).

Everything is read from sysfs, /dev and /etc under the view's root, so the fast subset that
`up` runs starts no program; the full doctor adds `uname -r`, `modinfo amdgpu` and dpkg-query.

Known good and bad (reference/seeds/lemonade-vllm-rocm-backend-pr.txt, AMD's own review there):
* gfx1151 needs a kernel with the CWSR (Context Wave Save/Restore) fix, which exports
  `cwsr_size` and `ctl_stack_size` in the KFD topology. Without it any GPU dispatch can end in a
  GCVM_L2_PROTECTION_FAULT and a hang that "appears randomly". Mainline has it from 6.18.4;
  Ubuntu 24.04's 6.17 HWE and 6.14 OEM kernels and Ubuntu 26.04 carry it, as do Arch and Fedora.
  A version number alone is weak evidence (vendors backport), so the properties decide. A
  published good gfx1151 node reads cwsr_size 19185664, ctl_stack_size 16384.
* amdgpu-dkms 6.16.13 (the default amdgpu/30.30 repository) replaces the kernel's own driver
  with a broken one. Only a DKMS build sets a module version (/sys/module/amdgpu/version,
  modinfo's `version:`); the in-tree driver has none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllmstack.checks.host.model import FAIL, PASS, SKIP, WARN, HostCheck, HostView
from vllmstack.checks.rdna4 import FIRST_FIXED_RCCL, avoids_ll
from vllmstack.runtime import flavours

KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"
CWSR_ARCH = "gfx1151"
CWSR_MAINLINE = (6, 18, 4)
BAD_DKMS = "6.16.13"
CWSR_FIX = ("boot a kernel with the CWSR fix: mainline 6.18.4 or newer, Ubuntu 24.04's 6.17 HWE "
            "or 6.14 OEM kernel, Ubuntu 26.04, or a current Arch/Fedora kernel; then check again "
            f"(grep -E 'cwsr_size|ctl_stack_size' {KFD_NODES}/*/properties)")
DKMS_FIX = ("switch the repository to amdgpu/31.20 (sudo sed -i 's|amdgpu/30\\.30/|amdgpu/31.20/|g' "
            "/etc/apt/sources.list.d/amdgpu*.list && sudo apt update && sudo apt install "
            "amdgpu-dkms amdgpu-dkms-firmware) or remove it (sudo apt remove amdgpu-dkms: the "
            "engine image brings its own ROCm user space); then reboot")


@dataclass(frozen=True)
class KfdNode:
    """One GPU node of the KFD topology (CPU nodes have gfx_target_version 0 and are skipped)."""

    index: int
    arch: str
    device_id: int
    props: dict[str, int]

    @property
    def cwsr(self) -> tuple[int, int] | None:
        """(cwsr_size, ctl_stack_size) when the kernel exports both, non-zero."""
        size, ctl = self.props.get("cwsr_size", 0), self.props.get("ctl_stack_size", 0)
        return (size, ctl) if size > 0 and ctl > 0 else None


def gfx_name(target_version: int) -> str:
    """KFD's gfx_target_version (major*10000 + minor*100 + stepping) as an arch: 110501 ->
    gfx1151, 120001 -> gfx1201, 90010 -> gfx90a (minor and stepping are hex digits)."""
    major, rest = divmod(target_version, 10000)
    minor, step = divmod(rest, 100)
    return f"gfx{major}{minor:x}{step:x}"


def override_arch(value: str) -> str | None:
    """HSA_OVERRIDE_GFX_VERSION=11.0.0 makes the runtime report gfx1100."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\.(\d+)\s*", value or "")
    if not match:
        return None
    major, minor, step = (int(g) for g in match.groups())
    return gfx_name(major * 10000 + minor * 100 + step)


def kfd_nodes(view: HostView) -> list[KfdNode] | None:
    """The GPU nodes of the KFD topology; None when there is no topology (amdgpu not loaded)."""
    folder = view.path(KFD_NODES)
    if not folder.is_dir():
        return None
    nodes: list[KfdNode] = []
    for node in sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        props: dict[str, int] = {}
        try:
            text = (node / "properties").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.strip().partition(" ")
            if value.strip().isdigit():
                props[key] = int(value.strip())
        version = props.get("gfx_target_version", 0)
        if version:
            nodes.append(KfdNode(int(node.name), gfx_name(version), props.get("device_id", 0), props))
    return nodes


def concerns_gfx1151(arch_pin: str, nodes: list[KfdNode] | None) -> bool:
    return arch_pin == CWSR_ARCH or any(n.arch == CWSR_ARCH for n in nodes or [])


def version_tuple(text: str) -> tuple[int, ...] | None:
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g or 0) for g in match.groups()) if match else None


def check_cwsr(view: HostView, arch_pin: str) -> HostCheck:
    nodes = kfd_nodes(view)
    if not concerns_gfx1151(arch_pin, nodes):
        return HostCheck("cwsr", "gfx1151 CWSR properties", SKIP,
                         "no gfx1151 (Strix Halo) GPU: only it needs the CWSR fix", guard=True)
    if nodes is None:
        return HostCheck("cwsr", "gfx1151 CWSR properties", WARN,
                         f"the platform is gfx1151 but {KFD_NODES} does not exist: the CWSR "
                         "properties cannot be read", "load amdgpu (ls /dev/kfd), then check again",
                         guard=True)
    ours = [n for n in nodes if n.arch == CWSR_ARCH]
    data = {"nodes": [{"node": n.index, "arch": n.arch,
                       "cwsr_size": n.props.get("cwsr_size"),
                       "ctl_stack_size": n.props.get("ctl_stack_size")} for n in ours]}
    missing = [n for n in ours if n.cwsr is None]
    if missing or not ours:
        which = ", ".join(f"node {n.index}" for n in missing) or "no gfx1151 node"
        return HostCheck("cwsr", "gfx1151 CWSR properties", FAIL,
                         f"{which}: the kernel exports no cwsr_size/ctl_stack_size, so it lacks "
                         "the CWSR fix and GPU work can hang with GCVM_L2_PROTECTION_FAULT",
                         CWSR_FIX, data, guard=True)
    seen = "; ".join(f"node {n.index}: cwsr_size {n.props['cwsr_size']}, ctl_stack_size "
                     f"{n.props['ctl_stack_size']}" for n in ours)
    return HostCheck("cwsr", "gfx1151 CWSR properties", PASS,
                     f"the kernel exports the CWSR properties ({seen})", data=data, guard=True)


def check_kernel(view: HostView, arch_pin: str) -> HostCheck:
    result = view.run("uname", "-r")
    release = result.stdout.strip() if result.ok else (view.read("/proc/sys/kernel/osrelease")
                                                        or "").strip()
    if not release:
        return HostCheck("kernel", "kernel", WARN, "the kernel release could not be read "
                         f"(uname -r: {(result.stderr or 'no output').strip()})",
                         "run doctor on the host itself")
    data = {"release": release}
    version = version_tuple(release)
    if not concerns_gfx1151(arch_pin, kfd_nodes(view)):
        return HostCheck("kernel", "kernel", PASS, f"Linux {release}", data=data)
    mainline = ".".join(str(p) for p in CWSR_MAINLINE)
    if version is not None and version >= CWSR_MAINLINE:
        return HostCheck("kernel", "kernel", PASS,
                         f"Linux {release} (gfx1151: mainline {mainline} and newer have the CWSR "
                         "fix)", data=data)
    nodes = kfd_nodes(view) or []
    if any(n.arch == CWSR_ARCH and n.cwsr for n in nodes):
        return HostCheck("kernel", "kernel", PASS,
                         f"Linux {release}: older than mainline {mainline}, but it exports the "
                         "CWSR properties (a backported fix)", data=data)
    return HostCheck("kernel", "kernel", WARN,
                     f"Linux {release} is older than mainline {mainline}, the first with the "
                     "gfx1151 CWSR fix, and shows no backport (see cwsr)", CWSR_FIX, data)


def _modinfo(view: HostView) -> tuple[str, str] | None:
    """(filename, version) of the amdgpu module this kernel loads, from `modinfo amdgpu`."""
    result = view.run("modinfo", "amdgpu")
    if not result.ok:
        return None
    fields: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields.get("filename", ""), fields.get("version", "")


def _package(view: HostView) -> str | None:
    """The installed amdgpu-dkms package version (Debian/Ubuntu), else None."""
    result = view.run("dpkg-query", "-W", "-f", "${Status} ${Version}\n", "amdgpu-dkms")
    if not result.ok or "installed" not in result.stdout or "not-installed" in result.stdout:
        return None
    return result.stdout.split()[-1]


def check_dkms(view: HostView, vendor: str, *, fast: bool) -> HostCheck:
    title = "amdgpu-dkms"
    loaded_dir = view.path("/sys/module/amdgpu")
    if vendor != "amd" and not loaded_dir.is_dir():
        return HostCheck("amdgpu-dkms", title, SKIP, "no amdgpu driver here", guard=True)
    loaded = (view.read("/sys/module/amdgpu/version") or "").strip()
    module = None if fast else _modinfo(view)
    package = None if fast else _package(view)
    next_boot = module[1] if module and re.search(r"/(updates|extra)/", module[0]) else ""
    data = {"loaded_version": loaded or None, "module_file": module[0] if module else None,
            "module_version": next_boot or None, "package": package}
    bad = [what for what, version in (("loaded", loaded), ("installed for this kernel", next_boot))
           if version == BAD_DKMS]
    if bad:
        return HostCheck("amdgpu-dkms", title, FAIL,
                         f"amdgpu-dkms {BAD_DKMS} ({' and '.join(bad)}) replaces the kernel's own "
                         "amdgpu with a version known to break ROCm", DKMS_FIX, data, guard=True)
    if loaded:
        return HostCheck("amdgpu-dkms", title, PASS,
                         f"amdgpu-dkms {loaded} is loaded in place of the kernel's driver (not "
                         f"the known-bad {BAD_DKMS})", data=data, guard=True)
    if not loaded_dir.is_dir():
        return HostCheck("amdgpu-dkms", title, SKIP, "amdgpu is not loaded (see devices)",
                         data=data, guard=True)
    extra = f"; amdgpu-dkms {package} is installed but not loaded" if package else ""
    return HostCheck("amdgpu-dkms", title, PASS, f"the kernel's own amdgpu driver is loaded{extra}",
                     data=data, guard=True)


# --- device access -----------------------------------------------------------------------------

GROUP_FIX = "sudo usermod -aG {groups} {user}, then log out and back in"


def _nodes(view: HostView) -> list[str]:
    dri = view.path("/dev/dri")
    renders = sorted(p.name for p in dri.glob("renderD*")) if dri.is_dir() else []
    return ["/dev/kfd", *(f"/dev/dri/{name}" for name in renders)]


def check_devices(view: HostView, vendor: str, pins: dict[str, str], runtime: str | None
                  ) -> HostCheck:
    """Whether the engine can open /dev/kfd and the render nodes.

    A native engine opens them as the invoking user, and so does rootless Podman (the flavour
    that keeps the user's id). A rootful container gets them through group_add: RENDER_GID and
    VIDEO_GID, read from the nodes unless pinned. With `runtime` None (RUNTIME=auto, not yet
    resolved) only what fails both ways is a FAIL."""
    title = "/dev/kfd and /dev/dri"
    if vendor != "amd":
        return HostCheck("devices", title, SKIP, f"GPU_VENDOR={vendor}: no AMD device nodes needed",
                         guard=True)
    nodes = _nodes(view)
    stats = {node: view.node_stat(view.path(node)) for node in nodes}
    missing = [n for n, s in stats.items() if s is None] + ([] if len(nodes) > 1 else
                                                             ["/dev/dri/renderD*"])
    if missing:
        return HostCheck("devices", title, FAIL, f"{', '.join(missing)} missing: the amdgpu "
                         "driver (amdkfd) is not loaded or this is not the GPU host",
                         "load the driver (sudo modprobe amdgpu; `dmesg | grep -i amdgpu` says why "
                         "it did not load) or run on the GPU host", guard=True)
    present = {n: s for n, s in stats.items() if s is not None}
    render_group = view.group("render")
    user = view.user
    data = {"nodes": [{"path": n, "mode": f"{s.mode:o}", "gid": s.gid,
                       "group": view.group_name(s.gid), "user_rw": s.user_rw}
                      for n, s in present.items()],
            "render_gid": render_group[0] if render_group else None,
            "user": user.name, "runtime": runtime}
    render_text = (f"render group gid {render_group[0]}" if render_group
                   else "no group named render (the nodes' own groups are used)")
    # The user route: what a native engine (and rootless Podman) needs.
    no_user = [n for n, s in present.items() if not s.user_rw]
    groups = sorted({view.group_name(present[n].gid) for n in no_user})
    listed = [g for g in groups if (entry := view.group(g)) and user.name in entry[1]]
    user_fix = (f"your session predates being added to {', '.join(listed)}: log out and back in "
                f"(or newgrp {listed[0]})" if listed and len(listed) == len(groups) else
                GROUP_FIX.format(groups=",".join(groups), user=user.name))
    user_text = f"{user.name} (uid {user.uid}) cannot read and write {', '.join(no_user)}"
    # The group route: what group_add gives a rootful container (VIDEO_GID for kfd's group,
    # RENDER_GID for the render nodes'); both are read from the nodes unless pinned.
    render_node = next(n for n in present if n != "/dev/kfd")
    broken = [f"{key}={pins[key]} but {node} belongs to gid {present[node].gid} "
              f"({view.group_name(present[node].gid)})"
              for key, node in (("VIDEO_GID", "/dev/kfd"), ("RENDER_GID", render_node))
              if pins.get(key, "").strip().isdigit() and int(pins[key]) != present[node].gid]
    broken += [f"{n} gives its group no read-write (mode {s.mode:o})" for n, s in present.items()
               if s.mode & 0o060 != 0o060 and s.mode & 0o006 != 0o006]
    pinned_keys = [k for k in ("VIDEO_GID", "RENDER_GID") if any(b.startswith(k) for b in broken)]
    group_fix = (f"remove {' and '.join(pinned_keys)} from .env so `up` reads the nodes' groups, "
                 "or pin the gids shown" if pinned_keys else
                 "restore the amdgpu udev rules (MODE=0660, GROUP=render), then replug or reboot")
    group_text = "a container would not get the devices: " + "; ".join(broken)
    flavour = flavours.FLAVOURS.get(runtime or "")
    user_route = runtime == "native" or bool(flavour and flavour.keep_id_when_rootless
                                             and user.uid != 0)
    if user_route and no_user:
        return HostCheck("devices", title, FAIL, f"{user_text}, and the {runtime} runtime opens "
                         f"them as that user; {render_text}", user_fix, data, guard=True)
    if not user_route and broken and (runtime is not None or no_user):
        return HostCheck("devices", title, FAIL, group_text + (f"; and {user_text}" if no_user
                                                               else ""),
                         group_fix, data, guard=True)
    if not user_route and broken:
        return HostCheck("devices", title, WARN, group_text, group_fix, data, guard=True)
    if no_user:
        return HostCheck("devices", title, WARN, f"{user_text} (containers get them through "
                         f"group_add; native runs, rocminfo and amd-smi do not); {render_text}",
                         user_fix, data, guard=True)
    groups_text = ", ".join(f"{n} {view.group_name(s.gid)} ({s.gid})" for n, s in present.items())
    return HostCheck("devices", title, PASS,
                     f"{user.name} can read and write them; {groups_text}; {render_text}",
                     data=data, guard=True)


# --- the ROCm release against the known-bad list (issue 39) ------------------------------------

ROCM_VERSION_FILE = "/opt/rocm/.info/version"
# AMD's rocm/vllm RDNA image on this ROCm release page-faults on gfx1201's first request
# (ROCm/legacy-rocm-build#6630).
RDNA_PAGE_FAULT_ROCM = (7, 14)


def check_rocm(view: HostView, vendor: str, arch: str, tensor_parallel: int,
               nccl_proto: str) -> HostCheck:
    """The host's ROCm release (the native runtime runs on it; a container brings its own) and
    what the known RDNA4 failures say about it: RCCL's gfx12 LL deadlock at TP >= 2 (no release
    has the fix yet) and the ROCm 7.14 RDNA page fault."""
    title = "ROCm release"
    if vendor != "amd":
        return HostCheck("rocm", title, SKIP, "not an AMD platform")
    text = (view.read(ROCM_VERSION_FILE) or "").strip()
    version = version_tuple(text) if text else None
    if version is None:
        return HostCheck("rocm", title, SKIP, f"no host ROCm ({ROCM_VERSION_FILE} not readable): "
                         "a container runtime brings the image's own")
    data = {"version": text, "arch": arch}
    release = f"ROCm {text}"
    if arch.startswith("gfx120") and version[:2] == RDNA_PAGE_FAULT_ROCM:
        return HostCheck("rocm", title, WARN,
                         f"{release} on {arch}: AMD's RDNA build of this release page-faults "
                         "([gfxhub] page fault) on the first request (ROCm/legacy-rocm-build#6630)",
                         "use another ROCm release, or the stack's own image (invoke build)", data)
    if arch.startswith("gfx12") and tensor_parallel >= 2 and rccl_lacks_fix(version):
        if avoids_ll(nccl_proto):
            return HostCheck("rocm", title, PASS,
                             f"{release}: its RCCL has the gfx12 LL-protocol deadlock "
                             f"(ROCm/rocm-systems#5480), avoided by NCCL_PROTO={nccl_proto}", data=data)
        return HostCheck("rocm", title, WARN,
                         f"{release}: its RCCL deadlocks at TP={tensor_parallel} on gfx12 in the "
                         "LL protocol (ROCm/rocm-systems#5480, vllm-project/vllm#40980)",
                         "set NCCL_PROTO=Simple in the platform layer", data)
    return HostCheck("rocm", title, PASS, f"{release}: not on the known-bad list for {arch or 'this GPU'}",
                     data=data)


def rccl_lacks_fix(version: tuple[int, ...]) -> bool:
    return FIRST_FIXED_RCCL is None or version[:2] < FIRST_FIXED_RCCL

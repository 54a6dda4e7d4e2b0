"""`invoke doctor` over recorded hosts (tests/data/host: sysfs trees as folders, tool outputs as
text files; README.md there says which were recorded where): every check PASS and FAIL, the
runtime choice and its reason, the JSON contract, and the fast subset `up` runs."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from vllmstack.checks.host import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    DoctorReport,
    HostView,
    NodeStat,
    UserIds,
    fast_checks,
    render_doctor,
    run_doctor,
)
from vllmstack.checks.host.amd import gfx_name, override_arch
from vllmstack.config.profiles import Resolved, resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.runtime.compose import detect_compose

HOST = Path(__file__).parent / "data" / "host"
TOOLS = HOST / "tools"
EMPTY = HOST / "nvidia-bare"  # a host without AMD devices, KFD or CDI specs
ALICE = "uid=1000(alice) gid=1000(alice) groups=1000(alice),44(video),992(render),998(docker)"
ALICE_NO_GROUPS = "uid=1000(alice) gid=1000(alice) groups=1000(alice),998(docker)"
MISSING = Result((), 127, "", "command not found")
IDS = ["kernel", "cwsr", "amdgpu-dkms", "rocm", "devices", "runtimes", "docker", "nvidia-driver",
       "nvidia-toolkit", "disk", "gpus"]


def tool(name: str) -> str:
    return (TOOLS / name).read_text()


def ok(name: str) -> Result:
    return Result((), 0, tool(name))


def failed(name: str, rc: int = 1, stdout: str = "") -> Result:
    return Result((), rc, stdout, tool(name))


def recorded_user(id_output: str) -> UserIds:
    """`id` as recorded: uid=1000(alice) gid=1000(alice) groups=1000(alice),44(video)."""
    uid, name = re.search(r"uid=(\d+)\((\w+)\)", id_output).groups()  # type: ignore[union-attr]
    gids = {int(g) for g in re.findall(r"(\d+)\(", id_output.split("groups=")[1])}
    return UserIds(int(uid), name, frozenset(gids))


def recorded_nodes(root: Path, user: UserIds) -> Callable[[Path], NodeStat | None]:
    """The case's dev-stat.txt (`stat -c '%n %a %u %g' /dev/kfd /dev/dri/renderD*`); read and
    write access from the mode bits, as access(2) decides without ACLs."""
    table: dict[str, tuple[int, int, int]] = {}
    stat_file = root / "dev-stat.txt"
    for line in stat_file.read_text().splitlines() if stat_file.is_file() else []:
        name, mode, uid, gid = line.split()
        table[name] = (int(mode, 8), int(uid), int(gid))

    def node_stat(path: Path) -> NodeStat | None:
        host_path = "/" + str(path.relative_to(root))
        if host_path not in table or not path.exists():
            return None
        mode, uid, gid = table[host_path]
        bits = (mode >> 6 if uid == user.uid else mode >> 3 if gid in user.gids else mode) & 0o6
        return NodeStat(mode, uid, gid, user.uid == 0 or bits == 0o6)

    return node_stat


def recorded_host(root: Path, id_output: str) -> HostView:
    """The fast checks' view of a recorded tree, for the user `id` printed; no runner."""
    user = recorded_user(id_output)
    return HostView(root, None, user, recorded_nodes(root, user))


def host_runner(**overrides: Result) -> RecordingRunner:
    """A Debian host like the test machine (recorded): docker 28.2.2 client with the 20.10 engine
    and no buildx, Compose v1 and podman-compose 1.0.3, no Compose v2, no NVIDIA tools; the
    kernel 6.18.22 mainline; no amdgpu-dkms. Keyword names are argv prefixes joined by '_'."""
    answers = {
        "uname_-r": ok("uname-6.18.22-mainline.txt"),
        "modinfo_amdgpu": ok("modinfo-amdgpu-intree.txt"),
        "dpkg-query": failed("dpkg-amdgpu-dkms-absent.txt"),
        "docker_version": ok("docker-version-28-engine-20.10.txt"),
        "docker_buildx_version": failed("docker-28-buildx-missing.txt"),
        "docker_compose_version": failed("docker-28-compose-missing.txt"),
        "docker-compose_version": ok("docker-compose-v1-version.txt"),
        "podman-compose_version": ok("podman-compose-version.txt"),
        "podman_compose_version": failed("podman-compose-subcommand-missing.txt", 125),
        "docker_info": ok("docker-info-root.txt"),
        "docker_image_inspect": failed("docker-image-missing.txt"),
        "df": ok("df-one-disk-53g.txt"),
        "nvidia-smi": MISSING, "nvidia-ctk": MISSING,
        **overrides,
    }
    runner = RecordingRunner()
    for key, result in answers.items():
        runner.respond(key.split("_"), result)
    return runner


def platform(project: Project, name: str, *sets: str, model: str = "qwen3-0.6b") -> Resolved:
    return resolve(project, platform=name, model=model, overrides=list(sets),
                   environ={"HOME": str(project.root / "home")})


def doctor(project: Project, resolved: Resolved, root: Path = EMPTY, *, user: str = ALICE,
           runner: RecordingRunner | None = None, runtime: str | None = None) -> DoctorReport:
    ids = recorded_user(user)
    return run_doctor(project, resolved, {"HOME": str(project.root / "home")},
                      runner or host_runner(), runtime=runtime, root=root, user=ids,
                      node_stat=recorded_nodes(root, ids))


def copy_case(name: str, dest: Path) -> Path:
    shutil.copytree(HOST / name, dest / name)
    return dest / name


# --- the kernel and gfx1151's CWSR fix --------------------------------------------------------


def test_gfx_target_versions_and_overrides_name_the_arch() -> None:
    assert [gfx_name(v) for v in (110501, 120001, 90010, 100306, 110002)] == \
        ["gfx1151", "gfx1201", "gfx90a", "gfx1036", "gfx1102"]
    assert override_arch("11.0.0") == "gfx1100" and override_arch("") is None


def test_strix_halo_with_the_cwsr_fix_passes(project: Project) -> None:
    report = doctor(project, platform(project, "strix-halo"), HOST / "strix-halo")
    cwsr, kernel = report.check("cwsr"), report.check("kernel")
    assert cwsr.status == PASS and "cwsr_size 19185664, ctl_stack_size 16384" in cwsr.detail
    assert cwsr.data["nodes"] == [{"node": 1, "arch": "gfx1151", "cwsr_size": 19185664,
                                   "ctl_stack_size": 16384}]
    assert kernel.status == PASS and "6.18.22-061822-generic" in kernel.detail


def test_strix_halo_without_the_cwsr_properties_fails_with_the_kernels_that_fix_it(
    project: Project
) -> None:
    runner = host_runner()
    runner.respond(["uname", "-r"], ok("uname-6.14-generic.txt"))
    report = doctor(project, platform(project, "strix-halo"), HOST / "strix-halo-no-cwsr",
                    runner=runner)
    cwsr, kernel = report.check("cwsr"), report.check("kernel")
    assert cwsr.status == FAIL and "GCVM_L2_PROTECTION_FAULT" in cwsr.detail
    assert cwsr.fix and "6.18.4" in cwsr.fix and "6.17 HWE" in cwsr.fix
    # One cause, one FAIL: the kernel line points at the properties, which decide.
    assert kernel.status == WARN and "6.14.0-29-generic" in kernel.detail and "see cwsr" in kernel.detail


def test_an_older_kernel_that_exports_the_properties_is_a_backport(project: Project) -> None:
    runner = host_runner()
    runner.respond(["uname", "-r"], ok("uname-6.17-hwe.txt"))
    kernel = doctor(project, platform(project, "strix-halo"), HOST / "strix-halo",
                    runner=runner).check("kernel")
    assert kernel.status == PASS and "backported" in kernel.detail


def test_cwsr_is_skipped_off_gfx1151_and_unreadable_without_kfd(project: Project) -> None:
    report = doctor(project, platform(project, "r9700"), HOST / "r9700-igpu")
    assert report.check("cwsr").status == SKIP
    assert report.check("kernel").status == PASS
    bare = doctor(project, platform(project, "strix-halo"), EMPTY).check("cwsr")
    assert bare.status == WARN and "cannot be read" in bare.detail


def test_kernel_release_that_cannot_be_read_warns(project: Project) -> None:
    runner = host_runner()
    runner.respond(["uname", "-r"], MISSING)
    kernel = doctor(project, platform(project, "nvidia"), runner=runner).check("kernel")
    assert kernel.status == WARN and "could not be read" in kernel.detail


# --- amdgpu-dkms --------------------------------------------------------------------------------


def test_the_known_bad_dkms_loaded_fails(project: Project) -> None:
    report = doctor(project, platform(project, "2xr9700"), HOST / "2xr9700-dkms")
    dkms = report.check("amdgpu-dkms")
    assert dkms.status == FAIL and "6.16.13 (loaded)" in dkms.detail
    assert dkms.fix and "amdgpu/31.20" in dkms.fix and "apt remove amdgpu-dkms" in dkms.fix
    assert dkms.data["loaded_version"] == "6.16.13"


def test_the_known_bad_dkms_built_for_this_kernel_fails_before_the_reboot_loads_it(
    project: Project
) -> None:
    runner = host_runner(**{"modinfo_amdgpu": ok("modinfo-amdgpu-dkms-6.16.13.txt"),
                            "dpkg-query": ok("dpkg-amdgpu-dkms-6.16.13.txt")})
    dkms = doctor(project, platform(project, "r9700"), HOST / "r9700-igpu",
                  runner=runner).check("amdgpu-dkms")
    assert dkms.status == FAIL and "installed for this kernel" in dkms.detail
    assert dkms.data["package"] == "1:6.16.13.30300000-2212066.24.04"
    assert dkms.data["module_file"].endswith("/updates/dkms/amdgpu.ko.zst")


def test_the_kernels_own_driver_or_another_dkms_passes(project: Project, tmp_path: Path) -> None:
    report = doctor(project, platform(project, "strix-halo"), HOST / "strix-halo")
    assert report.check("amdgpu-dkms").status == PASS
    assert "kernel's own amdgpu" in report.check("amdgpu-dkms").detail
    newer = copy_case("2xr9700-dkms", tmp_path)
    (newer / "sys/module/amdgpu/version").write_text("6.19.0\n")
    dkms = doctor(project, platform(project, "2xr9700"), newer).check("amdgpu-dkms")
    assert dkms.status == PASS and "amdgpu-dkms 6.19.0 is loaded" in dkms.detail
    assert doctor(project, platform(project, "nvidia")).check("amdgpu-dkms").status == SKIP


# --- /dev/kfd, /dev/dri and the render group -------------------------------------------------


def test_device_access_through_the_render_group_passes(project: Project) -> None:
    devices = doctor(project, platform(project, "strix-halo"), HOST / "strix-halo",
                     runtime="native").check("devices")
    assert devices.status == PASS and "render group gid 992" in devices.detail
    assert devices.data["render_gid"] == 992
    assert [n["path"] for n in devices.data["nodes"]] == ["/dev/kfd", "/dev/dri/renderD128"]


@pytest.mark.parametrize(("runtime", "status"), [("native", FAIL), ("compose", WARN), (None, WARN)])
def test_a_user_outside_render_and_video_fails_only_where_the_engine_runs_as_that_user(
    project: Project, runtime: str | None, status: str
) -> None:
    resolved = platform(project, "r9700", *([f"RUNTIME={runtime}"] if runtime else []))
    devices = doctor(project, resolved, HOST / "r9700-igpu", user=ALICE_NO_GROUPS,
                     runtime=runtime).check("devices")
    assert devices.status == status
    assert "cannot read and write /dev/kfd, /dev/dri/renderD128" in devices.detail
    assert devices.fix == "sudo usermod -aG render alice, then log out and back in"


def test_a_session_older_than_the_group_change_is_told_to_log_in_again(project: Project) -> None:
    devices = doctor(project, platform(project, "strix-halo"), HOST / "strix-halo",
                     user=ALICE_NO_GROUPS, runtime="native").check("devices")
    assert devices.status == FAIL and devices.fix is not None
    assert devices.fix.startswith("your session predates being added to render")


def test_a_pinned_render_gid_that_is_not_the_nodes_fails_containers(project: Project) -> None:
    resolved = platform(project, "strix-halo", "RENDER_GID=993")
    devices = doctor(project, resolved, HOST / "strix-halo", runtime="compose-v1").check("devices")
    assert devices.status == FAIL
    assert "RENDER_GID=993 but /dev/dri/renderD128 belongs to gid 992 (render)" in devices.detail
    assert devices.fix and devices.fix.startswith("remove RENDER_GID from .env")
    # A native engine never uses RENDER_GID.
    native = doctor(project, resolved, HOST / "strix-halo", runtime="native").check("devices")
    assert native.status == PASS


def test_missing_device_nodes_fail(project: Project) -> None:
    devices = doctor(project, platform(project, "r9700")).check("devices")
    assert devices.status == FAIL and "/dev/kfd" in devices.detail and "modprobe amdgpu" in (
        devices.fix or "")
    assert doctor(project, platform(project, "nvidia")).check("devices").status == SKIP


# --- the GPUs against the pins -------------------------------------------------------------------


def test_gpus_matching_the_pins_pass(project: Project) -> None:
    strix = doctor(project, platform(project, "strix-halo"), HOST / "strix-halo").check("gpus")
    assert strix.status == PASS and "AMD_Radeon_8060S 96 GiB" in strix.detail
    assert "1 × gfx1151" in strix.detail and "GPU_ARCH=gfx1151" in strix.detail
    two = doctor(project, platform(project, "2xr9700"), HOST / "2xr9700-dkms").check("gpus")
    assert two.status == PASS and "2 × AMD_Radeon_R9700 31.9 GiB" in two.detail
    assert two.data["kfd_nodes"][0] == {"node": 1, "arch": "gfx1201", "device_id": "0x7551"}


def test_another_arch_than_the_platforms_fails(project: Project, tmp_path: Path) -> None:
    gpus = doctor(project, platform(project, "rdna3"), HOST / "2xr9700-dkms").check("gpus")
    assert gpus.status == FAIL and "GPU_ARCH=gfx1100" in gpus.detail and "gfx1201" in gpus.detail
    # An RX 7600 XT (gfx1102) on the rdna3 platform runs as gfx1100 with the override.
    card = copy_case("strix-halo", tmp_path)
    props = card / "sys/class/kfd/kfd/topology/nodes/1/properties"
    props.write_text(props.read_text().replace("gfx_target_version 110501",
                                               "gfx_target_version 110002"))
    bare = doctor(project, platform(project, "rdna3"), card).check("gpus")
    assert bare.status == FAIL and "HSA_OVERRIDE_GFX_VERSION=11.0.0" in (bare.fix or "")
    fixed = doctor(project, platform(project, "rdna3", "HSA_OVERRIDE_GFX_VERSION=11.0.0"),
                   card).check("gpus")
    assert fixed.status != FAIL


def test_fewer_gpus_than_tensor_parallel_fails(project: Project) -> None:
    tp2 = doctor(project, platform(project, "2xr9700", "VLLM_TP=2", "HIP_VISIBLE_DEVICES=0"),
                 HOST / "r9700-igpu")
    assert tp2.check("gpus").status == FAIL
    assert "VLLM_TP=2 needs 2 GPUs; 1 found" in tp2.check("gpus").detail


def test_an_igpu_beside_the_card_is_kept_out_by_hip_visible_devices(
    project: Project, tmp_path: Path
) -> None:
    host = HOST / "r9700-igpu"  # node 1: the R9700 (HIP device 0), node 2: a gfx1036 iGPU
    pinned = doctor(project, platform(project, "r9700"), host).check("gpus")  # HIP_VISIBLE_DEVICES=0
    assert pinned.status == PASS and "1 × gfx1201" in pinned.detail
    unset = doctor(project, platform(project, "r9700", "HIP_VISIBLE_DEVICES="), host).check("gpus")
    assert unset.status == WARN and "gfx1036 (an integrated GPU?)" in unset.detail
    assert unset.fix == "set HIP_VISIBLE_DEVICES=0 (the gfx1201 GPUs)"
    # The iGPU enumerated first: device 0 is the iGPU, and the platform's 0 would pick it.
    swapped = copy_case("r9700-igpu", tmp_path)
    nodes = swapped / "sys/class/kfd/kfd/topology/nodes"
    (nodes / "1").rename(nodes / "9")
    (nodes / "2").rename(nodes / "1")
    (nodes / "9").rename(nodes / "2")
    wrong = doctor(project, platform(project, "r9700"), swapped).check("gpus")
    assert wrong.status == FAIL and "selects gfx1036" in wrong.detail
    assert wrong.fix == "set HIP_VISIBLE_DEVICES=1 and ROCR_VISIBLE_DEVICES=1"


def test_vram_count_and_name_that_differ_from_the_pins_warn(project: Project) -> None:
    strix = doctor(project, platform(project, "strix-halo", "GPU_VRAM_GIB=64"),
                   HOST / "strix-halo").check("gpus")
    assert strix.status == WARN and "GPU_VRAM_GIB=64" in strix.detail and "96.00 GiB" in strix.detail
    named = doctor(project, platform(project, "2xr9700", "GPU_DEVICE_NAME=AMD_Radeon_RX9070XT"),
                   HOST / "2xr9700-dkms").check("gpus")
    assert named.status == WARN and "vLLM names this card AMD_Radeon_R9700" in named.detail
    runner = host_runner(**{"nvidia-smi": ok("nvidia-smi-detect-2xh200.txt")})
    four = doctor(project, platform(project, "2xnvidia", "GPU_COUNT=4"),
                  runner=runner).check("gpus")
    assert four.status == WARN and "GPU_COUNT=4" in four.detail and "2 GPU(s) found" in four.detail


def test_nvidia_gpus_from_recorded_nvidia_smi(project: Project) -> None:
    runner = host_runner(**{"nvidia-smi": ok("nvidia-smi-detect-2xh200.txt")})
    gpus = doctor(project, platform(project, "2xnvidia", "VLLM_TP=2"), runner=runner).check("gpus")
    assert gpus.status == PASS and "nvidia-smi: 2 × NVIDIA_H200 139.8 GiB" in gpus.detail
    none = doctor(project, platform(project, "nvidia")).check("gpus")
    assert none.status == WARN and "nvidia-smi describes no NVIDIA GPU" in none.detail
    assert doctor(project, platform(project, "cpu")).check("gpus").status == SKIP


# --- container runtimes: which are present, which `up` picks and why -------------------------


def runtimes_host(v2: bool, v1: bool, podman: bool) -> RecordingRunner:
    return host_runner(**{
        "docker_compose_version": ok("compose-v2-version.txt") if v2 else
        failed("docker-28-compose-missing.txt"),
        "docker-compose_version": ok("docker-compose-v1-version.txt") if v1 else MISSING,
        "podman-compose_version": ok("podman-compose-version.txt") if podman else MISSING})


@pytest.mark.parametrize(("v2", "v1", "podman", "picked"), [
    (True, True, True, "compose"), (False, True, True, "compose-v1"),
    (False, False, True, "podman"), (True, False, False, "compose")])
def test_auto_picks_what_the_runtime_layer_picks_and_says_why(
    project: Project, v2: bool, v1: bool, podman: bool, picked: str
) -> None:
    runner = runtimes_host(v2, v1, podman)
    check = doctor(project, platform(project, "r9700"), runner=runner).check("runtimes")
    assert check.status == PASS and check.data["picked"] == picked
    # The same answer as the detection `up` itself runs.
    assert detect_compose(runtimes_host(v2, v1, podman), "docker", "auto").runtime == picked
    assert check.data["reason"].startswith("RUNTIME=auto: the first of compose, compose-v1, podman")
    present = check.data["present"]
    assert [present[n]["present"] for n in ("compose", "compose-v1", "podman")] == [v2, v1, podman]
    skipped = {"compose": "", "compose-v1": " (compose did not)",
               "podman": " (compose, compose-v1 did not)"}[picked]
    assert check.data["reason"].endswith("answers" + skipped)
    if podman:
        assert present["podman"]["version"] == "podman-composer version 1.0.3"
    if v2:
        assert present["compose"] == {"present": True, "command": "docker compose",
                                      "version": "Docker Compose version v2.40.3"}


def test_an_explicit_runtime_a_previous_up_and_native_explain_themselves(project: Project) -> None:
    runner = runtimes_host(True, True, True)
    explicit = doctor(project, platform(project, "r9700", "RUNTIME=podman"), runner=runner)
    assert explicit.check("runtimes").data["picked"] == "podman"
    assert "RUNTIME=podman (at --set)" in explicit.check("runtimes").detail
    project.generated.mkdir(parents=True)
    (project.generated / "state.json").write_text(json.dumps(
        {"runtime": "compose", "flavour": "compose-v1", "compose_project": "x"}))
    previous = doctor(project, platform(project, "r9700"), runner=runner).check("runtimes")
    assert previous.data["picked"] == "compose-v1" and "the last `up` here used compose-v1" in \
        previous.detail
    native = doctor(project, platform(project, "r9700", "RUNTIME=native"), runner=runner)
    assert native.check("runtimes").data["picked"] == "native"


def test_a_requested_runtime_that_is_absent_fails_with_the_runtime_layers_fix(
    project: Project
) -> None:
    check = doctor(project, platform(project, "r9700", "RUNTIME=compose"),
                   runner=runtimes_host(False, True, True)).check("runtimes")
    assert check.status == FAIL and check.data["picked"] is None
    assert "no working compose found (tried: docker compose)" in check.detail
    assert check.fix and "--runtime native" in check.fix


# --- docker and buildx ----------------------------------------------------------------------------


def test_docker_28_without_buildx_warns_and_20_10_builds_without_it(project: Project) -> None:
    docker = doctor(project, platform(project, "r9700")).check("docker")
    assert docker.status == WARN and "docker 28.2.2 has no buildx plugin" in docker.detail
    assert "BuildKit is enabled but the buildx component is missing" in docker.detail
    old = host_runner(docker_version=ok("docker-version-20.10.txt"),
                      docker_buildx_version=failed("docker-20.10-buildx-missing.txt"))
    passed = doctor(project, platform(project, "r9700"), runner=old).check("docker")
    assert passed.status == PASS and "BuildKit built into docker 20.10.24+dfsg1" in passed.detail
    with_buildx = host_runner(docker_buildx_version=Result(
        (), 0, "github.com/docker/buildx v0.11.2 9872040\n"))
    assert doctor(project, platform(project, "r9700"),
                  runner=with_buildx).check("docker").status == PASS


def test_an_unreachable_engine_fails_when_compose_needs_it(project: Project) -> None:
    down = host_runner(docker_version=failed("docker-version-28-no-engine.err.txt",
                                             stdout=tool("docker-version-28-no-engine.out.txt")))
    docker = doctor(project, platform(project, "r9700"), runner=down).check("docker")
    assert docker.status == FAIL and "cannot reach its engine" in docker.detail
    assert "systemctl start docker" in (docker.fix or "")
    denied = host_runner(docker_version=Result((), 1, "28.2.2|\n", (
        "permission denied while trying to connect to the Docker daemon socket at "
        "unix:///var/run/docker.sock: Get \"http://%2Fvar%2Frun%2Fdocker.sock/v1.24/version\": "
        "dial unix /var/run/docker.sock: connect: permission denied")))
    fix = doctor(project, platform(project, "r9700"), runner=denied).check("docker").fix
    assert fix and fix.startswith("sudo usermod -aG docker alice")


def test_no_docker_is_a_fail_for_compose_and_a_skip_for_podman(project: Project) -> None:
    none = runtimes_host(False, False, True)
    none.respond(["docker", "version"], MISSING)
    skipped = doctor(project, platform(project, "r9700"), runner=none).check("docker")
    assert skipped.status == SKIP and "up uses podman" in skipped.detail
    nothing = runtimes_host(False, False, False)
    nothing.respond(["docker", "version"], MISSING)
    assert doctor(project, platform(project, "r9700"), runner=nothing).check("docker").status == FAIL


# --- the NVIDIA driver and container toolkit --------------------------------------------------


def test_nvidia_driver_from_the_recorded_h200(project: Project) -> None:
    runner = host_runner(**{"nvidia-smi": ok("nvidia-smi-doctor-2xh200.txt")})
    driver = doctor(project, platform(project, "2xnvidia"), runner=runner).check("nvidia-driver")
    assert driver.status == PASS
    assert driver.detail == "driver 580.159.04; 2 × NVIDIA H200 (compute capability 9.0)"
    missing = doctor(project, platform(project, "nvidia")).check("nvidia-driver")
    assert missing.status == FAIL and "no NVIDIA driver" in missing.detail
    broken = host_runner(**{"nvidia-smi": Result((), 9, "", (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
        "that the latest NVIDIA driver is installed and running."))})
    failing = doctor(project, platform(project, "nvidia"), runner=broken).check("nvidia-driver")
    assert failing.status == FAIL and "couldn't communicate" in failing.detail
    assert doctor(project, platform(project, "r9700")).check("nvidia-driver").status == SKIP


def test_nvidia_toolkit_and_cdi_per_runtime(project: Project) -> None:
    # The recorded H200 machine: driver, no toolkit.
    bare = doctor(project, platform(project, "nvidia")).check("nvidia-toolkit")
    assert bare.status == FAIL and "runtime configure --runtime=docker" in (bare.fix or "")
    ctk = {"nvidia-ctk": ok("nvidia-ctk-version.txt")}
    docker = doctor(project, platform(project, "nvidia"), runner=host_runner(**ctk))
    assert docker.check("nvidia-toolkit").status == PASS
    assert "NVIDIA Container Toolkit CLI version 1.17.8" in docker.check("nvidia-toolkit").detail
    podman = platform(project, "nvidia", "RUNTIME=podman")
    no_spec = doctor(project, podman, runner=host_runner(**ctk)).check("nvidia-toolkit")
    assert no_spec.status == FAIL and no_spec.fix == \
        "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"
    spec = doctor(project, podman, HOST / "nvidia-cdi", runner=host_runner(**ctk))
    assert spec.check("nvidia-toolkit").status == PASS
    assert spec.check("nvidia-toolkit").data["cdi_specs"] == ["/etc/cdi/nvidia.yaml"]
    native = doctor(project, platform(project, "nvidia", "RUNTIME=native")).check("nvidia-toolkit")
    assert native.status == SKIP


# --- free disk ---------------------------------------------------------------------------------


def test_disk_needs_add_up_on_one_filesystem(project: Project) -> None:
    # 53.1 GiB free on one disk: 25 GiB for the missing image + 29.5 GiB of weights do not fit.
    big = doctor(project, platform(project, "r9700", model="qwen3.8-27b")).check("disk")
    assert big.status == FAIL and big.data["mounts"][0]["free_gib"] == 53.1
    assert big.data["mounts"][0]["hard_gib"] == 54.5 and len(big.data["mounts"]) == 1
    small = doctor(project, platform(project, "r9700")).check("disk")
    assert small.status == WARN  # fits, but not the 100 GiB a local build wants
    assert "100 GiB to build it" in small.detail
    there = host_runner(docker_image_inspect=Result((), 0, "sha256:4239\n"))
    assert doctor(project, platform(project, "r9700"), runner=there).check("disk").status == PASS


def test_disk_per_filesystem_and_natively(project: Project) -> None:
    two = host_runner(df=ok("df-two-disks.txt"))
    disk = doctor(project, platform(project, "r9700", model="qwen3.8-27b"), runner=two).check("disk")
    assert disk.status == FAIL and [m["mount"] for m in disk.data["mounts"]] == \
        ["/var/lib/docker", "/home"]
    assert "free 10 GiB on /home" in (disk.fix or "")
    native = doctor(project, platform(project, "nvidia", "RUNTIME=native"),
                    runner=host_runner(df=Result((), 0, tool("df-one-disk-53g.txt").rsplit(
                        "\n", 2)[0] + "\n"))).check("disk")
    assert [n["what"] for m in native.data["mounts"] for n in m["needs"]] == ["hf-cache"]
    broken = host_runner(df=Result((), 1, "", "df: /x: No such file or directory"))
    assert doctor(project, platform(project, "r9700"), runner=broken).check("disk").status == WARN


def test_disk_for_the_cpu_platform_counts_what_was_asked(project: Project) -> None:
    """Issue 23: `doctor --platform cpu` with .env's 27B profile budgeted its 29.5 GiB of weights
    and a 100 GiB ROCm build; the CPU image and the profile asked for are what count."""
    environ = {"HOME": str(project.root / "home")}
    asked = resolve(project, platform="cpu", environ=environ)  # .env.example: qwen3.8-27b
    disk = doctor(project, asked).check("disk")
    assert disk.status == PASS, disk.detail
    assert "qwen3.8-27b" in disk.detail and "is not made for cpu" in disk.detail
    assert "localhost/vllm-cpu:latest" in disk.detail and "10 GiB to build it" in disk.detail
    assert "100 GiB" not in disk.detail and "29.5" not in disk.detail
    # Named with --model, a profile's weights count whatever the platform.
    named = doctor(project, platform(project, "cpu", model="qwen3.8-27b")).check("disk")
    assert "29.5 GiB of weights" in named.detail
    gguf = doctor(project, platform(project, "cpu", model="tiny-gguf")).check("disk")
    assert "2 GiB for localhost/llamacpp:" in gguf.detail and "GGUF file is local" in gguf.detail


# --- the report: JSON contract and text ----------------------------------------------------------


def test_json_contract(project: Project) -> None:
    report = doctor(project, platform(project, "2xr9700"), HOST / "2xr9700-dkms")
    data = json.loads(json.dumps(report.as_json()))
    assert set(data) == {"schema", "platform", "vendor", "ok", "counts", "checks"}
    assert data["schema"] == 1 and data["platform"] == "2xr9700" and data["vendor"] == "amd"
    assert [c["id"] for c in data["checks"]] == IDS
    for check in data["checks"]:
        assert set(check) == {"id", "title", "status", "detail", "fix", "guard", "data"}
        assert check["status"] in ("PASS", "WARN", "FAIL", "SKIP")
        assert (check["fix"] is not None) or check["status"] in ("PASS", "SKIP")
    assert [c["id"] for c in data["checks"] if c["guard"]] == ["cwsr", "amdgpu-dkms", "devices",
                                                               "gpus"]
    assert sum(data["counts"].values()) == len(IDS)
    assert data["counts"]["fail"] == sum(c["status"] == "FAIL" for c in data["checks"]) >= 1
    assert data["ok"] is False and report.failed
    assert set(data["checks"][IDS.index("runtimes")]["data"]) == {"picked", "reason", "present"}


def test_text_report_shows_fixes_for_warn_and_fail_only(project: Project) -> None:
    report = doctor(project, platform(project, "strix-halo"), HOST / "strix-halo")
    text = render_doctor(report)
    lines = text.splitlines()
    assert lines[0] == "host prerequisites for platform strix-halo (GPU_VENDOR=amd)"
    assert re.search(r"^PASS  cwsr +the kernel exports", text, re.MULTILINE)
    fixes = [i for i, line in enumerate(lines) if line.strip().startswith("fix:")]
    assert fixes and all(lines[i - 1].startswith(("WARN", "FAIL")) for i in fixes)
    assert lines[-1].endswith("SKIP") and "PASS" in lines[-1]


# --- the fast subset `up` runs --------------------------------------------------------------------


def test_the_fast_subset_on_amd_reads_files_only_and_is_fast(project: Project) -> None:
    resolved = platform(project, "2xr9700")
    view = recorded_host(HOST / "2xr9700-dkms", ALICE)
    start = time.perf_counter()
    checks = fast_checks(resolved, view, None)
    elapsed = time.perf_counter() - start
    assert [c.id for c in checks] == ["devices", "gpus", "amdgpu-dkms", "cwsr"]
    assert [c.status for c in checks] == [PASS, PASS, FAIL, SKIP]
    assert not view._memo  # no program was asked for anything
    assert elapsed < 0.5, f"the fast subset took {elapsed:.3f} s"


def test_the_fast_subset_on_nvidia_asks_nvidia_smi_once(project: Project) -> None:
    runner = host_runner(**{"nvidia-smi": ok("nvidia-smi-detect-2xh200.txt")})
    checks = fast_checks(platform(project, "2xnvidia", "VLLM_TP=2"),
                         HostView(EMPTY, runner, recorded_user(ALICE)), None)
    assert [c.status for c in checks] == [SKIP, PASS, SKIP, SKIP]
    assert [c[0] for c in runner.calls] == ["nvidia-smi"]


def test_the_recorded_h200_machine_end_to_end(project: Project) -> None:
    """The H200 machine as recorded: driver and GPUs, no docker, no toolkit; the native runtime."""
    runner = RecordingRunner()
    for prefix, result in ((["uname", "-r"], ok("uname-h200.txt")),
                           (["nvidia-smi", "--query-gpu=index,name,memory.total,memory.reserved"],
                            ok("nvidia-smi-detect-2xh200.txt")),
                           (["nvidia-smi", "--query-gpu=index,name,compute_cap"],
                            ok("nvidia-smi-doctor-2xh200.txt")),
                           (["df"], ok("df-h200.txt"))):
        runner.respond(prefix, result)
    for missing in ("docker", "docker-compose", "podman-compose", "podman", "nvidia-ctk", "modinfo",
                    "dpkg-query"):
        runner.respond([missing], MISSING)
    ids = recorded_user("uid=0(root) gid=0(root) groups=0(root)")
    report = run_doctor(project, platform(project, "2xnvidia", "VLLM_TP=2", "RUNTIME=native"),
                        {"HOME": str(project.root / "home")}, runner, root=EMPTY, user=ids)
    statuses = {c.id: c.status for c in report.checks}
    assert statuses == {"kernel": PASS, "cwsr": SKIP, "amdgpu-dkms": SKIP, "rocm": SKIP,
                        "devices": SKIP,
                        "runtimes": PASS, "docker": SKIP, "nvidia-driver": PASS,
                        "nvidia-toolkit": SKIP, "disk": PASS, "gpus": PASS}
    assert not report.failed and report.check("kernel").detail == "Linux 6.18.44-fc-v657-gpu"
    assert report.check("runtimes").data["present"] == {
        name: {"present": False, "command": None, "version": None}
        for name in ("compose", "compose-v1", "podman")}

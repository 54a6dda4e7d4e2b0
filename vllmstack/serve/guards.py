"""Guards before `up` and the memory check after `down`: devices, the host's fast checks (device
access, GPUs vs the pins, a masking amdgpu-dkms, gfx1151's CWSR: checks/host), other engines,
free GPU memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from vllmstack.checks.host import FAIL, HostView, fast_checks
from vllmstack.config.profiles import Resolved
from vllmstack.core.runner import Runner
from vllmstack.observe.health import identify_server, port_answers
from vllmstack.runtime.gpu import GIB, AmdSysfsProbe, GpuMemory, GpuProbe, NvidiaSmiProbe, total_used
from vllmstack.serve.stack import LifecycleError

# After `down`, the GPUs count as released when used memory is back within this of the baseline.
RELEASE_SLACK = 1 * GIB


@dataclass
class Guard:
    code: str
    message: str
    fix: str
    overridable: bool = True


def required_bytes_per_gpu(resolved: Resolved, gpu: GpuMemory) -> int:
    """What vLLM itself demands free at start: ceil(total × gpu_memory_utilization)."""
    util = resolved.get_float("VLLM_GPU_MEM_UTIL")
    return int(gpu.total_bytes * util) + 1


def check_guards(
    resolved: Resolved,
    probe: GpuProbe,
    *,
    own_engine_running: bool,
    port_probe: Callable[[str, int], bool] = port_answers,
    identify: Callable[[str], str] = identify_server,
    host: HostView | None = None,
    runtime: str | None = None,
    runner: Runner | None = None,
) -> list[Guard]:
    """Everything that must hold before starting: devices, the host's fast checks, no other
    engine, enough free memory. `host` defaults to what the probe reads (its sysfs root, or its
    runner for nvidia-smi); `runtime` to RUNTIME unless that is auto."""
    guards: list[Guard] = []
    vendor = resolved.get_str("GPU_VENDOR")
    missing = probe.missing_devices()
    if missing:
        what = ", ".join(missing)
        fix = ("run on the GPU host with the amdgpu driver loaded (ls /dev/kfd), or use "
               "--platform cpu for a CPU engine" if vendor == "amd" else
               "install the NVIDIA driver and container toolkit, or use --platform cpu")
        guards.append(Guard("no-gpu-devices",
                            f"no {what} found: platform {resolved.platform} needs "
                            f"{'an AMD' if vendor == 'amd' else 'an NVIDIA'} GPU and this host does "
                            "not expose one", fix, overridable=False))
        return guards
    guards += host_guards(resolved, probe, host=host, runtime=runtime)
    if runner is not None:
        guards += [Guard("other-engine-service",
                         f"the system service {unit} is active: it runs another engine, which holds "
                         "GPU memory (two resident engines overcommit the card)",
                         f"invoke up --stop-other (runs `systemctl stop {unit}` first), or "
                         f"sudo systemctl stop {unit}")
                   for unit in active_services(resolved, runner)]
    ports = [int(p) for p in resolved.get_list("OTHER_ENGINE_PORTS") if p.isdigit()]
    own_port = resolved.get_int("VLLM_PORT")
    if not own_engine_running:
        ports = [own_port, *[p for p in ports if p != own_port]]
    for port in ports:
        if port_probe("127.0.0.1", port):
            who = identify(f"http://127.0.0.1:{port}")
            clash = " (the port this stack publishes)" if port == own_port else ""
            guards.append(Guard(
                "other-engine", f"port {port}{clash} is taken by {who}: another engine may hold "
                "the GPU, and two resident engines overcommit memory",
                ("`invoke down` (this stack's own engine), or `invoke up --stop-other`"
                 if clash else "stop it first (its systemd unit: add it to OTHER_ENGINE_SERVICE and "
                 "`invoke up --stop-other` stops it for you)") +
                f", or remove {port} from OTHER_ENGINE_PORTS if it is not an engine"))
    memory = probe.memory()
    tp = resolved.get_int("VLLM_TP")
    if memory and vendor != "none":
        for gpu in memory[:tp]:
            need = required_bytes_per_gpu(resolved, gpu)
            if gpu.free_bytes < need:
                guards.append(Guard(
                    "gpu-memory-busy",
                    f"GPU{gpu.index}: {gpu.free_bytes / GIB:.1f} GiB free of {gpu.total_bytes / GIB:.1f}"
                    f" GiB, but gpu_memory_utilization {resolved.get('VLLM_GPU_MEM_UTIL')} needs "
                    f"{need / GIB:.1f} GiB free at start ({gpu.used_bytes / GIB:.1f} GiB in use by "
                    "something else)",
                    "stop the other GPU user, or lower VLLM_GPU_MEM_UTIL (--set VLLM_GPU_MEM_UTIL=...)"))
    return guards


def active_services(resolved: Resolved, runner: Runner) -> list[str]:
    """The OTHER_ENGINE_SERVICE units that systemd reports active (none without systemctl: the
    runner answers 127, and `is-active` prints `active` for nothing else)."""
    active = []
    for unit in resolved.get_list("OTHER_ENGINE_SERVICE"):
        result = runner.run(["systemctl", "is-active", unit], mutates=False)
        if result.stdout.strip() == "active":
            active.append(unit)
    return active


def stop_services(units: list[str], runner: Runner, out: TextIO) -> None:
    """`--stop-other`: stop the other engine's services; a refusal (no permission) says how."""
    for unit in units:
        print(f"--stop-other: stopping the system service {unit} (another engine)", file=out)
        result = runner.run(["systemctl", "stop", unit])
        if not result.ok:
            raise LifecycleError(
                f"`systemctl stop {unit}` failed: {(result.stderr or result.stdout).strip()[-300:]}",
                f"sudo systemctl stop {unit} (or allow this user to stop it), then invoke up again")


def wait_gpu_settled(probe: GpuProbe, timeout: float, sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic, *, interval: float = 1.0,
                     steady_for: int = 5) -> int | None:
    """After stopping another engine: wait until used GPU memory stops falling (its teardown is
    over: `steady_for` readings `interval` s apart that do not fall), at most `timeout` s.
    Returns the bytes in use then (None: no GPU to read)."""
    start, last, steady = clock(), total_used(probe.memory()), 0
    while last is not None and last > RELEASE_SLACK and clock() - start < timeout \
            and steady < steady_for:
        sleep(interval)
        now = total_used(probe.memory())
        steady = steady + 1 if now is not None and now >= last else 0
        last = now
    return last


def host_guards(resolved: Resolved, probe: GpuProbe, *, host: HostView | None = None,
                runtime: str | None = None) -> list[Guard]:
    """The FAILs of `invoke doctor`'s fast subset as guards (`host-<check id>`), overridable:
    each reads the host from outside, and the operator may know better (--force)."""
    view = host
    if view is None and isinstance(probe, AmdSysfsProbe):
        view = HostView(root=probe.root)  # sysfs, /dev and /etc only: no program runs
    elif view is None and isinstance(probe, NvidiaSmiProbe):
        view = HostView(runner=probe.runner)  # one nvidia-smi query
    if view is None:
        return []  # no GPU platform, or a probe standing in for the host
    configured = resolved.get_str("RUNTIME")
    runtime = runtime or (configured if configured != "auto" else None)
    return [Guard(f"host-{check.id}", check.detail,
                  (check.fix or "see `invoke doctor`") + "; `invoke doctor` checks the whole host")
            for check in fast_checks(resolved, view, runtime) if check.status == FAIL]


def print_guards(guards: list[Guard], force: bool, out: TextIO) -> None:
    blocking = [g for g in guards if not g.overridable or not force]
    for guard in guards:
        if guard.overridable and force:
            print(f"WARNING --force: ignoring guard {guard.code}: {guard.message}", file=out)
    if blocking:
        first = blocking[0]
        raise LifecycleError(first.message, first.fix + ("" if not first.overridable else
                                                          " (or --force to start anyway)"),
                             details=[f"guard {g.code}: {g.message}" for g in blocking[1:]])


def wait_gpu_release(probe: GpuProbe, baseline: int | None, timeout: float,
                     sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic) -> tuple[bool, int | None]:
    """Wait until used GPU memory is back near `baseline`. Returns (released, used_now)."""
    start = clock()
    while True:
        used = total_used(probe.memory())
        if used is None:
            return True, None
        limit = (baseline or 0) + RELEASE_SLACK
        if used <= limit:
            return True, used
        if clock() - start > timeout:
            return False, used
        sleep(1.0)

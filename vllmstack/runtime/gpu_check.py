"""`invoke gpu-check`: does torch see the card, and does a kernel run on it, where the engine runs?

A small Python probe (PROBE, one argv) runs in the engine's own environment: the install-engine
environment's Python with the profile's engine variables (native), or the engine container
through the runtime's `exec` (compose). It prints one JSON object: torch and its CUDA/HIP
version, the devices with their name and compute capability or gfx arch (`gcnArchName`), the
result of a 256x256 matmul on the first device checked against float64 on the CPU, and
HSA_OVERRIDE_GFX_VERSION. `evaluate` turns that into PASS or FAIL with a fix for the platform's
GPU vendor. On the `cpu` platform the kernel runs on the CPU and says so.

A llama.cpp profile has no torch where its engine runs: there the check is the devices
`llama-server --list-devices` sees (its build for the platform's backend, or its container).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.config.engines import llamacpp, vllm
from vllmstack.config.engines.llamacpp import llamacpp_backend
from vllmstack.config.engines.table import engine_kind
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import load_schema
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime.base import EngineRuntime
from vllmstack.runtime.engine_env import engine_environment
from vllmstack.runtime.native.install import engine_dir, engine_version
from vllmstack.runtime.native.llamacpp_build import server_binary

PROBE = r"""
import glob, json, os, time
ENV = ("HSA_OVERRIDE_GFX_VERSION", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
       "CUDA_VISIBLE_DEVICES")
out = {"env": {k: os.environ[k] for k in ENV if k in os.environ}, "kfd": []}
# The AMD cards' real gfx arch, as the kernel driver reports it: the HSA override changes what
# the runtime (and torch) report, not this. 110002 -> gfx1102, 90010 -> gfx90a.
for path in sorted(glob.glob("/sys/class/kfd/kfd/topology/nodes/*/properties")):
    try:
        for line in open(path):
            key, _, value = line.partition(" ")
            if key == "gfx_target_version" and int(value) > 0:
                n = int(value)
                out["kfd"].append("gfx%d%x%x" % (n // 10000, n // 100 % 100, n % 100))
    except (OSError, ValueError):
        pass
try:
    import torch
except Exception as exc:
    out["error"] = "import torch: %s: %s" % (type(exc).__name__, exc)
    print(json.dumps(out))
    raise SystemExit(0)
out.update(torch=torch.__version__, cuda=torch.version.cuda,
           hip=getattr(torch.version, "hip", None))
try:
    out["available"], out["count"] = torch.cuda.is_available(), torch.cuda.device_count()
except Exception as exc:
    out["available"], out["count"] = False, 0
    out["init_error"] = "%s: %s" % (type(exc).__name__, exc)
out["devices"] = []
for i in range(out["count"]):
    p = torch.cuda.get_device_properties(i)
    out["devices"].append({"index": i, "name": p.name, "capability": "%d.%d" % (p.major, p.minor),
                           "gfx": getattr(p, "gcnArchName", None), "memory": p.total_memory})
device = "cuda:0" if out["count"] else "cpu"
try:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    want = a.double() @ b.double()
    start = time.perf_counter()
    got = a.to(device) @ b.to(device)
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
    out["kernel"] = {"device": device, "ok": err < 1e-2, "max_rel_error": err, "seconds": seconds}
except Exception as exc:
    out["kernel"] = {"device": device, "ok": False, "error": "%s: %s" % (type(exc).__name__, exc)}
print(json.dumps(out))
"""
PASS, FAIL = "PASS", "FAIL"


class GpuCheckError(StackError):
    """The probe cannot be run where the engine runs; `fix` says what to do."""


@dataclass
class GpuCheck:
    verdict: str  # PASS | FAIL
    where: str  # the runtime and the Python or container the probe ran in
    lines: list[str] = field(default_factory=list)
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def as_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "where": self.where, "lines": self.lines, "fix": self.fix,
                "probe": self.data}


def override_arch(value: str) -> str | None:
    """HSA_OVERRIDE_GFX_VERSION as the gfx name it makes the card report (11.0.0 -> gfx1100,
    9.0.10 -> gfx90a: the last field is hexadecimal in gfx names); None when malformed."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", value.strip())
    if not match:
        return None
    major, minor, step = (int(g) for g in match.groups())
    return f"gfx{major}{minor:x}{step:x}"


def base_arch(gfx: str | None) -> str:
    """gcnArchName without its feature suffixes (gfx90a:sramecc+:xnack- -> gfx90a)."""
    return (gfx or "").split(":", 1)[0]


def _seen_arch(data: Mapping[str, Any]) -> str:
    """The gfx arch the first device reports under a HIP torch ("" otherwise)."""
    devices = data.get("devices") or [{}]
    return base_arch(devices[0].get("gfx")) if data.get("hip") else ""


def evaluate(data: Mapping[str, Any], *, vendor: str, gpu_arch: str = "",
             where: str = "") -> GpuCheck:
    """PASS or FAIL from the probe's JSON, with what it found and a fix for `vendor`."""
    check = GpuCheck(FAIL, where, data=dict(data))
    if "error" in data:
        check.lines.append(f"torch does not load: {data['error']}")
        check.fix = ("install the engine into this environment (invoke install-engine), or run "
                     "gpu-check where the engine runs (--runtime native|compose)")
        return check
    build = f"CUDA {data['cuda']}" if data.get("cuda") else (
        f"HIP {data['hip']}" if data.get("hip") else "CPU only")
    check.lines.append(f"torch {data.get('torch')} ({build})")
    for device in data.get("devices") or []:
        # CUDA builds of torch answer gcnArchName too, with the device's name: only HIP's is an arch.
        arch = f"gfx arch {base_arch(device.get('gfx'))}" if data.get("hip") else (
            f"compute capability {device.get('capability')}")
        memory = device.get("memory") or 0
        check.lines.append(f"device {device.get('index')}: {device.get('name')}, {arch}, "
                           f"{memory / 2**30:.1f} GiB")
    override = str((data.get("env") or {}).get("HSA_OVERRIDE_GFX_VERSION") or "")
    kernel = data.get("kernel") or {}
    count = int(data.get("count") or 0)
    if vendor == "none":
        if kernel.get("ok"):
            check.verdict = PASS
            check.lines.append("no GPU on this platform (cpu): the matmul ran on the CPU"
                               + (f"; torch also sees {count} GPU(s)" if count else ""))
        else:
            check.lines.append(f"the matmul on the CPU failed: {_kernel_problem(kernel)}")
            check.fix = "reinstall the engine's torch: invoke install-engine --platform cpu --force"
        return check
    if vendor == "amd":
        check.lines += _override_lines(override, data, gpu_arch)
    if count == 0:
        check.lines.append("no GPU visible to torch" + (
            f" ({data['init_error']})" if data.get("init_error") else ""))
        check.fix = _no_gpu_fix(vendor, data)
        return check
    if not kernel.get("ok"):
        check.lines.append(f"the matmul on {kernel.get('device')} failed: {_kernel_problem(kernel)}")
        check.fix = _kernel_fix(vendor, kernel, data, gpu_arch)
        return check
    seen = _seen_arch(data)
    if vendor == "amd" and gpu_arch and seen and seen != gpu_arch and not override:
        check.lines.append(f"note: torch sees {seen}, but the platform pins GPU_ARCH={gpu_arch}; "
                           "is this the right --platform?")
    check.verdict = PASS
    check.lines.append(f"a 256x256 matmul on {kernel.get('device')} matches float64 on the CPU "
                       f"(relative error {float(kernel.get('max_rel_error') or 0):.1e})")
    return check


def _override_lines(override: str, data: Mapping[str, Any], gpu_arch: str) -> list[str]:
    """What HSA_OVERRIDE_GFX_VERSION does here: the card's real arch (from the kernel driver)
    against the one the runtime reports."""
    real = next(iter(data.get("kfd") or []), "")
    if not override:
        return ["HSA_OVERRIDE_GFX_VERSION is not set: the card reports its own gfx arch"
                + (f" ({real})" if real else "")]
    spoofed = override_arch(override)
    if spoofed is None:
        return [f"HSA_OVERRIDE_GFX_VERSION={override!r} is not X.Y.Z: the HSA runtime ignores "
                "or rejects it"]
    seen = _seen_arch(data)
    if seen and seen != spoofed:
        return [f"HSA_OVERRIDE_GFX_VERSION={override} is set but not in effect: torch sees {seen}, "
                f"not {spoofed}"]
    if real == spoofed:
        return [f"HSA_OVERRIDE_GFX_VERSION={override} names the card's own arch ({real}): it "
                "changes nothing"]
    card = f"the {real} card" if real else "the card (its real arch is not readable here)"
    return [f"HSA_OVERRIDE_GFX_VERSION={override} is in effect: {card} runs as {spoofed}, so "
            f"kernels built for {spoofed} run on it"
            + (f" (the platform's GPU_ARCH is {gpu_arch})" if gpu_arch and gpu_arch != spoofed else "")]


def _kernel_problem(kernel: Mapping[str, Any]) -> str:
    if kernel.get("error"):
        return str(kernel["error"])
    return f"result off by {float(kernel.get('max_rel_error') or 0):.1e} (relative)"


def _no_gpu_fix(vendor: str, data: Mapping[str, Any]) -> str:
    if vendor == "nvidia":
        if not data.get("cuda"):
            return "this torch is a CPU (or ROCm) build; install the engine's CUDA torch"
        return ("check that nvidia-smi lists the card on the host, that CUDA_VISIBLE_DEVICES "
                "names it, and (compose) that the container gets it through the NVIDIA runtime")
    if not data.get("hip"):
        return "this torch is not a ROCm build; install the engine's ROCm torch for the card"
    return ("check that the user can open /dev/kfd and /dev/dri (groups video and render), that "
            "HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES name the card, and that "
            "HSA_OVERRIDE_GFX_VERSION is not set to an empty value")


def _kernel_fix(vendor: str, kernel: Mapping[str, Any], data: Mapping[str, Any], gpu_arch: str) -> str:
    error = str(kernel.get("error") or "")
    if vendor == "amd" and ("invalid device function" in error or "no kernel image" in error):
        seen = _seen_arch(data) or gpu_arch or "this card"
        return (f"this torch has no kernels for {seen}: install one built for it, or (RDNA3 cards "
                "without their own code objects) set HSA_OVERRIDE_GFX_VERSION to an arch it has, "
                "e.g. 11.0.0 for gfx1100")
    if vendor == "nvidia" and "no kernel image" in error:
        return "this torch was not built for the card's compute capability; install one that is"
    return "read the error above; run invoke doctor for the host's GPU prerequisites"


def run_probe(runner: Runner, argv: list[str], env: Mapping[str, str] | None) -> dict[str, Any]:
    """The probe's JSON from `argv` (which ends with the probe's source); a crash is an error."""
    result = runner.run(argv, env=dict(env) if env is not None else None, mutates=False,
                        timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    try:
        data = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):  # RecursionError: nested thousands deep
        data = None
    if isinstance(data, dict):
        problem = probe_shape_problem(data)
        if problem is None:
            return data
        raise GpuCheckError(
            f"the GPU probe answered JSON that is not its own ({problem}): {lines[-1][:300]}",
            "something else printed on the probe's stdout (a sitecustomize, a wrapper around "
            "python); run the probe's Python by hand, or pass --python with a clean interpreter")
    said = (result.stderr or result.stdout).strip()[-800:] or "no output"
    raise GpuCheckError(f"the GPU probe did not finish (exit {result.returncode}): {said}",
                        "a crash here (a segfault in the GPU runtime) is what the engine would hit "
                        "too; run invoke doctor, and check the driver and the device files")


# The probe's fields and their JSON types (PROBE above); None is allowed where torch gives None.
_TEXT, _NUMBER, _FLAG = (str, type(None)), (int, float), (bool,)
PROBE_FIELDS: dict[str, tuple[type, ...]] = {
    "env": (dict,), "kfd": (list,), "error": (str,), "torch": _TEXT, "cuda": _TEXT,
    "hip": _TEXT, "available": _FLAG, "count": (int,), "init_error": (str,), "devices": (list,),
    "kernel": (dict,)}
DEVICE_FIELDS: dict[str, tuple[type, ...]] = {
    "index": (int,), "name": _TEXT, "capability": _TEXT, "gfx": _TEXT, "memory": _NUMBER}
KERNEL_FIELDS: dict[str, tuple[type, ...]] = {
    "device": (str,), "ok": _FLAG, "max_rel_error": _NUMBER, "seconds": _NUMBER, "error": (str,)}


def probe_shape_problem(data: Mapping[str, Any]) -> str | None:
    """Why `data` is not what the probe prints (None: it is), so `evaluate` never meets a list
    where it reads a count, or a number where it reads a device (a traceback, issue 22 #15)."""

    def fields(where: str, obj: Mapping[str, Any], types: dict[str, tuple[type, ...]]) -> str | None:
        for key, allowed in types.items():
            value = obj.get(key)
            if key in obj and (not isinstance(value, allowed) or (
                    isinstance(value, bool) and bool not in allowed)):
                return f"{where}{key} is {type(value).__name__}"
        return None

    problem = fields("", data, PROBE_FIELDS)
    if problem:
        return problem
    count = data.get("count", 0)
    if not 0 <= count <= 4096:
        return f"count is {count}"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data.get("env", {}).items()):
        return "env holds something other than text"
    if not all(isinstance(gfx, str) for gfx in data.get("kfd", [])):
        return "kfd holds something other than text"
    for index, device in enumerate(data.get("devices", [])):
        if not isinstance(device, dict):
            return f"devices[{index}] is {type(device).__name__}"
        problem = fields(f"devices[{index}].", device, DEVICE_FIELDS)
        if problem:
            return problem
    return fields("kernel.", data.get("kernel", {}), KERNEL_FIELDS)


# llama-server's --list-devices lines: "  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)".
DEVICE_LINE = re.compile(r"^\s+(?P<id>[A-Za-z]+\d+): (?P<name>.*?)(?: \((?P<mib>\d+) MiB, .*\))?$")
# The ggml device names of each vendor's backends.
VENDOR_DEVICES = {"nvidia": ("CUDA", "Vulkan"), "amd": ("ROCm", "HIP", "Vulkan")}


def evaluate_llamacpp(text: str, *, vendor: str, where: str = "") -> GpuCheck:
    """PASS or FAIL from `llama-server --list-devices` (a llama.cpp engine has no torch)."""
    devices = [m.groupdict() for m in map(DEVICE_LINE.match, text.splitlines()) if m]
    check = GpuCheck(FAIL, where, data={"devices": devices})
    check.lines = [f"device {d['id']}: {d['name']}" + (f", {int(d['mib']) / 1024:.1f} GiB"
                                                         if d["mib"] else "") for d in devices]
    if "Available devices:" not in text:
        check.lines.append(f"llama-server --list-devices printed no device list: {text[-300:]!r}")
        check.fix = ("rebuild it: invoke install-engine --engine llamacpp --force (or invoke build "
                     "--engine llamacpp)")
        return check
    if vendor == "none":
        check.verdict = PASS
        check.lines.append("no GPU on this platform (cpu): llama-server runs on the CPU")
        return check
    if any(d["id"].startswith(VENDOR_DEVICES.get(vendor, ())) for d in devices):
        check.verdict = PASS
        check.lines.append("llama-server sees the card (it loads no model here; `invoke up` runs "
                           "the kernels)")
        return check
    check.lines.append("llama-server sees no GPU device")
    check.fix = ("its build has no GPU backend, or the card is hidden from it: check build.json's "
                 "backend (invoke install-engine --engine llamacpp --backend " +
                 ("cuda" if vendor == "nvidia" else "rocm") + " --force), then " +
                 _no_gpu_fix(vendor, {"cuda": "?", "hip": "?"}))
    return check


def gpu_check(project: Project, resolved: Resolved, runner: Runner, *, runtime: str,
              environ: Mapping[str, str], engine: EngineRuntime | None = None,
              python: str | None = None) -> GpuCheck:
    """Run the probe where the engine runs and evaluate it for the platform's GPU vendor.

    native: `python` or the install-engine environment's Python, with the profile's engine
    variables; compose: inside the running engine container (`engine`), the image's Python."""
    vendor = resolved.get_str("GPU_VENDOR") or "none"
    probe = PROBES[engine_kind(resolved).name]
    return probe(project, resolved, runner, runtime=runtime, engine=engine, environ=environ,
                 vendor=vendor, python=python)


def _torch_check(project: Project, resolved: Resolved, runner: Runner, *, runtime: str,
                 engine: EngineRuntime | None, environ: Mapping[str, str], vendor: str,
                 python: str | None) -> GpuCheck:
    """A vLLM profile: what the engine's torch sees."""
    gpu_arch = resolved.get_str("GPU_ARCH")
    if runtime == "compose":
        if engine is None or not engine.state().running:
            raise GpuCheckError("gpu-check --runtime compose runs inside the engine container, and "
                                "it is not running", "start it (invoke up), or check the host's "
                                "engine environment: invoke gpu-check --runtime native")
        argv = engine.exec_command(["python3", "-c", PROBE], tty=False)
        return evaluate(run_probe(runner, argv, None), vendor=vendor, gpu_arch=gpu_arch,
                        where="compose: the engine container")
    interpreter = python or _engine_python(project, resolved)
    env = {**environ, "PYTHONNOUSERSITE": "1", **engine_environment(resolved, load_schema())}
    return evaluate(run_probe(runner, [interpreter, "-c", PROBE], env), vendor=vendor,
                    gpu_arch=gpu_arch, where=f"native: {interpreter}")


def _llamacpp_check(project: Project, resolved: Resolved, runner: Runner, *, runtime: str,
                    engine: EngineRuntime | None, environ: Mapping[str, str],
                    vendor: str, python: str | None) -> GpuCheck:
    """A llama.cpp profile: the devices its llama-server sees (its image and build have no torch)."""
    if runtime == "compose":
        if engine is None or not engine.state().running:
            raise GpuCheckError("gpu-check --runtime compose runs inside the engine container, and "
                                "it is not running", "start it (invoke up)")
        argv, env, where = (engine.exec_command(["llama-server", "--list-devices"], tty=False), None,
                            "compose: the llama.cpp container")
    else:
        backend = llamacpp_backend(resolved)
        # LLAMACPP_SERVER is the native runtime's own override: check what `up` would run.
        chosen = shlex.split(resolved.get_str("LLAMACPP_SERVER"))
        binary = Path(chosen[0]) if chosen else server_binary(
            project, resolved.get_str("LLAMACPP_REF"), backend)
        if not binary.is_file():
            raise GpuCheckError(f"no llama-server built for {backend} ({binary})",
                                f"invoke install-engine --engine llamacpp --backend {backend}")
        argv = [*chosen, "--list-devices"] if chosen else [str(binary), "--list-devices"]
        env = {**environ, **engine_environment(resolved, load_schema())}
        where = f"native: {binary}"
    result = runner.run(argv, env=env, mutates=False, timeout=300)
    return evaluate_llamacpp(result.stdout + result.stderr, vendor=vendor, where=where)


# What each engine kind is probed with where it runs (its image and build decide: llama.cpp's
# have no torch).
PROBES = {vllm.KIND.name: _torch_check, llamacpp.KIND.name: _llamacpp_check}


def _engine_python(project: Project, resolved: Resolved) -> str:
    version = engine_version(resolved)
    python = engine_dir(project, version) / "bin" / "python" if version else Path()
    if not version or not python.is_file():
        raise GpuCheckError(f"no engine environment for vLLM {version or '(no version)'} "
                            f"({python.parent.parent if version else 'NATIVE_ENGINE_VERSION unset'})",
                            "install it (invoke install-engine), or pass --python with the "
                            "interpreter that has the engine's torch")
    return str(python)


def render_gpu_check(check: GpuCheck) -> str:
    lines = [f"{check.verdict}  gpu-check ({check.where})", *(f"  {line}" for line in check.lines)]
    if check.fix and not check.passed:
        lines.append(f"fix: {check.fix}")
    return "\n".join(lines)

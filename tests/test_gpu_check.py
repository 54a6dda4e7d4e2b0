"""`invoke gpu-check`: torch sees the card and a kernel runs on it, where the engine runs.

Verdicts from probe outputs (tests/data/gpu-check: real ones from the H200 machine, AMD ones
shaped as a ROCm torch prints them): PASS with the device and its compute capability or gfx arch,
FAIL with a fix for the platform's vendor only (an NVIDIA box never gets an AMD hint), what
HSA_OVERRIDE_GFX_VERSION does against the card's real arch, and the CPU platform running the
kernel on the CPU. Then where the probe runs: the engine environment's Python with the profile's
engine variables, or inside the running engine container.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.runtime.base import EngineState
from vllmstack.runtime.gpu_check import (
    PROBE,
    GpuCheckError,
    evaluate,
    gpu_check,
    override_arch,
    render_gpu_check,
)

DATA = Path(__file__).parent / "data" / "gpu-check"


def probe(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    return data


def test_an_nvidia_card_passes_with_its_compute_capability() -> None:
    check = evaluate(probe("nvidia-h200"), vendor="nvidia", where="native")
    assert check.passed
    text = render_gpu_check(check)
    assert text.splitlines()[0] == "PASS  gpu-check (native)"
    assert "torch 2.11.0+cu130 (CUDA 13.0)" in text
    # CUDA torch answers gcnArchName with the device name: that is not a gfx arch.
    assert "device 0: NVIDIA H200, compute capability 9.0, 139.8 GiB" in text
    assert "gfx" not in text and "HSA" not in text
    assert "a 256x256 matmul on cuda:0 matches float64 on the CPU" in text


def test_no_visible_gpu_fails_with_the_vendors_fix_only() -> None:
    nvidia = evaluate(probe("nvidia-h200-hidden"), vendor="nvidia")
    assert not nvidia.passed and "no GPU visible to torch" in nvidia.lines
    assert nvidia.fix is not None and "nvidia-smi" in nvidia.fix and "/dev/kfd" not in nvidia.fix
    assert render_gpu_check(nvidia).endswith(f"fix: {nvidia.fix}")
    amd = evaluate(probe("amd-no-gpu"), vendor="amd", gpu_arch="gfx1201")
    assert not amd.passed and "no GPU visible to torch" in amd.lines
    assert amd.fix is not None and "/dev/kfd" in amd.fix and "nvidia" not in amd.fix.lower()
    # A CPU build of torch on a GPU platform is named as such.
    cpu_torch = dict(probe("nvidia-h200-hidden"), cuda=None)
    assert evaluate(cpu_torch, vendor="nvidia").fix == (
        "this torch is a CPU (or ROCm) build; install the engine's CUDA torch")


def test_an_amd_card_passes_with_its_gfx_arch() -> None:
    check = evaluate(probe("amd-gfx1201"), vendor="amd", gpu_arch="gfx1201")
    assert check.passed
    assert "device 0: AMD Radeon AI PRO R9700, gfx arch gfx1201, 31.9 GiB" in check.lines
    assert "HSA_OVERRIDE_GFX_VERSION is not set: the card reports its own gfx arch (gfx1201)" in (
        check.lines)
    assert "torch 2.13.0+rocm10.1.0 (HIP 10.1.25432)" in check.lines
    # The wrong platform for the card is pointed out.
    wrong = evaluate(probe("amd-gfx1201"), vendor="amd", gpu_arch="gfx1100")
    assert wrong.passed and any("GPU_ARCH=gfx1100" in line for line in wrong.lines)


def test_the_hsa_override_is_reported_against_the_cards_real_arch() -> None:
    check = evaluate(probe("amd-gfx1102-override"), vendor="amd", gpu_arch="gfx1100")
    assert check.passed
    assert ("HSA_OVERRIDE_GFX_VERSION=11.0.0 is in effect: the gfx1102 card runs as gfx1100, so "
            "kernels built for gfx1100 run on it") in check.lines
    same = dict(probe("amd-gfx1201"), env={"HSA_OVERRIDE_GFX_VERSION": "12.0.1"})
    assert ("HSA_OVERRIDE_GFX_VERSION=12.0.1 names the card's own arch (gfx1201): it changes "
            "nothing") in evaluate(same, vendor="amd").lines
    ignored = dict(probe("amd-gfx1201"), env={"HSA_OVERRIDE_GFX_VERSION": "11.0.0"})
    assert ("HSA_OVERRIDE_GFX_VERSION=11.0.0 is set but not in effect: torch sees gfx1201, not "
            "gfx1100") in evaluate(ignored, vendor="amd").lines


def test_a_card_without_kernels_fails_and_names_the_override() -> None:
    check = evaluate(probe("amd-gfx1102-no-override"), vendor="amd", gpu_arch="gfx1100")
    assert not check.passed
    assert any(line.startswith("the matmul on cuda:0 failed: RuntimeError: HIP error: invalid "
                               "device function") for line in check.lines)
    assert check.fix is not None and "no kernels for gfx1102" in check.fix
    assert "HSA_OVERRIDE_GFX_VERSION" in check.fix and "11.0.0" in check.fix


def test_the_cpu_platform_runs_the_kernel_on_the_cpu() -> None:
    check = evaluate(probe("nvidia-h200-hidden"), vendor="none")
    assert check.passed
    assert "no GPU on this platform (cpu): the matmul ran on the CPU" in check.lines
    broken = evaluate({"env": {}, "error": "import torch: ModuleNotFoundError: No module named "
                       "'torch'"}, vendor="none")
    assert not broken.passed and broken.fix is not None and "install-engine" in broken.fix
    assert "torch does not load: import torch: ModuleNotFoundError" in broken.lines[0]


def test_override_versions_name_gfx_archs() -> None:
    assert override_arch("11.0.0") == "gfx1100"
    assert override_arch("12.0.1") == "gfx1201"
    assert override_arch("9.0.10") == "gfx90a"  # the stepping is hexadecimal
    assert override_arch("9.4.2") == "gfx942"
    assert override_arch("gfx1100") is None


# --- where it runs ---------------------------------------------------------------------------------

def engine_python(project: Project) -> Path:
    python = project.cache / "engines" / "vllm-0.32.0+cpu" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    return python


def test_native_runs_the_probe_in_the_engine_environment_with_the_profiles_variables(
        project: Project) -> None:
    python = engine_python(project)
    resolved = resolve(project, platform="rdna3", overrides=["HSA_OVERRIDE_GFX_VERSION=11.0.0",
                                                            "NATIVE_ENGINE_VERSION=0.32.0+cpu"],
                       environ={})
    runner = RecordingRunner()
    # torch prints warnings before the probe's line; only the JSON line counts.
    runner.respond([str(python), "-c", PROBE], Result((), 0, "UserWarning: something\n"
                   + json.dumps(probe("amd-gfx1102-override")) + "\n"))
    check = gpu_check(project, resolved, runner, runtime="native", environ={"PATH": "/usr/bin"})
    assert check.passed and check.where == f"native: {python}"
    assert runner.calls == [(str(python), "-c", PROBE)]
    env = runner.envs[0] or {}
    assert env["HSA_OVERRIDE_GFX_VERSION"] == "11.0.0" and env["HIP_VISIBLE_DEVICES"] == "0"
    assert env["PYTHONNOUSERSITE"] == "1" and env["PATH"] == "/usr/bin"


def test_native_without_an_engine_environment_says_how_to_get_one(project: Project) -> None:
    resolved = resolve(project, platform="cpu", environ={})
    with pytest.raises(GpuCheckError) as err:
        gpu_check(project, resolved, RecordingRunner(), runtime="native", environ={})
    assert "no engine environment for vLLM 0.32.0+cpu" in err.value.cause
    assert err.value.fix is not None and "invoke install-engine" in err.value.fix


def test_a_probe_that_crashes_is_an_error_with_its_output(project: Project) -> None:
    python = engine_python(project)
    resolved = resolve(project, platform="cpu", environ={})
    runner = RecordingRunner()
    runner.respond([str(python)], Result((), -11, "", "Segmentation fault (core dumped)"))
    with pytest.raises(GpuCheckError) as err:
        gpu_check(project, resolved, runner, runtime="native", environ={})
    assert "did not finish (exit -11): Segmentation fault" in err.value.cause


class FakeEngine:
    """The runtime seam as gpu-check uses it: state and exec."""

    def __init__(self, running: bool) -> None:
        self.running = running

    def state(self) -> EngineState:
        return EngineState(exists=self.running, running=self.running,
                           status="running" if self.running else "missing")

    def exec_command(self, command: Sequence[str], *, tty: bool) -> list[str]:
        assert not tty
        return ["docker", "exec", "-i", "engine", *command]


def test_compose_runs_the_probe_inside_the_running_engine(project: Project) -> None:
    resolved = resolve(project, platform="nvidia", environ={})
    with pytest.raises(GpuCheckError) as err:
        gpu_check(project, resolved, RecordingRunner(), runtime="compose", environ={},
                  engine=FakeEngine(running=False))  # type: ignore[arg-type]
    assert err.value.fix is not None and "invoke up" in err.value.fix
    runner = RecordingRunner()
    runner.respond(["docker", "exec"], Result((), 0, json.dumps(probe("nvidia-h200"))))
    check = gpu_check(project, resolved, runner, runtime="compose", environ={},
                      engine=FakeEngine(running=True))  # type: ignore[arg-type]
    assert check.passed and check.where == "compose: the engine container"
    assert runner.calls == [("docker", "exec", "-i", "engine", "python3", "-c", PROBE)]


# --- a llama.cpp profile: the devices its llama-server sees -------------------------------------

def test_a_llamacpp_profile_checks_the_devices_its_llama_server_sees(project: Project) -> None:
    listing = (DATA / "llamacpp-h200-list-devices.txt").read_text()
    resolved = resolve(project, platform="nvidia", overrides=["ENGINE=llamacpp"], environ={})
    binary = project.cache / "engines" / "llamacpp-9993-cuda" / "bin" / "llama-server"
    with pytest.raises(GpuCheckError) as err:
        gpu_check(project, resolved, RecordingRunner(), runtime="native", environ={})
    assert err.value.fix == "invoke install-engine --engine llamacpp --backend cuda"
    binary.parent.mkdir(parents=True)
    binary.touch()
    runner = RecordingRunner()
    runner.respond([str(binary), "--list-devices"], Result((), 0, listing))
    check = gpu_check(project, resolved, runner, runtime="native", environ={})
    assert check.passed and "device CUDA0: NVIDIA H200, 139.8 GiB" in check.lines
    assert (runner.envs[0] or {})["CUDA_VISIBLE_DEVICES"] == "0"  # the profile's engine variables
    runner.respond([str(binary), "--list-devices"], Result((), 0, "Available devices:\n"))
    cpu_build = gpu_check(project, resolved, runner, runtime="native", environ={})
    assert not cpu_build.passed and "llama-server sees no GPU device" in cpu_build.lines
    assert cpu_build.fix is not None and "--backend cuda --force" in cpu_build.fix
    compose = RecordingRunner()
    compose.respond(["docker", "exec"], Result((), 0, listing))
    inside = gpu_check(project, resolved, compose, runtime="compose", environ={},
                       engine=FakeEngine(running=True))  # type: ignore[arg-type]
    assert inside.passed and compose.calls == [("docker", "exec", "-i", "engine", "llama-server",
                                                "--list-devices")]
    cpu = resolve(project, platform="cpu", overrides=["ENGINE=llamacpp"], environ={})
    cpu_binary = project.cache / "engines" / "llamacpp-9993-cpu" / "bin" / "llama-server"
    cpu_binary.parent.mkdir(parents=True)
    cpu_binary.touch()
    runner.respond([str(cpu_binary), "--list-devices"], Result((), 0, "Available devices:\n"))
    assert gpu_check(project, cpu, runner, runtime="native", environ={}).passed


def test_a_llamacpp_server_set_in_the_profile_is_the_one_checked(project: Project, tmp_path: Path) -> None:
    # LLAMACPP_SERVER overrides the install-engine build for `up`; gpu-check must ask the same one.
    own = tmp_path / "my build" / "llama-server"
    own.parent.mkdir()
    own.touch()
    listing = (DATA / "llamacpp-h200-list-devices.txt").read_text()
    resolved = resolve(project, platform="nvidia", environ={},
                       overrides=["ENGINE=llamacpp", f"LLAMACPP_SERVER='{own}'"])
    runner = RecordingRunner()
    runner.respond([str(own), "--list-devices"], Result((), 0, listing))
    check = gpu_check(project, resolved, runner, runtime="native", environ={})
    assert check.passed and runner.calls == [(str(own), "--list-devices")]

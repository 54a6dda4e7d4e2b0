"""Source patches and runtime overlays: where they are, what they are locked to, whether they hold.

Layout (one folder per upstream repository):
  patches/<component>/NNNN-topic.patch   applied at build time, in NNNN order
  patches/<component>/overlays.toml      manifest of runtime overlays (whole files)
  patches/<component>/overlays/...       the overlay files themselves

`verify_patches` keeps a bare mirror of each upstream repository under
.cache/mirrors (vllmstack.image.sources) and asks scripts/apply-patches.py (the
same script the image build runs) for the status of every patch at the pinned
ref, on a scratch index: no checkout, so a warm run takes seconds even for vLLM.

What a patch folder holds (its patches, in order, and anything that does not belong there) is
decided by one function, `discover` in scripts/apply-patches.py; this module imports it from
that file, so the build, the verification and the patch-set label can never disagree. The
script stays standard-library only, for bare build images.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.image import llamacpp_source
from vllmstack.image.sources import GitTool, SourceError, archive_repo, is_sdist, is_url, local_repo

# Patch folder name -> the settings that name its repository and ref.
COMPONENTS: dict[str, tuple[str, str]] = {
    "vllm": ("VLLM_REPO", "VLLM_REF"),
    "aiter": ("AITER_REPO", "AITER_REF"),
    "flash-attention": ("FLASH_ATTN_REPO", "FLASH_ATTN_REF"),
}
# Patch folders of another engine's source (verified when the folder is there; not part of the
# vLLM image). With no repository set, llama.cpp's is the pinned sdist's tree (llamacpp_source).
ENGINE_SOURCES: dict[str, tuple[str, str]] = {"llamacpp": ("LLAMACPP_REPO", "LLAMACPP_REF")}
# The patch script of this checkout (the one the image build copies).
PATCH_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "apply-patches.py"
MANIFEST = "overlays.toml"
OVERLAY_FIELDS = {"name", "file", "target", "ref", "base_sha256", "why", "upstream"}
OVERLAY_REQUIRED = ("name", "file", "target", "ref", "base_sha256")
SHA256 = re.compile(r"^[0-9a-f]{64}$")

# Statuses. Patches: applies / needs-earlier / upstream / fails. Overlays: ok / drifted /
# conflicts (a build-time patch edits the file the overlay replaces, so the overlay would hide it).
PATCH_BLOCKING = ("fails", "upstream")
OVERLAY_BLOCKING = ("drifted", "conflicts")


class PatchError(StackError, ValueError):
    """Bad input for verification (a flag, a manifest, a patch folder the patch script refuses):
    the message has the fix. An unreachable repository or ref is a sources.SourceError."""


# --- overlays -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Overlay:
    name: str
    file: Path          # our file, mounted read-only over the installed one
    target: str         # path inside the upstream source tree, e.g. vllm/entrypoints/...
    ref: str            # the upstream ref the file was derived from
    base_sha256: str    # sha256 of the upstream file at `ref` that `file` was derived from
    why: str = ""
    upstream: str = ""
    component: str = "vllm"
    line: int = 0       # where its entry starts in the manifest

    def lock(self) -> dict[str, str]:
        return {"target": self.target, "ref": self.ref, "base_sha256": self.base_sha256}


def load_overlays(project: Project, component: str = "vllm") -> list[Overlay]:
    """The overlays of patches/<component>/overlays.toml; a malformed manifest raises PatchError."""
    folder = project.patches / component
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return []
    display = _display(project, manifest)
    text = manifest.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PatchError(f"{display}: {exc} (fix the TOML syntax)") from exc
    unknown_tables = sorted(set(data) - {"overlay"})
    if unknown_tables:
        raise PatchError(f"{display}: unknown section(s) {unknown_tables}; each overlay is an "
                         "[[overlay]] table")
    entries = data.get("overlay", [])
    if not isinstance(entries, list):
        raise PatchError(f"{display}: write each overlay as an [[overlay]] table")
    starts = [i for i, raw in enumerate(text.splitlines(), 1) if raw.strip() == "[[overlay]]"]
    overlays: list[Overlay] = []
    for number, entry in enumerate(entries):
        line = starts[number] if number < len(starts) else 0
        overlays.append(_overlay_entry(folder, display, line, entry, component))
    _reject_duplicates(display, overlays)
    return overlays


def _overlay_entry(folder: Path, display: str, line: int, entry: Any, component: str) -> Overlay:
    where = f"{display}:{line}"
    unknown = sorted(set(entry) - OVERLAY_FIELDS)
    if unknown:
        raise PatchError(f"{where}: unknown field(s) {unknown}; known: {sorted(OVERLAY_FIELDS)}")
    for key in OVERLAY_REQUIRED:
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise PatchError(f"{where}: overlay lacks {key} (a non-empty string); every "
                             f"overlay needs {', '.join(OVERLAY_REQUIRED)}")
    name = entry["name"]
    if not SHA256.match(entry["base_sha256"]):
        raise PatchError(f"{where}: overlay {name!r}: base_sha256 must be 64 lowercase hex "
                         "digits (sha256sum of the upstream file at ref)")
    target = entry["target"]
    if target.startswith("/") or ".." in Path(target).parts:
        raise PatchError(f"{where}: overlay {name!r}: target must be a path inside the "
                         f"{component} source tree, like vllm/entrypoints/openai/.../protocol.py")
    if component == "vllm" and not target.startswith("vllm/"):
        raise PatchError(f"{where}: overlay {name!r}: target {target!r} is not inside the vllm "
                         "package (it must start with vllm/), so it cannot be mounted over it")
    file = (folder / entry["file"]).resolve()
    if folder.resolve() not in file.parents or not file.is_file():
        raise PatchError(f"{where}: overlay {name!r}: file {entry['file']!r} does not exist "
                         f"under {folder.name}/ (paths are relative to the manifest's folder)")
    return Overlay(name=name, file=file, target=target, ref=entry["ref"],
                   base_sha256=entry["base_sha256"], why=str(entry.get("why", "")),
                   upstream=str(entry.get("upstream", "")), component=component, line=line)


def _reject_duplicates(display: str, overlays: list[Overlay]) -> None:
    for attr in ("name", "target"):
        seen: dict[str, int] = {}
        for overlay in overlays:
            value = getattr(overlay, attr)
            if value in seen:
                raise PatchError(f"{display}:{overlay.line}: {attr} {value!r} is already used by "
                                 f"the overlay at line {seen[value]}; each overlay needs its own")
            seen[value] = overlay.line


def overlay_lock(overlays: Sequence[Overlay]) -> str:
    """One hash of every overlay's target, ref and base hash (what an image label records)."""
    entries = {o.name: o.lock() for o in sorted(overlays, key=lambda o: o.name)}
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


# --- patch folders ---------------------------------------------------------------------------

@functools.cache
def _patch_script(path: Path) -> ModuleType:
    """scripts/apply-patches.py as a module (it is a script, not part of the package)."""
    name = "_vllmstack_apply_patches_" + hashlib.sha256(str(path).encode()).hexdigest()[:8]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise PatchError(f"the patch script {path} is missing",
                         "restore scripts/apply-patches.py (git checkout -- scripts)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def discover(folder: Path, script: Path | None = None) -> tuple[list[Path], list[str]]:
    """(the patches the build applies from `folder`, in order; the entries that are neither a
    patch nor allowed beside one), by the patch script's own `discover`. A missing folder, or
    one that is a file, raises PatchError."""
    module = _patch_script(script or PATCH_SCRIPT)
    try:
        patches, strays = module.discover(folder)
    except module.PatchToolError as exc:
        raise PatchError(str(exc)) from exc
    return [Path(p) for p in patches], [str(s) for s in strays]


def patch_files(folder: Path) -> list[Path]:
    """The files the build applies, in order (what the patch-set hash covers)."""
    return discover(folder)[0]


def patch_set_hash(folder: Path) -> str:
    """sha256 over the ordered patch names and contents: changes when any patch changes."""
    digest = hashlib.sha256()
    for path in patch_files(folder):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def component_folders(project: Project) -> list[str]:
    """Patch folders present under patches/, known components first in a fixed order."""
    if not project.patches.is_dir():
        return []
    present = sorted(p.name for p in project.patches.iterdir() if p.is_dir())
    return [c for c in COMPONENTS if c in present] + [c for c in present if c not in COMPONENTS]


# --- verification -------------------------------------------------------------------------------

@dataclass
class Status:
    name: str
    status: str
    detail: str = ""

    def as_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


@dataclass
class ComponentReport:
    name: str
    repo: str
    ref: str
    folder: Path
    commit: str = ""
    patches: list[Status] = field(default_factory=list)
    overlays: list[Status] = field(default_factory=list)
    # sha256 of each overlay target at the verified commit (what a build from it contains).
    upstream_hashes: dict[str, str | None] = field(default_factory=dict)
    error: str = ""
    fix: str = ""
    note: str = ""

    def fail(self, exc: StackError) -> ComponentReport:
        self.error, self.fix = str(exc), exc.fix or ""
        return self

    @property
    def failed(self) -> bool:
        return bool(self.error) or any(p.status in PATCH_BLOCKING for p in self.patches) or any(
            o.status in OVERLAY_BLOCKING for o in self.overlays)

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "repo": self.repo, "ref": self.ref, "commit": self.commit,
            "patches": [p.as_json() for p in self.patches],
            "overlays": [o.as_json() for o in self.overlays],
        }
        if self.error:
            data["error"] = self.error
        if self.fix:
            data["fix"] = self.fix
        if self.note:
            data["note"] = self.note
        return data


@dataclass
class VerifyReport:
    components: list[ComponentReport]

    @property
    def failed(self) -> bool:
        return any(c.failed for c in self.components)

    def get(self, name: str) -> ComponentReport | None:
        return next((c for c in self.components if c.name == name), None)

    def as_json(self) -> dict[str, Any]:
        return {c.name: c.as_json() for c in self.components}


def parse_component_pairs(pairs: Sequence[str], flag: str) -> dict[str, str]:
    """`--ref vllm=v0.32.0` style flags -> {"vllm": "v0.32.0"}; unknown names are errors."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not value:
            raise PatchError(f"{flag} {pair!r}: write {flag} NAME=VALUE, e.g. {flag} vllm=...")
        if name not in COMPONENTS and name not in ENGINE_SOURCES:
            raise PatchError(f"{flag} {pair!r}: unknown component {name!r}; "
                             f"known: {', '.join([*COMPONENTS, *ENGINE_SOURCES])}")
        out[name] = value
    return out


def verify_patches(
    project: Project,
    resolved: Resolved,
    runner: Runner,
    *,
    environ: Mapping[str, str],
    refs: Mapping[str, str] | None = None,
    repos: Mapping[str, str] | None = None,
    patch_dirs: Mapping[str, str] | None = None,
    tool: Path | None = None,
) -> VerifyReport:
    """Status of every patch and overlay of every patch folder, at the pinned (or given) refs.

    Never "clean" about patches it did not check: a known component's missing folder, a folder
    named with --patches that holds no patch, and anything in a folder that is not a patch the
    build applies are errors of that component."""
    refs, repos, patch_dirs = refs or {}, repos or {}, patch_dirs or {}
    tool = tool or project.root / "scripts" / "apply-patches.py"
    git = GitTool(runner, project.cache, environ)
    # Every known component: the image build copies each one's folder (Dockerfile.fullbuild).
    names = list(COMPONENTS) + [n for n in component_folders(project) if n not in COMPONENTS]
    reports = [r for r in [_stray_files(project)] if r is not None]
    for name in names:
        folder = Path(patch_dirs[name]) if name in patch_dirs else project.patches / name
        if not folder.is_absolute():
            folder = project.root / folder
        reports.append(_verify_component(project, resolved, git, tool, name, folder,
                                         refs.get(name), repos.get(name),
                                         named=name in patch_dirs))
    return VerifyReport(reports)


def verify_component(project: Project, resolved: Resolved, runner: Runner, name: str, *,
                     environ: Mapping[str, str], ref: str, repo: str | None = None,
                     patch_dir: str | None = None, tool: Path | None = None) -> ComponentReport:
    """One component's patches and overlays at `ref` (what `invoke update-check` asks of the
    newest upstream release): the same verification as verify_patches, for one folder."""
    git = GitTool(runner, project.cache, environ)
    folder = Path(patch_dir) if patch_dir else project.patches / name
    if not folder.is_absolute():
        folder = project.root / folder
    mine = project.root / "scripts" / "apply-patches.py"
    return _verify_component(project, resolved, git, tool or (mine if mine.is_file() else PATCH_SCRIPT),
                             name, folder, ref, repo, named=patch_dir is not None)


def _stray_files(project: Project) -> ComponentReport | None:
    """Files directly under patches/ (a patch dropped one folder too high is never applied)."""
    if not project.patches.is_dir():
        return None  # each component's missing folder is its own error
    strays = sorted(p.name for p in project.patches.iterdir()
                    if not p.is_dir() and not p.name.endswith(".md"))
    if not strays:
        return None
    return ComponentReport("patches", "", "", project.patches, error=(
        f"patches/{', patches/'.join(strays)}: not inside a component folder, so no build "
        "applies it"), fix=f"move it into patches/<component>/ ({', '.join(COMPONENTS)})")


def _verify_component(project: Project, resolved: Resolved, git: GitTool, tool: Path, name: str,
                      folder: Path, ref: str | None, repo: str | None, *,
                      named: bool = False) -> ComponentReport:
    keys = COMPONENTS.get(name) or ENGINE_SOURCES.get(name)
    if keys is None:
        return ComponentReport(name, "", "", folder, error=(
            f"unknown patch folder patches/{name}: known components are "
            f"{', '.join([*COMPONENTS, *ENGINE_SOURCES])}"), fix="rename the folder, or move its "
            "patches into one")
    repo = repo or resolved.get_raw(keys[0])
    ref = ref or (resolved.get_str(keys[1]) if name in ENGINE_SOURCES else resolved.get_raw(keys[1]))
    report = ComponentReport(name, repo, ref, folder)
    display = _display(project, folder)
    try:
        patches, strays = discover(folder, tool)
        overlays = load_overlays(project, name) if folder == project.patches / name else []
    except PatchError as exc:
        if folder.exists():
            return report.fail(exc)
        return report.fail(PatchError(f"the patch folder {display} does not exist", (
            f"fix the path given to --patches {name}=" if named else
            f"restore it (git checkout -- {display}); the image build copies it")))
    if strays:
        return report.fail(PatchError(
            f"{display}: {', '.join(strays)}: not a patch the build applies",
            "name patches NNNN-topic.patch (NNNN sets the order; notes may be *.md), or move "
            "the rest out of the folder"))
    if not patches and not overlays:
        if named:
            return report.fail(PatchError(
                f"--patches {name}={folder}: the folder holds no NNNN-topic.patch file, so there "
                "is nothing to verify", "point --patches at the folder that holds the patches"))
        report.note = f"{display} holds no patches (notes only): nothing to verify"
        return report  # no need to mirror the repository
    if (not repo and name not in ENGINE_SOURCES) or not ref:
        report.error = (f"{keys[0]} and {keys[1]} must be set to verify {display} "
                        f"(in .env, or --repo/--ref {name}=...)")
        return report
    try:
        if name in ENGINE_SOURCES and repo == "":  # the pinned sdist's tree (llama.cpp), tagged <ref>
            repo = report.repo = str(llamacpp_source.source_repo(project, git.runner, ref,
                                                                 environ=git.environ))
        mirror = _mirror(project, git, name, repo)
        report.commit, report.note = git.resolve(mirror, repo, ref)
        data = run_patch_tool(git, tool, mirror, report.commit, folder,
                              [o.target for o in overlays])
    except (SourceError, PatchError) as exc:
        return report.fail(exc)
    touched: dict[str, list[str]] = {}
    for entry in data.get("patches", []):
        report.patches.append(Status(entry["name"], entry["status"], entry.get("detail", "")))
        for path in entry.get("files", []):
            touched.setdefault(path, []).append(entry["name"])
    report.upstream_hashes = dict(data.get("hashes", {}))
    report.overlays = [_overlay_status(o, ref, report.upstream_hashes.get(o.target), touched)
                       for o in overlays]
    return report


def _mirror(project: Project, git: GitTool, name: str, repo: str) -> Path:
    """The bare mirror of `repo`: a URL, a local repository, or an sdist made into one."""
    if is_url(repo):
        try:
            return git.ensure_mirror(repo)
        except SourceError as exc:
            sdist = "; for vLLM its sdist works too: --repo vllm=vllm-<VLLM_VERSION>.tar.gz " \
                "(from https://pypi.org/project/vllm/#files)" if name == "vllm" else ""
            raise SourceError(exc.cause, f"{exc.fix}. Offline, point --repo {name}=PATH at a local "
                              f"clone or bare mirror of it{sdist}") from exc
    path = local_repo(project, repo)
    if is_sdist(path):
        path = archive_repo(project.cache, git.runner, path, environ=git.environ)
    return git.ensure_mirror(str(path))


def run_patch_tool(git: GitTool, tool: Path, mirror: Path, commit: str, folder: Path,
                   hash_paths: Sequence[str]) -> dict[str, Any]:
    """`apply-patches.py verify` on the mirror at `commit`: every patch's status, and the
    sha256 of each of `hash_paths` at that commit. The tool's refusal is a PatchError."""
    argv = [sys.executable, str(tool), "verify", "--git-dir", str(mirror), "--ref", commit,
            "--patches", str(folder), "--json"]
    for path in hash_paths:
        argv += ["--hash", path]
    result = git.runner.run(argv, env=git.env, mutates=False)
    try:
        data: dict[str, Any] = json.loads(result.stdout)
    except json.JSONDecodeError as exc:
        message = (result.stderr or result.stdout).strip().removeprefix("apply-patches: ")
        raise PatchError(message or f"{tool.name} printed no report") from exc
    return data


def _overlay_status(overlay: Overlay, ref: str, current: str | None,
                    touched: Mapping[str, list[str]]) -> Status:
    if current is None:
        return Status(overlay.name, "drifted",
                      f"{overlay.target} does not exist at {ref}: the overlay would add a file "
                      "upstream removed or moved; re-derive it or drop it")
    if current != overlay.base_sha256:
        return Status(overlay.name, "drifted",
                      f"{overlay.target} changed upstream between {overlay.ref} and {ref} "
                      f"(sha256 {current[:12]}, manifest {overlay.base_sha256[:12]}): re-derive "
                      f"the overlay from the file at {ref}, then update ref and base_sha256")
    if overlay.target in touched:
        return Status(overlay.name, "conflicts",
                      f"{', '.join(touched[overlay.target])} patches {overlay.target} at build "
                      "time; the overlay replaces that file at run time and would hide the patch")
    detail = "" if overlay.ref == ref else (
        f"upstream file unchanged since {overlay.ref}; set ref = \"{ref}\" in the manifest")
    return Status(overlay.name, "ok", detail)


def render_report(report: VerifyReport) -> str:
    lines: list[str] = []
    for comp in report.components:
        where = f"{comp.repo} @ {comp.ref}" if comp.repo else "(no repository)"
        if comp.commit:
            where += f" ({comp.commit[:12]})"
        lines.append(f"{comp.name}: {where}")
        if comp.error:
            lines.append(f"  ERROR {comp.error}")
            if comp.fix:
                lines.append(f"  fix:  {comp.fix}")
            continue
        if comp.note:
            lines.append(f"  note: {comp.note}")
        for item, kind in [(p, "patch") for p in comp.patches] + [
                (o, "overlay") for o in comp.overlays]:
            text = f"  {item.status:13} {kind:7} {item.name}"
            lines.append(text + (f"\n{'':24}{item.detail}" if item.detail else ""))
    patches = sum(len(c.patches) for c in report.components)
    overlays = sum(len(c.overlays) for c in report.components)
    if report.failed:
        verdict = "FAILED: the build would stop (see above)"
    elif patches or overlays:
        verdict = f"all clean: {patches} patch(es) and {overlays} overlay(s) checked"
    else:
        verdict = "nothing to verify: no patch folder holds a patch or an overlay"
    lines.append(verdict)
    return "\n".join(lines)


def _display(project: Project, path: Path) -> str:
    try:
        return str(path.relative_to(project.root))
    except ValueError:
        return str(path)

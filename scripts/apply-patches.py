#!/usr/bin/env python3
"""Check and apply a folder of source patches in a defined order; the one patch tool.

Used by Dockerfile.fullbuild (mode `apply`, on the fetched work tree) and by
`invoke verify-patches` (mode `verify`, on a bare mirror at a ref, without a
checkout). Both modes run the same checks, so a patch set that verifies clean
on the host applies the same way in the image build.

  apply-patches.py apply  --source DIR --patches DIR
  apply-patches.py verify --git-dir DIR --ref REF --patches DIR [--hash PATH ...] [--json]

Order: patches are named NNNN-topic.patch and applied by the number NNNN.
Every patch starts with a header (Subject, Why, Upstream, Made-for, Drop-when)
before its diff. `apply` checks the whole set on a scratch index first and
stops at the first patch that does not apply, naming it and its hunk; nothing
is applied to the tree unless every patch applies. It never skips a patch.

Standard library only: it runs in bare build images (Python 3.9+ and git).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

NAME = re.compile(r"^(\d+)-[A-Za-z0-9][A-Za-z0-9._+-]*\.patch$")
HEADER_FIELDS = ("Subject", "Why", "Upstream", "Made-for", "Drop-when")
# What a patch folder may hold besides patches: notes, the runtime-overlay manifest and the
# folder of overlay files (overlays are mounted at run time, never applied by the build).
ALLOWED_FILES = re.compile(r"^(README.*|.*\.md|overlays\.toml)$")
ALLOWED_DIRS = ("overlays",)
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@(.*)$")
# What git says when a hunk's context is not found: "error: patch failed: PATH:LINE".
HUNK_FAILED = re.compile(r"patch failed: (.+):(\d+)$")

APPLIES = "applies"
NEEDS_EARLIER = "needs-earlier"
UPSTREAM = "upstream"
FAILS = "fails"


class PatchToolError(Exception):
    """A problem with the inputs (not with a patch): the message says what to fix."""


@dataclass
class Hunk:
    old_start: int
    old_len: int
    header: str


@dataclass
class FileDiff:
    path: str
    hunks: list[Hunk] = field(default_factory=list)


@dataclass
class Patch:
    path: Path
    number: int
    header: dict[str, str]
    files: list[FileDiff]
    problem: str = ""

    @property
    def name(self) -> str:
        return self.path.name

    def touched(self) -> set[str]:
        return {f.path for f in self.files}


@dataclass
class Outcome:
    name: str
    status: str
    detail: str
    files: list[str]
    header: dict[str, str]

    def as_json(self) -> dict[str, object]:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                "files": self.files, "header": self.header}


# --- reading a patch folder ----------------------------------------------------------

def discover(folder: Path) -> tuple[list[Path], list[str]]:
    """The patches of `folder` in application order, and every entry that is neither a patch
    nor allowed beside one (its strays; a folder's name ends in /).

    The one definition of what a patch folder holds: the image build runs it here, and
    `invoke verify-patches` and the image's patch-set label import it from this file.
    """
    if not folder.is_dir():
        raise PatchToolError(f"{folder} is not a folder" if folder.exists() else
                             f"the patch folder {folder} does not exist")
    patches: list[Path] = []
    strays: list[str] = []
    for entry in sorted(folder.iterdir()):
        if entry.is_dir():
            if entry.name not in ALLOWED_DIRS:
                strays.append(entry.name + "/")
        elif ALLOWED_FILES.match(entry.name):
            continue
        elif entry.is_file() and NAME.match(entry.name):
            patches.append(entry)
        else:
            strays.append(entry.name)
    patches.sort(key=lambda p: (int(p.name.split("-", 1)[0]), p.name))
    return patches, strays


def load_patch_set(folder: Path) -> list[Patch]:
    """Patches of a folder in application order; naming or header problems are kept per patch."""
    paths, strays = discover(folder)
    if strays:
        # Something the build would not apply must not sit there looking applied.
        raise PatchToolError(
            f"{folder}: {', '.join(strays)}: not a patch the build applies; name patches "
            "NNNN-topic.patch (NNNN sets the order; notes may be *.md), or move it out"
        )
    patches = [read_patch(path, int(path.name.split("-", 1)[0])) for path in paths]
    by_number: dict[int, str] = {}
    for patch in patches:
        if patch.number in by_number:
            patch.problem = (
                f"has the same number as {by_number[patch.number]}, so their order is "
                "undefined; renumber one of them"
            )
        by_number.setdefault(patch.number, patch.name)
    return patches


def read_patch(path: Path, number: int) -> Patch:
    text = path.read_text(encoding="utf-8", errors="replace")
    header, problem = parse_header(text)
    files = parse_diff(text)
    if not problem and not files:
        problem = "contains no diff (expected `diff --git a/... b/...` sections)"
    return Patch(path, number, header, files, problem)


def parse_header(text: str) -> tuple[dict[str, str], str]:
    """The `Key: value` lines before the first diff; continuation lines start with a space."""
    header: dict[str, str] = {}
    last = ""
    for line in text.splitlines():
        if line.startswith(("diff --git ", "--- ", "Index: ")):
            break
        if line[:1] in (" ", "\t") and last:
            header[last] = f"{header[last]} {line.strip()}".strip()
            continue
        key, sep, value = line.partition(":")
        if sep and re.fullmatch(r"[A-Za-z][A-Za-z-]*", key):
            last = key
            header[key] = value.strip()
        else:
            last = ""
    missing = [k for k in HEADER_FIELDS if not header.get(k)]
    if missing:
        return header, (
            f"header lacks {', '.join(missing)}; every patch starts with "
            + ", ".join(f"{k}:" for k in HEADER_FIELDS) + " lines before its diff"
        )
    return header, ""


def parse_diff(text: str) -> list[FileDiff]:
    files: list[FileDiff] = []
    current: FileDiff | None = None
    old_path = ""
    for line in text.splitlines():
        if line.startswith("diff --git "):
            current = None
            continue
        if line.startswith("--- "):
            old_path = _strip_prefix(line[4:])
            continue
        if line.startswith("+++ "):
            new_path = _strip_prefix(line[4:])
            current = FileDiff(new_path if new_path != "/dev/null" else old_path)
            files.append(current)
            continue
        hunk = HUNK.match(line)
        if hunk and current is not None:
            length = int(hunk.group(2)) if hunk.group(2) is not None else 1
            current.hunks.append(Hunk(int(hunk.group(1)), length, hunk.group(3).strip()))
    return files


def _strip_prefix(raw: str) -> str:
    path = raw.split("\t")[0].strip()
    if path.startswith(("a/", "b/")):
        return path[2:]
    return path


# --- git on a scratch index ---------------------------------------------------------------

class Scratch:
    """Index files and an object store in a temp folder, so checks never touch the repository.

    `git apply --cached` works against an index instead of a work tree, which is
    what lets `verify` run on a bare mirror; new blobs go to the temp object
    store (the mirror's objects are read as an alternate).
    """

    def __init__(self, git_dir: Path) -> None:
        self.git_dir = git_dir.resolve()
        found = subprocess.run(
            ["git", "-c", "safe.directory=*", f"--git-dir={self.git_dir}", "rev-parse",
             "--git-path", "objects"],
            capture_output=True, check=False,
        )
        if found.returncode:
            raise PatchToolError(f"{git_dir} is not a git repository: {_text(found.stderr)}")
        objects = (self.git_dir / _text(found.stdout)).resolve()
        self.tmp = Path(tempfile.mkdtemp(prefix="apply-patches-"))
        (self.tmp / "objects").mkdir()
        self.env = {
            **os.environ,
            "GIT_OBJECT_DIRECTORY": str(self.tmp / "objects"),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(objects),
            "GIT_TERMINAL_PROMPT": "0",
            "LC_ALL": "C",
        }

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def git(self, args: list[str], index: str | None = None,
            stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        env = dict(self.env)
        if index is not None:
            env["GIT_INDEX_FILE"] = str(self.tmp / index)
        argv = ["git", "-c", "safe.directory=*", f"--git-dir={self.git_dir}", *args]
        return subprocess.run(argv, env=env, input=stdin, capture_output=True, check=False)

    def load(self, index: str, commit: str) -> None:
        """Set the scratch index `index` to the tree of `commit`."""
        done = self.git(["read-tree", commit], index=index)
        if done.returncode:
            raise PatchToolError(f"cannot read the tree of {commit}: {_text(done.stderr)}")

    def check(self, index: str, patch: Path, reverse: bool = False) -> tuple[bool, str]:
        args = ["apply", "--cached", "--check", "--whitespace=nowarn"]
        if reverse:
            args.append("--reverse")
        done = self.git([*args, str(patch)], index=index)
        return done.returncode == 0, _text(done.stderr)

    def apply(self, index: str, patch: Path) -> tuple[bool, str]:
        done = self.git(["apply", "--cached", "--whitespace=nowarn", str(patch)], index=index)
        return done.returncode == 0, _text(done.stderr)

    def resolve(self, ref: str) -> str:
        done = self.git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"])
        sha = _text(done.stdout).strip()
        if done.returncode or not sha:
            raise PatchToolError(f"ref {ref!r} is not in {self.git_dir}")
        return sha

    def blob_sha256(self, commit: str, path: str) -> str | None:
        done = self.git(["cat-file", "blob", f"{commit}:{path}"])
        if done.returncode:
            return None
        return hashlib.sha256(done.stdout).hexdigest()


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").strip()


def explain_failure(patch: Patch, git_error: str) -> str:
    """Turn git's message into `PATH hunk K/N (@@ -L,n @@ context)`, the hunk that did not match."""
    for line in git_error.splitlines():
        line = line.removeprefix("error: ").strip()
        match = HUNK_FAILED.search(line)
        if match:
            path, start = match.group(1), int(match.group(2))
            for diff in patch.files:
                if diff.path != path:
                    continue
                for number, hunk in enumerate(diff.hunks, start=1):
                    if hunk.old_start == start:
                        where = f" {hunk.header}" if hunk.header else ""
                        return (f"{path} hunk {number}/{len(diff.hunks)} "
                                f"(@@ -{hunk.old_start},{hunk.old_len} @@{where}) does not match")
            return f"{path}: the hunk at line {start} does not match"
    for line in git_error.splitlines():
        line = line.removeprefix("error: ").strip()
        if "does not exist in index" in line:
            return f"{line.split(':')[0]} does not exist at this ref (renamed or removed upstream?)"
        if "already exists in index" in line:
            return f"{line.split(':')[0]} already exists at this ref"
    lines = [ln.removeprefix("error: ") for ln in git_error.splitlines() if ln.strip()]
    return lines[-1] if lines else "git apply failed without a message"


# --- the two modes ----------------------------------------------------------------------

def classify(scratch: Scratch, commit: str, patches: list[Patch]) -> list[Outcome]:
    """Every patch's status at `commit`, applying the set in order on a scratch index."""
    scratch.load("base", commit)
    scratch.load("seq", commit)
    applied: list[Patch] = []
    outcomes: list[Outcome] = []
    for patch in patches:
        outcome = Outcome(patch.name, FAILS, "", sorted(patch.touched()), patch.header)
        outcomes.append(outcome)
        if patch.problem:
            outcome.detail = patch.problem
            continue
        ok, error = scratch.check("seq", patch.path)
        if ok:
            scratch.apply("seq", patch.path)
            outcome.status, outcome.detail = APPLIES, ""
            earlier = [p for p in applied if p.touched() & patch.touched()]
            if earlier and not scratch.check("base", patch.path)[0]:
                outcome.status = NEEDS_EARLIER
                outcome.detail = _needed_earlier(scratch, commit, patch, earlier)
            applied.append(patch)
            continue
        if scratch.check("seq", patch.path, reverse=True)[0]:
            outcome.status = UPSTREAM
            outcome.detail = "the ref already contains this change (it reverse-applies): drop it"
            continue
        outcome.detail = explain_failure(patch, error)
        overlapping = [p.name for p in applied if p.touched() & patch.touched()]
        if overlapping and scratch.check("base", patch.path)[0]:
            outcome.detail += (
                f"; it applies to the bare ref, so an earlier patch changed its context: "
                f"{', '.join(overlapping)}"
            )
    # A failing patch that fits after the whole set sits before a patch it depends on.
    for index, patch in enumerate(patches):
        outcome = outcomes[index]
        if outcome.status == FAILS and not patch.problem and scratch.check("seq", patch.path)[0]:
            later = [p.name for p in patches[index + 1:] if p.touched() & patch.touched()]
            if later:
                outcome.detail += (f"; it applies after {', '.join(later)}: "
                                   "renumber it to come after them")
    return outcomes


def _needed_earlier(scratch: Scratch, commit: str, patch: Patch, earlier: list[Patch]) -> str:
    needed = []
    for candidate in earlier:
        scratch.load("pair", commit)
        scratch.apply("pair", candidate.path)
        if scratch.check("pair", patch.path)[0]:
            needed.append(candidate.name)
    if needed:
        return (f"applies only after {' or '.join(needed)}; keep it numbered after "
                "that patch, and rebase it when that patch is dropped")
    names = ", ".join(p.name for p in earlier)
    return f"applies only after the earlier patches together: {names}"


def run_verify(args: argparse.Namespace) -> int:
    git_dir = Path(args.git_dir)
    scratch = Scratch(git_dir)
    try:
        commit = scratch.resolve(args.ref)
        patches = load_patch_set(Path(args.patches))
        outcomes = classify(scratch, commit, patches)
        hashes = {path: scratch.blob_sha256(commit, path) for path in args.hash or []}
    finally:
        scratch.close()
    bad = [o for o in outcomes if o.status in (FAILS, UPSTREAM)]
    if args.json:
        print(json.dumps({"ref": args.ref, "commit": commit,
                          "patches": [o.as_json() for o in outcomes], "hashes": hashes},
                         indent=2))
    else:
        print(f"{args.patches} against {args.ref} ({commit[:12]}): {len(outcomes)} patches")
        for o in outcomes:
            print(f"  {o.status:13} {o.name}" + (f": {o.detail}" if o.detail else ""))
        for path, digest in hashes.items():
            print(f"  sha256 {digest or '(absent)'}  {path}")
    return 1 if bad else 0


def run_apply(args: argparse.Namespace) -> int:
    source = Path(args.source)
    patches = load_patch_set(Path(args.patches))
    print(f"apply-patches: {len(patches)} patches from {args.patches} onto {source}")
    if not patches:
        return 0
    git_dir = _git_dir(source)
    scratch = Scratch(git_dir)
    try:
        commit = scratch.resolve("HEAD")
        # Check the whole set first, in order, so a failure leaves the tree untouched.
        scratch.load("seq", commit)
        for number, patch in enumerate(patches, start=1):
            if patch.problem:
                return _stop(patch, patch.problem, number)
            ok, error = scratch.check("seq", patch.path)
            if not ok:
                if scratch.check("seq", patch.path, reverse=True)[0]:
                    why = "the source already contains this change (it reverse-applies): drop it"
                else:
                    why = explain_failure(patch, error)
                return _stop(patch, why, number)
            scratch.apply("seq", patch.path)
            print(f"  checked  {patch.name}")
    finally:
        scratch.close()
    for patch in patches:
        done = subprocess.run(
            ["git", "-c", "safe.directory=*", "-C", str(source), "apply", "--whitespace=nowarn",
             str(patch.path)],
            capture_output=True, check=False,
        )
        if done.returncode:
            # The scratch check passed, so this means the work tree differs from HEAD.
            return _stop(patch, f"{explain_failure(patch, _text(done.stderr))} in the work tree "
                                "(it has local changes?)", patches.index(patch) + 1)
        print(f"  applied  {patch.name}")
    print(f"apply-patches: all {len(patches)} patches applied")
    return 0


def _stop(patch: Patch, why: str, number: int) -> int:
    sys.stdout.flush()
    print(f"  FAILED   {patch.name}: {why}", file=sys.stderr)
    print(f"apply-patches: stopped at patch {number} ({patch.name}); nothing was applied. "
          "Rebase or drop it (see `invoke verify-patches`).", file=sys.stderr)
    return 1


def _git_dir(source: Path) -> Path:
    done = subprocess.run(
        ["git", "-c", "safe.directory=*", "-C", str(source), "rev-parse", "--absolute-git-dir"],
        capture_output=True, check=False,
    )
    if done.returncode:
        raise PatchToolError(f"{source} is not a git work tree: {_text(done.stderr)}")
    return Path(_text(done.stdout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    apply = modes.add_parser("apply", help="check the set, then apply it to a work tree")
    apply.add_argument("--source", required=True, help="git work tree to patch")
    apply.add_argument("--patches", required=True, help="folder of NNNN-topic.patch files")
    verify = modes.add_parser("verify", help="status of each patch at a ref, no checkout")
    verify.add_argument("--git-dir", required=True, help="repository (a bare mirror is fine)")
    verify.add_argument("--ref", required=True, help="tag, branch or commit")
    verify.add_argument("--patches", required=True, help="folder of NNNN-topic.patch files")
    verify.add_argument("--hash", action="append", metavar="PATH",
                        help="also print the sha256 of PATH at the ref (repeatable)")
    verify.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    try:
        return run_apply(args) if args.mode == "apply" else run_verify(args)
    except PatchToolError as exc:
        print(f"apply-patches: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

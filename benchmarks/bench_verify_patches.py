#!/usr/bin/env python3
"""How long `invoke verify-patches` takes on a repository the size of vLLM, against a clone.

Source: the vLLM sdist from PyPI as a git repository (7.4k files), cached under
.cache/. Twelve patches are made against it (one pair depends on each other, as
real sets do). Timed:

  verify, cold    first run: bare mirror made, then every patch classified
  verify, warm    mirror present (the everyday case)
  clone + apply   the manual method: clone, check out the ref, `git apply --check`
                  and `git apply` each patch in order
  reset + apply   the same on an existing clone (reset, clean, apply)

Run: python benchmarks/bench_verify_patches.py [--runs 5] [--version 0.31.0]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllmstack.config.profiles import resolve  # noqa: E402
from vllmstack.core.paths import Project  # noqa: E402
from vllmstack.core.runner import SubprocessRunner  # noqa: E402
from vllmstack.image.patches import verify_patches  # noqa: E402
from vllmstack.image.sources import sdist_repo  # noqa: E402

HEADER = "Subject: bench {n}\nWhy: benchmark\nUpstream: none\nMade-for: v{v}\nDrop-when: -\n\n"
PATCHES = 12


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout


def make_patches(repo: Path, version: str, folder: Path, work: Path) -> None:
    """Twelve one-line edits spread over vllm/*.py; patch 12 builds on patch 11's edit."""
    subprocess.run(["git", "-c", "advice.detachedHead=false", "clone", "-q", "--shared", "-b",
                    f"v{version}", str(repo), str(work)],
                   check=True)
    files = sorted(p for p in git(work, "ls-files", "vllm/*.py").split()
                   if (work / p).stat().st_size > 4000)
    step = max(1, len(files) // (PATCHES - 1))
    chosen = files[::step][: PATCHES - 1]
    folder.mkdir(parents=True)
    for number, path in enumerate(chosen, start=1):
        target = work / path
        lines = target.read_text().splitlines(keepends=True)
        lines.insert(20, f"# vllmstack bench edit {number}\n")
        target.write_text("".join(lines))
        diff = git(work, "diff")
        (folder / f"{number * 10:04d}-edit-{number}.patch").write_text(
            HEADER.format(n=number, v=version) + diff)
        if number < PATCHES - 1:
            git(work, "checkout", "-q", "--", ".")
    # The last patch edits right next to the previous one: it needs that patch first.
    target = work / chosen[-1]
    text = target.read_text().replace(f"# vllmstack bench edit {PATCHES - 1}\n",
                                      f"# vllmstack bench edit {PATCHES - 1}\n# and {PATCHES}\n")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "base for the dependent patch")
    target.write_text(text)
    (folder / f"{PATCHES * 10:04d}-edit-{PATCHES}.patch").write_text(
        HEADER.format(n=PATCHES, v=version) + git(work, "diff"))


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="warm runs to take the median of")
    parser.add_argument("--version", default="0.31.0", help="vLLM release (sdist) to use")
    args = parser.parse_args()
    runner = SubprocessRunner()
    repo = sdist_repo(ROOT / ".cache", runner, version=args.version, environ=os.environ)
    files = len(git(repo, "ls-files").splitlines())
    tmp = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    try:
        project = Project(tmp / "project")
        shutil.copytree(ROOT / "env", project.env_dir)
        shutil.copy(ROOT / ".env.example", project.dotenv_example)
        (project.root / "tasks.py").write_text("# marker\n")
        make_patches(repo, args.version, project.patches / "vllm", tmp / "work")
        patches = sorted((project.patches / "vllm").glob("*.patch"))
        resolved = resolve(project, overrides=[f"VLLM_REPO={repo}", f"VLLM_REF=v{args.version}"],
                           environ={})

        def verify() -> None:
            report = verify_patches(project, resolved, runner, environ=os.environ,
                                    tool=ROOT / "scripts" / "apply-patches.py")
            vllm = report.get("vllm")
            assert vllm is not None and not report.failed, vllm
            statuses = [p.status for p in vllm.patches]
            assert statuses == ["applies"] * (PATCHES - 1) + ["needs-earlier"], statuses

        cold = timed(verify)
        warm = [timed(verify) for _ in range(args.runs)]

        def clone_and_apply() -> None:
            clone = tmp / "clone"
            shutil.rmtree(clone, ignore_errors=True)
            subprocess.run(["git", "-c", "advice.detachedHead=false", "clone", "-q",
                            "--no-hardlinks", "-b", f"v{args.version}",
                            f"file://{repo}", str(clone)], check=True)
            for patch in patches:
                subprocess.run(["git", "-C", str(clone), "apply", "--check", str(patch)],
                               check=True)
                subprocess.run(["git", "-C", str(clone), "apply", str(patch)], check=True)

        def reset_and_apply() -> None:
            clone = tmp / "clone"
            subprocess.run(["git", "-C", str(clone), "reset", "-q", "--hard", f"v{args.version}"],
                           check=True)
            subprocess.run(["git", "-C", str(clone), "clean", "-qfdx"], check=True)
            for patch in patches:
                subprocess.run(["git", "-C", str(clone), "apply", "--check", str(patch)],
                               check=True)
                subprocess.run(["git", "-C", str(clone), "apply", str(patch)], check=True)

        clones = [timed(clone_and_apply) for _ in range(max(1, args.runs // 2))]
        resets = [timed(reset_and_apply) for _ in range(args.runs)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"vLLM {args.version} sdist as git: {files} files; {PATCHES} patches "
          f"(one needs the one before)")
    print(f"{'method':28} {'seconds':>8}")
    print(f"{'verify-patches, cold':28} {cold:8.2f}")
    print(f"{'verify-patches, warm':28} {statistics.median(warm):8.2f}   "
          f"(median of {len(warm)}; min {min(warm):.2f}, max {max(warm):.2f})")
    print(f"{'clone + checkout + apply':28} {statistics.median(clones):8.2f}   "
          f"(median of {len(clones)})")
    print(f"{'reset + clean + apply':28} {statistics.median(resets):8.2f}   "
          f"(existing clone, median of {len(resets)})")
    print("verify-patches also classifies each patch (applies / needs-earlier / upstream / "
          "fails + hunk); the clone methods only say the first failure.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`invoke update-check` (issue 24), offline against a vLLM repository made here.

The repository has three release tags (and a pre-release); its v0.3.0 contains the change one
local patch makes. Pinned at the middle tag, the report lists only v0.3.0, verifies the patch
folder there and calls that patch droppable; pinned at the newest, it lists no candidate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, copy_project

from vllmstack.maintenance.upstream import newer, newer_image_tags, release_key
from vllmstack.maintenance.watchlist import read_watchlist

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
HEADER = ("Subject: {subject}\nWhy: a test\nUpstream: https://github.com/vllm-project/vllm/pull/1\n"
          "Made-for: v0.2.0\nDrop-when: upstream has it\n\n")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def commit(repo: Path, files: dict[str, str], tag: str) -> None:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", tag)
    git(repo, "tag", tag)


def diff_of(repo: Path, old: str, new: str, path: str) -> str:
    return git(repo, "diff", old, new, "--", path)


@pytest.fixture
def upstream_repo(tmp_path: Path) -> tuple[Path, str, str]:
    """(repo, the patch that v0.3.0 makes upstream, one that still applies there)."""
    repo = tmp_path / "vllm"
    repo.mkdir()
    git(repo, "init", "-q")
    base = {"vllm/engine.py": "def start():\n    return 'slow'\n",
            "vllm/parser.py": "FLAGS = ['--a']\n\n\ndef parse():\n    return FLAGS\n"}
    commit(repo, base, "v0.1.0")
    commit(repo, {"vllm/parser.py": "FLAGS = ['--a', '--b']\n\n\ndef parse():\n    return FLAGS\n"},
           "v0.2.0")
    # What our local patch does to v0.2.0, made upstream in v0.3.0 (plus an unrelated change).
    fixed = "def start():\n    return 'fast'\n"
    commit(repo, {"vllm/engine.py": fixed}, "scratch")
    droppable = diff_of(repo, "v0.2.0", "scratch", "vllm/engine.py")
    git(repo, "tag", "-d", "scratch")
    git(repo, "reset", "-q", "--hard", "v0.2.0")
    commit(repo, {"vllm/engine.py": fixed, "README": "notes\n"}, "v0.3.0rc1")
    commit(repo, {"README": "release\n"}, "v0.3.0")
    kept = ("--- a/vllm/parser.py\n+++ b/vllm/parser.py\n@@ -2,4 +2,4 @@\n \n \n def parse():\n"
            "-    return FLAGS\n+    return list(FLAGS)\n")
    return repo, droppable, kept


def run_check(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", "update-check", "--offline", *args],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(root / "home")})


def test_pinned_at_the_middle_tag_only_the_newest_is_a_candidate_and_its_upstream_patch_droppable(
        tmp_path: Path, upstream_repo: tuple[Path, str, str]) -> None:
    repo, droppable, kept = upstream_repo
    root = copy_project(tmp_path / "stack")
    folder = root / "patches" / "vllm-next"
    folder.mkdir()
    (folder / "0001-fast-start.patch").write_text(HEADER.format(subject="fast start") + droppable)
    (folder / "0002-copy-flags.patch").write_text(HEADER.format(subject="copy flags") + kept)
    done = run_check(root, "--repo", f"vllm={repo}", "--patches", "vllm=patches/vllm-next",
                     "--set", "VLLM_REF=v0.2.0", "--set", "VLLM_VERSION=0.2.0", "--json", "--write-plan")
    assert done.returncode == 0, done.stdout + done.stderr
    vllm = json.loads(done.stdout)["components"]["vllm"]
    assert vllm["pinned"] == "v0.2.0"
    assert [c["ref"] for c in vllm["candidates"]] == ["v0.3.0"]  # not v0.1.0, not the rc
    newest = vllm["candidates"][0]
    assert {p["name"]: p["status"] for p in newest["patches"]} == {
        "0001-fast-start.patch": "upstream", "0002-copy-flags.patch": "applies"}
    assert newest["droppable"] == ["0001-fast-start.patch"]
    assert vllm["lookups"]["index vllm"] == "unknown (offline)"
    # The Markdown report and the plan went under results/updates/; no pin was touched.
    report = next((root / "results" / "updates").glob("*-update-check.md")).read_text()
    assert "| vllm | `v0.2.0` (VLLM_REF) | `v0.3.0` | v0.3.0 |" in report
    assert "| 0001-fast-start.patch | **upstream** |" in report
    assert "Droppable (already upstream): 0001-fast-start.patch." in report
    assert (root / ".env.example").read_text() == (ROOT / ".env.example").read_text()
    plan = next((root / "results" / "updates").glob("*-bump.diff"))
    assert "+VLLM_REF=v0.3.0" in plan.read_text() and "+VLLM_VERSION=0.3.0" in plan.read_text()
    applied = subprocess.run(["git", "apply", "--check", "-v", str(plan)], cwd=root,
                             capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    assert "patches/vllm-next/0001-fast-start.patch" in applied.stderr  # the drop is in the diff


def test_pinned_at_the_newest_tag_there_is_no_candidate(
        tmp_path: Path, upstream_repo: tuple[Path, str, str]) -> None:
    repo, _, _ = upstream_repo
    root = copy_project(tmp_path / "stack")
    done = run_check(root, "--set", f"VLLM_REPO={repo}", "--set", "VLLM_REF=v0.3.0",
                     "--set", "VLLM_VERSION=0.3.0", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["components"]["vllm"]["candidates"] == []
    assert data["deep_check"] == {}
    # Everything that needs the network says so instead of failing.
    assert data["components"]["aiter"]["candidates"] == "unknown (offline)"
    assert data["components"]["rocm-image"]["lookups"] == {"registry": "unknown (offline)"}


def test_an_unknown_component_is_an_error_with_the_known_ones(tmp_path: Path) -> None:
    done = run_check(copy_project(tmp_path / "stack"), "--repo", "vlm=/x")
    assert done.returncode == 1
    assert "unknown component 'vlm'" in done.stderr and "Traceback" not in done.stderr


def test_release_order_skips_pre_releases_and_keeps_post_releases() -> None:
    assert newer(["v0.1.24", "v0.1.24.post1", "v0.1.25rc1", "v0.1.25", "main"], "v0.1.24") == [
        "v0.1.25", "v0.1.24.post1"]
    assert newer(["b9994", "b10001", "b9993"], "9993") == ["b10001", "b9994"]
    assert newer(["v1"], "1cc7ff67") == []  # a commit pin is compared with HEAD instead
    assert release_key("0.32.0") == (0, 32, 0, 0, 0)
    assert newer_image_tags(["10.1.0-full", "10.2.0-full", "10.2.0", "11.0.0-full", "latest"],
                            "10.1.0-full") == ["11.0.0-full", "10.2.0-full"]


def test_the_watchlist_is_read_from_agents_md() -> None:
    items = read_watchlist(ROOT / "AGENTS.md")
    numbers = [n for item in items for _, n in item.references]
    assert 35288 in numbers and 45238 in numbers
    assert all(repo == "vllm-project/vllm" for item in items for repo, _ in item.references)


@pytest.mark.slow
def test_the_candidates_own_parser_checks_every_profile_when_it_is_installed(tmp_path: Path) -> None:
    """vLLM 0.32.0's parser from the native CPU engine (tests/integration/test_real_cpu_engine.py
    provisions it): a flag that release does not know is named, with the profile."""
    from conftest import need

    from vllmstack.core.paths import Project
    from vllmstack.runtime.native.install import engine_dir, read_manifest

    engine = engine_dir(Project(ROOT), "0.32.0+cpu")
    need(read_manifest(engine) is not None, "vLLM's CPU build 0.32.0 (invoke install-engine --platform cpu)")
    repo = tmp_path / "vllm"
    repo.mkdir()
    git(repo, "init", "-q")
    commit(repo, {"a": "1\n"}, "v0.31.0")
    commit(repo, {"a": "2\n"}, "v0.32.0")
    root = copy_project(tmp_path / "stack")
    (root / ".cache" / "engines").mkdir(parents=True)
    (root / ".cache" / "engines" / engine.name).symlink_to(engine)
    args = ("--repo", f"vllm={repo}", "--set", "VLLM_REF=v0.31.0", "--set", "VLLM_VERSION=0.31.0",
            "--model", "tiny", "--json")
    fine = json.loads(run_check(root, *args).stdout)["deep_check"]
    assert fine["run"] is True and fine["profiles"] == {"tiny on cpu": "ok"}, fine
    wrong = json.loads(run_check(root, *args, "--set", "VLLM_EXTRA_ARGS=--no-such-flag 1").stdout)
    [problem] = wrong["deep_check"]["profiles"]["tiny on cpu"]
    assert "--no-such-flag" in problem and "VLLM_EXTRA_ARGS" in problem

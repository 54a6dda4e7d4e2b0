"""verify-patches never says "clean" about patches it did not check, and it agrees with the
patch script on every folder.

The package imports `discover` from scripts/apply-patches.py, so the two cannot disagree by
construction; the tests below prove it on folders good and bad, through both front doors
(`apply-patches.py verify` as the build runs it, `verify_patches` as `invoke verify-patches`
runs it), and check the errors a user meets: a missing folder, a folder of notes named with
--patches, a stray file, a repository out of reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
import test_patches_verify as base
from test_patches_verify import Upstream, write_patch

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner
from vllmstack.image.patches import PatchError, discover, patch_files, render_report, verify_patches

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "scripts" / "apply-patches.py"
# The same fixtures: a small upstream repository, a throwaway project without shipped patches.
upstream = base.upstream
proj = base.proj


def run_verify(project: Project, **kwargs: object) -> tuple[dict[str, object], bool, str]:
    report = verify_patches(project, resolve(project, environ={}), SubprocessRunner(),
                            environ=os.environ, tool=TOOL, **kwargs)  # type: ignore[arg-type]
    return report.as_json(), report.failed, render_report(report)


def script_verify(upstream: Upstream, folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), "verify", "--git-dir",
                           str(upstream.path / ".git"), "--ref", "v1", "--patches", str(folder),
                           "--json"], capture_output=True, text=True, check=False)


# --- one discovery, many folders -----------------------------------------------------------------

def good(up: Upstream) -> dict[str, str]:
    return {"a": up.diff({"a.py": ("a3\n", "A3\n")}), "b": up.diff({"b.py": ("b3\n", "B3\n")})}


def build(folder: Path, up: Upstream, kind: str) -> None:
    """A patch folder of one kind, good or bad."""
    diffs = good(up)
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "ordered":  # numeric, not lexical order, beside notes, a manifest and overlays/
        write_patch(folder, "0100-b.patch", diffs["b"])
        write_patch(folder, "20-a.patch", diffs["a"])
        (folder / "README.md").write_text("notes\n")
        (folder / "NOTES.md").write_text("more notes\n")
        (folder / "overlays").mkdir()
        (folder / "overlays" / "x.py").write_text("x\n")
    elif kind == "notes-only":
        (folder / "README.md").write_text("no patches yet\n")
    elif kind == "empty":
        pass
    elif kind == "only-stray":  # nothing the build applies, so nothing that looked checkable
        (folder / "fix.diff").write_text(diffs["a"])
    elif kind == "no-diff":  # named like a patch, but is not one
        write_patch(folder, "0010-a.patch", "just words, no diff\n")
    elif kind == "same-number":
        write_patch(folder, "0010-a.patch", diffs["a"])
        write_patch(folder, "0010-b.patch", diffs["b"])
    else:
        write_patch(folder, "0010-a.patch", diffs["a"])
        stray = {"diff-file": "fix.diff", "underscore": "0010_b.patch", "no-number": "b.patch",
                 "backup": "0020-b.patch.orig", "upper-case": "0020-b.PATCH",
                 "dotfile": ".0020-b.patch.swp"}.get(kind)
        if stray is not None:
            (folder / stray).write_text(diffs["b"])
        elif kind == "subfolder":  # a patch one level down is never applied
            write_patch(folder / "extra", "0020-b.patch", diffs["b"])
        elif kind == "dangling-link":
            (folder / "0020-b.patch").symlink_to(folder / "gone.patch")
        elif kind == "folder-named-like-a-patch":
            (folder / "0020-b.patch").mkdir()
        else:
            raise AssertionError(kind)


KINDS = ["ordered", "notes-only", "empty", "only-stray", "no-diff", "same-number", "diff-file", "underscore",
         "no-number", "backup", "upper-case", "dotfile", "subfolder", "dangling-link",
         "folder-named-like-a-patch"]
STRAY = {"only-stray": "fix.diff", "diff-file": "fix.diff", "underscore": "0010_b.patch",
         "no-number": "b.patch", "backup": "0020-b.patch.orig", "upper-case": "0020-b.PATCH",
         "dotfile": ".0020-b.patch.swp", "subfolder": "extra/", "dangling-link": "0020-b.patch",
         "folder-named-like-a-patch": "0020-b.patch/"}


@pytest.mark.parametrize("kind", KINDS)
def test_the_script_and_verify_patches_agree_on_the_folder(proj: Project, upstream: Upstream,
                                                           kind: str) -> None:
    folder = proj.patches / "vllm"
    build(folder, upstream, kind)
    done = script_verify(upstream, folder)
    data, failed, text = run_verify(proj)
    vllm = data["vllm"]
    assert isinstance(vllm, dict)
    if kind in STRAY:
        # The build would stop on it; so does verification, naming the same entry.
        assert done.returncode == 2 and STRAY[kind] in done.stderr
        assert failed and STRAY[kind] in vllm["error"] and "NNNN-topic.patch" in vllm["fix"]
        assert f"ERROR patches/vllm: {STRAY[kind]}" in text
        return
    script = json.loads(done.stdout)["patches"]
    assert [(p["name"], p["status"]) for p in vllm["patches"]] == [
        (p["name"], p["status"]) for p in script]
    assert failed == (done.returncode == 1)
    assert [p.name for p in patch_files(folder)] == [p["name"] for p in script]
    expected = {"ordered": ["20-a.patch", "0100-b.patch"], "notes-only": [], "empty": [],
                "no-diff": ["0010-a.patch"], "same-number": ["0010-a.patch", "0010-b.patch"]}
    assert [p["name"] for p in script] == expected[kind]
    if not script:
        assert "nothing to verify" in text and "clean" not in text


@pytest.mark.parametrize(("make", "message"), [
    (lambda folder: None, "does not exist"),
    (lambda folder: folder.write_text("a file, not a folder\n"), "is not a folder"),
])
def test_a_missing_folder_or_a_file_is_an_error_for_both(
        tmp_path: Path, make: Callable[[Path], None], message: str) -> None:
    folder = tmp_path / "set"
    make(folder)
    done = subprocess.run([sys.executable, str(TOOL), "apply", "--source", str(tmp_path),
                           "--patches", str(folder)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and message in done.stderr
    with pytest.raises(PatchError, match=message):
        discover(folder)


# --- what verify-patches says about folders it cannot check ----------------------------------------

def test_a_missing_component_folder_is_an_error_with_a_fix(proj: Project, upstream: Upstream) -> None:
    write_patch(proj.patches / "vllm", "0010-a.patch", good(upstream)["a"])
    (proj.patches / "aiter").rmdir()
    data, failed, text = run_verify(proj)
    assert failed
    aiter = data["aiter"]
    assert isinstance(aiter, dict)
    assert aiter["error"] == "the patch folder patches/aiter does not exist"
    assert "git checkout -- patches/aiter" in aiter["fix"]
    assert "  fix:  restore it (git checkout -- patches/aiter)" in text
    assert text.splitlines()[-1].startswith("FAILED")
    # The vllm patch was still checked.
    vllm = data["vllm"]
    assert isinstance(vllm, dict) and vllm["patches"][0]["status"] == "applies"


def test_a_folder_named_with_patches_must_hold_patches(proj: Project, upstream: Upstream,
                                                       tmp_path: Path) -> None:
    notes = tmp_path / "candidate"
    build(notes, upstream, "notes-only")
    data, failed, _ = run_verify(proj, patch_dirs={"vllm": str(notes)})
    vllm = data["vllm"]
    assert isinstance(vllm, dict) and failed
    assert "holds no NNNN-topic.patch file" in vllm["error"]
    data, failed, _ = run_verify(proj, patch_dirs={"vllm": str(tmp_path / "typo")})
    vllm = data["vllm"]
    assert isinstance(vllm, dict) and failed
    assert vllm["error"].endswith("does not exist") and "--patches vllm=" in vllm["fix"]


def test_a_patch_dropped_directly_into_patches_is_an_error(proj: Project, upstream: Upstream) -> None:
    write_patch(proj.patches, "0010-a.patch", good(upstream)["a"])
    data, failed, text = run_verify(proj)
    top = data["patches"]
    assert isinstance(top, dict) and failed
    assert "patches/0010-a.patch: not inside a component folder" in top["error"]
    assert "move it into patches/<component>/" in text
    (proj.patches / "0010-a.patch").unlink()
    (proj.patches / "NOTES.md").write_text("notes may sit here\n")
    assert "patches" not in run_verify(proj)[0]


# --- a repository out of reach ------------------------------------------------------------------------

def test_an_unreachable_repository_says_how_to_verify_offline_and_leaves_no_partial_mirror(
        proj: Project, upstream: Upstream) -> None:
    write_patch(proj.patches / "vllm", "0010-a.patch", good(upstream)["a"])
    for url in ("http://127.0.0.1:9/vllm.git", "file:///nonexistent/vllm.git"):
        data, failed, text = run_verify(proj, repos={"vllm": url})
        vllm = data["vllm"]
        assert isinstance(vllm, dict) and failed
        assert f"cannot mirror {url}" in vllm["error"]
        assert "Offline, point --repo vllm=PATH at a local clone or bare mirror" in vllm["fix"]
        assert "--repo vllm=vllm-<VLLM_VERSION>.tar.gz" in vllm["fix"]
        assert "fix:" in text
        mirrors = proj.cache / "mirrors"
        assert not [p.name for p in mirrors.iterdir() if p.name.endswith(".partial")]


def sdist(upstream: Upstream, path: Path, top: str) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in ("a.py", "b.py", "c.py"):
            tar.add(upstream.path / name, arcname=f"{top}/{name}")
    return path


def test_repo_may_point_at_an_sdist(proj: Project, upstream: Upstream, tmp_path: Path) -> None:
    write_patch(proj.patches / "vllm", "0010-a.patch", good(upstream)["a"])
    archive = sdist(upstream, tmp_path / "vllm-1.0.tar.gz", "vllm-1.0")
    data, failed, _ = run_verify(proj, repos={"vllm": str(archive)}, refs={"vllm": "v1.0"})
    vllm = data["vllm"]
    assert isinstance(vllm, dict) and not failed, vllm
    assert vllm["patches"] == [{"name": "0010-a.patch", "status": "applies", "detail": ""}]
    # An archive not laid out like an sdist is refused with the reason, and nothing half-made stays.
    bad = sdist(upstream, tmp_path / "vllm-2.0.tar.gz", "elsewhere")
    data, failed, _ = run_verify(proj, repos={"vllm": str(bad)}, refs={"vllm": "v2.0"})
    vllm = data["vllm"]
    assert isinstance(vllm, dict) and failed and "has no vllm-2.0/ folder" in vllm["error"]
    assert not (proj.cache / "sources" / "vllm-2.0.partial").exists()

"""verify-patches and the apply script on git repositories the tests build.

Every status (applies, needs-earlier, upstream, fails; overlay ok, drifted,
conflicts), the order, a failing middle patch, and refs given as tag, branch
and commit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner
from vllmstack.image.patches import (
    PatchError,
    load_overlays,
    overlay_lock,
    parse_component_pairs,
    patch_set_hash,
    render_report,
    verify_patches,
)
from vllmstack.image.sources import mirror_path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "scripts" / "apply-patches.py"
GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}
HEADER = "Subject: {s}\nWhy: test\nUpstream: none\nMade-for: v1\nDrop-when: never\n\n"


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], env=GIT_ENV, capture_output=True,
                          text=True, check=True)
    return done.stdout.strip()


def numbered(prefix: str, count: int = 30) -> str:
    return "".join(f"{prefix}{i}\n" for i in range(1, count + 1))


class Upstream:
    """A small upstream repository: tag v1, branch dev, and a way to make patches against it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        git(path, "init", "-q", "-b", "main")
        self.write({"a.py": numbered("a"), "b.py": numbered("b"), "c.py": numbered("c")})
        self.commit("v1 content")
        git(path, "tag", "v1")
        git(path, "branch", "dev")

    def write(self, files: dict[str, str]) -> None:
        for name, text in files.items():
            (self.path / name).parent.mkdir(parents=True, exist_ok=True)
            (self.path / name).write_text(text)

    def commit(self, message: str) -> str:
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "-m", message)
        return git(self.path, "rev-parse", "HEAD")

    def diff(self, edits: dict[str, tuple[str, str]], base: str = "HEAD") -> str:
        """A patch that replaces lines in files (old -> new), made against `base`."""
        git(self.path, "checkout", "-q", base)
        for name, (old, new) in edits.items():
            path = self.path / name
            text = path.read_text()
            assert old in text, (name, old)
            path.write_text(text.replace(old, new, 1))
        patch = git(self.path, "diff") + "\n"
        git(self.path, "checkout", "-q", "--", ".")
        git(self.path, "checkout", "-q", "main")
        return patch


def write_patch(folder: Path, name: str, diff: str, subject: str = "x") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(HEADER.format(s=subject) + diff)
    return path


@pytest.fixture
def upstream(tmp_path: Path) -> Upstream:
    return Upstream(tmp_path / "upstream")


@pytest.fixture
def proj(project: Project, upstream: Upstream) -> Project:
    """The throwaway project, with no shipped patches and VLLM_REPO pointing at `upstream`."""
    for folder in project.patches.iterdir():
        for path in sorted(folder.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
    (project.root / ".env").write_text(
        project.dotenv_example.read_text() + f"\nVLLM_REPO={upstream.path}\nVLLM_REF=v1\n")
    return project


def verify(project: Project, **kwargs: object) -> dict[str, object]:
    resolved = resolve(project, environ={})
    report = verify_patches(project, resolved, SubprocessRunner(), environ=os.environ, tool=TOOL,
                            **kwargs)  # type: ignore[arg-type]
    data: dict[str, object] = report.as_json()
    data["_failed"] = report.failed
    data["_text"] = render_report(report)
    return data


def statuses(data: dict[str, object], kind: str = "patches") -> list[tuple[str, str]]:
    vllm = data["vllm"]
    assert isinstance(vllm, dict), data
    return [(p["name"], p["status"]) for p in vllm[kind]]


def detail(data: dict[str, object], name: str) -> str:
    vllm = data["vllm"]
    assert isinstance(vllm, dict)
    for item in vllm["patches"] + vllm["overlays"]:
        if item["name"] == name:
            return str(item["detail"])
    raise AssertionError(name)


# --- patch statuses ------------------------------------------------------------------------------

def test_clean_set_applies_in_numeric_order(proj: Project, upstream: Upstream) -> None:
    folder = proj.patches / "vllm"
    write_patch(folder, "0020-b.patch", upstream.diff({"b.py": ("b3\n", "B3\n")}))
    write_patch(folder, "0100-c.patch", upstream.diff({"c.py": ("c3\n", "C3\n")}))
    write_patch(folder, "0003-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    data = verify(proj)
    # Numeric, not lexical: 0003 < 0020 < 0100.
    assert statuses(data) == [("0003-a.patch", "applies"), ("0020-b.patch", "applies"),
                              ("0100-c.patch", "applies")]
    assert data["_failed"] is False
    vllm = data["vllm"]
    assert isinstance(vllm, dict)
    assert vllm["commit"] == git(upstream.path, "rev-parse", "v1")


def test_failing_middle_patch_names_the_hunk_and_the_rest_are_still_checked(
    proj: Project, upstream: Upstream
) -> None:
    folder = proj.patches / "vllm"
    write_patch(folder, "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    # Its b.py part matches; its c.py part's context does not.
    bad = upstream.diff({"b.py": ("b3\n", "B3\n")})
    bad += upstream.diff({"c.py": ("c5\n", "C5\n")}).replace(" c4\n", " c4 changed upstream\n")
    write_patch(folder, "0020-bc.patch", bad)
    write_patch(folder, "0030-b.patch", upstream.diff({"b.py": ("b20\n", "B20\n")}))
    data = verify(proj)
    assert statuses(data) == [("0010-a.patch", "applies"), ("0020-bc.patch", "fails"),
                              ("0030-b.patch", "applies")]
    assert "c.py hunk 1/1" in detail(data, "0020-bc.patch")
    assert data["_failed"] is True


def test_second_hunk_failure_is_named_by_number(proj: Project, upstream: Upstream) -> None:
    diff = upstream.diff({"a.py": ("a3\n", "A3\n")})
    diff2 = upstream.diff({"a.py": ("a25\n", "A25\n")})
    # One patch with two hunks in a.py; the second one's context does not exist upstream.
    hunks = diff + diff2.split("\n", 4)[4].replace(" a23\n", " a23 (gone)\n")
    write_patch(proj.patches / "vllm", "0010-a.patch", hunks)
    data = verify(proj)
    assert statuses(data) == [("0010-a.patch", "fails")]
    assert "a.py hunk 2/2 (@@ -22,7 @@" in detail(data, "0010-a.patch")


def test_patch_already_upstream_is_reported_as_upstream(proj: Project, upstream: Upstream) -> None:
    folder = proj.patches / "vllm"
    write_patch(folder, "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    write_patch(folder, "0020-b.patch", upstream.diff({"b.py": ("b3\n", "B3\n")}))
    # Upstream merges the first patch's change in v2.
    upstream.write({"a.py": numbered("a").replace("a3\n", "A3\n")})
    upstream.commit("merge the a fix")
    git(upstream.path, "tag", "v2")
    assert statuses(verify(proj)) == [("0010-a.patch", "applies"), ("0020-b.patch", "applies")]
    data = verify(proj, refs={"vllm": "v2"})
    assert statuses(data) == [("0010-a.patch", "upstream"), ("0020-b.patch", "applies")]
    assert "drop it" in detail(data, "0010-a.patch")
    assert data["_failed"] is True


def test_patch_on_top_of_an_earlier_one_needs_earlier(proj: Project, upstream: Upstream) -> None:
    folder = proj.patches / "vllm"
    first = upstream.diff({"a.py": ("a3\n", "A3\n")})
    write_patch(folder, "0010-a.patch", first)
    # Made on a tree where 0010 is applied: its context contains A3.
    git(upstream.path, "checkout", "-q", "-b", "tmp")
    upstream.write({"a.py": numbered("a").replace("a3\n", "A3\n")})
    upstream.commit("tmp")
    second = upstream.diff({"a.py": ("a4\n", "A4\n")}, base="tmp")
    write_patch(folder, "0020-a.patch", second)
    data = verify(proj)
    assert statuses(data) == [("0010-a.patch", "applies"), ("0020-a.patch", "needs-earlier")]
    assert "0010-a.patch" in detail(data, "0020-a.patch")
    assert data["_failed"] is False
    # In the wrong order the dependent patch fails, and the report says how to fix it.
    (folder / "0020-a.patch").rename(folder / "0005-a.patch")
    data = verify(proj)
    assert statuses(data) == [("0005-a.patch", "fails"), ("0010-a.patch", "applies")]
    assert "applies after 0010-a.patch" in detail(data, "0005-a.patch")


def test_header_and_name_problems_fail_the_patch(proj: Project, upstream: Upstream) -> None:
    folder = proj.patches / "vllm"
    (folder).mkdir(exist_ok=True)
    (folder / "0010-a.patch").write_text("Subject: no why\n\n"
                                         + upstream.diff({"a.py": ("a3\n", "A3\n")}))
    write_patch(folder, "0020-b.patch", upstream.diff({"b.py": ("b3\n", "B3\n")}))
    write_patch(folder, "0020-c.patch", upstream.diff({"c.py": ("c3\n", "C3\n")}))
    data = verify(proj)
    assert statuses(data) == [("0010-a.patch", "fails"), ("0020-b.patch", "applies"),
                              ("0020-c.patch", "fails")]
    assert "Why, Upstream, Made-for, Drop-when" in detail(data, "0010-a.patch")
    assert "same number as 0020-b.patch" in detail(data, "0020-c.patch")
    # A file the build would never apply is an error, not silently ignored.
    (folder / "fix.diff").write_text("x")
    vllm = verify(proj)["vllm"]
    assert isinstance(vllm, dict)
    assert "fix.diff" in vllm["error"] and "NNNN-topic.patch" in vllm["fix"]


# --- refs as tag, branch and commit -------------------------------------------------------------

def test_ref_as_tag_branch_and_commit(proj: Project, upstream: Upstream) -> None:
    write_patch(proj.patches / "vllm", "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    v1 = git(upstream.path, "rev-parse", "v1")
    for ref in ("v1", "dev", v1, v1[:10]):
        data = verify(proj, refs={"vllm": ref})
        assert statuses(data) == [("0010-a.patch", "applies")], ref
        vllm = data["vllm"]
        assert isinstance(vllm, dict) and vllm["commit"] == v1 and vllm["ref"] == ref
    # The branch moves upstream (it merges the patch): a warm run sees the new head.
    git(upstream.path, "checkout", "-q", "dev")
    upstream.write({"a.py": numbered("a").replace("a3\n", "A3\n")})
    head = upstream.commit("dev merges the fix")
    git(upstream.path, "checkout", "-q", "main")
    data = verify(proj, refs={"vllm": "dev"})
    vllm = data["vllm"]
    assert isinstance(vllm, dict) and vllm["commit"] == head
    assert statuses(data) == [("0010-a.patch", "upstream")]
    # A commit that no branch or tag holds any more is fetched by its id.
    orphan_tip = head
    git(upstream.path, "branch", "-D", "dev")
    assert statuses(verify(proj, refs={"vllm": orphan_tip})) == [("0010-a.patch", "upstream")]


def test_unknown_ref_is_a_clear_error(proj: Project, upstream: Upstream) -> None:
    write_patch(proj.patches / "vllm", "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    data = verify(proj, refs={"vllm": "v9.9"})
    vllm = data["vllm"]
    assert isinstance(vllm, dict)
    assert "'v9.9' is not a tag, branch or commit" in vllm["error"]
    assert data["_failed"] is True


def test_warm_run_reuses_one_bare_mirror(proj: Project, upstream: Upstream) -> None:
    write_patch(proj.patches / "vllm", "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    verify(proj)
    verify(proj, refs={"vllm": "dev"})
    mirrors = list((proj.cache / "mirrors").iterdir())
    assert mirrors == [mirror_path(proj.cache, str(upstream.path))]
    assert git(mirrors[0], "rev-parse", "--is-bare-repository") == "true"


def test_component_without_patches_needs_no_repository(proj: Project) -> None:
    data = verify(proj)
    aiter = data["aiter"]
    assert isinstance(aiter, dict)
    assert aiter == {"repo": "https://github.com/ROCm/aiter.git", "ref": "v0.1.24.post1",
                     "commit": "", "patches": [], "overlays": [],
                     "note": "patches/aiter holds no patches (notes only): nothing to verify"}
    assert not (proj.cache / "mirrors").exists()
    # Not "clean" about patches it never saw: the verdict says there was nothing to check.
    assert data["_failed"] is False
    assert str(data["_text"]).splitlines()[-1] == (
        "nothing to verify: no patch folder holds a patch or an overlay")


def test_patches_flag_points_at_another_folder(proj: Project, upstream: Upstream,
                                               tmp_path: Path) -> None:
    other = tmp_path / "candidate"
    write_patch(other, "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    data = verify(proj, patch_dirs={"vllm": str(other)})
    assert statuses(data) == [("0010-a.patch", "applies")]


def test_component_pairs_parse_and_reject_unknown_names() -> None:
    assert parse_component_pairs(["vllm=v0.32.0", "aiter=main"], "--ref") == {
        "vllm": "v0.32.0", "aiter": "main"}
    with pytest.raises(PatchError, match="unknown component 'vlm'"):
        parse_component_pairs(["vlm=v1"], "--ref")
    with pytest.raises(PatchError, match="NAME=VALUE"):
        parse_component_pairs(["vllm"], "--ref")


# --- overlays -------------------------------------------------------------------------------------

def write_overlay(project: Project, upstream: Upstream, target: str = "a.py",
                  ref: str = "v1", extra: str = "") -> None:
    folder = project.patches / "vllm"
    (folder / "overlays").mkdir(parents=True, exist_ok=True)
    base = (upstream.path / target).read_bytes()
    (folder / "overlays" / "a.py").write_bytes(base.replace(b"a3\n", b"OVERLAY\n"))
    import hashlib

    digest = hashlib.sha256(base).hexdigest()
    (folder / "overlays.toml").write_text(
        "# overlays\n\n[[overlay]]\n"
        f'name = "a-fix"\nfile = "overlays/a.py"\ntarget = "vllm/{target}"\n'
        f'ref = "{ref}"\nbase_sha256 = "{digest}"\n{extra}')


@pytest.fixture
def vllm_layout(upstream: Upstream) -> Upstream:
    """Upstream files under vllm/ like the real package, for overlay targets."""
    upstream.write({"vllm/a.py": numbered("a"), "vllm/b.py": numbered("b")})
    upstream.commit("package layout")
    git(upstream.path, "tag", "-f", "v1")
    return upstream


def test_overlay_ok_then_drifted_when_upstream_changes(proj: Project, vllm_layout: Upstream) -> None:
    write_overlay(proj, vllm_layout)
    [overlay] = load_overlays(proj)
    assert overlay.target == "vllm/a.py" and overlay.ref == "v1" and overlay.file.is_file()
    data = verify(proj)
    assert statuses(data, "overlays") == [("a-fix", "ok")]
    vllm_layout.write({"vllm/a.py": numbered("a") + "new upstream line\n"})
    vllm_layout.commit("upstream edits a.py")
    git(vllm_layout.path, "tag", "v2")
    data = verify(proj, refs={"vllm": "v2"})
    assert statuses(data, "overlays") == [("a-fix", "drifted")]
    assert "changed upstream between v1 and v2" in detail(data, "a-fix")
    assert data["_failed"] is True


def test_overlay_unchanged_at_new_ref_is_ok_with_a_note(proj: Project,
                                                        vllm_layout: Upstream) -> None:
    write_overlay(proj, vllm_layout)
    vllm_layout.write({"vllm/b.py": "other file changed\n"})
    vllm_layout.commit("unrelated")
    git(vllm_layout.path, "tag", "v2")
    data = verify(proj, refs={"vllm": "v2"})
    assert statuses(data, "overlays") == [("a-fix", "ok")]
    assert 'set ref = "v2"' in detail(data, "a-fix")


def test_overlay_target_removed_upstream_is_drifted(proj: Project, vllm_layout: Upstream) -> None:
    write_overlay(proj, vllm_layout)
    git(vllm_layout.path, "rm", "-q", "vllm/a.py")
    vllm_layout.commit("remove a.py")
    git(vllm_layout.path, "tag", "v2")
    data = verify(proj, refs={"vllm": "v2"})
    assert statuses(data, "overlays") == [("a-fix", "drifted")]
    assert "does not exist at v2" in detail(data, "a-fix")


def test_overlay_over_a_patched_file_conflicts(proj: Project, vllm_layout: Upstream) -> None:
    write_overlay(proj, vllm_layout)
    write_patch(proj.patches / "vllm", "0010-a.patch",
                vllm_layout.diff({"vllm/a.py": ("a9\n", "A9\n")}))
    data = verify(proj)
    assert statuses(data, "overlays") == [("a-fix", "conflicts")]
    assert "0010-a.patch patches vllm/a.py" in detail(data, "a-fix")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('colour = "red"\n', r"overlays.toml:3: unknown field\(s\) \['colour'\]"),
        ("", None),
    ],
)
def test_manifest_errors_name_file_and_line(proj: Project, vllm_layout: Upstream, extra: str,
                                            message: str | None) -> None:
    write_overlay(proj, vllm_layout, extra=extra)
    if message is None:
        assert len(load_overlays(proj)) == 1
        return
    with pytest.raises(PatchError, match=message):
        load_overlays(proj)


def test_manifest_rejects_bad_hash_missing_file_and_duplicates(proj: Project,
                                                               vllm_layout: Upstream) -> None:
    write_overlay(proj, vllm_layout)
    manifest = proj.patches / "vllm" / "overlays.toml"
    good = manifest.read_text()
    manifest.write_text(good.replace('base_sha256 = "', 'base_sha256 = "zz'))
    with pytest.raises(PatchError, match=r"overlays.toml:3: .*64 lowercase hex"):
        load_overlays(proj)
    manifest.write_text(good.replace("overlays/a.py", "overlays/missing.py"))
    with pytest.raises(PatchError, match=r"'overlays/missing\.py' does not exist"):
        load_overlays(proj)
    manifest.write_text(good + "\n" + good.split("\n", 2)[2])
    with pytest.raises(PatchError, match=r"overlays\.toml:10: name 'a-fix' is already used by "
                                         r"the overlay at line 3"):
        load_overlays(proj)
    manifest.write_text(good.replace('ref = "v1"\n', ""))
    with pytest.raises(PatchError, match=r"overlays\.toml:3: overlay lacks ref"):
        load_overlays(proj)
    manifest.write_text(good.replace("[[overlay]]", "[[overlay]"))
    with pytest.raises(PatchError, match=r"overlays.toml: .*line 3"):
        load_overlays(proj)
    manifest.write_text(good.replace('target = "vllm/a.py"', 'target = "../a.py"'))
    with pytest.raises(PatchError, match="target must be a path inside"):
        load_overlays(proj)


def test_bad_manifest_is_a_component_error_in_the_report(proj: Project,
                                                         vllm_layout: Upstream) -> None:
    write_overlay(proj, vllm_layout, extra="colour = 1\n")
    data = verify(proj)
    vllm = data["vllm"]
    assert isinstance(vllm, dict) and "unknown field" in vllm["error"]
    assert "ERROR" in str(data["_text"]) and data["_failed"] is True


def test_lock_and_set_hashes_follow_content(proj: Project, vllm_layout: Upstream) -> None:
    folder = proj.patches / "vllm"
    empty = patch_set_hash(folder)
    path = write_patch(folder, "0010-a.patch", vllm_layout.diff({"vllm/a.py": ("a3\n", "A3\n")}))
    one = patch_set_hash(folder)
    path.write_text(path.read_text().replace("Why: test", "Why: better words"))
    assert len({empty, one, patch_set_hash(folder)}) == 3
    (folder / "README.md").write_text("notes do not change the set\n")
    assert patch_set_hash(folder) != one
    write_overlay(proj, vllm_layout)
    lock = overlay_lock(load_overlays(proj))
    write_overlay(proj, vllm_layout, ref="v1.1")
    assert overlay_lock(load_overlays(proj)) != lock


# --- the script's apply mode (what the Dockerfile runs) ----------------------------------------

def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          check=False)


def test_apply_stops_at_a_bad_middle_patch_and_leaves_the_tree_untouched(
    tmp_path: Path, upstream: Upstream
) -> None:
    folder = tmp_path / "set"
    write_patch(folder, "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    write_patch(folder, "0020-b.patch",
                upstream.diff({"b.py": ("b10\n", "B10\n")}).replace(" b8\n", " b8 moved\n"))
    write_patch(folder, "0030-c.patch", upstream.diff({"c.py": ("c3\n", "C3\n")}))
    tree = tmp_path / "tree"
    subprocess.run(["git", "clone", "-q", str(upstream.path), str(tree)], check=True)
    done = run_tool("apply", "--source", str(tree), "--patches", str(folder))
    assert done.returncode == 1
    assert "FAILED   0020-b.patch: b.py hunk 1/1 (@@ -7,7 @@" in done.stderr
    assert "stopped at patch 2 (0020-b.patch); nothing was applied" in done.stderr
    assert git(tree, "status", "--porcelain") == ""
    # The checked-so-far line shows the first patch was fine; the third was never reached.
    assert "checked  0010-a.patch" in done.stdout and "0030-c.patch" not in done.stdout


def test_apply_applies_the_whole_set_in_order(tmp_path: Path, upstream: Upstream) -> None:
    folder = tmp_path / "set"
    write_patch(folder, "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    git(upstream.path, "checkout", "-q", "-b", "tmp")
    upstream.write({"a.py": numbered("a").replace("a3\n", "A3\n")})
    upstream.commit("tmp")
    write_patch(folder, "0020-a.patch", upstream.diff({"a.py": ("a4\n", "A4\n")}, base="tmp"))
    tree = tmp_path / "tree"
    subprocess.run(["git", "clone", "-q", "-b", "v1", str(upstream.path), str(tree)],
                   check=True, capture_output=True)
    done = run_tool("apply", "--source", str(tree), "--patches", str(folder))
    assert done.returncode == 0, done.stderr
    assert "A3\nA4\n" in (tree / "a.py").read_text()
    assert done.stdout.index("applied  0010-a.patch") < done.stdout.index("applied  0020-a.patch")


def test_apply_refuses_a_change_the_source_already_has(tmp_path: Path, upstream: Upstream) -> None:
    folder = tmp_path / "set"
    write_patch(folder, "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    upstream.write({"a.py": numbered("a").replace("a3\n", "A3\n")})
    upstream.commit("merged")
    tree = tmp_path / "tree"
    subprocess.run(["git", "clone", "-q", str(upstream.path), str(tree)], check=True)
    done = run_tool("apply", "--source", str(tree), "--patches", str(folder))
    assert done.returncode == 1
    assert "already contains this change" in done.stderr


def test_apply_with_an_empty_folder_is_a_no_op_and_a_missing_one_an_error(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("no patches yet\n")
    done = run_tool("apply", "--source", str(tmp_path), "--patches", str(tmp_path / "notes"))
    assert done.returncode == 0 and "0 patches" in done.stdout
    done = run_tool("apply", "--source", str(tmp_path), "--patches", str(tmp_path / "none"))
    assert done.returncode == 2 and "0 patches" not in done.stdout
    assert f"the patch folder {tmp_path / 'none'} does not exist" in done.stderr


def test_verify_mode_json_shape(tmp_path: Path, upstream: Upstream) -> None:
    folder = tmp_path / "set"
    write_patch(folder, "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))
    done = run_tool("verify", "--git-dir", str(upstream.path / ".git"), "--ref", "v1",
                    "--patches", str(folder), "--json", "--hash", "a.py", "--hash", "gone.py")
    data = json.loads(done.stdout)
    assert done.returncode == 0
    assert data["patches"][0]["name"] == "0010-a.patch"
    assert data["patches"][0]["status"] == "applies"
    assert data["patches"][0]["files"] == ["a.py"]
    assert data["hashes"]["gone.py"] is None and len(data["hashes"]["a.py"]) == 64


# --- the invoke task ---------------------------------------------------------------------------

def test_invoke_verify_patches_json_and_exit_code(proj: Project, upstream: Upstream) -> None:
    shutil.copy(ROOT / "tasks.py", proj.root / "tasks.py")
    (proj.root / "scripts").mkdir()
    shutil.copy(TOOL, proj.root / "scripts" / "apply-patches.py")
    folder = proj.patches / "vllm"
    write_patch(folder, "0010-a.patch", upstream.diff({"a.py": ("a3\n", "A3\n")}))

    def invoke(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "invoke", "verify-patches", *args],
                              cwd=proj.root, capture_output=True, text=True, check=False)

    done = invoke("--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["vllm"]["patches"] == [{"name": "0010-a.patch", "status": "applies",
                                        "detail": ""}]
    # llamacpp: the shipped patches/llamacpp/ folder (notes only), verified because it is there.
    assert set(data) == {"vllm", "aiter", "flash-attention", "llamacpp"}
    assert {"repo", "ref", "patches", "overlays"} <= set(data["vllm"])
    upstream.write({"a.py": numbered("a").replace("a3\n", "A3\n")})
    upstream.commit("merged")
    git(upstream.path, "tag", "v2")
    done = invoke("--ref", "vllm=v2")
    assert done.returncode == 1
    assert "upstream      patch   0010-a.patch" in done.stdout
    done = invoke("--ref", "vlm=v2")
    assert done.returncode == 1 and "unknown component 'vlm'" in done.stderr

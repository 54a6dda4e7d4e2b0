"""The patch stage of Dockerfile.fullbuild, built for real on the local Docker engine.

The upstream source is a git repository made by the test, handed to the build
as upstream/vllm in the build context (the `vllm-local` fetch stage), and the
stage's base is the locally built Debian image instead of the ROCm image. The
build must stop at a bad patch in the middle, by name and hunk, and apply a good
set in order for a ref given as tag, branch or commit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import helpers
import pytest
from conftest import ROOT, need

from vllmstack.image import build, cpu

BASE_IMAGE = "vllmstack/base:bookworm"
# The build sees no variable of the caller's environment.
SEALED = {"DOCKER_BUILDKIT": "1", "PATH": "/usr/bin:/bin"}
HEADER = "Subject: {s}\nWhy: test\nUpstream: none\nMade-for: v1\nDrop-when: never\n\n"
pytestmark = pytest.mark.docker


def docker(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return helpers.docker(*args, timeout=timeout, env=SEALED)


def docker_ok() -> bool:
    return helpers.docker_ready(BASE_IMAGE, env=SEALED)


def git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(repo)}
    return subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def lines(prefix: str) -> str:
    return "".join(f"{prefix}{i}\n" for i in range(1, 31))


class Context:
    """A build context: the real Dockerfile and script, test patches, and upstream/vllm."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.work = root.parent / "work"
        (root / "scripts").mkdir(parents=True)
        shutil.copy(ROOT / "Dockerfile.fullbuild", root / "Dockerfile.fullbuild")
        shutil.copy(ROOT / ".dockerignore", root / ".dockerignore")
        shutil.copy(ROOT / "scripts" / "apply-patches.py", root / "scripts" / "apply-patches.py")
        self.patches = root / "patches" / "vllm"
        self.patches.mkdir(parents=True)
        self.work.mkdir()
        git(self.work, "init", "-q", "-b", "main")
        for name in ("a", "b", "c"):
            (self.work / f"{name}.py").write_text(lines(name))
        git(self.work, "add", "-A")
        git(self.work, "commit", "-q", "-m", "v1")
        git(self.work, "tag", "v1")
        git(self.work, "branch", "release")
        self.commit = git(self.work, "rev-parse", "HEAD")
        # main moves on after v1, so a build at v1 must not see this.
        (self.work / "a.py").write_text(lines("a") + "after v1\n")
        git(self.work, "commit", "-q", "-am", "after v1")
        subprocess.run(["git", "clone", "-q", "--bare", str(self.work),
                        str(root / "upstream" / "vllm")], check=True)

    def patch(self, name: str, file: str, old: str, new: str, context_edit: str = "") -> None:
        git(self.work, "checkout", "-q", "v1")
        path = self.work / file
        path.write_text(path.read_text().replace(old, new, 1))
        diff = git(self.work, "diff") + "\n"
        git(self.work, "checkout", "-q", "--", ".")
        git(self.work, "checkout", "-q", "main")
        if context_edit:
            diff = diff.replace(*context_edit.split("|"))
        (self.patches / name).write_text(HEADER.format(s=name) + diff)

    def build(self, ref: str, tag: str) -> subprocess.CompletedProcess[str]:
        return docker("build", "--progress=plain", "-f", "Dockerfile.fullbuild",
                      "--target", "vllm-source",
                      "--build-arg", f"ROCM_IMAGE={BASE_IMAGE}",
                      "--build-arg", f"SOURCE_BASE={BASE_IMAGE}",
                      "--build-arg", "VLLM_FETCH=vllm-local",
                      "--build-arg", f"VLLM_REF={ref}",
                      "-t", tag, str(self.root))


@pytest.fixture
def context(tmp_path: Path) -> Iterator[Context]:
    need(docker_ok(), f"a Docker engine and the {BASE_IMAGE} image are needed")
    yield Context(tmp_path / "ctx")


@pytest.fixture
def tag() -> Iterator[str]:
    name = f"vllmstack-test/patch-stage:{uuid.uuid4().hex[:10]}"
    yield name
    docker("image", "rm", "-f", name)


def test_patch_stage_stops_at_a_bad_middle_patch(context: Context, tag: str) -> None:
    context.patch("0010-a.patch", "a.py", "a3\n", "A3\n")
    context.patch("0020-b.patch", "b.py", "b10\n", "B10\n", context_edit=" b8\n| b8 gone\n")
    context.patch("0030-c.patch", "c.py", "c3\n", "C3\n")
    done = context.build("v1", tag)
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    assert "checked  0010-a.patch" in log
    assert "FAILED   0020-b.patch: b.py hunk 1/1 (@@ -7,7 @@" in log
    assert "stopped at patch 2 (0020-b.patch); nothing was applied" in log
    # It stopped: the later patch was never checked, and nothing was applied.
    assert "0030-c.patch" not in log and "applied  " not in log
    assert docker("image", "inspect", tag, timeout=30).returncode != 0


@pytest.mark.parametrize("ref_kind", ["tag", "branch", "commit"])
def test_patch_stage_applies_a_good_set_at_a_tag_branch_or_commit(
    context: Context, tag: str, ref_kind: str
) -> None:
    context.patch("0010-a.patch", "a.py", "a3\n", "A3\n")
    context.patch("0020-c.patch", "c.py", "c3\n", "C3\n")
    ref = {"tag": "v1", "branch": "release", "commit": context.commit}[ref_kind]
    done = context.build(ref, tag)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert log.index("applied  0010-a.patch") < log.index("applied  0020-c.patch")
    shown = docker("run", "--rm", tag, "sh", "-c",
                   "cat /src/vllm/a.py /src/vllm/c.py; git -C /src/vllm rev-parse HEAD")
    assert shown.returncode == 0, shown.stderr
    assert "A3\n" in shown.stdout and "C3\n" in shown.stdout
    # The ref's own content: main's later commit is not in the build.
    assert "after v1" not in shown.stdout
    assert shown.stdout.strip().endswith(context.commit)


def test_overlay_mounts_through_the_vllm_package_symlink(tmp_path: Path, tag: str) -> None:
    """Compose mounts overlays at /opt/vllm-package/...; Docker must follow that symlink."""
    need(docker_ok(), f"a Docker engine and the {BASE_IMAGE} image are needed")
    link_line = next(line for line in (ROOT / "Dockerfile.fullbuild").read_text().splitlines()
                     if line.startswith("RUN ln -sfn") and "/opt/vllm-package" in line)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    # A stand-in vllm package in site-packages, linked by the runtime stage's own command.
    (ctx / "Dockerfile").write_text(
        f"FROM {BASE_IMAGE}\n"
        "RUN ln -s /usr/bin/python3 /usr/local/bin/python \\\n"
        " && site=$(python3 -c 'import sysconfig; print(sysconfig.get_path(\"purelib\"))') \\\n"
        " && mkdir -p $site/vllm/entrypoints \\\n"
        " && echo 'VALUE = \"upstream\"' > $site/vllm/entrypoints/protocol.py \\\n"
        " && touch $site/vllm/__init__.py $site/vllm/entrypoints/__init__.py\n"
        f"{link_line}\n")
    built = docker("build", "-t", tag, str(ctx))
    assert built.returncode == 0, built.stdout + built.stderr
    overlay = tmp_path / "protocol.py"
    overlay.write_text('VALUE = "overlay"\n')
    probe = "import vllm.entrypoints.protocol as p; print(p.VALUE, p.__file__)"
    plain = docker("run", "--rm", tag, "python3", "-c", probe)
    assert plain.stdout.startswith("upstream "), plain.stderr
    mounted = docker("run", "--rm", "-v",
                     f"{overlay}:/opt/vllm-package/entrypoints/protocol.py:ro", tag,
                     "python3", "-c", probe)
    assert mounted.returncode == 0, mounted.stderr
    # Imported from the real site-packages path, with the overlay's content.
    assert mounted.stdout.startswith("overlay /usr/"), mounted.stdout


def test_cpu_target_fetches_the_pinned_sdist_and_patches_the_verified_tree(tmp_path: Path) -> None:
    """`invoke build --platform cpu --target vllm-source`: the real command up to the patch stage.

    The sdist is checked against its pin inside the build and made into the same commit the host
    verified the patches on; the patch-set sum the wheel version takes is the label's."""
    need(docker_ok(), f"a Docker engine and the {BASE_IMAGE} image are needed")
    root = helpers.copy_project(tmp_path / "stack")
    for name in (build.BUILD_FILE, ".dockerignore"):
        shutil.copy(ROOT / name, root / name)
    (root / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "apply-patches.py", root / "scripts" / "apply-patches.py")
    inputs = ROOT / ".cache" / cpu.INPUTS
    if inputs.is_dir():  # what an earlier build fetched (else the command downloads it)
        (root / ".cache" / cpu.INPUTS).mkdir(parents=True)
        for path in inputs.iterdir():
            os.link(path, root / ".cache" / cpu.INPUTS / path.name)
    tag = f"vllmstack-test/cpu-source:{uuid.uuid4().hex[:10]}"
    helpers.write_dotenv(root, {"PLATFORM": "cpu", "MODEL_PROFILE": "tiny", "VLLM_IMAGE": tag,
                                "DOCKER": helpers.DOCKER})
    try:
        done = subprocess.run([sys.executable, "-m", "invoke", "build", "--target", "vllm-source"],
                              cwd=root, capture_output=True, text=True, timeout=1200, check=False)
        log = done.stdout + done.stderr
        assert done.returncode == 0, log[-4000:]
        labels = json.loads(docker("image", "inspect", "--format", "{{json .Config.Labels}}",
                                   tag, timeout=30).stdout)
        assert labels["vllmstack.target"] == "cpu"
        # (The steps may come from the layer cache, so the image is read, not the log.)
        shown = docker("run", "--rm", tag, "sh", "-c", "cat /src/vllm-patchset.sha256; "
                       "git -C /src/vllm rev-parse HEAD; git -C /src/vllm diff --name-only")
        patchset, commit, *changed = shown.stdout.split()
        assert patchset == labels["vllmstack.patches.vllm"]
        assert commit == labels["vllmstack.commit.vllm"]  # the tree the patches were verified on
        assert labels["vllmstack.vllm-wheel-version"].endswith(f"+cpu.p{patchset[:8]}")
        # Every listed patch was applied: its files differ from the sdist's.
        for name in labels["vllmstack.patch-list.vllm"].split(","):
            text = (root / "patches" / "vllm" / name).read_text()
            for path in re.findall(r"^\+\+\+ b/(\S+)", text, re.M):
                assert path in changed, (name, path)
    finally:
        docker("image", "rm", "-f", tag)

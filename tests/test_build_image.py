"""invoke build: pins to build args, labels, fail-fast verification, and stale-image findings."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from vllmstack.config.profiles import resolve
from vllmstack.config.schema import load_schema
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result, SubprocessRunner
from vllmstack.image import build, cpu
from vllmstack.image.patches import VerifyReport, patch_set_hash

ROOT = Path(__file__).resolve().parents[1]
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}


@pytest.fixture
def proj(project: Project) -> Project:
    """The throwaway project with the shipped Dockerfile, script and patch folders."""
    shutil.copy(ROOT / build.BUILD_FILE, project.root / build.BUILD_FILE)
    (project.root / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "apply-patches.py", project.root / "scripts")
    return project


def without_patches(project: Project) -> Project:
    for path in (project.patches / "vllm").glob("*.patch"):
        path.unlink()
    (project.patches / "vllm" / "overlays.toml").unlink()
    return project


def test_every_build_arg_key_is_a_dockerfile_arg_and_back() -> None:
    declared = set(re.findall(r"^ARG (\w+)", (ROOT / build.BUILD_FILE).read_text(), re.M))
    keys = set(build.build_arg_keys())
    assert keys <= declared, keys - declared
    # The Dockerfile-only knobs: the stage selectors and target flags invoke build derives (the
    # cpu target's torch and sdist pin are derived from the pinned source, not settings).
    extra = declared - keys
    derived = set()
    for target in build.TARGETS.values():
        resolved = resolve(Project(ROOT), platform="cpu" if target.name == "cpu" else "r9700",
                           environ={})
        inputs = cpu_inputs(Path("/nonexistent")) if target.name == "cpu" else None
        derived |= set(build.target_args(Project(ROOT), resolved, target, inputs))
    assert derived <= declared and extra == derived - keys
    for arg, stage in build.FETCH_ARGS.values():
        text = (ROOT / build.BUILD_FILE).read_text()
        assert f"AS {stage}-local" in text and f"AS {stage}-remote" in text, arg


def cpu_inputs(folder: Path) -> cpu.SourceInputs:
    return cpu.SourceInputs(folder, folder / "vllm-0.31.0.tar.gz", "ab" * 32, "2.13.0+cpu", "cd" * 32)


def test_build_arg_keys_follow_the_schema() -> None:
    schema = load_schema()
    keys = build.build_arg_keys(schema)
    assert keys[:2] == ["ROCM_IMAGE", "GPU_ARCH"]
    assert {"VLLM_REF", "AITER_REF", "FLASH_ATTN_REF", "FLYDSL_VERSION"} <= set(keys)
    assert all(schema.keys[k].becomes == "build-arg" for k in keys)


@pytest.mark.parametrize(
    ("image", "version", "commit", "expected"),
    [
        ("docker.io/rocm/dev-ubuntu-24.04:10.1.0-full", "0.31.0", "", "0.31.0+rocm101.gfx1201.p1a2b3c4d"),
        ("localhost:5000/rocm/dev:7.2.3-complete", "0.31.0", "abc", "0.31.0+rocm72.gfx1201.p1a2b3c4d"),
        ("rocm/dev:10.1.0", "0.32.0.dev12", "0123456789abcdef",
         "0.32.0.dev12+g0123456789ab.rocm101.gfx1201.p1a2b3c4d"),
    ],
)
def test_wheel_version_names_the_target_and_the_patch_set(image: str, version: str, commit: str,
                                                          expected: str) -> None:
    patches = "1a2b3c4d" + "0" * 56
    target = build.rocm_wheel_target(image, "gfx1201")
    assert build.wheel_version(version, target, patches, commit) == expected
    assert build.wheel_version("0.31.0", "cpu", patches) == "0.31.0+cpu.p1a2b3c4d"


def test_wheel_version_refuses_an_unreadable_rocm_tag() -> None:
    with pytest.raises(build.BuildError, match=r"tag must start with X\.Y"):
        build.rocm_wheel_target("localhost:5000/rocm/dev:latest", "gfx1201")


def test_pin_findings_catch_empty_pins_bad_tags_and_unreachable_local_repos(proj: Project) -> None:
    resolved = resolve(proj, overrides=["FLYDSL_VERSION=", "ROCM_IMAGE=rocm/dev:latest",
                                        "VLLM_REPO=/home/me/vllm"], environ={})
    found = {(f.code, f.key): f for f in build.pin_findings(proj, resolved)}
    assert found[("empty-pin", "FLYDSL_VERSION")].source == "--set"
    assert ("rocm-image-tag", "ROCM_IMAGE") in found
    local = found[("local-repo-outside-context", "VLLM_REPO")]
    assert "git clone --bare /home/me/vllm upstream/vllm" in (local.fix or "")
    (proj.root / "upstream" / "vllm").mkdir(parents=True)
    resolved = resolve(proj, overrides=["VLLM_REPO=upstream/vllm"], environ={})
    assert build.pin_findings(proj, resolved) == []


def test_plan_passes_every_pin_labels_and_buildkit(proj: Project) -> None:
    without_patches(proj)
    resolved = resolve(proj, platform="strix-halo", overrides=["DOCKER=/usr/bin/docker"],
                       environ={})
    plan = build.plan_build(proj, resolved, VerifyReport([]))
    argv = plan.argv
    assert argv[:5] == ["env", "DOCKER_BUILDKIT=1", "/usr/bin/docker", "build", "--progress=plain"]
    assert argv[argv.index("--file") + 1] == str(proj.root / "Dockerfile.fullbuild")
    assert argv[-1] == str(proj.root)
    args = dict(a.split("=", 1) for a in _values(argv, "--build-arg"))
    rocm = build.TARGETS["rocm"]
    assert set(args) == set(build.pin_keys(rocm)) | set(build.target_args(proj, resolved, rocm))
    assert not {"ONEDNN_REPO", "ONEDNN_REF"} & set(args)  # the cpu target's pins only
    for key in build.pin_keys(rocm):
        assert args[key] == (resolved.get(key) or ""), key
    assert args["GPU_ARCH"] == "gfx1151"  # from the platform layer
    assert (args["FRAMEWORK"], args["DEPENDENCIES"], args["PLATFORM_RUNTIME"]) == (
        "framework-rocm", "dependencies-rocm", "runtime-rocm")
    assert (args["VLLM_TARGET_DEVICE"], args["VLLM_WHEEL_TARGET"]) == ("rocm", "rocm101.gfx1151")
    assert args["BASE_IMAGE"] == args["ROCM_IMAGE"] and args["VLLM_FETCH"] == "vllm-remote"
    labels = dict(a.split("=", 1) for a in _values(argv, "--label"))
    assert labels == plan.labels
    assert labels["vllmstack.pin.vllm_ref"] == "v0.31.0"
    assert labels["vllmstack.target"] == "rocm"
    assert labels["vllmstack.vllm-package"] == "/opt/vllm-package"
    patches = patch_set_hash(proj.patches / "vllm")
    assert labels["vllmstack.vllm-wheel-version"] == f"0.31.0+rocm101.gfx1151.p{patches[:8]}"
    assert labels["vllmstack.patches.vllm"] == patches
    assert labels["vllmstack.patch-list.vllm"] == ""  # without_patches
    assert "--no-cache" not in argv and "--target" not in argv
    rebuild = build.plan_build(proj, resolved, VerifyReport([]), no_cache=True,
                               target="vllm-source").argv
    assert "--no-cache" in rebuild and rebuild[rebuild.index("--target") + 1] == "vllm-source"


def test_plan_selects_the_local_fetch_stage_for_upstream_folder(proj: Project) -> None:
    without_patches(proj)
    (proj.root / "upstream" / "vllm").mkdir(parents=True)
    resolved = resolve(proj, overrides=["VLLM_REPO=upstream/vllm"], environ={})
    argv = build.plan_build(proj, resolved, VerifyReport([])).argv
    assert "VLLM_FETCH=vllm-local" in _values(argv, "--build-arg")
    assert "AITER_FETCH=aiter-remote" in _values(argv, "--build-arg")


def _values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_build_runs_docker_once_verification_is_clean(proj: Project) -> None:
    without_patches(proj)
    runner = RecordingRunner()
    said: list[str] = []
    outcome = build.build_image(proj, resolve(proj, environ={}), runner, environ={"PATH": "/bin"},
                                say=said.append)
    assert outcome.ok and said and "nothing to verify" in said[0]
    assert len(runner.calls) == 1 and runner.calls[0][:4] == ("env", "DOCKER_BUILDKIT=1",
                                                              "docker", "build")


def test_dry_run_prints_the_exact_build_command(proj: Project) -> None:
    import io

    without_patches(proj)
    out = io.StringIO()
    runner = SubprocessRunner(dry_run=True, out=out)
    outcome = build.build_image(proj, resolve(proj, environ={}), runner, environ={},
                                say=lambda _: None)
    assert outcome.ok
    line = out.getvalue().strip()
    assert line.startswith(f"cd {proj.root} && env DOCKER_BUILDKIT=1 docker build ")
    assert "--build-arg VLLM_REF=v0.31.0" in line


def test_build_stops_before_docker_when_a_patch_fails(proj: Project) -> None:
    upstream = proj.root / "upstream" / "vllm"
    upstream.mkdir(parents=True)
    (upstream / "vllm").mkdir()
    (upstream / "vllm" / "a.py").write_text("one\ntwo\nthree\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "v1"], ["tag", "v1"]):
        subprocess.run(["git", "-C", str(upstream), *args], env=GIT_ENV, check=True)
    without_patches(proj)
    (proj.patches / "vllm" / "0010-bad.patch").write_text(
        "Subject: s\nWhy: w\nUpstream: u\nMade-for: v1\nDrop-when: d\n\n"
        "--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -1,3 +1,3 @@\n one\n-TWO\n+2\n three\n")
    real = SubprocessRunner()

    def passthrough(argv: tuple[str, ...]) -> Result:
        return real.run(argv)

    runner = RecordingRunner()
    runner.respond(["git"], passthrough)
    runner.respond([sys.executable], passthrough)
    resolved = resolve(proj, overrides=["VLLM_REPO=upstream/vllm", "VLLM_REF=v1"], environ={})
    outcome = build.build_image(proj, resolved, runner, environ={}, say=lambda _: None)
    assert not outcome.ok and outcome.result is None
    assert outcome.report is not None and outcome.report.failed
    assert not any("build" in call for call in runner.calls)
    [status] = outcome.report.components[0].patches
    assert status.status == "fails" and "vllm/a.py hunk 1/1" in status.detail


def test_read_image_labels(proj: Project) -> None:
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect"],
                   Result((), 0, json.dumps({"vllmstack.pin.vllm_ref": "v0.31.0"})))
    assert build.read_image_labels(runner, "docker", "img") == {"vllmstack.pin.vllm_ref": "v0.31.0"}
    assert runner.calls[0] == ("docker", "image", "inspect", "--format",
                               "{{json .Config.Labels}}", "img")
    runner.respond(["docker", "image", "inspect"], Result((), 0, "null"))
    assert build.read_image_labels(runner, "docker", "img") == {}
    runner.respond(["docker", "image", "inspect"], Result((), 1, "", "No such image: img"))
    assert build.read_image_labels(runner, "docker", "img") is None


# --- stale-image findings ------------------------------------------------------------------

def labels_for(project: Project, base: str) -> dict[str, str]:
    """Labels as a build of the current settings would write them."""
    resolved = resolve(project, environ={})
    report = VerifyReport([])
    labels = build.image_labels(project, resolved, report)
    target = "vllm/entrypoints/openai/chat_completion/protocol.py"
    labels["vllmstack.overlay-bases"] = json.dumps({target: base})
    return labels


SHIPPED_BASE = "4bdc71f668e4820d8ae5bae2a153fed0296b430cd6353ace8c0c27cfb982ebc1"


def codes(project: Project, labels: dict[str, str] | None, *sets: str) -> list[str]:
    resolved = resolve(project, overrides=list(sets), environ={})
    return [f.code for f in build.image_label_findings(project, resolved, labels)]


def test_fresh_image_has_no_findings(proj: Project) -> None:
    assert codes(proj, labels_for(proj, SHIPPED_BASE)) == []


def test_missing_or_foreign_image_is_only_info(proj: Project) -> None:
    resolved = resolve(proj, environ={})
    [missing] = build.image_label_findings(proj, resolved, None)
    assert (missing.severity, missing.code, missing.fix) == ("info", "image-missing",
                                                            "invoke build")
    [foreign] = build.image_label_findings(proj, resolved, {"maintainer": "someone"})
    assert (foreign.severity, foreign.code) == ("info", "image-unlabelled")


def test_changed_pin_is_a_warning_naming_key_and_source(proj: Project) -> None:
    resolved = resolve(proj, overrides=["VLLM_REF=v0.32.0", "MAX_JOBS=4"], environ={})
    found = build.image_label_findings(proj, resolved, labels_for(proj, SHIPPED_BASE))
    [pin] = found  # MAX_JOBS does not change what is built
    assert (pin.severity, pin.code, pin.key, pin.source) == ("warning", "image-pin-mismatch",
                                                             "VLLM_REF", "--set")
    assert "VLLM_REF='v0.31.0'" in pin.message and "'v0.32.0'" in pin.message


def test_changed_patches_and_dockerfile_are_warnings(proj: Project) -> None:
    labels = labels_for(proj, SHIPPED_BASE)
    patch = next((proj.patches / "vllm").glob("*.patch"))
    patch.write_text(patch.read_text().replace("Why:", "Why: (edited)"))
    (proj.root / build.BUILD_FILE).write_text("# changed\n")
    assert codes(proj, labels) == ["image-patches-stale", "image-dockerfile-stale"]


def test_overlay_derived_from_other_upstream_file_is_a_warning(proj: Project) -> None:
    labels = labels_for(proj, "0" * 64)
    labels["vllmstack.overlay-lock"] = "old"
    resolved = resolve(proj, environ={})
    [finding] = build.image_label_findings(proj, resolved, labels)
    assert finding.code == "overlay-base-mismatch"
    assert finding.source == "patches/vllm/overlays.toml:10"
    assert "would replace the image's code" in finding.message


def test_overlay_added_after_the_build_is_checked_against_the_image_ref(proj: Project) -> None:
    labels = labels_for(proj, SHIPPED_BASE)
    labels["vllmstack.overlay-lock"] = "old"
    labels["vllmstack.overlay-bases"] = "{}"
    assert codes(proj, labels) == ["image-overlays-stale"]
    labels["vllmstack.pin.vllm_ref"] = "v0.30.0"
    assert codes(proj, labels, "VLLM_REF=v0.30.0") == ["overlay-ref-mismatch"]


def test_malformed_manifest_is_an_error_finding(proj: Project) -> None:
    labels = labels_for(proj, SHIPPED_BASE)
    manifest = proj.patches / "vllm" / "overlays.toml"
    manifest.write_text(manifest.read_text().replace("base_sha256", "base_sha"))
    assert codes(proj, labels) == ["overlay-manifest"]


# --- the cpu target ---------------------------------------------------------------------------

CPU_TXT = ('-r common.txt\ntorch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == '
           '"aarch64"\ntorch==2.13.0; platform_system == "Darwin"\n')


def fake_sdist(folder: Path, version: str = "0.31.0") -> Path:
    """A vLLM sdist as PyPI ships it: vllm-X/ with requirements/cpu.txt and a source file."""
    import io
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vllm-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in ((f"vllm-{version}/requirements/cpu.txt", CPU_TXT),
                           (f"vllm-{version}/vllm/a.py", "one\ntwo\nthree\n")):
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def cpu_project(proj: Project, monkeypatch: pytest.MonkeyPatch) -> Path:
    without_patches(proj)
    sdist = fake_sdist(proj.cache / cpu.INPUTS)
    from vllmstack.image import sources

    monkeypatch.setitem(sources.VLLM_SDIST_SHA256, "0.31.0", sources.file_sha256(sdist))
    (proj.patches / "vllm" / "0010-a.patch").write_text(
        "Subject: s\nWhy: w\nUpstream: u\nMade-for: v0.31.0\nDrop-when: d\n\n"
        "--- a/vllm/a.py\n+++ b/vllm/a.py\n@@ -1,3 +1,3 @@\n one\n-two\n+2\n three\n")
    return sdist


class GitRunner(RecordingRunner):
    """Records every command; git and the patch tool really run, with their own cwd and env
    (an sdist is made into a repository by commands that rely on their cwd)."""

    def run(self, argv: Sequence[str], **kwargs: Any) -> Result:
        recorded = super().run(argv, **kwargs)
        if argv[0] == "git" or str(argv[1:2]).endswith("apply-patches.py']"):
            allowed = {k: kwargs[k] for k in ("capture", "check", "env", "cwd", "timeout") if k in kwargs}
            return SubprocessRunner().run(argv, **allowed)
        return recorded


def test_cpu_target_builds_the_pinned_sdist_verified_with_the_patch_series(
        proj: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_project(proj, monkeypatch)
    monkeypatch.chdir(proj.root)  # git never runs in the checkout, whatever a command's cwd
    runner = GitRunner()

    def pip_download(argv: tuple[str, ...]) -> Result:
        dest = Path(argv[argv.index("--dest") + 1])
        (dest / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"wheel")
        return Result(argv, 0)

    runner.respond([sys.executable, "-m", "pip", "download"], pip_download)
    resolved = resolve(proj, platform="cpu", model="tiny", overrides=["GPU_ARCH="], environ={})
    said: list[str] = []
    outcome = build.build_image(proj, resolved, runner, environ={}, say=said.append)
    assert outcome.ok, ([f.render() for f in outcome.findings], said)
    [download] = [c for c in runner.calls if c[1:4] == ("-m", "pip", "download")]
    assert download[-1] == "torch==2.13.0+cpu"  # the sdist's own CPU pin, for the image's Python
    assert outcome.report is not None
    names = [c.name for c in outcome.report.components]
    assert "vllm" in names and not {"aiter", "flash-attention"} & set(names)  # not this target's
    [status] = outcome.report.components[0].patches
    assert status.status == "applies"  # verified on the sdist's tree, offline
    docker = runner.calls[-1]
    assert docker[docker.index("--file") + 1] == str(proj.root / build.BUILD_FILE)
    args = dict(docker[i + 1].split("=", 1) for i, a in enumerate(docker) if a == "--build-arg")
    assert args["BASE_IMAGE"] == cpu.DEBIAN_BASE and args["FRAMEWORK"] == "framework-cpu"
    assert (args["VLLM_FETCH"], args["TORCH_VERSION"], args["VLLM_TARGET_DEVICE"]) == (
        "vllm-sdist", "2.13.0+cpu", "cpu")
    assert "FETCHCONTENT_FULLY_DISCONNECTED=ON" in args["VLLM_CMAKE_ARGS"]
    assert not {"ROCM_IMAGE", "GPU_ARCH", "TORCH_INDEX_URL"} & set(args)  # no ROCm pin read
    labels = outcome.plan.labels if outcome.plan else {}
    assert labels["vllmstack.patch-list.vllm"] == "0010-a.patch"
    assert labels["vllmstack.commit.vllm"] == outcome.report.components[0].commit
    assert labels["vllmstack.vllm-wheel-version"] == (
        f"0.31.0+cpu.p{patch_set_hash(proj.patches / 'vllm')[:8]}")
    assert labels["vllmstack.torch"] == "2.13.0+cpu"


def test_cpu_target_refuses_a_ref_that_is_not_the_release_and_an_unpinned_sdist(
        proj: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_project(proj, monkeypatch)
    resolved = resolve(proj, platform="cpu", overrides=["VLLM_REF=main"], environ={})
    [finding] = build.pin_findings(proj, resolved)
    assert (finding.code, finding.key, finding.source) == ("cpu-ref-not-release", "VLLM_REF", "--set")
    resolved = resolve(proj, platform="cpu", overrides=["VLLM_VERSION=0.1.0", "VLLM_REF=v0.1.0"],
                       environ={})
    runner = RecordingRunner()
    outcome = build.build_image(proj, resolved, runner, environ={}, say=lambda _: None)
    [finding] = outcome.findings
    assert finding.code == "vllm-sdist-pin" and "VLLM_SDIST_SHA256" in (finding.fix or "")
    assert outcome.result is None and runner.calls == []


def test_cpu_image_findings_compare_the_cpu_pins_only(proj: Project) -> None:
    resolved = resolve(proj, platform="cpu", environ={})
    inputs = cpu.SourceInputs(proj.cache, proj.cache / "x.tar.gz", "ab" * 32, "2.13.0+cpu", "")
    labels = build.image_labels(proj, resolved, VerifyReport([]), inputs=inputs)
    assert build.image_label_findings(proj, resolved, labels) == []  # no ROCm pin is missed
    changed = resolve(proj, platform="cpu", overrides=["ONEDNN_REF=" + "1" * 40], environ={})
    assert [f.key for f in build.image_label_findings(proj, changed, labels)] == ["ONEDNN_REF"]
    rocm_labels = labels_for(proj, SHIPPED_BASE)  # an image of the rocm target
    [finding] = build.image_label_findings(proj, resolved, rocm_labels)
    assert finding.code == "image-target-mismatch"


def test_a_mirror_of_the_same_pinned_commit_is_no_reason_to_rebuild(proj: Project) -> None:
    # The offline cpu build takes oneDNN from a local mirror (ONEDNN_REPO=upstream/onednn) at the
    # pinned commit; `up` with the default repository then warned "invoke rebuild" (an hour).
    mirror = resolve(proj, platform="cpu", overrides=["ONEDNN_REPO=upstream/onednn"], environ={})
    inputs = cpu.SourceInputs(proj.cache, proj.cache / "x.tar.gz", "ab" * 32, "2.13.0+cpu", "")
    labels = build.image_labels(proj, mirror, VerifyReport([]), inputs=inputs)
    assert build.image_label_findings(proj, resolve(proj, platform="cpu", environ={}), labels) == []
    # Another commit still is (both differ then); so is another repository where the ref is a
    # tag, which that repository can move.
    moved = resolve(proj, platform="cpu", overrides=["ONEDNN_REF=" + "1" * 40], environ={})
    assert [f.key for f in build.image_label_findings(proj, moved, labels)] == ["ONEDNN_REPO",
                                                                                "ONEDNN_REF"]
    fork = resolve(proj, overrides=["VLLM_REPO=https://example.com/fork/vllm.git"], environ={})
    [finding] = build.image_label_findings(proj, fork, labels_for(proj, SHIPPED_BASE))
    assert (finding.code, finding.key) == ("image-pin-mismatch", "VLLM_REPO")

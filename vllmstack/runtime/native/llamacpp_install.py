"""`invoke install-engine --engine llamacpp --backend cpu|cuda|rocm|vulkan`: llama-server from the
pinned source.

Only the `llama-server` target is built, with cmake, from the patched tree of
vllmstack.image.llamacpp_source, into .cache/engines/llamacpp-<ref>-<backend>/ (the folder
vllmstack.runtime.native.llamacpp_build names): bin/llama-server (linked statically against
llama.cpp's own libraries; shared ones, should extra arguments ask for them, go beside it), and
build.json (ref, sdist sha256, backend, cmake arguments, compiler, seconds, date), written last.

The cmake build folder (.cache/engines/llamacpp-<ref>-<backend>.build) survives a failed or
interrupted run, so the next one resumes instead of compiling everything again (a CPU build is
about 15 minutes on 2 cores); it is removed after a build succeeds. The result is assembled in a
.partial folder and renamed into place, so a reader never sees half an engine. A second install
of the same ref and backend is a no-op unless `force`.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from vllmstack.config.engines.llamacpp import llamacpp_backend
from vllmstack.config.profiles import Resolved
from vllmstack.core.checkout import holds_stack_lock
from vllmstack.core.cpu import cpu_flags
from vllmstack.core.errors import StackError
from vllmstack.core.files import JsonFileError, read_json_file, write_json
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner, format_command
from vllmstack.core.store import Key, link_entry, open_store, users
from vllmstack.image.llamacpp_source import (
    TARGET,
    cmake_args,
    patch_folder,
    pinned_sha256,
    prepare_source,
    source_dir,
)
from vllmstack.image.patches import patch_set_hash
from vllmstack.runtime.native.install import check_not_in_use
from vllmstack.runtime.native.llamacpp_build import BUILD_INFO, build_dir, read_build_info

ARGS_FILE = "vllmstack-cmake-args.json"  # in the build folder: the arguments it was configured with
# What a backend needs installed to build, for the error when cmake's configure step fails.
NEEDS = {
    "cpu": "cmake and a C++ compiler (Debian/Ubuntu: apt install cmake g++)",
    "cuda": "cmake, g++ and the CUDA toolkit with nvcc on PATH (or CUDACXX set)",
    "rocm": "cmake and ROCm's HIP SDK (hipconfig on PATH; or HIPCXX and HIP_PATH set)",
    "vulkan": "cmake, g++, the Vulkan headers and glslc (Debian/Ubuntu: apt install "
              "libvulkan-dev glslc)",
}


class LlamaInstallError(StackError):
    """llama-server cannot be built as asked; `fix` says what to do."""


def current_patch_set(project: Project) -> str:
    """The hash of patches/llamacpp's patches ("" without the folder): a build records it."""
    folder = patch_folder(project)
    return patch_set_hash(folder) if folder.is_dir() else ""


def installed_llamacpp(project: Project, ref: str, backend: str) -> Path | None:
    """The finished build of `ref` for `backend` with today's patches (its folder), or None."""
    folder = build_dir(project, ref, backend)
    info = read_build_info(folder)
    if info is None or not (folder / "bin" / TARGET).is_file():
        return None
    if str(info.get("ref")) != ref or info.get("backend") != backend:
        return None
    if info.get("patch_set", "") != current_patch_set(project):
        return None  # patches/llamacpp changed since: the next install builds again
    return folder


def hip_environment(runner: Runner, environ: Mapping[str, str]) -> dict[str, str]:
    """HIPCXX and HIP_PATH as the pinned docs set them (from hipconfig), unless already set."""
    env: dict[str, str] = {}
    for key, flag, suffix in (("HIPCXX", "-l", "/clang"), ("HIP_PATH", "-R", "")):
        if environ.get(key):
            continue
        found = runner.run(["hipconfig", flag], env=dict(environ), mutates=False, timeout=60)
        if found.ok and found.stdout.strip():
            env[key] = found.stdout.strip() + suffix
    return env


def compiler_info(build: Path) -> dict[str, str]:
    """The compilers cmake chose (id and version per language), from its CMakeFiles/<ver>/."""
    found: dict[str, str] = {}
    for path in sorted(build.glob("CMakeFiles/*/CMake*Compiler.cmake")):
        text = path.read_text(errors="replace")
        lang = path.name.removeprefix("CMake").removesuffix("Compiler.cmake")
        ident = re.search(r'set\(CMAKE_\w+_COMPILER_ID "([^"]*)"\)', text)
        version = re.search(r'set\(CMAKE_\w+_COMPILER_VERSION "([^"]*)"\)', text)
        if ident or version:
            found[lang] = " ".join(m.group(1) for m in (ident, version) if m).strip()
    return found


@holds_stack_lock("install-engine")  # never while this stack's `up`/`down` starts or stops it
def install_llamacpp(project: Project, runner: Runner, *, ref: str, backend: str,
                     environ: Mapping[str, str], out: TextIO, jobs: int | None = None,
                     gpu_arch: str = "", cuda_arch: str = "", extra_args: Sequence[str] = (),
                     force: bool = False, dry_run: bool = False, stream: bool = True) -> Path:
    """Build llama-server for `backend` from the pinned source of `ref`; returns its folder.

    `cuda_arch` is CMAKE_CUDA_ARCHITECTURES (default: CUDAARCHS from the environment, else
    "native"); `gpu_arch` the gfx target of a ROCm build (GPU_ARCH). `stream` lets the compiler's
    output reach the terminal; without it the tail of the output goes into the error."""
    dry_run = dry_run or runner.dry_run
    args = cmake_args(backend, ref=ref, gpu_arch=gpu_arch,
                      cuda_arch=cuda_arch or environ.get("CUDAARCHS", ""), extra=extra_args)
    folder = build_dir(project, ref, backend)

    def say(line: str) -> None:
        print(("(dry run) " if dry_run else "") + line, file=out)

    existing = installed_llamacpp(project, ref, backend)
    if existing is None and read_build_info(folder) is not None:
        say(f"{folder} was built from other patches or for another ref or backend: building again")
    if existing is not None and not force:
        built = read_build_info(existing) or {}
        say(f"llama.cpp {ref} for {backend} is already built in {existing} "
            f"({built.get('date', '?')}); --force builds it again")
        return existing
    if folder.exists() and not dry_run:
        check_not_in_use(project, folder)  # before compiling for minutes, not after
    if shutil.which("cmake", path=environ.get("PATH")) is None and not dry_run:
        raise LlamaInstallError("cmake is not installed, so llama-server cannot be built",
                                f"install {NEEDS[backend]}")
    store = open_store(environ)
    entry = store.entry(llamacpp_key(project, ref, backend, args, environ)) if store else None
    if entry is not None and entry.is_complete() and not force:
        if not dry_run:
            link_entry(folder, entry.path)
        say(f"llama.cpp {ref} for {backend} is in the build store ({entry.path}): linked {folder}")
        return folder
    # With the store the cmake folder lies beside the entry: a killed build resumes in whichever
    # checkout runs next.
    build = (entry.path.with_name(entry.key.slug + ".build") if entry is not None
             else folder.with_name(folder.name + ".build"))
    source = source_dir(project, ref)
    jobs = jobs or os.cpu_count() or 1
    env = {**environ, **(hip_environment(runner, environ) if backend == "rocm" else {})}
    configure = ["cmake", "-S", str(source), "-B", str(build), *args]
    compile_ = ["cmake", "--build", str(build), "--config", "Release", "--target", TARGET,
                "-j", str(jobs)]
    if dry_run:
        say(f"fetch the pinned sdist of llama.cpp {ref} and apply patches/llamacpp into {source}")
        say(format_command(configure))
        say(format_command(compile_))
        say(f"then copy bin/{TARGET} and its libraries, with {BUILD_INFO}, into "
            + (f"the build store ({entry.path}), linked from {folder}" if entry else str(folder)))
        return folder

    def compile_into(target: Path) -> None:
        _compile(project, runner, ref, backend, target, build, configure, compile_, args, jobs, env,
                 environ, stream, say)

    if entry is None:
        compile_into(folder)
        shutil.rmtree(build, ignore_errors=True)  # the result is in place; the objects are not needed
        return folder
    running = users(entry.path) if force else []
    if running:
        raise LlamaInstallError(f"pid {', '.join(map(str, running))} runs {entry.path}, which "
                                "--force would replace (the build store's, shared by this machine's "
                                "checkouts)", "stop that engine first (invoke down in its checkout)")
    made = entry.store.ensure(entry.key, compile_into, files=[f"bin/{TARGET}", BUILD_INFO],
                              force=force, say=say)
    shutil.rmtree(build, ignore_errors=True)
    if folder.exists() and not folder.is_symlink():
        check_not_in_use(project, folder)
        say(f"replacing the earlier build in {folder} with a link to the build store")
        shutil.rmtree(folder)
    link_entry(folder, made.path)
    say(f"kept in the build store: {made.path} (every checkout on this machine links to it)")
    return folder


def install_from_settings(project: Project, resolved: Resolved, runner: Runner, *,
                          environ: Mapping[str, str], out: TextIO, backend: str | None = None,
                          jobs: int | None = None, cuda_arch: str = "",
                          extra_args: Sequence[str] = (), force: bool = False,
                          dry_run: bool = False, stream: bool = True) -> Path:
    """install_llamacpp with the profile's pins: LLAMACPP_REF, the backend (`backend`, else
    LLAMACPP_BACKEND, else the platform's GPU vendor's) and GPU_ARCH for ROCm."""
    return install_llamacpp(project, runner, ref=resolved.get_str("LLAMACPP_REF"),
                            backend=backend or llamacpp_backend(resolved), environ=environ,
                            out=out, jobs=jobs, gpu_arch=resolved.get_str("GPU_ARCH"),
                            cuda_arch=cuda_arch, extra_args=extra_args, force=force,
                            dry_run=dry_run, stream=stream)


def llamacpp_key(project: Project, ref: str, backend: str, args: Sequence[str],
                 environ: Mapping[str, str]) -> Key:
    """What a build depends on: the source (ref, the sdist's pinned sha256, the patch set), the
    cmake arguments, the compilers cmake finds (their real files), the machine and, since cmake
    compiles for this CPU (GGML_NATIVE is on by default), the CPU's flags."""
    path = environ.get("PATH")
    tools = {}
    for name, default in (("CC", "cc"), ("CXX", "c++"), ("CUDACXX", "nvcc"), ("HIPCXX", "hipconfig")):
        found = shutil.which(environ.get(name) or default, path=path)
        if found:
            real = Path(os.path.realpath(found))
            stat = real.stat()
            tools[name] = f"{real} {stat.st_size} {int(stat.st_mtime)}"
    return Key("llamacpp", f"llamacpp-{ref}-{backend}", {
        "ref": ref, "backend": backend, "sdist_sha256": pinned_sha256(ref),
        "patch_set": current_patch_set(project), "cmake_args": list(args), "tools": sorted(
            f"{k}={v}" for k, v in tools.items()), "machine": platform.machine(),
        "cpu_flags": sorted(cpu_flags())})


def _compile(project: Project, runner: Runner, ref: str, backend: str, folder: Path, build: Path,
             configure: list[str], compile_: list[str], args: list[str], jobs: int,
             env: Mapping[str, str], environ: Mapping[str, str], stream: bool,
             say: Callable[[str], None]) -> None:
    """Configure and build in `build` (kept when a step fails: the next run resumes), check that
    the binary runs, and assemble `folder` with its build.json."""
    prepared = prepare_source(project, runner, ref, environ=environ, say=say)
    _reset_if_reconfigured(build, configure, say)
    say(f"building {TARGET} (llama.cpp {ref}, {backend}) with {jobs} job(s) in {build}")
    started = time.monotonic()
    for step, argv in (("configure", configure), ("build", compile_)):
        result = runner.run(argv, env=env, capture=not stream)
        if not result.ok:
            said = "" if stream else ":\n" + (result.stderr or result.stdout).strip()[-2000:]
            raise LlamaInstallError(
                f"cmake's {step} step failed (exit {result.returncode}); the build folder {build} is "
                f"kept, so the next run resumes{said}",
                (f"install {NEEDS[backend]}, then run it again" if step == "configure" else
                 "read the compiler's error above; a killed compiler (out of memory) needs fewer "
                 "jobs: --jobs 1"))
        if step == "configure":
            write_json(build / ARGS_FILE, configure)
    seconds = time.monotonic() - started
    binary = build / "bin" / TARGET
    version = runner.run([str(binary), "--version"], env=env, mutates=False, timeout=120)
    if not version.ok:
        raise LlamaInstallError(
            f"the built {binary} does not run (exit {version.returncode}): "
            f"{(version.stderr or version.stdout).strip()[-600:]}",
            "install the runtime libraries it names, then run this again with --force")
    info: dict[str, Any] = {
        "engine": "llamacpp", "ref": ref, "backend": backend, "sdist": prepared.sdist.name,
        "sdist_sha256": prepared.sdist_sha256, "patches": prepared.patches,
        "patch_set": current_patch_set(project), "cmake_args": args, "jobs": jobs,
        "compiler": compiler_info(build), "machine": platform.machine(),
        "build_seconds": round(seconds, 1),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "version": (version.stdout + version.stderr).strip().splitlines()[-2:],
    }
    _assemble(project, build, folder, info, say)
    say(f"built {TARGET} in {seconds / 60:.1f} min")


def _reset_if_reconfigured(build: Path, configure: list[str], say: Callable[[str], None]) -> None:
    """A build folder configured with other arguments is started over: CMake's cache would keep
    a value that was dropped from the arguments (say, an extra -DGGML_... of an earlier run)."""
    try:
        before = read_json_file(build / ARGS_FILE, expect_object=False)
    except JsonFileError:
        before = None
    if build.exists() and before != configure:
        say(f"starting the build folder {build} over (configured differently before)")
        shutil.rmtree(build)


def _assemble(project: Project, build: Path, folder: Path, info: dict[str, Any],
              say: Callable[[str], None]) -> None:
    """bin/llama-server and its libraries (links kept) plus build.json, renamed into place."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "bin").mkdir(parents=True)
    libraries = []
    for path in sorted((build / "bin").iterdir()):
        if path.name == TARGET or re.search(r"\.so(\.\d+)*$", path.name):
            shutil.copy2(path, partial / "bin" / path.name, follow_symlinks=False)
            if path.name != TARGET:
                libraries.append(path.name)
    write_json(partial / BUILD_INFO, {**info, "libraries": libraries})
    if folder.exists():
        check_not_in_use(project, folder)
        say(f"replacing the earlier build in {folder}")
        shutil.rmtree(folder)
    partial.rename(folder)


def render_build(folder: Path) -> str:
    """One line per fact of a finished build (for `invoke install-engine --engine llamacpp`)."""
    info = read_build_info(folder) or {}
    compilers = ", ".join(f"{k} {v}" for k, v in (info.get("compiler") or {}).items())
    return "\n".join([
        f"llama-server: {folder / 'bin' / TARGET}",
        f"  llama.cpp {info.get('ref', '?')} for {info.get('backend', '?')} "
        f"({info.get('sdist', '?')}, sha256 {str(info.get('sdist_sha256', '?'))[:12]})",
        f"  patches: {', '.join(info.get('patches') or []) or 'none'}",
        f"  compiler: {compilers or '?'}; {info.get('build_seconds', '?')} s on {info.get('jobs', '?')} "
        f"job(s), {info.get('date', '?')}",
        f"  cmake: {' '.join(info.get('cmake_args') or [])}",
    ])

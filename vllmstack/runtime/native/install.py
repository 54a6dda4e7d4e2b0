"""Engine environments for the native runtime: one virtual environment per engine version.

`invoke install-engine` creates `<project.cache>/engines/vllm-<version>` with the pinned vLLM,
either from the package index (the NVIDIA/CUDA wheel on PyPI) or offline from a folder of
wheels (AMD's per-arch ROCm wheels, or a prebuilt bundle). A manifest written last marks the
environment as complete and records what went in, so a second install into it is refused and
`invoke up --runtime native` knows which binary to run.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError
from vllmstack.core.files import write_json
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime.native.procs import ProcTable
from vllmstack.runtime.native.records import read_record

ENGINES = ("vllm",)
MANIFEST = "vllmstack-engine.json"
# Packages whose versions the install report names (the rest are in the manifest).
REPORTED = ("vllm", "torch", "triton", "transformers", "aiter", "flash-attn", "amdsmi")
# A release or local version (0.31.0, 0.31.0rc1, 0.31.0+rocm7.2): nothing that could walk
# out of the engines folder or reach pip as an option.
VERSION = re.compile(r"^[0-9][0-9A-Za-z.!_-]*(\+[0-9A-Za-z._-]+)?$")
# {name}-{version}(-{build})?-{python tag}-{abi tag}-{platform tag}.whl (PEP 427).
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-"
                   r"(?P<plat>[^-]+)\.whl$")


class EngineInstallError(StackError):
    """The engine cannot be installed as asked; `fix` says what to do instead."""


def engine_version(resolved: Resolved) -> str:
    """The version the native runtime uses: NATIVE_ENGINE_VERSION, else the build pin."""
    return (resolved.get("NATIVE_ENGINE_VERSION") or resolved.get("VLLM_VERSION") or "").strip()


def engine_dir(project: Project, version: str, engine: str = "vllm") -> Path:
    return project.cache / "engines" / f"{engine}-{version}"


def engine_binary(project: Project, version: str) -> Path:
    return engine_dir(project, version) / "bin" / "vllm"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalised (PEP 503)
    version: str
    python_tags: tuple[str, ...]
    abi: str

    @property
    def public_version(self) -> str:
        return self.version.split("+", 1)[0]


def normalise_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_wheel(path: Path) -> Wheel | None:
    match = WHEEL.match(path.name)
    if not match:
        return None
    return Wheel(path, normalise_name(match["name"]), match["version"],
                 tuple(match["py"].split(".")), match["abi"])


def scan_wheels(folder: Path) -> list[Wheel]:
    return [w for w in map(parse_wheel, sorted(folder.glob("*.whl"))) if w is not None]


def wheel_fits_python(wheel: Wheel, python: tuple[int, int]) -> bool:
    """Whether pip on this Python would accept the wheel's python/abi tags."""
    ours = python[0] * 100 + python[1]
    for tag in wheel.python_tags:
        if tag in ("py3", f"py{python[0]}{python[1]}") or tag == f"py{python[0]}":
            return True
        digits = tag[2:]
        if tag.startswith("cp") and digits.isdigit():
            theirs = int(digits[0]) * 100 + int(digits[1:] or 0)
            # abi3 wheels run on their Python and every later one.
            if theirs == ours or (wheel.abi == "abi3" and theirs <= ours):
                return True
    return False


def describe_tags(wheel: Wheel) -> str:
    tags = []
    for tag in wheel.python_tags:
        digits = tag[2:]
        if tag.startswith("cp") and digits.isdigit():
            tags.append(f"CPython {digits[0]}.{digits[1:]}" + (" or later" if wheel.abi == "abi3" else ""))
        else:
            tags.append(tag)
    return ", ".join(tags)


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

    def as_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "version": self.version, "folder": str(self.folder),
                "source": self.source, "python": self.python,
                "installed": {k: v for k, v in self.packages.items() if k in REPORTED},
                "packages": len(self.packages), "seconds": round(self.seconds, 1),
                "replaced": self.replaced, "dry_run": self.dry_run, "notes": self.notes}


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


def pick_engine_wheel(wheels: Path, version: str, python: tuple[int, int]) -> Wheel:
    """The vLLM wheel in `wheels` that pip will install for `version` on `python`, or a clear error."""
    if not wheels.is_dir():
        raise EngineInstallError(f"--wheels {wheels} is not a folder",
                                 "give the folder that holds the .whl files")
    found = scan_wheels(wheels)
    engines = [w for w in found if w.name == "vllm"]
    if not engines:
        names = ", ".join(w.path.name for w in found[:5]) or "no wheels at all"
        raise EngineInstallError(f"{wheels} has no vllm wheel ({names})",
                                 "put the vllm-*.whl file (and its dependencies) into that folder")
    matching = [w for w in engines if w.public_version == version]
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
    """Refuse to replace the environment a running native engine was started from."""
    record = read_record(project)
    if record is None or not record.argv:
        return
    executable = Path(record.argv[0])
    if folder.resolve() in executable.resolve().parents and ProcTable().is_alive(record):
        raise EngineInstallError(
            f"the native engine (pid {record.pid}) runs from {folder}; replacing it under a running "
            "engine breaks it", "stop it first: invoke down")


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
) -> InstallReport:
    """Create the engine's environment and install the pinned engine into it.

    `stream` lets pip's progress reach the terminal; without it (JSON output) pip's output is
    captured and its tail goes into the error.
    """
    if engine not in ENGINES:
        raise EngineInstallError(f"unknown engine {engine!r}", f"use one of: {', '.join(ENGINES)}")
    if not version:
        raise EngineInstallError("no engine version: VLLM_VERSION is not set",
                                 "pass --version (e.g. --version 0.31.0) or set VLLM_VERSION in .env")
    if not VERSION.match(version):
        raise EngineInstallError(f"{version!r} is not a version number", "pass e.g. --version 0.31.0")
    dry_run = runner.dry_run
    folder = engine_dir(project, version, engine)
    py = python_version(runner, python)
    wheel = pick_engine_wheel(wheels, version, py) if wheels is not None else None
    source = f"wheels in {wheels}" if wheels is not None else "package index"
    report = InstallReport(engine, version, folder, source, f"{py[0]}.{py[1]}", dry_run=dry_run)
    if index_deps and wheels is None:
        report.notes.append("--index-deps only matters with --wheels; ignored")

    def say(line: str) -> None:
        print(("(dry run) " if dry_run else "") + line, file=out)

    manifest = read_manifest(folder)
    if manifest is not None:
        if not force:
            raise EngineInstallError(
                f"{engine} {manifest.get('installed', version)} is already installed in {folder} "
                f"(from {manifest.get('source', '?')}, {manifest.get('installed_at', '?')})",
                "use it (invoke up --runtime native), or start over with --force")
        check_not_in_use(project, folder)
        say(f"--force: removing the existing environment {folder}")
        report.replaced = True
    elif folder.exists():
        # No manifest: an earlier install stopped half-way; nothing usable is in there.
        say(f"removing the unfinished environment of an earlier attempt: {folder}")
    if folder.exists() and not dry_run:
        shutil.rmtree(folder)

    started = time.monotonic()
    created = runner.run([python, "-m", "venv", str(folder)], timeout=600)
    if not created.ok:
        raise EngineInstallError(
            f"could not create a virtual environment in {folder}: "
            f"{(created.stderr or created.stdout).strip()[-500:]}",
            "install the venv module (Debian/Ubuntu: apt install python3-venv), or pass --python")
    venv_python = str(folder / "bin" / "python")
    pip = [venv_python, "-m", "pip", "install", "--disable-pip-version-check"]
    if wheels is not None:
        pip += [*([] if index_deps else ["--no-index"]), "--find-links", str(wheels)]
    pip.append(f"{engine}=={version}")
    # User-site packages would shadow the environment's own (a seen huggingface-hub clash).
    pip_env = {**environ, "PYTHONNOUSERSITE": "1", "PIP_NO_INPUT": "1"}
    say(f"installing {engine}=={version} from {source} into {folder}")
    installed = runner.run(pip, capture=not stream, env=pip_env)
    if not installed.ok:
        hint = ("the folder must hold every dependency too (or add --index-deps to take the missing "
                "ones from the package index)" if wheels is not None and not index_deps else
                "read pip's output (no network? use --wheels DIR with downloaded wheels)")
        said = "" if stream else ":\n" + (installed.stderr or installed.stdout).strip()[-1500:]
        raise EngineInstallError(f"pip could not install {engine}=={version} (exit "
                                 f"{installed.returncode}); {folder} is left unfinished{said}", hint)
    if dry_run:
        return report
    if not (folder / "bin" / engine).is_file():
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
    return report


def write_manifest(folder: Path, report: InstallReport, wheel: Wheel | None) -> None:
    """Written last: its presence is what marks the environment as complete and in use."""
    data = {
        "engine": report.engine,
        "version": report.version,
        "installed": report.packages.get(report.engine, report.version),
        "source": report.source,
        "wheel": wheel.path.name if wheel is not None else None,
        "python": report.python,
        "installed_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "packages": report.packages,
    }
    write_json(folder / MANIFEST, data)


def render_install(report: InstallReport, project: Project) -> str:
    try:
        where = str(report.folder.relative_to(project.root))
    except ValueError:
        where = str(report.folder)
    if report.dry_run:
        return f"(dry run) would install {report.engine} {report.version} into {where}"
    engine_version_text = report.packages.get(report.engine, report.version)
    others = [f"{name} {report.packages[name]}" for name in REPORTED
              if name != report.engine and name in report.packages]
    lines = [f"installed {report.engine} {engine_version_text} into {where} in {report.seconds:.0f} s"
             + (" (replaced the previous one)" if report.replaced else ""),
             f"  from:     {report.source}",
             f"  python:   {report.python}",
             f"  packages: {len(report.packages)}" + (f" ({', '.join(others)})" if others else "")]
    lines += [f"note: {note}" for note in report.notes]
    lines.append(f"run it:   invoke up --runtime native   (uses it when NATIVE_ENGINE_VERSION or "
                 f"VLLM_VERSION is {report.version})")
    return "\n".join(lines)

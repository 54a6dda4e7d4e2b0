"""Running a module of this package in the engine's own Python on the host (runtime.base.Beside):
what `calibrate-kv`, and `up` on the native runtime, measure fp8 KV scales with."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import load_schema
from vllmstack.core.paths import Project
from vllmstack.core.runner import Result, Runner
from vllmstack.runtime.base import Beside
from vllmstack.runtime.engine_env import engine_environment
from vllmstack.runtime.native.install import engine_interpreter, engine_version
from vllmstack.runtime.native.procs import NativeError

PACKAGE_PARENT = Path(__file__).resolve().parents[3]
NO_ENGINE_FIX = ("install it (invoke install-engine, --platform cpu for the CPU build), name the "
                 "platform whose engine is installed (--platform cpu), or pass --python with an "
                 "interpreter that has torch and transformers")


def runner_path(environ: Mapping[str, str]) -> str:
    """PYTHONPATH for `python -m vllmstack...` in the engine's Python: the folder that holds this
    package, which is not the project's root when the stack runs from another checkout or an
    installed package (the runner then was "No module named 'vllmstack'")."""
    return os.pathsep.join(p for p in (str(PACKAGE_PARENT), environ.get("PYTHONPATH", "")) if p)


def runner_environment(resolved: Resolved, environ: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment with the engine's settings, this package importable and the
    user's site-packages (~/.local) kept from shadowing the engine's own."""
    return {**environ, "PYTHONNOUSERSITE": "1", **engine_environment(resolved, load_schema()),
            "PYTHONPATH": runner_path(environ)}


def native_beside(project: Project, resolved: Resolved, environ: Mapping[str, str], runner: Runner,
                  python: str | None = None) -> Beside:
    """The engine's interpreter (`python`, else install.engine_interpreter) on the host, which
    sees every host path as it is."""
    interpreter = python or engine_interpreter(project, resolved)
    version = engine_version(resolved)
    if interpreter is None:
        raise NativeError(f"no engine environment for vLLM {version or '(no version)'} to run in",
                          NO_ENGINE_FIX)
    env = runner_environment(resolved, environ)

    def run(args: Sequence[str], _writable: Sequence[Path], timeout: float) -> Result:
        return runner.run([interpreter, *args], env=env, cwd=project.root, timeout=timeout)

    return Beside({"engine": version or "(unset)", "python": interpreter}, runner.dry_run, str, run)

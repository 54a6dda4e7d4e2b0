"""Where `invoke install-engine --engine llamacpp` puts a llama-server build, and what it was built for.

One folder per llama.cpp ref and backend, `.cache/engines/llamacpp-<ref>-<backend>/`, holding
`bin/llama-server` and `build.json` (ref, backend, cmake arguments, ...). A build for another
backend than the platform's would start and then run on the CPU, or not at all, so `up` refuses it
here, before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllmstack.core.files import JsonFileError, read_json_file
from vllmstack.core.paths import Project

BUILD_INFO = "build.json"


def build_dir(project: Project, ref: str, backend: str) -> Path:
    return project.cache / "engines" / f"llamacpp-{ref}-{backend}"


def server_binary(project: Project, ref: str, backend: str) -> Path:
    return build_dir(project, ref, backend) / "bin" / "llama-server"


def read_build_info(folder: Path) -> dict[str, Any] | None:
    """build.json of a finished build, or None (absent, unreadable: not a finished build)."""
    try:
        data = read_json_file(folder / BUILD_INFO)
    except JsonFileError:
        return None
    return data if isinstance(data, dict) else None


def backend_problem(project: Project, ref: str, backend: str) -> tuple[str, str] | None:
    """(cause, fix) when the build in the expected folder is not a finished build of `ref` for
    `backend`; None when it is, or when there is none yet (the missing binary says that)."""
    folder = build_dir(project, ref, backend)
    if not (folder / "bin" / "llama-server").exists():
        return None
    info = read_build_info(folder)
    fix = f"invoke install-engine --engine llamacpp --backend {backend} --force"
    if info is None:
        return (f"{folder} has a llama-server but no readable {BUILD_INFO}: an unfinished or "
                "foreign build", fix)
    built_for, built_ref = str(info.get("backend", "?")), str(info.get("ref", "?"))
    if built_for != backend:
        return (f"the llama-server in {folder} was built for {built_for}, but this platform needs "
                f"{backend} (LLAMACPP_BACKEND)", fix)
    if built_ref != ref:
        return (f"the llama-server in {folder} was built from llama.cpp {built_ref}, not the "
                f"pinned {ref} (LLAMACPP_REF)", fix)
    return None

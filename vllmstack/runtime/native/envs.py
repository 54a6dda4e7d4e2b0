"""The native runtime's engine environments as they lie in .cache/engines: where one is, whether
it is complete (its manifest, written last by install-engine), which one a profile runs, and
`invoke engines`' list. A folder there may be a link into the build store (vllmstack/core/store.py),
shared by the machine's checkouts; everything here follows the link.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.config.profiles import Resolved
from vllmstack.core.files import JsonFileError, read_json_file
from vllmstack.core.paths import Project

MANIFEST = "vllmstack-engine.json"


def engine_version(resolved: Resolved) -> str:
    """The version the native runtime uses: NATIVE_ENGINE_VERSION, else the build pin."""
    return (resolved.get("NATIVE_ENGINE_VERSION") or resolved.get("VLLM_VERSION") or "").strip()


def engine_dir(project: Project, version: str, engine: str = "vllm") -> Path:
    return project.cache / "engines" / f"{engine}-{version}"


def engine_binary(project: Project, version: str) -> Path:
    return engine_dir(project, version) / "bin" / "vllm"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:  # damaged (cut short, deep, not JSON): not a finished install
        data = read_json_file(folder / MANIFEST)
    except JsonFileError:
        return None
    return data if isinstance(data, dict) else None


# --- invoke engines ----------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineEnv:
    """One folder under .cache/engines: complete (a manifest) or left unfinished."""

    folder: Path
    manifest: dict[str, Any] | None

    @property
    def version(self) -> str:
        if self.manifest is not None:
            return str(self.manifest.get("version") or "?")
        return self.folder.name.split("-", 1)[-1]

    def package(self, name: str) -> str | None:
        packages = (self.manifest or {}).get("packages")
        found = packages.get(name) if isinstance(packages, dict) else None
        return str(found) if found else None

    def as_json(self) -> dict[str, Any]:
        data = self.manifest or {}
        return {"folder": str(self.folder), "version": self.version,
                "complete": self.manifest is not None, "vllm": self.package("vllm"),
                "torch": self.package("torch"), "python": data.get("python"),
                "source": data.get("source"), "installed_at": data.get("installed_at"),
                "system_site_packages": bool(data.get("system_site_packages"))}


def list_engines(project: Project) -> list[EngineEnv]:
    root = project.cache / "engines"
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [EngineEnv(folder, read_manifest(folder)) for folder in folders]


def engine_interpreter(project: Project, resolved: Resolved, *, any_installed: bool = False) -> str | None:
    """The Python the profile's engine runs under, for work done beside it (tuning, calibration,
    training): NATIVE_ENGINE_COMMAND's interpreter when it is `<python> -m vllm...`; else the
    install-engine environment of the profile's version; with `any_installed` (work that needs
    torch, not a given vLLM), the newest complete environment here. None: none of these."""
    try:
        words = shlex.split(resolved.get("NATIVE_ENGINE_COMMAND") or "")
    except ValueError:
        words = []  # `invoke check` reports the quoting
    if len(words) >= 2 and words[1] == "-m" and "python" in Path(words[0]).name:
        return words[0]
    version = engine_version(resolved)
    candidate = engine_dir(project, version) / "bin" / "python" if version else None
    if candidate is not None and candidate.is_file():
        return str(candidate)
    others = [env.folder / "bin" / "python" for env in list_engines(project)
              if env.manifest is not None and (env.folder / "bin" / "python").is_file()]
    return str(others[-1]) if any_installed and others else None


def render_engines(envs: list[EngineEnv], used: str) -> str:
    """One line per environment; `used` is the version the current profile runs natively."""
    if not envs:
        return ("no engine environments in .cache/engines\n"
                "install one: invoke install-engine (--platform cpu for vLLM's CPU build)")
    lines = []
    for env in envs:
        mark = "*" if env.version == used else " "
        if env.manifest is None:
            lines.append(f"{mark} {env.folder.name:<24} unfinished (an install stopped half-way; "
                         "install-engine starts it over)")
            continue
        data = env.manifest
        extra = ", system site-packages" if data.get("system_site_packages") else ""
        lines.append(f"{mark} {env.folder.name:<24} vllm {env.package('vllm') or '?':<12} torch "
                     f"{env.package('torch') or '?':<14} python {data.get('python', '?')}{extra}; "
                     f"{data.get('source', '?')}, {data.get('installed_at', '?')}")
    if any(env.version == used for env in envs):
        lines.append(f"* = what the native runtime runs for this profile (vLLM {used})")
    elif used:
        lines.append(f"this profile's native engine, vLLM {used}, is not installed: "
                     f"invoke install-engine --version {used}")
    return "\n".join(lines)

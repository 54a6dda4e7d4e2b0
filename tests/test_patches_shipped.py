"""The shipped patches and overlays against vLLM's real source at the pinned version.

The source is the vLLM sdist from PyPI (the git host is out of reach here),
turned into a git repository tagged v<VLLM_VERSION> and cached under .cache/.
"""

from __future__ import annotations

import ast
import ctypes
import difflib
import os
import subprocess
import sys
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from conftest import need

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner
from vllmstack.image.patches import load_overlays, patch_files, verify_patches
from vllmstack.image.sources import sdist_repo

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "scripts" / "apply-patches.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pinned() -> tuple[str, str]:
    resolved = resolve(Project(ROOT), environ={})
    ref, version = resolved.get("VLLM_REF") or "", resolved.get("VLLM_VERSION") or ""
    assert ref == f"v{version}", "VLLM_REF and VLLM_VERSION must name the same release"
    return ref, version


@pytest.fixture(scope="module")
def vllm_repo(pinned: tuple[str, str]) -> Path:
    try:
        return sdist_repo(ROOT / ".cache", SubprocessRunner(), version=pinned[1],
                          environ=os.environ)
    except (OSError, urllib.error.URLError) as exc:
        need(False, f"the vLLM {pinned[1]} sdist could not be fetched from PyPI: {exc}")
        raise


def test_shipped_patches_and_overlays_verify_clean(project: Project, vllm_repo: Path,
                                                   pinned: tuple[str, str]) -> None:
    assert patch_files(project.patches / "vllm"), "ship at least one real vLLM patch"
    assert load_overlays(project), "ship at least one real overlay"
    # Reuse the repository's mirror cache across runs.
    (ROOT / ".cache").mkdir(exist_ok=True)
    (project.root / ".cache").symlink_to(ROOT / ".cache")
    resolved = resolve(project, environ={})
    report = verify_patches(project, resolved, SubprocessRunner(), environ=os.environ,
                            repos={"vllm": str(vllm_repo)}, tool=TOOL)
    vllm = report.get("vllm")
    assert vllm is not None and vllm.ref == pinned[0] and not vllm.error, vllm
    assert {p.status for p in vllm.patches} <= {"applies", "needs-earlier"}, vllm.patches
    assert [o.status for o in vllm.overlays] == ["ok"] * len(vllm.overlays), vllm.overlays
    assert not report.failed


def test_overlay_changes_only_the_empty_tools_check(vllm_repo: Path,
                                                    pinned: tuple[str, str]) -> None:
    [overlay] = [o for o in load_overlays(Project(ROOT)) if o.name == "tools-empty-list"]
    assert overlay.ref == pinned[0]
    upstream = subprocess.run(["git", "-C", str(vllm_repo), "show", f"{overlay.ref}:{overlay.target}"],
                              capture_output=True, text=True, check=True).stdout
    ours = overlay.file.read_text()
    assert ours.startswith("# SPDX-License-Identifier: Apache-2.0\n"), "keep vLLM's licence header"
    diff = [line for line in difflib.unified_diff(upstream.splitlines(), ours.splitlines(),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    removed = [line[1:].strip() for line in diff if line.startswith("-")]
    added = [line[1:].strip() for line in diff if line.startswith("+")]
    assert removed == ["# Reject empty tools array, matching OpenAI API behavior"]
    code = [line for line in added if not line.startswith("#")]
    assert code == ['if data.get("tools") == [] and data.get("tool_choice") in (None, "none"):',
                    'data.pop("tools")']


def _patched_function(tree: Path, name: str, namespace: dict[str, Any]) -> Any:
    """Compile the module-level functions of vllm/env_override.py without importing torch."""
    source = (tree / "vllm" / "env_override.py").read_text()
    module = ast.parse(source)
    functions = [node for node in module.body if isinstance(node, ast.FunctionDef)]
    exec(compile(ast.Module(body=functions, type_ignores=[]), "env_override.py", "exec"),
         namespace)
    return namespace[name]


def test_rocm_patch_skips_symbol_promotion_only_beside_rocm_sdk(
    vllm_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinned: tuple[str, str]
) -> None:
    tree = tmp_path / "vllm"
    subprocess.run(["git", "clone", "-q", "--shared", "-b", pinned[0], str(vllm_repo), str(tree)],
                   check=True, capture_output=True)
    applied = subprocess.run([sys.executable, str(TOOL), "apply", "--source", str(tree),
                              "--patches", str(ROOT / "patches" / "vllm")],
                             capture_output=True, text=True, check=False)
    assert applied.returncode == 0, applied.stderr
    site = tmp_path / "site"
    torch = site / "torch"
    (torch / "lib").mkdir(parents=True)
    (torch / "version.py").write_text("hip = '7.1.0'\ncuda = None\n")
    (torch / "lib" / "libtorch_cpu.so").write_bytes(b"")
    loads: list[tuple[str, int]] = []
    monkeypatch.setattr(ctypes, "CDLL", lambda path, mode=0: loads.append((path, mode)))

    def promote() -> list[tuple[str, int]]:
        loads.clear()
        namespace: dict[str, Any] = {"os": os, "importlib": __import__("importlib.util")}
        function = _patched_function(tree, "_maybe_promote_torch_symbols_for_rocm", namespace)
        namespace["_get_torch_root"] = lambda: str(torch)
        function()
        return list(loads)

    monkeypatch.delenv("VLLM_ROCM_FORCE_TORCH_SYMBOL_PROMOTION", raising=False)
    # System ROCm wheels: upstream behaviour, the library goes global.
    assert promote() == [(str(torch / "lib" / "libtorch_cpu.so"), ctypes.RTLD_GLOBAL)]
    # TheRock SDK packages beside torch: skipped.
    (site / "_rocm_sdk_core").mkdir()
    assert promote() == []
    # Asked for explicitly (GPU tracing): promoted again.
    monkeypatch.setenv("VLLM_ROCM_FORCE_TORCH_SYMBOL_PROMOTION", "1")
    assert promote() == [(str(torch / "lib" / "libtorch_cpu.so"), ctypes.RTLD_GLOBAL)]

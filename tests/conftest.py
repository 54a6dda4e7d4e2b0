from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from vllmstack.paths import Project

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def full_run() -> bool:
    """`invoke test` (not --quick) promises the Docker engine and browser exist: never skip then."""
    return os.environ.get("VLLMSTACK_TEST_FULL") == "1"


def need(condition: bool, why: str) -> None:
    """Skip when a facility is missing during a quick run; fail during a full run."""
    if condition:
        return
    if full_run():
        pytest.fail(f"{why} (the full test run provisions it: scripts/test-env.sh)")
    pytest.skip(why)


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def shipped() -> Project:
    """The project as shipped (read-only use)."""
    return Project(ROOT)


@pytest.fixture
def project(tmp_path: Path) -> Project:
    """A throwaway copy of the shipped env/ layers, .env.example and tuned-config folders."""
    for name in ("env", "chat-templates", "fp8_configs", "fused_moe_configs", "patches"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name)
    shutil.copy(ROOT / ".env.example", tmp_path / ".env.example")
    (tmp_path / "tasks.py").write_text("# marker\n")
    return Project(tmp_path)

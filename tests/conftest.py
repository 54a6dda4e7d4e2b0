from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from vllmstack.core.paths import Project

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


# What a throwaway project needs to resolve profiles and run invoke; the package and the
# dashboard's build files only for tests that build the dashboard image.
PROJECT_DIRS = ("env", "chat-templates", "fp8_configs", "fused_moe_configs", "patches")
PROJECT_FILES = ("tasks.py", ".env.example", "compose.yaml")
PACKAGE_PARTS = ("vllmstack", "pyproject.toml", "Dockerfile.dashboard",
                 "Dockerfile.dashboard.dockerignore")


def copy_project(dest: Path, *, with_package: bool = False) -> Path:
    """A copy of the shipped project at `dest` (created) that `invoke` can run in."""
    dest.mkdir(parents=True, exist_ok=True)
    names = PROJECT_DIRS + PROJECT_FILES + (PACKAGE_PARTS if with_package else ())
    for name in names:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif src.is_file():
            shutil.copy(src, dest / name)
    return dest


def write_dotenv(root: Path, settings: dict[str, str]) -> None:
    """`.env` = `.env.example` with `settings` replacing (never duplicating) its lines."""
    lines = [line for line in (ROOT / ".env.example").read_text().splitlines()
             if line.split("=", 1)[0] not in settings]
    (root / ".env").write_text("\n".join([*lines, *(f"{k}={v}" for k, v in settings.items())]) + "\n")


@pytest.fixture
def project(tmp_path: Path) -> Project:
    """A throwaway copy of the shipped env/ layers, .env.example and tuned-config folders."""
    return Project(copy_project(tmp_path))

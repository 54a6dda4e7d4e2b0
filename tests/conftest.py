from __future__ import annotations

import os
from pathlib import Path

import pytest

# Defined in helpers.py (shared with the benchmarks); tests may import them from here too.
from helpers import ROOT as ROOT
from helpers import copy_project as copy_project
from helpers import write_dotenv as write_dotenv

from vllmstack.core.paths import Project

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
    return Project(copy_project(tmp_path))

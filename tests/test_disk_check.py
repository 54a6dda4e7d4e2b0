"""scripts/disk-check.sh: the full test run refuses to start on a disk without room for it, and
says which paths share the disk, how much is free and how to free it or run anyway."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "disk-check.sh"


def disk_check(need_gib: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    # No Docker client: the report of what Docker could reclaim is left out, not an error.
    env = {**os.environ, "VLLMSTACK_MIN_FREE_GIB": need_gib, "DOCKER": "/nonexistent/docker"}
    return subprocess.run(["bash", str(SCRIPT), *map(str, paths)], capture_output=True, text=True,
                          env=env, timeout=60, check=False)


def free_gib(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize // 2**30


def test_a_disk_with_room_passes_and_one_disk_is_counted_once(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    done = disk_check("0", tmp_path / "a", tmp_path / "not-made-yet" / "deeper")
    assert done.returncode == 0, done.stderr
    # Both paths are on one device: one line names both, with the space a user can use.
    [line] = done.stdout.splitlines()
    assert line == (f"disk-check: {free_gib(tmp_path)} GiB free for {tmp_path / 'a'}, "
                    f"{tmp_path / 'not-made-yet' / 'deeper'}")


def test_too_little_room_is_refused_with_the_paths_and_the_fix(tmp_path: Path) -> None:
    need = free_gib(tmp_path) + 1000
    done = disk_check(str(need), tmp_path)
    assert done.returncode == 1
    assert (f"only {free_gib(tmp_path)} GiB free for {tmp_path}; a full run writes up to {need} "
            "GiB on one disk") in done.stderr
    assert "docker image prune" in done.stderr and "VLLMSTACK_MIN_FREE_GIB=0" in done.stderr
    assert "Docker reports" not in done.stderr  # no client: nothing claimed about Docker


def test_a_threshold_that_is_not_a_number_is_named(tmp_path: Path) -> None:
    done = disk_check("15GB", tmp_path)
    assert done.returncode == 2
    assert "VLLMSTACK_MIN_FREE_GIB=15GB is not a whole number of GiB" in done.stderr

"""The stack never chowns a folder it did not create (issue 11, item 2).

As root, `up` used to hand an existing HF_CACHE_DIR to USER_UID; with HF_CACHE_DIR=/ that is the
whole host. Now only folders `up` creates are chowned, and `--dry-run` lists every mkdir and chown.
These tests need root (the test machines run as root): they chown for real.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllmstack.runtime import engine_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
USER = engine_env.HostIds(4242, 4343, None, None)


def _owner(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_uid, st.st_gid


def test_an_existing_cache_folder_is_never_chowned(tmp_path: Path) -> None:
    hf = tmp_path / "huggingface"
    hf.mkdir(mode=0o755)
    (hf / "model.bin").write_text("x")
    before = _owner(hf), _owner(hf / "model.bin")
    paths = engine_env.StackPaths(hf, tmp_path / "engine", None)
    with pytest.raises(engine_env.CacheDirError) as info:
        engine_env.ensure_cache_dirs(paths, USER, dry_run=False)
    assert (_owner(hf), _owner(hf / "model.bin")) == before == ((0, 0), (0, 0))
    assert f"sudo chown -R 4242:4343 {hf}" in info.value.cause  # the operator decides
    assert "never changes the owner" in info.value.cause


def test_an_existing_folder_the_user_can_write_is_left_as_it_is(tmp_path: Path) -> None:
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    os.chown(shared, 5555, 5555)
    os.chmod(shared, 0o1777)  # like /tmp: anyone may write
    group = tmp_path / "group-cache"
    group.mkdir()
    os.chown(group, 6666, USER.gid)
    os.chmod(group, 0o2775)
    for hf in (shared, group):
        paths = engine_env.StackPaths(hf, tmp_path / f"engine-{hf.name}", None)
        done = engine_env.ensure_cache_dirs(paths, USER, dry_run=False)
        assert f"chown {USER.uid}:{USER.gid} {hf}" not in done
    assert _owner(shared) == (5555, 5555) and _owner(group) == (6666, USER.gid)


def test_folders_up_creates_are_chowned_every_level_and_only_those(tmp_path: Path) -> None:
    cache = tmp_path / "new" / "deeper" / "cache"
    paths = engine_env.StackPaths(cache / "huggingface", cache / "vllmstack-engine", None)
    done = engine_env.ensure_cache_dirs(paths, USER, dry_run=False)
    for folder in (tmp_path / "new", tmp_path / "new" / "deeper", cache, paths.hf_cache,
                   paths.engine_cache / "aiter", paths.engine_cache / "aiter" / "jit"):
        assert _owner(folder) == (USER.uid, USER.gid), folder
        assert f"chown 4242:4343 {folder}" in done
    assert _owner(tmp_path) == (0, 0)  # it existed: not ours


def test_dry_run_lists_every_mkdir_and_chown_and_changes_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "cache"
    paths = engine_env.StackPaths(cache / "huggingface", cache / "vllmstack-engine", None)
    planned = engine_env.ensure_cache_dirs(paths, USER, dry_run=True)
    assert not (tmp_path / "a").exists()
    made = [line.split(" ", 2)[2] for line in planned if line.startswith("mkdir -p ")]
    chowned = [line.split(" ", 2)[2] for line in planned if line.startswith("chown ")]
    assert made == chowned  # as root, each folder made is handed to the user, one by one
    assert made[:3] == [str(tmp_path / "a"), str(cache), str(cache / "huggingface")]
    assert str(paths.engine_cache / "aiter" / "jit") in made and len(made) == len(set(made))
    # The real run does exactly what the dry run listed.
    assert engine_env.ensure_cache_dirs(paths, USER, dry_run=False) == planned
    assert engine_env.ensure_cache_dirs(paths, USER, dry_run=False) == []  # nothing left to do


def test_hf_cache_dir_slash_is_refused_and_never_chowned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # os.chown only records here: were this ever broken again, the test must not chown the host's /.
    calls: list[tuple[str, int, int]] = []
    monkeypatch.setattr(os, "chown", lambda path, uid, gid: calls.append((str(path), uid, gid)))
    paths = engine_env.StackPaths(Path("/"), tmp_path / "engine", None)
    with pytest.raises(engine_env.CacheDirError, match="sudo chown -R 4242:4343 /"):
        engine_env.ensure_cache_dirs(paths, USER, dry_run=False)
    assert calls == []

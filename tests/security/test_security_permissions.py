"""Files that can hold a token are created mode 0600, never chmod-ed afterwards (issue 11, item 3).

generated/compose.env (DASHBOARD_TOKEN), resolved.env (every setting), the override (the
engine's environment: HF_TOKEN), vllm-argv.txt (--api-key) and state.json (the argv).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllmstack.config.profiles import resolve
from vllmstack.config.vllm_args import build_serve_argv
from vllmstack.core import files
from vllmstack.core.paths import Project
from vllmstack.runtime import compose_files, engine_env
from vllmstack.serve import state

ENVIRON = {"HOME": "/home/u"}
IDS = engine_env.HostIds(1000, 1000, None, None)
TOKEN = "dash-token-0123456789"


@pytest.fixture
def wide_umask() -> Iterator[None]:
    """umask 0: a file is only private if it was created with a private mode."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def no_chmod(project: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail on any chmod (once the project copy exists): the mode must come from os.open,
    never be fixed up afterwards."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"chmod called: {args}")

    for name in ("chmod", "fchmod", "lchmod"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(Path, "chmod", refuse)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _render(project: Project) -> compose_files.Rendered:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=ENVIRON,
                       overrides=[f"DASHBOARD_TOKEN={TOKEN}", "HF_TOKEN=hf_secret_value",
                                  "VLLM_EXTRA_ARGS=--api-key sk-secret-1"])
    command = build_serve_argv(resolved)
    paths = engine_env.stack_paths(resolved, ENVIRON)
    override, notes = compose_files.build_override(project, resolved, command, runtime="compose",
                                                   ids=IDS, paths=paths, package_dir=None)
    env = compose_files.interpolation_env(resolved, IDS, paths)
    return compose_files.write_rendered(project, resolved, command, override, env, notes)


@pytest.mark.usefixtures("wide_umask", "no_chmod")
def test_every_rendered_file_is_created_private(project: Project) -> None:
    rendered = _render(project)
    secrets = {"compose.env": TOKEN, "resolved.env": "hf_secret_value",
               "compose.override.yaml": "hf_secret_value", "vllm-argv.txt": "sk-secret-1"}
    for name, secret in secrets.items():
        path = rendered.folder / name
        assert secret in path.read_text()  # it does hold the token ...
        assert _mode(path) == 0o600, name  # ... so only its owner may read it
    assert _mode(rendered.folder) == 0o700
    assert not list(rendered.folder.glob("*.tmp"))


@pytest.mark.usefixtures("wide_umask", "no_chmod")
def test_an_older_world_readable_file_is_replaced_by_a_private_one(project: Project) -> None:
    project.generated.mkdir()
    for name in ("compose.env", "compose.env.tmp", "state.json"):
        old = project.generated / name
        old.write_text("OLD=1\n")  # umask 0: created 0666, as any older stack left it
        assert _mode(old) == 0o666
    rendered = _render(project)
    assert _mode(rendered.env_file) == 0o600 and "OLD" not in rendered.env_file.read_text()
    state.write_state(project, {"runtime": "compose", "argv": ["vllm", "--api-key", "k"]})
    assert _mode(project.generated / "state.json") == 0o600


@pytest.mark.usefixtures("wide_umask", "no_chmod")
def test_write_text_and_write_json_create_with_the_mode_asked(tmp_path: Path) -> None:
    files.write_text(tmp_path / "a.env", "A=1\n")
    files.write_json(tmp_path / "b.json", {"b": 1}, mode=files.PRIVATE)
    files.write_json(tmp_path / "c.json", {"c": 1})  # a record without secrets stays readable
    assert (_mode(tmp_path / "a.env"), _mode(tmp_path / "b.json")) == (0o600, 0o600)
    assert _mode(tmp_path / "c.json") == 0o644


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    link = tmp_path / "compose.env"
    link.symlink_to(victim)
    files.write_text(link, "A=1\n")
    assert victim.read_text() == "keep me\n"
    assert not link.is_symlink() and link.read_text() == "A=1\n"

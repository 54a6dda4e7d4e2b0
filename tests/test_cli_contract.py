"""The JSON contracts of `invoke check` and `invoke config`, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllmstack.core.paths import Project


def invoke(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root, text=True,
                          capture_output=True, check=False)


@pytest.fixture
def cli_project(project: Project) -> Project:
    return project  # the throwaway copy carries the real tasks.py


def test_check_json_contract_and_exit_codes(cli_project: Project) -> None:
    ok = invoke(cli_project.root, "check", "--model", "qwen3-0.6b", "--platform", "cpu", "--json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert set(data) == {"profile", "platform", "ok", "findings"}
    assert (data["profile"], data["platform"], data["ok"]) == ("qwen3-0.6b", "cpu", True)
    for f in data["findings"]:
        assert set(f) == {"severity", "code", "key", "source", "message", "fix"}
    bad = invoke(cli_project.root, "check", "--model", "qwen3-0.6b", "--platform", "cpu",
                 "--set", "VLLM_TP=two", "--json")
    assert bad.returncode == 1
    data = json.loads(bad.stdout)
    assert data["ok"] is False
    [f] = [f for f in data["findings"] if f["severity"] == "error"]
    assert (f["key"], f["source"], f["code"]) == ("VLLM_TP", "--set", "bad-value")


def test_check_text_is_one_clear_message_not_a_traceback(cli_project: Project) -> None:
    out = invoke(cli_project.root, "check", "--set", 'VLLM_SPEC_DECODE={"method": "mtp"')
    assert out.returncode == 1
    assert "Traceback" not in out.stdout + out.stderr
    assert "VLLM_SPEC_DECODE" in out.stdout and "not valid JSON" in out.stdout
    unknown = invoke(cli_project.root, "check", "--model", "nope")
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert "unknown model 'nope'" in unknown.stderr and "qwen3-0.6b" in unknown.stderr


def test_config_vllm_args_json_is_the_argv(cli_project: Project) -> None:
    out = invoke(cli_project.root, "config", "--model", "qwen3-0.6b", "--platform", "cpu",
                 "--set", "VLLM_MAX_NUM_SEQS=3", "--vllm-args", "--json")
    argv = json.loads(out.stdout)
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]
    assert argv[argv.index("--max-num-seqs") + 1] == "3"


def test_config_explain_json_names_each_source(cli_project: Project) -> None:
    out = invoke(cli_project.root, "config", "--explain", "--json", "--set", "VLLM_TP=2")
    table = json.loads(out.stdout)
    assert table["VLLM_TP"] == {"value": "2", "source": "--set"}
    assert table["VLLM_MAX_NUM_SEQS"]["source"].startswith("env/models/qwen3.8-27b.env:")
    assert table["VLLM_PORT"]["source"] in ("default", ) or table["VLLM_PORT"]["source"].startswith(
        ".env.example:")

"""Tokens never appear in what the stack prints (issue 11, item 3): `--dry-run` commands, echoed
and failed commands, `invoke config` (plain, --explain, --json, --vllm-args) and `invoke check`."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllmstack.checks.registry import render_report, run_checks
from vllmstack.config.profiles import resolve
from vllmstack.config.view import render_config
from vllmstack.core.paths import Project
from vllmstack.core.runner import CommandError, Result, SubprocessRunner, is_secret_name, mask_argv
from vllmstack.runtime.native.command import NativeCommand

ENVIRON = {"HOME": "/home/u"}
DASH = "dash-0123456789abcdef"
HF = "hf_ABCDEFGHIJKLMNOP"
API = "sk-live-9876543210"


@pytest.mark.parametrize("name,secret", [
    ("HF_TOKEN", True), ("DASHBOARD_TOKEN", True), ("VLLM_API_KEY", True), ("OPENAI_API_KEY", True),
    ("AWS_SECRET_ACCESS_KEY", True), ("DB_PASSWORD", True), ("--api-key", True), ("--hf-token", True),
    ("VLLM_MAX_BATCHED_TOKENS", False), ("VLLM_TOKENIZER", False), ("TOKENIZERS_PARALLELISM", False),
    ("--max-num-batched-tokens", False), ("--tokenizer", False), ("VLLM_MAX_MODEL_LEN", False),
])
def test_secret_names_are_whole_words(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_dry_run_prints_commands_with_tokens_masked() -> None:
    out = io.StringIO()
    runner = SubprocessRunner(dry_run=True, out=out)
    runner.run(["env", f"HF_TOKEN={HF}", "vllm", "serve", "m", "--api-key", API,
                f"--hf-token={HF}", "--max-num-batched-tokens", "8192"])
    runner.run(["docker", "run", "-e", f"DASHBOARD_TOKEN={DASH}", "img"], cwd=Path("/srv"))
    printed = out.getvalue()
    for secret in (HF, API, DASH):
        assert secret not in printed
    assert "'HF_TOKEN=***'" in printed and "--api-key '***'" in printed
    assert "'--hf-token=***'" in printed and "-e 'DASHBOARD_TOKEN=***'" in printed
    assert "--max-num-batched-tokens 8192" in printed  # not a secret: shown as it is


def test_echoed_and_failed_commands_are_masked(capsys: pytest.CaptureFixture[str]) -> None:
    SubprocessRunner(echo=True).run(["true", "--api-key", API])
    assert API not in capsys.readouterr().err
    error = CommandError(Result(("vllm", "serve", "--api-key", API), 1, "", "boom"))
    assert API not in str(error) and "--api-key '***'" in str(error)
    assert mask_argv(["--api-key"]) == ["--api-key"]  # a flag at the end hides nothing


def test_native_dry_run_line_masks_the_engine_environment() -> None:
    command = NativeCommand(["vllm", "serve", "m", "--api-key", API],
                            {"HF_TOKEN": HF, "HIP_VISIBLE_DEVICES": "0"}, "0.31.0", None)
    line = command.shell()
    assert HF not in line and API not in line and "HIP_VISIBLE_DEVICES=0" in line


@pytest.fixture
def secret_project(project: Project) -> Project:
    layer = project.env_dir / "models" / "qwen3-0.6b.env"
    layer.write_text(layer.read_text() + "DASHBOARD_TOKEN=layer-token-abcdef\n")
    (project.root / ".env").write_text(
        f"PLATFORM=cpu\nMODEL_PROFILE=qwen3-0.6b\nDASHBOARD_TOKEN={DASH}\nHF_TOKEN={HF}\n"
        f"VLLM_EXTRA_ARGS='--api-key {API} --max-num-batched-tokens 8192'\n")
    return project


@pytest.mark.parametrize("explain,as_json,vllm_args", [
    (False, False, False), (True, False, False), (True, True, False), (False, True, False),
    (False, False, True), (False, True, True)])
def test_config_views_never_show_a_token(secret_project: Project, explain: bool, as_json: bool,
                                         vllm_args: bool) -> None:
    resolved = resolve(secret_project, environ=ENVIRON)
    text = render_config(resolved, explain=explain, as_json=as_json, vllm_args=vllm_args)
    for secret in (DASH, HF, API, "layer-token-abcdef"):
        assert secret not in text
    assert "8192" in text  # the rest stays readable
    if explain and as_json:
        table = json.loads(text)
        assert table["DASHBOARD_TOKEN"] == {"value": "***", "source": ".env:3"}
        assert table["VLLM_EXTRA_ARGS"]["value"] == "--api-key *** --max-num-batched-tokens 8192"


def test_check_report_never_quotes_a_token(secret_project: Project) -> None:
    resolved = resolve(secret_project, environ=ENVIRON)
    findings, _ = run_checks(secret_project, resolved, ENVIRON)
    override = [f for f in findings if f.code == "dotenv-override" and f.key == "DASHBOARD_TOKEN"]
    assert override and "***" in override[0].message  # the finding is kept, the values are not
    report = render_report(resolved, findings, verbose=True)
    report += json.dumps([f.to_json() for f in findings])
    for secret in (DASH, HF, API, "layer-token-abcdef"):
        assert secret not in report


def test_invoke_config_explain_as_a_user_runs_it(secret_project: Project) -> None:
    for args in (["config", "--explain"], ["config", "--json"], ["config", "--vllm-args"]):
        out = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=secret_project.root,
                             text=True, capture_output=True, check=False)
        assert out.returncode == 0, out.stderr
        assert DASH not in out.stdout and HF not in out.stdout and API not in out.stdout

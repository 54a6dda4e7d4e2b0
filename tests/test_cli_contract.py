"""The JSON contracts of `invoke check` and `invoke config`, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_tasks
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import Task

from vllmstack.core.errors import StackError
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


def test_check_runtime_flag_checks_for_that_runtime(cli_project: Project, tmp_path: Path) -> None:
    model = tmp_path / "outside" / "qwen3-0.6b"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    args = ["check", "--model", "qwen3-0.6b", "--platform", "cpu", "--json",
            "--set", f"VLLM_MODEL={model}", "--set", "MODELS_DIR="]
    codes = {}
    for runtime in ("native", "compose"):
        out = invoke(cli_project.root, *args, "--runtime", runtime)
        assert out.stdout.startswith("{"), out.stderr
        found = [f for f in json.loads(out.stdout)["findings"] if f["code"] == "path-not-mounted"]
        codes[runtime] = (out.returncode, [f["severity"] for f in found])
    # A host process reads the path where it is; a container only sees MODELS_DIR.
    assert codes == {"native": (0, ["info"]), "compose": (1, ["error"])}


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


def test_config_vllm_args_of_a_llamacpp_profile_is_llama_servers_argv(cli_project: Project) -> None:
    out = invoke(cli_project.root, "config", "--model", "tiny-gguf", "--platform", "cpu",
                 "--set", "MODELS_DIR=/models", "--vllm-args", "--json")
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout)
    assert argv[:3] == ["llama-server", "--model", "/models/tiny-qwen3-f16.gguf"]
    assert argv[argv.index("--alias") + 1] == "tiny-gguf"


def test_config_explain_json_names_each_source(cli_project: Project) -> None:
    out = invoke(cli_project.root, "config", "--explain", "--json", "--set", "VLLM_TP=2")
    table = json.loads(out.stdout)
    assert table["VLLM_TP"] == {"value": "2", "source": "--set"}
    assert table["VLLM_MAX_NUM_SEQS"]["source"].startswith("env/models/qwen3.8-27b.env:")
    assert table["VLLM_PORT"]["source"] in ("default", ) or table["VLLM_PORT"]["source"].startswith(
        ".env.example:")


ROOT = Path(__file__).resolve().parents[1]
# `invoke --list` as users know it: the restructuring of issue 10 kept every task name; issues 13
# and 14 added bench-vs, burn, gguf-convert, gpu-check and router; issue 25 tune and calibrate-kv;
# issue 38 startup.
TASKS = ["bench", "bench-conc", "bench-depth", "bench-vs", "build", "burn", "calibrate-kv", "check",
         "clear-caches", "config", "dashboard", "dashboard-down", "dashboard-up", "doctor", "down",
         "engines", "exec", "export", "gguf-convert", "gpu-check", "import-env", "install-engine",
         "logs", "make-model", "probe", "profiles", "rebuild", "report", "router", "stability",
         "startup", "status", "template-check", "test", "tune", "up", "update-check", "verify-patches"]


def test_task_list_is_unchanged() -> None:
    out = invoke(ROOT, "--list")
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines()
             if line.startswith("  ") and not line.startswith("   ")]
    assert names == TASKS
    assert "  bench-depth      Decode and prefill speed over a context-depth ladder" in out.stdout


@pytest.mark.parametrize("name", ["bench", "up", "check", "report", "dashboard", "bench-conc",
                                  "import-env", "gguf-convert", "bench-vs", "router"])
def test_dash_h_is_help_on_every_task(name: str) -> None:
    out = invoke(ROOT, name, "-h")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"Usage: inv[oke] [--core-opts] {name} [--options]")
    assert "Options:" in out.stdout and "Traceback" not in out.stderr


def test_no_task_has_a_dash_h_flag() -> None:
    tasks = load_tasks()
    for task in (t for t in vars(tasks).values() if isinstance(t, Task)):
        for arg in task.get_arguments():
            assert "h" not in arg.nicknames, (task.name, arg.name)


def test_stack_errors_end_a_task_with_their_message_and_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tasks = load_tasks()

    @tasks.stack_task()
    def broken(c: Context) -> None:
        print("what was done so far")
        raise StackError("the engine did not start", "invoke logs", details=["last log line"])

    with pytest.raises(Exit) as ended:
        broken(Context())
    assert ended.value.code == 1
    out, err = capsys.readouterr()
    assert out == "what was done so far\n"
    assert err == "last log line\nerror: the engine did not start\nfix:   invoke logs\n"

    @tasks.stack_task()
    def buggy(c: Context) -> None:
        raise KeyError("a bug")  # not a user error: the traceback is what helps

    with pytest.raises(KeyError):
        buggy(Context())


def test_benchmark_and_dashboard_errors_are_stack_errors() -> None:
    from vllmstack.bench.cli import CliError
    from vllmstack.bench.client.client import EndpointError
    from vllmstack.bench.report.history import HistoryError
    from vllmstack.bench.runs.runs import RunError
    from vllmstack.bench.target import TargetError
    from vllmstack.dashboard.app import DashboardError
    from vllmstack.dashboard.runs import RunError as DashboardRunError
    from vllmstack.workload.ladders import LadderError
    from vllmstack.workload.prompts import TokenizerError

    for error, also in ((RunError, RuntimeError), (EndpointError, RuntimeError),
                        (TargetError, ValueError), (TokenizerError, ValueError),
                        (LadderError, ValueError), (HistoryError, ValueError),
                        (DashboardError, ValueError), (DashboardRunError, RuntimeError),
                        (CliError, Exception)):
        assert issubclass(error, StackError) and issubclass(error, also), error
        assert str(error("cause")) == "cause" and error("cause").render() == "error: cause"


def test_bench_errors_keep_their_message_through_invoke() -> None:
    out = invoke(ROOT, "bench", "--url", "http://127.0.0.1:9", "--model", "m", "--runs", "1")
    assert out.returncode == 1
    error, fix = out.stderr.splitlines()[-2:]  # the tasks' one failure format (issue 23)
    assert error.startswith("error: no tokenizer") and fix.startswith("fix:")
    assert "Traceback" not in out.stdout + out.stderr

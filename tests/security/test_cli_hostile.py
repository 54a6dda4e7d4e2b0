"""A hostile pass over the command line and its inputs (issues 22 and 28, the CLI's part).

Each case is what an attacker or a careless user gives a task -- a file that lies about its size,
a FIFO where a file belongs, a symlink out of the project, JSON nested thousands deep, a prompt
longer than the server's window, a signal while a prompt is built -- and asserts what a user
depends on: one clear error with its fix, nothing hung, nothing read that should not be, no
traceback. (bench-vs/burn and signals: tests/integration/test_resident_signals.py; every option
of every task: tests/test_cli_values.py.)
"""

from __future__ import annotations

import io
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import finishes
from simulator.fixture import SimProcess, run_simulator
from test_llamacpp_checks import small_gguf

from vllmstack.bench.cli import main
from vllmstack.bench.runs.session import RunError, RunOptions
from vllmstack.checks.gguf import GgufError, read_gguf
from vllmstack.checks.registry import run_checks
from vllmstack.config import migrate
from vllmstack.config.profiles import ProfileError, list_profiles, resolve
from vllmstack.config.view import render_config
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.runtime.gpu_check import GpuCheckError, run_probe

ENVIRON = {"HOME": "/home/u"}
SECRET = "TOP_SECRET_LINE=hunter2"


def invoke(project: Project, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=project.root, text=True,
                          capture_output=True, check=False, timeout=timeout)


def error_and_fix(done: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr
    error, fix = done.stderr.splitlines()[-2:]
    assert error.startswith("error: ") and fix.startswith("fix:"), done.stderr
    return error, fix


# --- GGUF headers that lie (issue 22 #11) ----------------------------------------------------------

def lying_gguf(path: Path, *, tensors: int = 0, pairs: int = 2, layers: int = 2) -> Path:
    """576 bytes: a GGUF v3 header claiming `tensors` tensors, `pairs` key/value pairs and a
    block_count of `layers`."""

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    body = (text("general.architecture") + struct.pack("<I", 8) + text("llama")
            + text("llama.block_count") + struct.pack("<I", 10) + struct.pack("<Q", layers))
    data = b"GGUF" + struct.pack("<IQQ", 3, tensors, pairs) + body
    path.write_bytes(data + b"\0" * (576 - len(data)))
    return path


@pytest.mark.parametrize(("claims", "said"), [
    ({"layers": 10**12}, "claims 1000000000000 layers but holds 0 tensors"),
    ({"tensors": 10**12}, "claims 1000000000000 tensors in a 576-byte file"),
    ({"pairs": 10**12}, "claims 1000000000000 key/value pairs in a 576-byte file"),
])
def test_a_576_byte_gguf_claiming_10_to_the_12_is_invalid_not_a_memory_error(
        tmp_path: Path, claims: dict[str, int], said: str) -> None:
    path = lying_gguf(tmp_path / "lie.gguf", **claims)
    with pytest.raises(GgufError) as caught:
        finishes(lambda: read_gguf(path), 10)
    assert caught.value.kind == "invalid" and said in str(caught.value)


def test_check_reports_the_lying_gguf_as_a_finding(project: Project, tmp_path: Path) -> None:
    path = lying_gguf(tmp_path / "lie.gguf", layers=10**12)
    done = invoke(project, "check", "--model", "tiny-gguf", "--platform", "cpu",
                  "--set", f"LLAMACPP_MODEL={path}", "--runtime", "native")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "gguf-invalid" in done.stdout and "claims 1000000000000 layers" in done.stdout


def test_a_fifo_as_the_model_file_is_refused_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GgufError, match="not a regular file"):
        finishes(lambda: read_gguf(fifo), 10)  # opening a FIFO blocks until a writer comes


@pytest.mark.parametrize("layers", ["²", "٣", "1_0", "-3"])
def test_gpu_layers_takes_ascii_digits_only(project: Project, tmp_path: Path,
                                            layers: str) -> None:
    small_gguf(tmp_path / "m.gguf")
    resolved = resolve(project, model="tiny-gguf", platform="nvidia", environ=ENVIRON,
                       overrides=[f"LLAMACPP_MODEL={tmp_path / 'm.gguf'}",
                                  f"LLAMACPP_GPU_LAYERS={layers}", "GPU_VRAM_GIB=80"])
    findings, _ = run_checks(project, resolved, ENVIRON, runtime="native")  # '²' raised here
    [bad] = [f for f in findings if f.key == "LLAMACPP_GPU_LAYERS" and f.severity == "error"]
    assert "must be a whole number, auto or all" in bad.message


# --- the gpu-check probe's JSON (issue 22 #15) ------------------------------------------------------

@pytest.mark.parametrize("stdout", [
    '{"devices": 5, "count": 1}', '{"count": "two"}', '{"count": 1, "devices": [7]}',
    '{"kernel": "ok"}', '{"count": 1, "devices": [{"name": "x", "memory": "big"}]}',
    '{"env": {"HSA_OVERRIDE_GFX_VERSION": 11}}', '{"count": 1000000000000}',
    '{"a": ' * 100_000 + "1" + "}" * 100_000,
], ids=["devices-int", "count-text", "device-int", "kernel-text", "memory-text", "env-int",
        "count-huge", "nested-100k"])
def test_probe_json_that_is_not_the_probes_is_an_error(project: Project, stdout: str) -> None:
    runner = RecordingRunner()
    runner.respond(["python"], Result((), 0, stdout + "\n", ""))
    with pytest.raises(GpuCheckError) as caught:
        run_probe(runner, ["python", "-c", "probe"], env=None)
    assert caught.value.fix and len(caught.value.cause) < 1000  # its output quoted, cut short


# --- bench against a server with an 8k window (issue 28 #3 and minors) -------------------------------

@pytest.fixture(scope="module")
def sim8k(tokenizer_file: Path) -> Any:
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "5", "SIM_ITL_MS": "1",
           "SIM_TOKENIZER": str(tokenizer_file)}
    with run_simulator(env=env, argv=["--served-model-name", "sim", "--max-model-len", "8192"]) \
            as proc:
        yield proc


def bench(sim: SimProcess, tokenizer: Path, folder: Path, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main([args[0], "--url", sim.url, "--model", "sim", "--tokenizer", str(tokenizer),
                 "--history-dir", str(folder), *args[1:]], environ={}, project=Project(folder),
                out=out, err=out)
    return code, out.getvalue()


@pytest.mark.parametrize("args", [
    ("bench", "--pp", "900000"), ("bench", "--pp", "8000", "--tg", "500"),
    ("depth", "--depth", "8000", "--pp", "512"), ("conc", "--pp", "9000", "--concurrency", "1"),
])
def test_a_prompt_longer_than_the_window_is_refused_before_it_is_built(
        sim8k: SimProcess, tokenizer_file: Path, tmp_path: Path, args: tuple[str, ...]) -> None:
    started = time.monotonic()
    code, text = bench(sim8k, tokenizer_file, tmp_path, *args)
    assert code == 1 and "more than the server's max_model_len of 8192" in text
    assert "no prompt was built" in text and "fix:" in text
    assert time.monotonic() - started < 10  # 900,000 tokens took minutes and gigabytes to build
    assert not list(tmp_path.glob("*_history.jsonl"))


def test_sigterm_stops_a_long_prompt_build_at_once(tokenizer_file: Path, tmp_path: Path) -> None:
    env = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "5", "SIM_ITL_MS": "1",
           "SIM_TOKENIZER": str(tokenizer_file)}
    with run_simulator(env=env, argv=["--served-model-name", "sim",
                                      "--max-model-len", "2000000"]) as sim:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllmstack.bench", "bench", "--url", sim.url, "--model", "sim",
             "--tokenizer", str(tokenizer_file), "--pp", "1000000", "--tg", "4", "--runs", "1",
             "--history-dir", str(tmp_path)], cwd=tmp_path, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for line in proc.stdout:  # the overhead probe came first: the big prompt builds now
            if "request overhead" in line:
                break
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - started
    assert proc.returncode == 1 and "stopped by signal" in rest
    assert stopped_in < 2.0, f"the build held the signal for {stopped_in:.1f} s"
    assert not list(tmp_path.glob("*_history.jsonl"))


@pytest.mark.parametrize("field", ["model", "messages", "max_tokens", "stream", "min_tokens"])
def test_extra_body_cannot_replace_what_the_measurement_sends(field: str) -> None:
    with pytest.raises(RunError) as caught:
        RunOptions(extra_body={field: "x"}).check()
    assert field in caught.value.cause and caught.value.fix
    RunOptions(extra_body={"temperature": 0.7, "top_k": 5}).check()  # adding is fine


def test_extra_body_nested_thousands_deep_is_an_error(sim8k: SimProcess, tokenizer_file: Path,
                                                      tmp_path: Path) -> None:
    code, text = bench(sim8k, tokenizer_file, tmp_path, "bench", "--extra-body",
                       "[" * 50_000 + "]" * 50_000)
    assert code == 2 and "error: --extra-body is not JSON" in text and "Traceback" not in text


def test_a_duration_too_short_to_send_anything_is_refused(project: Project) -> None:
    with pytest.raises(RunError, match="--duration"):
        RunOptions(duration_s=1e-300).check()
    error, _ = error_and_fix(invoke(project, "bench-conc", "--duration", "1e-300"))
    assert "--duration '1e-300' must be at least 0.1" in error


# --- config: --set, printed values, EXTENDS (issue 28 minors) ---------------------------------------

@pytest.mark.parametrize("pair", ["=V", "KEY", "1X=2", " =x"])
def test_a_malformed_set_is_refused_not_ignored(project: Project, pair: str) -> None:
    with pytest.raises(ProfileError, match="is not KEY=VALUE"):
        resolve(project, platform="cpu", model="tiny", overrides=[pair])
    error, fix = error_and_fix(invoke(project, "config", "--set", pair))
    assert "--set" in error and "KEY=VALUE" in fix


def test_config_prints_control_characters_escaped(project: Project) -> None:
    resolved = resolve(project, platform="cpu", model="tiny", environ=ENVIRON,
                       overrides=["PROFILE_DESCRIPTION=a\nINJECTED=1\x1b[2J\u202e"])
    lines = render_config(resolved).splitlines()
    assert not any(line.startswith("INJECTED=") for line in lines)
    [shown] = [line for line in lines if line.startswith("PROFILE_DESCRIPTION=")]
    assert shown == "PROFILE_DESCRIPTION=a\\nINJECTED=1\\x1b[2J\\u202e"


def test_config_explain_reports_an_extends_loop(project: Project) -> None:
    family = project.env_dir / "families" / "qwen3.6.env"
    family.write_text("EXTENDS=models/qwen3.6-27b\n" + family.read_text())
    done = invoke(project, "config", "--model", "qwen3.6-27b", "--platform", "cpu", "--explain")
    assert done.returncode == 0 and "layer-cycle" in done.stdout
    assert ("layers extend each other in a loop: models/qwen3.6-27b -> families/qwen3.6"
            in done.stdout)


def test_a_3000_deep_extends_chain_is_a_named_error(project: Project) -> None:
    chain = project.env_dir / "chain"
    chain.mkdir()
    for i in range(3000):
        (chain / f"l{i}.env").write_text(f"EXTENDS=chain/l{i + 1}\n")
    (chain / "l3000.env").write_text("VLLM_MAX_NUM_SEQS=1\n")
    model = project.env_dir / "models" / "deep.env"
    model.write_text("EXTENDS=chain/l0\n" + (project.env_dir / "models" / "tiny.env").read_text())
    resolved = resolve(project, platform="cpu", model="deep", environ=ENVIRON)  # RecursionError
    [deep] = [p for p in resolved.problems if p.code == "layer-depth"]
    assert deep.severity == "error" and "more than 32 layers deep" in deep.message


def test_a_3000_deep_reference_chain_is_a_named_error(project: Project) -> None:
    lines = [f"X{i}=${{X{i + 1}}}" for i in range(3000)] + ["X3000=end"]
    project.dotenv.write_text("\n".join(lines) + "\n")
    resolved = resolve(project, platform="cpu", model="tiny", environ=ENVIRON)
    assert "reference-depth" in {p.code for p in resolved.problems}


def test_references_that_double_at_each_level_stop_at_a_bound(project: Project) -> None:
    lines = [f"Y{i}=${{Y{i + 1}}}${{Y{i + 1}}}" for i in range(30)] + ["Y30=abcdefgh"]
    project.dotenv.write_text("\n".join(lines) + "\n")  # 8 GiB if expanded
    resolved = finishes(lambda: resolve(project, platform="cpu", model="tiny", environ=ENVIRON), 20)
    assert "reference-size" in {p.code for p in resolved.problems}
    assert all(len(s.value) <= 65536 for s in resolved.values.values())


def test_a_json_setting_nested_thousands_deep_is_a_finding(project: Project) -> None:
    deep = "[" * 3000 + "]" * 3000  # fits on a command line; Python's parser stops near 1,000
    resolved = resolve(project, platform="cpu", model="tiny", environ=ENVIRON,
                       overrides=[f"VLLM_SPEC_DECODE={deep}"])  # RecursionError here
    [bad] = [p for p in resolved.problems if p.key == "VLLM_SPEC_DECODE"]
    assert bad.code == "bad-value" and "nested too deep" in bad.message
    done = invoke(project, "check", "--platform", "cpu", "--set", f"VLLM_SPEC_DECODE={deep}")
    assert done.returncode == 1 and "Traceback" not in done.stderr


def test_a_model_folder_whose_config_json_is_nested_thousands_deep(project: Project,
                                                                   tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    done = invoke(project, "check", "--model", "tiny", "--platform", "cpu", "--runtime", "native",
                  "--set", f"VLLM_MODEL={model}", "--set", f"VLLM_TOKENIZER={model}")
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr
    assert "FAILED" in done.stdout or "ok" in done.stdout.lower()


# --- symlinks out of the project (issue 28 minor) -------------------------------------------------

@pytest.fixture
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("elsewhere") / "secret.env"  # not below the project
    target.write_text(f"{SECRET}\nnot an env line at all\nPROFILE_DESCRIPTION=leaked\n")
    return target


def test_a_model_profile_symlinked_out_of_the_project_is_refused_unread(
        project: Project, outside: Path) -> None:
    (project.env_dir / "models" / "linked.env").symlink_to(outside)
    with pytest.raises(ProfileError, match="outside the project"):
        resolve(project, platform="cpu", model="linked", environ=ENVIRON)
    done = invoke(project, "check", "--model", "linked", "--platform", "cpu")
    error_and_fix(done)
    assert "hunter2" not in done.stdout + done.stderr and "not an env line" not in done.stderr
    assert "linked" not in [p.name for p in list_profiles(project)]
    assert "leaked" not in invoke(project, "profiles").stdout


def test_an_extends_layer_symlinked_out_of_the_project_is_a_finding(
        project: Project, outside: Path) -> None:
    (project.env_dir / "families" / "evil.env").symlink_to(outside)
    model = project.env_dir / "models" / "tiny.env"
    model.write_text("EXTENDS=families/evil\n" + model.read_text())
    resolved = resolve(project, platform="cpu", model="tiny", environ=ENVIRON)
    [refused] = [p for p in resolved.problems if p.code == "layer-outside"]
    assert refused.severity == "error" and "outside the project" in refused.message
    assert "TOP_SECRET_LINE" not in resolved.values
    done = invoke(project, "check", "--model", "tiny", "--platform", "cpu")
    assert "hunter2" not in done.stdout + done.stderr and "not an env line" not in done.stdout


def test_a_symlink_inside_the_project_still_works(project: Project) -> None:
    (project.env_dir / "models" / "alias.env").symlink_to(project.env_dir / "models" / "tiny.env")
    assert resolve(project, platform="cpu", model="alias", environ=ENVIRON).get_str(
        "VLLM_SERVED_NAME") == "tiny"


def test_an_over_long_profile_name_from_dotenv_is_an_error_not_a_traceback(
        project: Project) -> None:
    project.dotenv.write_text(f"MODEL_PROFILE={'m' * 300}\nPLATFORM=cpu\n")
    with pytest.raises(ProfileError, match="a file name holds 251 at most"):
        resolve(project, environ=ENVIRON)
    error_and_fix(invoke(project, "config"))


# --- import-env (issue 28 minors) --------------------------------------------------------------------

def test_import_env_of_a_directory_says_it_is_one(project: Project, tmp_path: Path) -> None:
    error, fix = error_and_fix(invoke(project, "import-env", str(tmp_path)))
    assert error == f"error: {tmp_path} is a directory, not an env file"
    assert f"{tmp_path}/.env" in fix


def test_import_env_of_a_fifo_is_refused_without_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "old.env"
    os.mkfifo(fifo)
    with pytest.raises(migrate.ImportEnvError, match="not a regular file"):
        finishes(lambda: migrate.map_env_file(fifo), 10)


def test_import_env_of_a_50_mb_binary_file_stops_at_once(project: Project,
                                                         tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with big.open("wb") as handle:
        handle.truncate(50_000_000)
        handle.write(os.urandom(4096))
    done = invoke(project, "import-env", str(big))
    error, _ = error_and_fix(done)
    assert "50000000 bytes" in error and len(done.stderr.splitlines()) <= 3


def test_import_env_names_20_unreadable_lines_and_counts_the_rest(project: Project,
                                                                  tmp_path: Path) -> None:
    binary = tmp_path / "blob.env"
    binary.write_bytes(b"".join(b"K%d=\xff\xfe\n" % i for i in range(5000)))
    done = invoke(project, "import-env", str(binary))
    error, _ = error_and_fix(done)
    assert "5000 line(s) that cannot be read" in error
    assert "... and 4980 more line(s) that cannot be read (left out)" in done.stderr
    assert len(done.stderr.splitlines()) < 50  # 195,000 lines for a 50 MB file before


def test_import_env_over_an_existing_profile_is_error_and_fix(project: Project,
                                                              tmp_path: Path) -> None:
    source = tmp_path / "old.env"
    source.write_text("VLLM_MAX_NUM_SEQS=4\n")
    before = (project.env_dir / "models" / "tiny.env").read_text()
    error, fix = error_and_fix(invoke(project, "import-env", str(source), "--name", "tiny"))
    assert "exists; nothing was overwritten" in error and "--name" in fix
    assert (project.env_dir / "models" / "tiny.env").read_text() == before


# --- option values no shell sends, but a script can ---------------------------------------------------

@pytest.mark.parametrize("args", [
    ["gpu-check", "--runtime", "docker;rm -rf ~"], ["logs", "--tail", "٣"],
    ["down", "--timeout", "1e309"], ["router", "--ttl", "nan"], ["router", "--port", "70000"],
    ["probe", "itl-stall", "--param", "x" * 300],
    ["bench-vs", "-t", "vllm:" + "p" * 300],
])
def test_values_no_option_holds_are_refused_in_two_lines(project: Project,
                                                         args: list[str]) -> None:
    done = invoke(project, *args)
    error, _ = error_and_fix(done)
    assert len(error) < 300

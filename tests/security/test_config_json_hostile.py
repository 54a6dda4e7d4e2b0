"""A hostile pass over a model's config.json (issue 36, row 4, and its property test).

config.json is the model's file: the stack reads its geometry (config/hfconfig.py, modelinfo.py,
weights.py) for `invoke check`, `up`, `router --plan` and `tune`. Each case here is what a cut-short
download, a hand edit or an attacker puts there -- a number as a string, a list, NaN, 1e308, a
boolean, a negative count, a hybrid without one of its linear_* keys, nesting 100,000 deep, a
file larger than any config, /dev/zero, a FIFO -- and asserts what a user depends on: no
traceback, no hang, one named error that says which file and which key, with a fix; `check`
reports it as a finding (bad-model-config), the other tasks end with error:/fix: and exit 1.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from helpers import copy_project
from hypothesis import given, settings
from hypothesis import strategies as st

from vllmstack.checks.capacity import rule_memory, rule_parallelism
from vllmstack.checks.context import CheckContext, build_context
from vllmstack.checks.registry import run_checks
from vllmstack.checks.scheduler import rule_scheduler
from vllmstack.checks.tuned_configs import rule_tuned_configs
from vllmstack.config.hfconfig import ModelConfigError
from vllmstack.config.modelinfo import (
    GIB,
    estimate_mamba_blocks,
    kv_bytes_per_token_per_gpu,
    load_model_facts,
)
from vllmstack.config.profiles import Resolved, resolve
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.router.catalog import build_catalog
from vllmstack.router.memory import build_plan
from vllmstack.serve.lifecycle import preflight
from vllmstack.tune import shapes as sh
from vllmstack.tune.tuning import plan_tune

ENV = {"HOME": "/nonexistent"}
CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
# A Qwen3.6 hybrid (Gated DeltaNet + full attention), its geometry under text_config.
HYBRID: dict[str, Any] = json.loads((CONFIGS / "qwen3.6-27b-h200-dummy.json").read_text())
MOE_TEXT = {"hidden_size": 1024, "num_experts": 64, "moe_intermediate_size": 384,
            "num_experts_per_tok": 4, "num_hidden_layers": 2, "num_attention_heads": 8,
            "vocab_size": 1000}


def hybrid_with(**text: Any) -> str:
    config = copy.deepcopy(HYBRID)
    config["text_config"].update(text)
    return json.dumps(config)  # NaN and 1e308 are written as Python's json writes them


def hybrid_without(key: str) -> str:
    config = copy.deepcopy(HYBRID)
    del config["text_config"][key]
    return json.dumps(config)


def moe_with(**top: Any) -> str:
    return json.dumps({"model_type": "qwen3_5_moe", "text_config": MOE_TEXT, **top})


def write(text: str) -> Callable[[Path], None]:
    return lambda path: path.write_text(text)


def fifo(path: Path) -> None:
    os.mkfifo(path)


def dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


# case -> (how config.json is made, the key the error names or None for the file, what it says)
CASES: dict[str, tuple[Callable[[Path], None], str | None, str]] = {
    "string-number": (write(hybrid_with(num_hidden_layers="28")), "num_hidden_layers",
                      "is '28' (a string), not a whole number"),
    "list": (write(hybrid_with(hidden_size=[5120])), "hidden_size",
             "is [5120] (a list), not a whole number"),
    "nan": (write(hybrid_with(num_hidden_layers=float("nan"))), "num_hidden_layers",
            "is NaN, not a whole number"),
    "1e308": (write(hybrid_with(hidden_size=1e308)), "hidden_size",
              "is 1e+308 (a decimal number), not a whole number"),
    "bool": (write(hybrid_with(num_attention_heads=True)), "num_attention_heads",
             "is true (a boolean), not a whole number"),
    "negative": (write(hybrid_with(num_key_value_heads=-4)), "num_key_value_heads",
                 "is -4, not between 1 and 1000000"),
    "missing-linear-key": (write(hybrid_without("linear_key_head_dim")), "linear_key_head_dim",
                           "linear_key_head_dim is missing: the model has 48 linear-attention"),
    "deep-nesting": (write('{"a": ' * 100_000 + "1" + "}" * 100_000), None, "nested too deeply"),
    "huge": (write(hybrid_with(pad="x" * (8 * 1024 * 1024))), None, "is larger than"),
    "dev-zero": (dev_zero, None, "is not a regular file"),
    "fifo": (fifo, None, "is not a regular file"),
}


def hostile_model(folder: Path, case: str) -> Path:
    """A model folder (no weight files: served as --load-format dummy) with the case's config."""
    folder.mkdir(parents=True, exist_ok=True)
    CASES[case][0](folder / "config.json")
    return folder


def assert_named(text: str, config: Path, case: str) -> None:
    """The message names the file, the key (where a key is to blame) and what is wrong."""
    _, key, says = CASES[case]
    assert str(config) in text, text
    assert says in text, text
    if key is not None:
        assert key in text, text
    assert "Traceback" not in text


def named_error(work: Callable[[], Any], config: Path, case: str) -> ModelConfigError:
    with pytest.raises(ModelConfigError) as caught:
        work()
    error = caught.value
    assert_named(error.cause, config, case)
    assert error.fix and str(config) in error.fix
    if CASES[case][1] is not None:
        assert error.key is not None and CASES[case][1] in error.key
    return error


def profile(project: Project, model: Path, name: str = "qwen3.6-27b",
            platform: str = "2xr9700") -> Resolved:
    return resolve(project, model=name, platform=platform,
                   overrides=[f"VLLM_MODEL={model}", f"MODELS_DIR={model.parent}"])


@pytest.mark.parametrize(("config", "facts"), [
    ("qwen3.6-27b-h200-dummy.json", {
        "kind": "hybrid", "num_layers": 64, "full_attention_layers": 16, "num_attention_heads": 24,
        "num_kv_heads": 4, "head_dim": 256, "hidden_size": 5120, "intermediate_size": 17408,
        "num_experts": 0, "moe_intermediate_size": 0, "max_position_embeddings": 262144,
        "mamba_state_mib": 146.8, "weight_gib": 46.31}),
    ("qwen3-0.6b-h200-dummy.json", {
        "kind": "dense", "num_layers": 28, "full_attention_layers": 28, "num_attention_heads": 16,
        "num_kv_heads": 8, "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072,
        "num_experts": 0, "moe_intermediate_size": 0, "max_position_embeddings": 40960,
        "weight_gib": 0.84}),
])
def test_a_real_config_reads_as_it_did(project: Project, tmp_path: Path, config: str,
                                       facts: dict[str, Any]) -> None:
    # The guard for the checks above: a real config loses no field to them (the values are what
    # the reader gave before it checked anything).
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((CONFIGS / config).read_text())
    read = load_model_facts(profile(project, tmp_path / "m"), ENV)
    assert {k: getattr(read, k) for k in facts} == facts and read.config_problem is None


# --- the entry points the tasks call, in-process ----------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_check_reports_the_config_as_a_finding(project: Project, tmp_path: Path, case: str) -> None:
    model = hostile_model(tmp_path / "m", case)
    findings, _ = run_checks(project, profile(project, model), ENV)  # `invoke check`, `up`
    [bad] = [f for f in findings if f.code == "bad-model-config"]
    assert bad.severity == "error" and bad.key == "VLLM_MODEL" and bad.fix
    assert_named(bad.message, model / "config.json", case)
    # The file is there, so it is not also "missing" (a FIFO or a device is not a folder's lack).
    assert "missing-model-config" not in {f.code for f in findings}


@pytest.mark.parametrize("case", list(CASES))
def test_up_stops_before_anything_starts(project: Project, tmp_path: Path, case: str) -> None:
    model = hostile_model(tmp_path / "m", case)
    with pytest.raises(StackError) as caught:
        preflight(project, profile(project, model), ENV)
    assert "nothing was started" in caught.value.cause
    [detail] = [d for d in caught.value.details if "bad-model-config" in d]
    assert_named(detail, model / "config.json", case)


@pytest.mark.parametrize("case", list(CASES))
def test_router_plan_is_a_named_error(project: Project, tmp_path: Path, case: str) -> None:
    model = hostile_model(tmp_path / "m", case)
    catalog = build_catalog(project, ENV, platform="2xr9700", profiles=["qwen3.6-27b"],
                            overrides=[f"VLLM_MODEL={model}"])
    named_error(lambda: build_plan(project, catalog, ENV, setting="restart", several=False,
                                   cards=None), model / "config.json", case)


@pytest.mark.parametrize("case", list(CASES))
def test_tune_is_a_named_error(project: Project, tmp_path: Path, case: str) -> None:
    model = hostile_model(tmp_path / "m", case)
    resolved = profile(project, model, "qwen3.6-35b-a3b", "nvidia")
    named_error(lambda: plan_tune(project, resolved, ENV, kind="moe"), model / "config.json", case)


@pytest.mark.parametrize(("top", "key", "says"), [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": ["128", 128]}},
     "quantization_config.weight_block_size[0]", "is '128' (a string), not a whole number"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 0]}},
     "quantization_config.weight_block_size[1]", "is 0, not between 1 and 1048576"),
    ({"quantization_config": ["fp8"]}, "quantization_config", "is [\"fp8\"] (a list), not an object"),
    ({"num_experts_per_tok": [8]}, "num_experts_per_tok", "is [8] (a list), not a whole number"),
])
def test_the_tuners_own_fields_are_checked(project: Project, tmp_path: Path, top: dict[str, Any],
                                           key: str, says: str) -> None:
    # num_experts_per_tok and the FP8 block are read by tune's shapes, not by the facts.
    model = tmp_path / "m"
    model.mkdir()
    text = {k: v for k, v in MOE_TEXT.items() if k not in top}
    (model / "config.json").write_text(json.dumps({"text_config": text, **top}))
    resolved = profile(project, model, "qwen3.6-35b-a3b", "nvidia")
    with pytest.raises(ModelConfigError) as caught:
        plan_tune(project, resolved, ENV, kind="moe")
    assert caught.value.cause == f"{model / 'config.json'}: {key} {says}"
    assert caught.value.key == key and caught.value.fix


# --- the tasks themselves, as a user runs them -----------------------------------------------

def invoke(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root, text=True,
                          capture_output=True, check=False, timeout=120)


@pytest.fixture
def stack(tmp_path: Path) -> Path:
    return copy_project(tmp_path / "stack")


@pytest.mark.parametrize("case", ["string-number", "nan", "missing-linear-key", "dev-zero"])
def test_invoke_check_prints_the_finding_and_fails(stack: Path, tmp_path: Path, case: str) -> None:
    model = hostile_model(tmp_path / "m", case)
    done = invoke(stack, "check", "--model", "tiny", "--platform", "cpu", "--runtime", "native",
                  "--set", f"VLLM_MODEL={model}")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr and done.stderr == ""
    lines = done.stdout.splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("ERROR   bad-model-config")]
    assert lines[at].startswith("ERROR   bad-model-config [VLLM_MODEL @ --set]: ")
    assert_named(lines[at], model / "config.json", case)
    assert lines[at + 1].startswith("        fix: ")
    assert lines[-1].startswith("FAILED: 1 error(s)")


def error_and_fix(done: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """Exit 1 and exactly two lines on stderr: `error: ...` and `fix: ...`."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr
    error, fix = done.stderr.splitlines()
    assert error.startswith("error: ") and fix.startswith("fix:   "), done.stderr
    return error, fix


@pytest.mark.parametrize(("task", "case"), [
    (("router", "--plan", "--platform", "cpu", "--profiles", "tiny", "--runtime", "native"),
     "string-number"),
    (("router", "--plan", "--platform", "cpu", "--profiles", "tiny", "--runtime", "native"),
     "huge"),
    (("tune", "moe", "--model", "tiny", "--platform", "cpu"), "missing-linear-key"),
    (("tune", "fp8-dense", "--model", "tiny", "--platform", "cpu"), "fifo"),
])
def test_router_plan_and_tune_end_with_error_and_fix(stack: Path, tmp_path: Path,
                                                     task: tuple[str, ...], case: str) -> None:
    model = hostile_model(tmp_path / "m", case)
    # The router has no --set: the profile itself points at the folder.
    env_file = stack / "env" / "models" / "tiny.env"
    env_file.write_text("".join(f"VLLM_MODEL={model}\n" if line.startswith("VLLM_MODEL=") else line
                                for line in env_file.read_text().splitlines(keepends=True)))
    error, fix = error_and_fix(invoke(stack, *task))
    assert_named(error, model / "config.json", case)
    assert str(model / "config.json") in fix


# --- property: whatever JSON the geometry fields hold, never a traceback ----------------------

GEOMETRY = (
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
    "num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_tok",
    "max_position_embeddings", "vocab_size", "full_attention_interval", "layer_types",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "mamba_ssm_dtype", "attn_output_gate",
    "tie_word_embeddings", "mtp_num_hidden_layers", "num_nextn_predict_layers", "torch_dtype",
    "dtype", "quantization_config", "vision_config", "text_config")
SCALARS = (st.none() | st.booleans() | st.integers(0, 96) | st.integers(-(2**80), 2**80)
           | st.floats() | st.text(max_size=6)
           | st.sampled_from(["full_attention", "linear_attention", "attention", "fp8", "float32",
                              "bfloat16", "28"]))
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.sampled_from((*GEOMETRY, "quant_method", "weight_block_size", "depth")), inner,
        max_size=4), max_leaves=12)
BASES = [{}, HYBRID["text_config"], MOE_TEXT]


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    # Mostly plausible numbers, so that many examples get past the reader into the projections.
    plausible = st.integers(1, 512) | st.sampled_from([1, 2, 4, 8, 64, 128, 4096, 2**20])
    fields = draw(st.dictionaries(st.sampled_from(GEOMETRY), plausible | plausible | VALUES,
                                  max_size=6))
    merged = {**draw(st.sampled_from(BASES)), **fields}
    return {"text_config": merged} if draw(st.booleans()) else merged


@dataclass(frozen=True)
class Arena:
    """One model folder whose config.json each example rewrites, its profile and check context."""

    path: Path
    resolved: Resolved
    ctx: CheckContext

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return f"Arena({self.path})"


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory) -> Arena:
    root = tmp_path_factory.mktemp("config-property")
    project = Project(copy_project(root / "stack"))
    model = root / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    resolved = profile(project, model, "qwen3.6-35b-a3b", "nvidia")
    return Arena(model / "config.json", resolved, build_context(project, resolved, ENV))


def assert_names_the_field(error: ModelConfigError, path: Path) -> None:
    assert str(path) in error.cause and error.fix and str(path) in error.fix
    assert error.key and error.key in error.cause


# No example database: the test leaves nothing in the checkout's .hypothesis/.
@settings(max_examples=200, deadline=None, database=None)
@given(config=configs())
def test_random_geometry_is_facts_or_a_named_error(arena: Arena, config: dict[str, Any]) -> None:
    arena.path.write_text(json.dumps(config))  # NaN, Infinity as Python's json writes them
    try:
        facts = load_model_facts(arena.resolved, ENV)  # router --plan, tune, bench's roofline
    except ModelConfigError as exc:
        assert_names_the_field(exc, arena.path)
        # `check` and `up` get the same error as a finding (bad-model-config), not an exception.
        checked = load_model_facts(arena.resolved, ENV, strict=False)
        assert checked.config_problem is not None and checked.config_problem.cause == exc.cause
        return
    try:
        shapes = sh.read_model_config(facts)  # the fields only tune reads
    except ModelConfigError as exc:
        assert_names_the_field(exc, arena.path)
        shapes = {}
    # What check, router --plan and tune compute from the facts: no traceback either.
    checked_ctx = replace(arena.ctx, facts=facts)
    for rule in (rule_memory, rule_parallelism, rule_scheduler, rule_tuned_configs):
        rule(checked_ctx)
    assert int((facts.weight_gib or 0.0) * GIB) >= 0
    for tp in (1, 2, 8):
        kv_bytes_per_token_per_gpu(facts, tp, "auto")
        estimate_mamba_blocks(facts, tp, "fp8", 64.0 * GIB)
    sh.quant_block(facts, shapes)
    for shape in (lambda: sh.moe_shape(arena.resolved, facts, 1),
                  lambda: sh.dense_shapes(facts, 2, ("gate_up", "down", "qkv", "o"))):
        # TuneShapeError: the profile is not that kind of model, a named error of its own.
        with contextlib.suppress(sh.TuneShapeError, ModelConfigError):
            shape()

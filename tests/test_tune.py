"""`invoke tune`: shapes and file names as vLLM looks them up (and as `invoke check` accepts them),
the search space's rules, the numeric gate, the keep rule, the budget, and the files written,
all on the CPU: the GPU side is driven with fakes where it decides something."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from vllmstack.checks.registry import run_checks
from vllmstack.config.modelinfo import load_model_facts
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.tune import kernel_bench as kb
from vllmstack.tune import shapes as sh
from vllmstack.tune import space as sp
from vllmstack.tune import tuning
from vllmstack.tune import verdict as vd

ENV = {"HOME": "/nonexistent"}


def facts(project: Project, model: str, *sets: str) -> Any:
    return load_model_facts(resolve(project, model=model, platform="nvidia", overrides=list(sets)), ENV)


def tuned_findings(project: Project, model: str, tp: int, device: str) -> list[str]:
    resolved = resolve(project, model=model, platform="nvidia",
                       overrides=[f"VLLM_TP={tp}", f"GPU_DEVICE_NAME={device}", f"GPU_COUNT={tp}"])
    findings, _ = run_checks(project, resolved, ENV)
    return [f"{f.code}: {f.message}" for f in findings if f.code.startswith("tuned-")]


# --- shapes and names ----------------------------------------------------------------------


def test_moe_shape_is_keyed_on_the_per_gpu_intermediate_size(project: Project) -> None:
    resolved = resolve(project, model="qwen3.6-35b-a3b", platform="nvidia")
    f = load_model_facts(resolved, ENV)
    tp1, tp2 = sh.moe_shape(resolved, f, 1), sh.moe_shape(resolved, f, 2)
    assert (tp1.experts, tp1.n, tp1.hidden, tp1.topk) == (256, 512, 2048, 8)
    assert tp2.n == 256  # N is w2's intermediate // TP, never x2 (the gate/up merge is w13's)
    assert tp1.file_name("NVIDIA_H200") == (
        "E=256,N=512,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json")


def test_h200_variants_share_one_moe_name_but_not_one_dense_name() -> None:
    moe = sh.MoeShape(128, 768, 2048, 8, None, None)
    assert moe.file_name("NVIDIA_H200_NVL") == "E=128,N=768,device_name=NVIDIA_H200.json"
    dense = sh.DenseShape("down", 5120, 17408, (128, 128))
    assert "device_name=NVIDIA_H200_NVL," in dense.file_name("NVIDIA_H200_NVL")


def test_dense_shapes_of_the_mlp_and_attention(project: Project) -> None:
    f = facts(project, "qwen3.8-27b")
    got = {s.name: (s.n, s.k) for s in sh.dense_shapes(f, 1, ("gate_up", "down", "qkv", "o"))}
    assert got["gate_up"] == (34816, 5120) and got["down"] == (5120, 17408)
    # Gated attention (hybrid Qwen3.5/3.6): q doubled; 24 heads, 4 KV heads, head_dim 256.
    assert got["qkv"] == ((48 + 8) * 256, 5120) and got["o"] == (5120, 24 * 256)
    tp2 = {s.name: (s.n, s.k) for s in sh.dense_shapes(f, 2)}
    assert tp2 == {"gate_up": (17408, 5120), "down": (5120, 8704)}


@pytest.mark.parametrize("tp", [1, 2])
def test_the_tuned_config_check_accepts_every_file_the_tuner_names(project: Project, tp: int) -> None:
    device = "NVIDIA_H200"
    resolved = resolve(project, model="qwen3.6-35b-a3b", platform="nvidia")
    moe = sh.moe_shape(resolved, load_model_facts(resolved, ENV), tp)
    dense = sh.dense_shapes(facts(project, "qwen3.8-27b"), tp, ("gate_up", "down", "qkv", "o"))
    for folder, name in [(sh.MOE_FOLDER, moe.file_name(device)),
                         *((sh.DENSE_FOLDER, s.file_name(device)) for s in dense)]:
        (project.root / folder).mkdir(exist_ok=True)
        (project.root / folder / name).write_text('{"1": {"BLOCK_SIZE_M": 16}}')
    assert tuned_findings(project, "qwen3.6-35b-a3b", tp, device) == []
    assert tuned_findings(project, "qwen3.8-27b", tp, device) == []
    # ... and the same files seen at the other TP are flagged: the check really looks.
    other = 2 if tp == 1 else 1
    assert any("tuned-wrong-tp" in f for f in tuned_findings(project, "qwen3.6-35b-a3b", other, device))


def test_shapes_refuse_what_vllm_would_never_look_up(project: Project) -> None:
    dense = resolve(project, model="qwen3-0.6b", platform="nvidia")
    with pytest.raises(sh.TuneShapeError, match="not an MoE model"):
        sh.moe_shape(dense, load_model_facts(dense, ENV), 1)
    with pytest.raises(sh.TuneShapeError, match="not block-quantized FP8"):
        sh.dense_shapes(load_model_facts(dense, ENV), 1)
    moe = resolve(project, model="qwen3.6-35b-a3b", platform="nvidia",
                  overrides=["MODEL_NUM_EXPERTS_PER_TOK=0"])
    with pytest.raises(sh.TuneShapeError) as err:
        sh.moe_shape(moe, load_model_facts(moe, ENV), 1)
    assert "MODEL_NUM_EXPERTS_PER_TOK" in (err.value.fix or "")
    with pytest.raises(sh.TuneShapeError, match="does not split"):
        sh.moe_shape(resolve(project, model="qwen3.6-35b-a3b", platform="nvidia"),
                     load_model_facts(resolve(project, model="qwen3.6-35b-a3b", platform="nvidia"), ENV), 3)


def test_config_json_wins_over_the_profile(project: Project, tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_moe", "text_config": {
            "hidden_size": 1024, "num_experts": 64, "moe_intermediate_size": 384,
            "num_experts_per_tok": 4, "num_hidden_layers": 2, "num_attention_heads": 8},
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 128]}}))
    resolved = resolve(project, model="qwen3.6-35b-a3b", platform="nvidia",
                       overrides=[f"VLLM_MODEL={model}"])
    shape = sh.moe_shape(resolved, load_model_facts(resolved, ENV), 1)
    assert (shape.experts, shape.n, shape.topk, shape.block_shape) == (64, 384, 4, (64, 128))


# --- the search space ----------------------------------------------------------------------


def test_no_candidate_mixes_scale_groups() -> None:
    block = (128, 128)
    for m in (1, 64, 4096):
        for config in sp.candidates(m, sp.DENSE_AXES, block, 1):
            assert block[1] % config["BLOCK_SIZE_K"] == 0
    wide = {"BLOCK_SIZE_K": 256}
    assert not sp.scale_groups_ok(wide, block)  # spans two 128-wide groups
    assert sp.scale_groups_ok(wide, None)  # bf16: no groups to mix
    assert any(c["BLOCK_SIZE_K"] == 256 for c in sp.candidates(4096, sp.MOE_BF16_AXES, None, 2))


def test_the_space_is_pruned_to_what_the_rows_allow() -> None:
    decode = sp.candidates(1, sp.DENSE_AXES, (128, 128), 1)
    assert {c["BLOCK_SIZE_M"] for c in decode} == {16}
    assert {c["GROUP_SIZE_M"] for c in decode} == {1}  # one tile along M: grouping does nothing
    prefill = sp.candidates(4096, sp.DENSE_AXES, (128, 128), 1)
    assert min(c["BLOCK_SIZE_M"] for c in prefill) == 64
    assert all(c["num_warps"] == 4 for c in prefill if c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] < 8192)
    assert all(c["num_stages"] * (c["BLOCK_SIZE_M"] + c["BLOCK_SIZE_N"]) * c["BLOCK_SIZE_K"]
               <= sp.HOPPER_SMEM for c in prefill)
    assert sp.moe_rows(1, 8, 256) == 1 and sp.moe_rows(4096, 8, 256) == 128


def test_ordered_puts_stock_first_and_is_reproducible() -> None:
    space = sp.candidates(256, sp.DENSE_AXES, (128, 128), 1)
    stock = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
             "num_warps": 4, "num_stages": 2, "SPLIT_K": 1}
    first, again = sp.ordered(space, stock, 7), sp.ordered(space, stock, 7)
    assert first == again and first[0] == sp.tile_of(stock) and "SPLIT_K" not in first[0]
    assert sum(sp.same_tile(c, stock) for c in first) == 1


# --- gate, keep rule, budget --------------------------------------------------------------


def test_the_gate_admits_rounding_noise_and_refuses_wrong_numbers() -> None:
    stock = 0.03  # fp8 activations in MoE
    assert vd.passes_gate(0.035, stock) and vd.passes_gate(0.059, stock)
    assert not vd.passes_gate(0.3, stock)  # a tile reading the neighbouring group's scale
    assert not vd.passes_gate(math.nan, stock) and not vd.passes_gate(math.inf, stock)
    assert vd.passes_gate(0.006, 0.002)  # dense: stock + slack when stock is tiny
    assert vd.relative_error(math.nan, 1.0) == math.inf and vd.relative_error(1.0, 0.0) == math.inf
    assert vd.stock_is_sane(0.04) and not vd.stock_is_sane(0.5)


def test_an_entry_is_kept_only_when_it_wins_by_five_percent_in_the_rerun() -> None:
    assert vd.keep_entry([105.0, 105.5, 104.8], [100.0, 99.9, 100.2])
    assert not vd.keep_entry([104.0, 104.0, 104.0], [100.0, 100.0, 100.0])
    assert not vd.keep_entry([], [100.0])
    row = {"m": 8, "stock": {"BLOCK_SIZE_M": 16}, "stock_tile": {"BLOCK_SIZE_M": 16},
           "best": {"BLOCK_SIZE_M": 32}, "rerun": {"stock_us": [50, 52, 51], "best_us": [40, 41, 60]}}
    verdict = vd.judge(row)
    assert verdict is not None and verdict.kept and verdict.tuned_us == 41
    # The first pass's winner that loses its lead in the re-run is not kept.
    lucky = {**row, "rerun": {"stock_us": [50, 50, 50], "best_us": [49, 49, 49]}}
    assert not vd.judge(lucky).kept  # type: ignore[union-attr]
    # Stock itself winning keeps nothing, whatever the noise says.
    same = {**row, "best": {"BLOCK_SIZE_M": 16}}
    assert not vd.judge(same).kept  # type: ignore[union-attr]
    assert vd.judge({"m": 1, "error": "boom"}) is None


def test_budget_shares_what_is_left() -> None:
    now = [0.0]
    budget = vd.Budget(100.0, clock=lambda: now[0])
    assert budget.share(4) == 25.0
    now[0] = 10.0  # the first part finished early: the three after it share the rest
    assert budget.share(3) == 30.0
    now[0] = 150.0
    assert budget.left() == 0.0 and budget.share(2) == 0.0


def verdict_row(m: int, kept: bool) -> vd.EntryVerdict:
    return vd.EntryVerdict(m, 100.0, 90.0 if kept else 99.0, 0.11 if kept else 0.01, kept,
                           {"BLOCK_SIZE_M": 64, "SPLIT_K": 1}, {"BLOCK_SIZE_M": 16}, 10, 20, 1, 0, False)


def test_a_written_file_changes_only_the_winning_batch_sizes() -> None:
    assert vd.file_entries([verdict_row(1, False)], {1: {"BLOCK_SIZE_M": 32}}) is None
    shipped = {1: {"BLOCK_SIZE_M": 32}, 4096: {"BLOCK_SIZE_M": 128}}
    entries = vd.file_entries([verdict_row(1, True), verdict_row(8, False)], shipped)
    assert entries == {1: {"BLOCK_SIZE_M": 16}, 8: {"BLOCK_SIZE_M": 64, "SPLIT_K": 1},
                       4096: {"BLOCK_SIZE_M": 128}}


# --- the GPU side's loop, with a fake problem --------------------------------------------


class FakeTensor:
    def __init__(self, value: float) -> None:
        self.value = value

    def float(self) -> Any:
        return self

    def __sub__(self, other: FakeTensor) -> FakeTensor:
        return FakeTensor(self.value - other.value)

    def norm(self) -> FakeTensor:
        return FakeTensor(abs(self.value))

    def item(self) -> Any:  # `float` here would name the method above
        return self.value


class FakeCuda:
    @staticmethod
    def empty_cache() -> None:
        return None


class FakeTorch:
    cuda = FakeCuda


class FakeProblem:
    """Outputs 1.0 +/- a small error; a tile with BLOCK_SIZE_K=256 reads the wrong scale."""

    torch = FakeTorch

    def stock(self, m: int) -> tuple[dict[str, Any], str, None]:
        return ({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
                 "num_warps": 4, "num_stages": 2}, "default", None)

    def case(self, m: int) -> dict[str, Any]:
        return {"m": m}

    def reference(self, case: dict[str, Any]) -> FakeTensor:
        return FakeTensor(1.0)

    def runner(self, case: dict[str, Any], config: dict[str, Any]) -> Any:
        if config.get("num_stages") == 5:
            def crash() -> Any:
                raise RuntimeError("out of resources")
            return crash
        wrong = config["BLOCK_SIZE_K"] == 256
        return lambda: FakeTensor(1.4 if wrong else 1.002)


def fake_time(torch: Any, fn: Any) -> float:
    """The wide-K tile would be fastest, were its numbers right."""
    return 10.0 if fn().value > 1.1 else 20.0


def test_the_gate_throws_out_a_fast_wrong_tile_before_it_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kb, "time_us", fake_time)
    good = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
            "num_warps": 4, "num_stages": 3}
    wide = {**good, "BLOCK_SIZE_K": 256}
    crashing = {**good, "num_stages": 5}
    row = kb.tune_size(FakeProblem(), 1, [good, wide, crashing], seed=0, deadline=1e18,  # type: ignore[arg-type]
                       known_bad=set())
    assert row["rejected"] == 1 and row["rejected_examples"][0]["config"] == wide
    assert row["failed"] == 1 and row["tried"] == 3
    assert row["best"] != wide and len(row["rerun"]["stock_us"]) == kb.RERUN_ROUNDS
    # A deadline already past still times stock and re-runs it, and says the budget cut it.
    cut = kb.tune_size(FakeProblem(), 1, [good, wide], seed=0, deadline=0, known_bad=set())  # type: ignore[arg-type]
    assert cut["budget_cut"] and cut["tried"] == 0 and cut["best"] == cut["stock_tile"]


def test_a_harness_whose_stock_is_wrong_times_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(FakeProblem):
        def reference(self, case: dict[str, Any]) -> FakeTensor:
            return FakeTensor(2.0)

    row = kb.tune_size(Broken(), 1, [], seed=0, deadline=1e18, known_bad=set())  # type: ignore[arg-type]
    assert "harness is wrong" in row["error"] and "rerun" not in row


def test_each_tile_is_compiled_once_per_specialisation_it_meets() -> None:
    # Triton builds an int argument separately when it is 1 and when it is a multiple of 16.
    assert [kb.spec_class("fp8-dense", m, 1) for m in (1, 2, 8, 16, 48, 100)] == [1, 2, 2, 16, 16, 2]
    assert [kb.spec_class("moe", m, 8) for m in (1, 2, 3)] == [2, 16, 2]  # routed rows M*topk
    tile = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
            "num_warps": 4, "num_stages": 3}
    entry = {"shape": {"N": 5120, "K": 17408}, "space": {"1": [tile], "4": [tile], "8": [tile],
                                                          "64": [tile]}}
    jobs = kb.compile_jobs("fp8-dense", [entry, entry], [1, 4, 8, 64])
    assert sorted(rep for _, rep in jobs) == [1, 2, 16]  # two shapes, four sizes: three builds


# --- the command and the files ------------------------------------------------------------


def moe_plan(project: Project) -> tuning.TunePlan:
    resolved = resolve(project, model="qwen3.6-35b-a3b", platform="nvidia")
    return tuning.plan_tune(project, resolved, ENV, kind="moe", batch_sizes=[1, 64], budget_min=1,
                            workers=0)


def fake_result(plan: tuning.TunePlan, *, name: str | None = None, win: bool = True) -> dict[str, Any]:
    shape = plan.shapes[0]
    stock = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
             "num_warps": 4, "num_stages": 4}
    tuned = {**stock, "BLOCK_SIZE_N": 128}
    rows = [{"m": 1, "stock": stock, "stock_tile": stock, "best": tuned, "space": 40, "tried": 40,
             "rerun": {"stock_us": [30, 30, 30], "best_us": [25, 25, 25] if win else [29.5] * 3}},
            {"m": 64, "error": "Traceback ... CUDA error"}]
    return {"kind": plan.kind, "device": "NVIDIA H200", "device_file_name": "NVIDIA_H200",
            "versions": {"vllm": "0.27.1", "triton": "3.6.0", "torch": "2.11.0"}, "elapsed_s": 50,
            "shapes": [{"shape": shape.as_json(), "vllm_file_name": name or shape.file_name("NVIDIA_H200"),
                        "stock_source": "shipped",
                        "shipped": {"1": stock, "4096": {**stock, "BLOCK_SIZE_M": 64}},
                        "batch_sizes": rows}]}


def test_tune_runs_one_command_where_the_engine_runs(project: Project) -> None:
    plan = moe_plan(project)
    resolved = resolve(project, model="qwen3.6-35b-a3b", platform="nvidia",
                       overrides=["NATIVE_ENGINE_COMMAND=/opt/venv/bin/python3 -m vllm.entrypoints.cli.main"])
    runner = RecordingRunner()

    def gpu(argv: tuple[str, ...]) -> Result:
        spec = json.loads(Path(argv[3]).read_text())
        assert spec["shapes"][0]["space"]["1"] == plan.spaces[0][1]  # the explicit space travels
        Path(argv[4]).write_text(json.dumps(fake_result(plan)))
        return Result(argv, 0)

    runner.respond(["/opt/venv/bin/python3", "-m", "vllmstack.tune.kernel_bench"], gpu)
    outcome = tuning.run_tune(project, resolved, runner,
                              {"VLLM_TUNED_CONFIG_FOLDER": "/x", "PYTHONPATH": "/site"}, plan)
    assert outcome is not None
    env = runner.envs[0] or {}
    assert "VLLM_TUNED_CONFIG_FOLDER" not in env  # stock is vLLM's shipped file, not ours
    assert env["PYTHONPATH"].split(":") == [str(project.root), "/site"]
    written = project.root / "fused_moe_configs" / plan.shapes[0].file_name("NVIDIA_H200")
    body = json.loads(written.read_text())
    assert body["triton_version"] == "3.6.0" and body["1"]["BLOCK_SIZE_N"] == 128
    assert body["4096"]["BLOCK_SIZE_M"] == 64  # vLLM's shipped entry, carried unchanged
    sidecar = json.loads((written.parent / "sidecars" / written.name).read_text())
    assert sidecar["versions"]["vllm"] == "0.27.1" and sidecar["batch_sizes"][0]["gain"] == 0.2
    assert sidecar["failed_batch_sizes"][0]["batch_size"] == 64
    assert sidecar["search_space"]["candidates_per_batch_size"]["1"] == len(plan.spaces[0][1])
    assert tuned_findings(project, "qwen3.6-35b-a3b", 1, "NVIDIA_H200") == []


def test_dry_run_prints_the_command_and_writes_nothing(project: Project) -> None:
    plan = moe_plan(project)
    resolved = resolve(project, model="qwen3.6-35b-a3b", platform="nvidia",
                       overrides=["NATIVE_ENGINE_COMMAND=python3 -m vllm.entrypoints.cli.main"])
    runner = RecordingRunner(dry_run=True)
    assert tuning.run_tune(project, resolved, runner, {}, plan) is None
    assert runner.calls[0][:3] == ("python3", "-m", "vllmstack.tune.kernel_bench")
    assert not (project.root / "generated" / "tune").exists()


def test_no_gain_writes_the_sidecar_but_no_config(project: Project) -> None:
    plan = moe_plan(project)
    outcome = tuning.write_outcome(project, plan, fake_result(plan, win=False))
    assert outcome.written == [] and outcome.sidecars[0].is_file()
    assert "no entry won" in tuning.render_outcome(outcome)


def test_a_dense_file_has_no_triton_version_and_an_old_file_is_kept(project: Project) -> None:
    resolved = resolve(project, model="qwen3.8-27b", platform="nvidia")
    plan = tuning.plan_tune(project, resolved, ENV, kind="fp8-dense", batch_sizes=[1], budget_min=1,
                            projections=("down",), workers=0)
    result = fake_result(plan)
    target = project.root / "fp8_configs" / plan.shapes[0].file_name("NVIDIA_H200")
    target.parent.mkdir(exist_ok=True)
    target.write_text('{"1": {"hand": 1}}')
    with pytest.raises(tuning.TuneError, match="exists"):
        tuning.write_outcome(project, plan, result)
    tuning.write_outcome(project, plan, result, force=True)
    assert "triton_version" not in json.loads(target.read_text())
    backups = [p for p in target.parent.iterdir() if p.name.startswith(target.name) and p.suffix == ".bak"]
    assert [p.read_text() for p in backups] == ['{"1": {"hand": 1}}']
    assert tuned_findings(project, "qwen3.8-27b", 1, "NVIDIA_H200") == []


def test_a_name_vllm_would_not_look_up_is_never_written(project: Project) -> None:
    plan = moe_plan(project)
    with pytest.raises(tuning.TuneError, match="looks this shape up as"):
        tuning.write_outcome(project, plan,
                             fake_result(plan, name="E=256,N=1024,device_name=NVIDIA_H200.json"))
    assert not (project.root / "fused_moe_configs" / plan.shapes[0].file_name("NVIDIA_H200")).exists()


def test_bad_requests_say_what_to_do(project: Project) -> None:
    resolved = resolve(project, model="qwen3.6-35b-a3b", platform="nvidia")
    with pytest.raises(tuning.TuneError, match="comma-separated"):
        tuning.parse_batch_sizes("1,two")
    with pytest.raises(tuning.TuneError, match="unknown tuning kind"):
        tuning.plan_tune(project, resolved, ENV, kind="attention")
    with pytest.raises(tuning.TuneError) as err:
        tuning.engine_python(project, resolved, None)
    assert "install-engine" in (err.value.fix or "")

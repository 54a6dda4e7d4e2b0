"""`invoke calibrate-kv`: the scale gate, the calibrated copy vLLM reads, freshness, and the
measurement itself on the CPU engine's Python (torch + transformers)."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from helpers import write_checkpoint

from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner, Result
from vllmstack.models import kv_calibration as gate
from vllmstack.models import tiny
from vllmstack.runtime.base import Beside
from vllmstack.runtime.native.beside import native_beside
from vllmstack.tune import kv_copy as kv


def on_host(runner: RecordingRunner) -> Beside:
    """What calibrate-kv measures with: NATIVE_ENGINE_COMMAND's interpreter, through `runner`."""
    return native_beside(Project(ROOT), resolve(Project(ROOT), model="tiny", platform="cpu", overrides=[
        "NATIVE_ENGINE_COMMAND=/opt/py/bin/python3 -m vllm.entrypoints.cli.main"]), {}, runner)


def read_scales(path: Path) -> dict[str, float]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    header.pop("__metadata__")
    out = {}
    for name, entry in header.items():
        assert entry["dtype"] == "F32" and entry["shape"] == [1]
        start, _ = entry["data_offsets"]
        (out[name],) = struct.unpack("<f", raw[8 + size + start:8 + size + start + 4])
    return out


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "m")


def plan_for(project: Project, model: Path, tmp_path: Path,
             corpus_text: str = "some text") -> kv.CalibrationPlan:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text)
    resolved = resolve(project, model="tiny", platform="cpu",
                       overrides=[f"VLLM_MODEL={model}", f"MODELS_DIR={tmp_path / 'models'}"])
    return kv.plan_calibration(project, resolved, {"HOME": str(tmp_path)}, corpus=corpus)


SCALES = {"model.layers.0.self_attn": {"k_scale": 0.02, "v_scale": 0.01},
          "model.layers.1.self_attn": {"k_scale": 0.3, "v_scale": 0.004}}
VERSIONS = {"engine": "0.32.0+cpu", "python": "/x/python"}


def test_a_zero_or_broken_scale_is_refused_and_nothing_written(project: Project, model: Path,
                                                                tmp_path: Path) -> None:
    plan = plan_for(project, model, tmp_path)
    for bad in (0.0, -1.0, math.nan, math.inf, None):
        scales = {**SCALES, "model.layers.1.self_attn": {"k_scale": bad, "v_scale": 0.01}}
        assert kv.scale_problems(scales)  # type: ignore[arg-type]
        with pytest.raises(kv.CalibrationError, match="refusing"):
            kv.write_calibrated_copy(plan, scales, plan.identity(VERSIONS))  # type: ignore[arg-type]
        assert not plan.target.exists()
    assert kv.scale_problems({}) == ["no attention layer was measured"]


def test_the_copy_links_the_weights_and_carries_what_vllm_reads(project: Project, model: Path,
                                                                 tmp_path: Path) -> None:
    plan = plan_for(project, model, tmp_path)
    folder = kv.write_calibrated_copy(plan, SCALES, plan.identity(VERSIONS))
    assert folder == tmp_path / "models" / "calibrated" / "m-kv-fp8"
    weights = folder / "model.safetensors"
    # Hard-linked (the same file, visible wherever the copy is mounted), not copied.
    assert weights.samefile(model / "model.safetensors") and weights.stat().st_nlink == 2
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["kv_cache_scheme"] == kv.KV_SCHEME
    assert json.loads((model / "config.json").read_text()) == {"model_type": "qwen3",
                                                               "num_hidden_layers": 2}  # source untouched
    scales = read_scales(folder / kv.SCALES_FILE)
    assert scales["model.layers.1.self_attn.k_scale"] == pytest.approx(0.3)
    assert set(scales) == {f"model.layers.{i}.self_attn.{k}" for i in (0, 1) for k in ("k_scale", "v_scale")}


def test_an_index_names_the_scales_and_fp8_or_other_quantization(project: Project, model: Path,
                                                                  tmp_path: Path) -> None:
    index = {"weight_map": {"a": "model.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    plan = plan_for(project, model, tmp_path)
    folder = kv.write_calibrated_copy(plan, SCALES, plan.identity(VERSIONS))
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["model.layers.0.self_attn.v_scale"] == kv.SCALES_FILE and weight_map["a"]
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert kv.calibrated_config(fp8) == fp8  # Fp8Config loads the scale tensors itself
    with pytest.raises(kv.CalibrationError, match="awq"):
        kv.calibrated_config({"quantization_config": {"quant_method": "awq"}})


def test_a_stale_sidecar_is_named_and_a_fresh_one_kept(project: Project, model: Path, tmp_path: Path) -> None:
    plan = plan_for(project, model, tmp_path)
    assert kv.staleness(plan, VERSIONS) == "no calibrated copy yet"
    kv.write_calibrated_copy(plan, SCALES, plan.identity(VERSIONS))
    assert kv.staleness(plan, VERSIONS) is None
    assert "tool versions" in (kv.staleness(plan, {**VERSIONS, "engine": "0.33.0"}) or "")
    other_corpus = plan_for(project, model, tmp_path, corpus_text="other text")
    assert "corpus" in (kv.staleness(other_corpus, VERSIONS) or "")
    os.utime(model / "model.safetensors", ns=(1, 1))  # new weights under the same name
    assert "source snapshot" in (kv.staleness(plan_for(project, model, tmp_path), VERSIONS) or "")
    # A sidecar whose scales went bad (hand-edited, or an old calibrator's zeros) is rebuilt.
    sidecar = json.loads((plan.target / kv.SIDECAR).read_text())
    sidecar["scales"]["model.layers.0.self_attn"]["k_scale"] = 0.0
    (plan.target / kv.SIDECAR).write_text(json.dumps(sidecar))
    assert "unusable" in (kv.staleness(plan, VERSIONS) or "")


def test_ensure_measures_once_then_keeps_the_fresh_copy(project: Project, model: Path,
                                                        tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text")
    resolved = resolve(project, model="tiny", platform="cpu",
                       overrides=[f"VLLM_MODEL={model}", f"MODELS_DIR={tmp_path / 'models'}",
                                  "NATIVE_ENGINE_COMMAND=/opt/py/bin/python3 -m vllm.entrypoints.cli.main"])
    runner = RecordingRunner()

    def measure(argv: tuple[str, ...]) -> Result:
        assert Path(argv[4]).read_text() == "tex"  # the held-out tenth is not measured
        Path(argv[5]).write_text(json.dumps({"tokens": 99, "versions": {"torch": "t"}, "layers": {
            "model.layers.0.self_attn": {"k_amax": 4.48, "v_amax": 0.448}}}))
        return Result(argv, 0)

    runner.respond(["/opt/py/bin/python3", "-m", "vllmstack.models.kv_calibrate_runner"], measure)
    env = {"HOME": str(tmp_path)}
    made = kv.ensure_calibrated(project, resolved, env, beside=on_host(runner), corpus=corpus)
    assert made is not None and made.made and made.reason == "no calibrated copy yet"
    assert made.sidecar["scales"]["model.layers.0.self_attn"] == {"k_scale": 0.01, "v_scale": 0.001}
    again = kv.ensure_calibrated(project, resolved, env, beside=on_host(runner), corpus=corpus)
    assert again is not None and not again.made and len(runner.calls) == 1
    zero = RecordingRunner()
    zero.respond(["/opt/py/bin/python3"], lambda argv: (Path(argv[5]).write_text(json.dumps(
        {"layers": {"model.layers.0.self_attn": {"k_amax": 0.0, "v_amax": 1.0}}})), Result(argv, 0))[1])
    with pytest.raises(kv.CalibrationError, match="zero"):
        kv.ensure_calibrated(project, resolved, env, beside=on_host(zero), corpus=corpus, force=True)
    assert kv.read_sidecar(made.folder) is not None  # the good copy survived the refused one


@pytest.mark.slow
@pytest.mark.real_engine
def test_the_runner_measures_every_layer_on_a_real_model(tmp_path: Path, cpu_engine_python: Path) -> None:
    folder = tiny.make_model("tiny", out=tmp_path / "tiny").folder
    out = tmp_path / "amax.json"
    done = subprocess.run([str(cpu_engine_python), "-m", "vllmstack.models.kv_calibrate_runner", str(folder),
                           str(kv.DEFAULT_CORPUS), str(out), "--tokens", "2048"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    measured: dict[str, Any] = json.loads(out.read_text())
    assert measured["tokens"] == 2048
    scales = kv.scales_from_amax(measured["layers"])
    assert sorted(scales) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert kv.scale_problems(scales) == []


def test_the_quality_gate_compares_fp8_with_bf16_and_checks_the_scales_were_used() -> None:
    scales = {"model.layers.0.self_attn": {"k_scale": 0.0097, "v_scale": 0.0032}}
    bf16 = {"ppl": 50.0, "recall_mean": 0.8, "recall": {"0.1": 0.8, "0.9": 0.8},
            "scales": {"model.layers.0.self_attn.attn": [1.0, 1.0]}}
    fp8 = {"ppl": 50.9, "recall_mean": 0.78, "recall": {"0.1": 0.78, "0.9": 0.78},
           "scales": {"model.layers.0.self_attn.attn": [0.0097, 0.0032]}}
    ok, lines = gate.quality_verdict(bf16, fp8, scales)
    assert ok and all(line.startswith("PASS") for line in lines)
    worse = {**fp8, "ppl": 51.5}  # +3 %
    assert not gate.quality_verdict(bf16, worse, scales)[0]
    forgetful = {**fp8, "recall_mean": 0.7}  # 87.5 % of bf16's
    assert not gate.quality_verdict(bf16, forgetful, scales)[0]
    # One depth at 92.5 % of bf16's with the score at 96 %: within the per-depth floor (90 %).
    uneven = {**fp8, "recall_mean": 0.77, "recall": {"0.1": 0.74, "0.9": 0.8}}
    assert gate.quality_verdict(bf16, uneven, scales)[0]
    # The mean holds, but the far past (the shallowest needle) is lost.
    shallow = {**fp8, "recall_mean": 0.8, "recall": {"0.1": 0.6, "0.9": 1.0}}
    ok, lines = gate.quality_verdict(bf16, shallow, scales)
    assert not ok and "short at 0.1" in lines[1]
    # vLLM resolves "auto" to the calibrated copy's fp8 scheme: a baseline that held fp8 is no baseline.
    ok, lines = gate.quality_verdict({**bf16, "cache_dtype": "auto"}, {**fp8, "cache_dtype": "fp8"}, scales)
    assert ok and lines[0] == "PASS KV cache dtypes: baseline auto, calibrated fp8"
    ok, lines = gate.quality_verdict({**bf16, "cache_dtype": "fp8"}, {**fp8, "cache_dtype": "fp8"}, scales)
    assert not ok and lines[0].startswith("FAIL KV cache dtypes")
    # A model that copies nothing passes "95 % of bf16's" with 0 % against 0 %: not a pass.
    blank = {"recall_mean": 0.0, "recall": {"0.1": 0.0, "0.9": 0.0}}
    ok, lines = gate.quality_verdict({**bf16, **blank}, {**fp8, **blank}, scales)
    assert not ok and lines[1].startswith("FAIL recall") and "cannot judge" in lines[1]
    # vLLM fell back to scale 1.0: the copy's scales were not loaded, whatever the numbers say.
    for used in ([1.0, 1.0], [0.0097, 1.0]):
        ignored = {**fp8, "scales": {"model.layers.0.self_attn.attn": used}}
        ok, lines = gate.quality_verdict(bf16, ignored, scales)
        assert not ok and lines[-1].startswith("FAIL vLLM used the calibrated scales")


def kv_findings(project: Project, model_dir: Path, kv_dtype: str = "fp8") -> list[Any]:
    from vllmstack.checks.registry import run_checks

    resolved = resolve(project, model="tiny", platform="cpu",
                       overrides=[f"VLLM_MODEL={model_dir}", f"VLLM_KV_CACHE_DTYPE={kv_dtype}"])
    findings, _ = run_checks(project, resolved, {"HOME": "/nonexistent"})
    return [f for f in findings if f.code.startswith("kv-")]


def test_check_refuses_zero_scales_and_a_stale_copy_and_warns_without_scales(project: Project, model: Path,
                                                                          tmp_path: Path) -> None:
    plan = plan_for(project, model, tmp_path)
    folder = kv.write_calibrated_copy(plan, SCALES, plan.identity(VERSIONS))
    assert kv_findings(project, folder) == []
    sidecar = json.loads((folder / kv.SIDECAR).read_text())
    sidecar["scales"]["model.layers.1.self_attn"]["v_scale"] = 0.0
    (folder / kv.SIDECAR).write_text(json.dumps(sidecar))
    (found,) = kv_findings(project, folder)
    assert (found.severity, found.code) == ("error", "kv-scales-unusable")  # `up` stops on errors
    assert found.fix is not None and "invoke calibrate-kv" in found.fix
    kv.write_calibrated_copy(plan, SCALES, plan.identity(VERSIONS))
    os.utime(model / "model.safetensors", ns=(5, 5))  # the source's weights changed
    # `up` rebuilds it first (test_kv_served.py): `check` warns that it will, and takes minutes.
    (found,) = kv_findings(project, folder)
    assert (found.severity, found.code) == ("warning", "kv-calibration-stale")
    fresh = plan_for(project, model, tmp_path)  # what calibrate-kv does next: rebuild
    kv.write_calibrated_copy(fresh, SCALES, fresh.identity(VERSIONS))
    assert kv_findings(project, folder) == []
    (found,) = kv_findings(project, model)  # the uncalibrated source itself
    assert (found.severity, found.code) == ("warning", "kv-scales-default")
    assert kv_findings(project, model, kv_dtype="bfloat16") == []


def test_the_held_out_tenth_is_neither_trained_nor_calibrated_on(project: Project, model: Path,
                                                                 tmp_path: Path) -> None:
    from vllmstack.workload.corpus import split_corpus

    text = kv.DEFAULT_CORPUS.read_text()
    train, held = split_corpus(text)
    assert train + held == text and held.startswith("\n\n") and 0.08 < len(held) / len(text) < 0.12
    assert gate.heldout_text(kv.DEFAULT_CORPUS, tmp_path).read_text() == held  # what --gate scores
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    resolved = resolve(project, model="tiny", platform="cpu",
                       overrides=[f"VLLM_MODEL={model}", f"MODELS_DIR={tmp_path / 'models'}",
                                  "NATIVE_ENGINE_COMMAND=/opt/py/bin/python3 -m vllm.entrypoints.cli.main"])
    measured: list[str] = []

    def measure(argv: tuple[str, ...]) -> Result:
        measured.append(Path(argv[4]).read_text())
        layers = {"model.layers.0.self_attn": {"k_amax": 4, "v_amax": 1}}
        Path(argv[5]).write_text(json.dumps({"layers": layers}))
        return Result(argv, 0)

    runner = RecordingRunner()
    runner.respond(["/opt/py/bin/python3"], measure)
    kv.ensure_calibrated(project, resolved, {"HOME": str(tmp_path)}, beside=on_host(runner), corpus=corpus)
    assert measured == [train]


def test_a_cpu_engine_without_avx512_or_amx_is_refused_before_booting() -> None:
    with pytest.raises(kv.CalibrationError, match=r"cpu_attn\.py") as err:
        gate.check_fp8_kv_engine("0.32.0+cpu", {"sse4_2", "avx2"})
    assert "GPU" in (err.value.fix or "")
    gate.check_fp8_kv_engine("0.32.0+cpu", {"avx2", "fma", "avx512f", "avx512vl", "avx512bw", "avx512dq"})
    gate.check_fp8_kv_engine("0.32.0+cpu", {"amx_tile"})
    gate.check_fp8_kv_engine("0.27.1", {"avx2"})  # a GPU engine: the CPU's flags do not matter
    cpuinfo = Path(__file__).parent / "data" / "nonexistent-cpuinfo"
    assert gate.cpu_flags(cpuinfo) == set()


def test_the_recall_probe_hides_a_random_needle_at_each_depth() -> None:
    from vllmstack.models.kv_quality_runner import recall_prompts

    held = list(range(100, 400))
    prompts, expected = recall_prompts(held, context=1024, needle=16, cue=4, depths=[0.1, 0.9], trials=3)
    assert len(prompts) == 6 and all(len(p) == 1024 for p in prompts)
    depths = []
    for prompt, want in zip(prompts, expected, strict=True):
        assert len(want) == 12
        cue = prompt[-4:]
        # The needle (cue + continuation) sits once, whole, inside the filler.
        at = [i for i in range(len(prompt) - 20) if prompt[i:i + 16] == cue + want]
        assert len(at) == 1
        depths.append(at[0] / 1024)
    assert max(depths[:3]) < 0.15 and min(depths[3:]) > 0.85

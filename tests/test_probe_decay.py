"""depth-decay: decode at 8K/32K/64K (capped by the window) as a share of the first depth; FAIL
below a quarter of the share the roofline predicts at the deepest, naming the attention backend
and the fix for the GPU it runs on (never the backend it already uses).

The collapse it guards: 2x R9700 (gfx1201) on the default ROCm attention path, about 100 tok/s at
8K and 14 tok/s at 79K (vllm#46192); the fix is AITER unified attention with a bf16/fp16 KV cache
(vllm#46192, ROCm/aiter#3294). The simulator slows each decode step with the context
(SIM_DECODE_DEPTH_SLOWDOWN), so one server passes and one fails through the whole CLI.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest
from helpers import ROOT
from helpers import bench_cli as cli
from simulator.fixture import run_simulator

from vllmstack.bench.client.client import ChatClient, EndpointError
from vllmstack.bench.client.row import BenchRow, Stat
from vllmstack.bench.probes.params import ParamError, check_params
from vllmstack.bench.probes.probe_base import ProbeContext
from vllmstack.bench.probes.probe_decay import (
    NOMINAL_DEPTHS,
    DepthPlan,
    plan_depths,
    probe_depth_decay,
    suggest_fix,
)
from vllmstack.bench.probes.probes import PROBES
from vllmstack.bench.target import target_from_profile
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project

# 10 ms steps after a 50 ms first token: on a loaded 2-core machine the simulator, behind its
# absolute deadlines after tokenizing a deep prompt, sent 2 ms steps in one burst (no decode rate).
PACED = {"SIM_BOOT_SECONDS": "0", "SIM_TTFT_MS": "50", "SIM_ITL_MS": "10"}
SMALL = ["-p", "pp=32", "-p", "tg=32", "-p", "runs=1"]


# --- the depths -----------------------------------------------------------------------------


def test_the_nominal_depths_when_64k_fits() -> None:
    assert plan_depths(131072, 128, 128) == DepthPlan(NOMINAL_DEPTHS, "")
    # 65536 + 128 + 128 + the 256-token margin is exactly the window.
    assert plan_depths(66048, 128, 128) == DepthPlan((8192, 32768, 65536), "")


def test_a_window_below_64k_caps_the_deepest_and_keeps_8k() -> None:
    plan = plan_depths(40960, 128, 128)
    assert plan is not None and plan.depths == (8192, 32768, 40448)
    assert plan.capped_by.startswith("max_model_len 40960")
    plan = plan_depths(32768, 128, 128)  # 32K itself no longer fits with the question
    assert plan is not None and plan.depths == (8192, 32256)


def test_a_small_window_scales_the_ladder_down() -> None:
    # The tiny CPU model's 4096 tokens: 3712 left, 3584 in whole 256-token steps.
    plan = plan_depths(4096, 64, 64)
    assert plan is not None and plan.depths == (448, 1792, 3584)
    plan = plan_depths(8192, 32, 32)
    assert plan is not None and plan.depths == (960, 3840, 7680)


def test_max_depth_caps_below_the_window_and_too_little_room_is_no_plan() -> None:
    plan = plan_depths(131072, 128, 128, max_depth=16384)
    assert plan is not None and plan.depths == (8192, 16384)
    assert plan.capped_by == "-p max_depth=16384"
    assert plan_depths(900, 128, 128) is None  # 388 left: under two 256-token steps
    assert plan_depths(None, 128, 128) is None
    plan = plan_depths(None, 128, 128, max_depth=2048)
    assert plan is not None and plan.depths == (256, 1024, 2048)


def test_params_are_checked_up_front() -> None:
    assert check_params("depth-decay", {"tg": 64, "min_of_roofline": 0.6}) == {
        "tg": 64, "min_of_roofline": 0.6}
    for bad in ({"tg": 1}, {"min_of_roofline": 0}, {"min_of_roofline": 1.5}, {"max_depth": 100},
                {"depth": 8192}, {"min_share": 0.5}):
        with pytest.raises(ParamError):
            check_params("depth-decay", bad)
    assert "depth-decay" in PROBES


# --- the fix ------------------------------------------------------------------------------


def test_gfx1201_gets_aiter_unified_attention_with_its_sources() -> None:
    fix = suggest_fix("amd", "gfx1201", "TRITON_ATTN", "auto")
    assert "ATTENTION_BACKEND=ROCM_AITER_UNIFIED_ATTN" in fix and "VLLM_ROCM_USE_AITER=1" in fix
    assert "bf16/fp16" in fix and "block 64" in fix
    assert "vllm#46192" in fix and "ROCm/aiter#3294" in fix
    # Already on AITER unified attention, with fp8 KV: that path takes bf16/fp16 only.
    fp8 = suggest_fix("amd", "gfx1201", "ROCM_AITER_UNIFIED_ATTN", "fp8_e4m3")
    assert "VLLM_KV_CACHE_DTYPE=auto" in fp8 and "vllm#46192" in fp8
    # Already right: the build may lack the support; the log line tells.
    built = suggest_fix("amd", "gfx1201", "ROCM_AITER_UNIFIED_ATTN", "auto")
    assert "AITER_REF" in built and "`Using ... backend`" in built


def test_elsewhere_the_advice_is_another_backend_and_never_amds() -> None:
    nvidia = suggest_fix("nvidia", "", "FLASH_ATTN", "auto")
    assert "another attention backend" in nvidia and "FLASHINFER" in nvidia
    assert "AITER" not in nvidia and "gfx" not in nvidia and "#46192" not in nvidia
    other_amd = suggest_fix("amd", "gfx1100", "TRITON_ATTN", "auto")
    assert "another attention backend" in other_amd and "#46192" not in other_amd
    assert suggest_fix("none", "", "vLLM's choice", "auto").startswith("try another attention")


def test_the_fix_never_offers_the_backend_the_profile_already_uses() -> None:
    # The H200 baseline ran TRITON_ATTN: the fix offered TRITON_ATTN again.
    on_triton = suggest_fix("nvidia", "sm90", "TRITON_ATTN", "auto")
    assert "ATTENTION_BACKEND=FLASH_ATTN or FLASHINFER (it uses TRITON_ATTN already)" in on_triton
    on_flash = suggest_fix("nvidia", "sm90", "FLASH_ATTN", "auto")
    assert "ATTENTION_BACKEND=FLASHINFER or TRITON_ATTN (it uses FLASH_ATTN already)" in on_flash
    amd = suggest_fix("amd", "gfx1100", "TRITON_ATTN", "auto")
    assert "=TRITON_ATTN" not in amd and "ROCM_AITER_UNIFIED_ATTN" in amd
    assert "(it uses TRITON_ATTN already)" in amd
    # vLLM's own choice (ATTENTION_BACKEND empty) is none of them: all are offered, no remark.
    unset = suggest_fix("nvidia", "", "vLLM's choice", "auto")
    assert "FLASH_ATTN, FLASHINFER or TRITON_ATTN" in unset and "already" not in unset
    # gfx1201 already on the recommended backend: said so, and the backend is not offered again.
    built = suggest_fix("amd", "gfx1201", "ROCM_AITER_UNIFIED_ATTN", "auto")
    assert "already is ROCM_AITER_UNIFIED_ATTN, the recommended one" in built
    assert "ATTENTION_BACKEND=ROCM_AITER_UNIFIED_ATTN" not in built


def test_the_r9700_profile_names_its_backend_and_gpu() -> None:
    resolved = resolve(Project(ROOT), platform="2xr9700", model="qwen3.6-27b", environ={})
    settings = target_from_profile(resolved).settings
    assert settings["ATTENTION_BACKEND"] == "ROCM_AITER_UNIFIED_ATTN"
    assert (settings["GPU_VENDOR"], settings["GPU_ARCH"]) == ("amd", "gfx1201")


# --- the verdict over given rates (bench-depth's rows, faked) ------------------------------


class NoMetrics:
    """A client whose /metrics does not answer: the KV dtype comes from the profile then."""

    async def get_text(self, path: str) -> str:
        raise EndpointError(f"{path}: 404")


def run_with_rates(rates: dict[int, float | None], window: int = 131072,
                   settings: dict[str, str] | None = None, roofline: dict[str, Any] | None = None,
                   **params: Any) -> tuple[Any, list[tuple[list[int], int, int, int]]]:
    asked: list[tuple[list[int], int, int, int]] = []

    async def rows(depths: list[int], pp: int, tg: int,
                   runs: int) -> tuple[list[BenchRow], list[str]]:
        asked.append((depths, pp, tg, runs))
        return [BenchRow(depth=d, mode="two-phase", errors=0,
                         tg_tps=None if (rate := rates[d]) is None else Stat(mean=rate))
                for d in depths], []

    ctx = ProbeContext(cast(ChatClient, NoMetrics()), "m", None, None, window,
                       check_params("depth-decay", params), lambda _line: None,
                       settings=settings or {}, depth_rows=rows, roofline=roofline)
    return asyncio.run(probe_depth_decay(ctx)), asked


# The roofline's inputs of the two H200 geometries, as benchmarks/2026-12-04-h200-depth-decay.md
# states them (8B: 13.95 GB of weights, 147,456 B of KV per token; the hybrid: 49.6 GB, 65,536 B
# of KV per token over its 16 full-attention layers, 154 MB of GDN state), TP=1.
H200_8B = {"decode_bytes_per_gpu": 13.95e9, "kv_bytes_per_token_per_gpu": 147456.0,
           "state_bytes_per_gpu": 0.0}
H200_HYBRID = {"decode_bytes_per_gpu": 49.6e9, "kv_bytes_per_token_per_gpu": 65536.0,
               "state_bytes_per_gpu": 154e6}


def r9700_roofline() -> dict[str, Any]:
    """The shipped qwen3.6-27b on 2xr9700, as `invoke probe` reads it from the profile."""
    from vllmstack.bench.report.roofline import inputs_from_profile

    inputs = inputs_from_profile(resolve(Project(ROOT), platform="2xr9700", model="qwen3.6-27b",
                                         environ={}), {})
    assert inputs is not None
    return inputs


def test_the_healthy_h200_curves_pass_against_their_roofline() -> None:
    # Measured 2026-12-04 on TRITON_ATTN: 164.0/97.6/63.7 and 35.3/19.0/11.9 t/s. A fixed 50 % at
    # 64K failed both; against the roofline's own share they keep 0.60 and 0.36 of it.
    for inputs, rates, roofline_share, kept in (
            (H200_8B, {8192: 164.0, 32768: 97.6, 65536: 63.7}, 0.64, 0.60),
            (H200_HYBRID, {8192: 35.3, 32768: 19.0, 65536: 11.9}, 0.93, 0.36)):
        verdict, _ = run_with_rates(rates, roofline=inputs,
                                    settings={"ATTENTION_BACKEND": "TRITON_ATTN",
                                              "GPU_VENDOR": "nvidia"})
        assert verdict.verdict == "pass", verdict.checks
        details = verdict.details
        assert details["roofline_share"] == pytest.approx(roofline_share, abs=0.005)
        assert details["of_roofline"] == pytest.approx(kept, abs=0.005)
        assert details["fix"] is None
        rows = {c.name: c for c in verdict.checks}
        assert rows["roofline share at 64K"].value == f"{roofline_share:.0%}"
        assert f"{kept:.2f} of the roofline's {roofline_share:.0%}" in rows[
            "decode at 64K / 8K"].note


def test_the_r9700_collapse_fails_against_its_roofline() -> None:
    # vllm#46192: 100 t/s at 8K, 14 at 79K on 2x R9700; about 17 at 64K on a per-token cost
    # linear in depth. The shipped profile's roofline keeps 90 % at 64K: 0.19 of it is the collapse.
    amd = {"ATTENTION_BACKEND": "ROCM_ATTN", "GPU_VENDOR": "amd", "GPU_ARCH": "gfx1201"}
    verdict, _ = run_with_rates({8192: 100.0, 32768: 45.0, 65536: 17.0}, roofline=r9700_roofline(),
                                settings=amd)
    assert verdict.verdict == "fail" and verdict.exit_code == 1
    assert verdict.details["roofline_share"] == pytest.approx(0.90, abs=0.01)
    assert verdict.details["of_roofline"] == pytest.approx(0.19, abs=0.01)
    final = verdict.checks[-1]
    assert "backend ROCM_ATTN" in final.note and "ATTENTION_BACKEND=ROCM_AITER_UNIFIED_ATTN" in final.note
    # The same curve with a healthy backend's decay (the hybrid H200's 34 %) passes there too.
    verdict, _ = run_with_rates({8192: 100.0, 32768: 54.0, 65536: 34.0}, roofline=r9700_roofline(),
                                settings=amd)
    assert verdict.verdict == "pass"


def test_the_boundary_and_no_roofline_taken_as_the_strictest() -> None:
    verdict, asked = run_with_rates({8192: 100.0, 32768: 80.0, 65536: 25.0})
    assert asked == [([8192, 32768, 65536], 128, 128, 2)]
    assert verdict.verdict == "pass"
    assert verdict.details["shares"] == [1.0, 0.8, 0.25]
    assert verdict.details["roofline_share"] is None and verdict.details["of_roofline"] == 0.25
    rows = {c.name: c for c in verdict.checks}
    assert rows["decode at 32K"].value == "80.0 t/s (80% of 8K)"
    assert rows["decode at 64K / 8K"].value == "25%"
    assert rows["roofline share at 64K"].value == "100% (assumed)"
    verdict, _ = run_with_rates({8192: 100.0, 32768: 80.0, 65536: 24.9})
    assert verdict.verdict == "fail" and verdict.exit_code == 1
    # -p min_of_roofline moves the line: the 14 % passes at 0.1.
    verdict, _ = run_with_rates({8192: 100.0, 32768: 40.0, 65536: 14.0}, min_of_roofline=0.1)
    assert verdict.verdict == "pass"


def test_a_fail_names_the_backend_and_the_fix_for_the_profiles_gpu() -> None:
    collapse = {8192: 100.0, 32768: 40.0, 65536: 14.0}
    amd = {"ATTENTION_BACKEND": "TRITON_ATTN", "GPU_VENDOR": "amd", "GPU_ARCH": "gfx1201"}
    verdict, _ = run_with_rates(collapse, settings=amd)
    assert verdict.verdict == "fail"
    final = verdict.checks[-1]
    assert "backend TRITON_ATTN" in final.note and "ROCM_AITER_UNIFIED_ATTN" in final.note
    assert verdict.details["attention_backend"] == "TRITON_ATTN"
    assert "vllm#46192" in verdict.details["fix"]
    verdict, _ = run_with_rates(collapse, settings={"GPU_VENDOR": "nvidia"})
    assert "vLLM's choice" in verdict.checks[-1].note and "AITER" not in verdict.checks[-1].note
    # -p wins over the profile.
    verdict, _ = run_with_rates(collapse, settings=amd, attention_backend="ROCM_ATTN",
                                gpu_vendor="nvidia", gpu_arch="sm90")
    assert "backend ROCM_ATTN" in verdict.checks[-1].note and "FLASHINFER" in verdict.details["fix"]


def test_a_missing_rate_is_inconclusive_not_a_verdict() -> None:
    verdict, _ = run_with_rates({8192: 100.0, 32768: 90.0, 65536: None})
    assert verdict.verdict == "inconclusive" and verdict.exit_code == 2
    verdict, asked = run_with_rates({}, window=600)
    assert verdict.verdict == "inconclusive" and not asked  # nothing fits: nothing sent


# --- through the CLI, against the simulator --------------------------------------------------


def simulated(tokenizer_file: Path, tmp_path: Path, slowdown: str,
              *params: str) -> tuple[int, dict[str, Any]]:
    env = {**PACED, "SIM_TOKENIZER": str(tokenizer_file), "SIM_DECODE_DEPTH_SLOWDOWN": slowdown}
    argv = ["--served-model-name", "sim", "--max-model-len", "8192"]
    with run_simulator(env=env, argv=argv) as sim:
        return cli(sim.url, tokenizer_file, tmp_path, "probe", "depth-decay", *SMALL, *params)


def test_a_profiles_roofline_reaches_the_verdict(tokenizer_file: Path, tmp_path: Path) -> None:
    """--platform/--profile beside --url: the probe judges the simulator's collapse against the
    shipped R9700 profile's roofline, and names the gfx1201 fix from the profile's GPU."""
    from helpers import copy_project

    project = copy_project(tmp_path / "project")
    code, record = simulated(tokenizer_file, project, "20", "--platform", "2xr9700",
                             "--profile", "qwen3.6-27b", "-p", "attention_backend=ROCM_ATTN")
    assert (code, record["verdict"]) == (1, "fail"), record["checks"]
    details = record["details"]
    # 960 -> 7680 tokens of a hybrid with bf16 KV on two GPUs: the roofline keeps ~98.6 %.
    assert details["roofline_share"] == pytest.approx(0.986, abs=0.005)
    assert details["of_roofline"] == pytest.approx(details["shares"][-1] / details["roofline_share"])
    assert (details["gpu_vendor"], details["gpu_arch"]) == ("amd", "gfx1201")
    assert "ATTENTION_BACKEND=ROCM_AITER_UNIFIED_ATTN" in details["fix"]


def test_a_backend_that_keeps_its_speed_passes(tokenizer_file: Path, tmp_path: Path) -> None:
    code, record = simulated(tokenizer_file, tmp_path, "0.25")
    assert (code, record["verdict"]) == (0, "pass"), record["checks"]
    details = record["details"]
    assert details["depths"] == [960, 3840, 7680]  # 8192 tokens: capped, the same shape
    assert details["capped_by"].startswith("max_model_len 8192")
    first, *_, last = details["tg_tps"]
    assert details["shares"][0] == 1.0 and details["shares"][-1] == pytest.approx(last / first)
    # 10 ms + 0.25 ms per 1K of context: ~10.25 ms a step at 960 deep, ~11.9 ms at 7680.
    assert 0.8 <= details["shares"][-1] <= 0.95
    assert details["kv_cache_dtype"] == "auto" and details["fix"] is None


def test_a_collapsing_backend_fails_with_the_gfx1201_fix(tokenizer_file: Path,
                                                         tmp_path: Path) -> None:
    code, record = simulated(tokenizer_file, tmp_path, "20", "-p", "gpu_vendor=amd",
                             "-p", "gpu_arch=gfx1201", "-p", "attention_backend=ROCM_ATTN")
    assert (code, record["verdict"]) == (1, "fail"), record["checks"]
    details = record["details"]
    # ~29 ms a step at 960 deep, ~164 ms at 7680: under a fifth of the speed is left, as on the
    # R9700 (no roofline against a bare --url: its share is taken as 100 %).
    assert 0.1 <= details["shares"][-1] <= 0.25
    assert details["roofline_share"] is None and details["of_roofline"] == details["shares"][-1]
    assert details["shares"][0] == 1.0 > details["shares"][1] > details["shares"][2]
    final = record["checks"][-1]
    assert final["name"] == "decode at 7680 / 960" and final["verdict"] == "fail"
    assert "backend ROCM_ATTN" in final["note"] and "ROCM_AITER_UNIFIED_ATTN" in final["note"]
    assert "vllm#46192" in final["note"]

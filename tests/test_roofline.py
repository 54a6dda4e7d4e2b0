"""% of the roofline: the limits a bench row is set against, and how the report shows them."""

from __future__ import annotations

import pytest

from vllmstack.bench.client.row import BenchRow
from vllmstack.bench.report import roofline
from vllmstack.bench.report.report import render_markdown
from vllmstack.config.modelinfo import GIB, MIB, ModelFacts
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project

ENV = {"HOME": "/nonexistent"}


def dense_facts() -> ModelFacts:
    return ModelFacts(kind="dense", num_layers=36, full_attention_layers=36, num_attention_heads=32,
                      num_kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=12288,
                      weight_gib=15.0, quant=None)


def test_decode_is_bandwidth_over_the_bytes_one_token_reads() -> None:
    inputs = roofline.compute_inputs(dense_facts(), 1, "NVIDIA_H200", "auto")
    kv = 36 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16
    assert inputs.kv_bytes_per_token_per_gpu == kv
    row = BenchRow.from_json({"pp": 2048, "tg": 128, "tg_tps": {"mean": 100.0},
                              "pp_tps": {"mean": 20000.0}}, "test")
    roof = roofline.row_roofline(row, vars(inputs))
    assert roof is not None
    limit = 4800e9 / (15 * GIB + kv * (2048 + 64))
    assert roof.decode_limit_tps == pytest.approx(limit, abs=0.1)
    assert roof.decode_pct == pytest.approx(100 * 100 / limit, abs=0.1)
    # Prefill: 2 FLOPs per bf16 parameter plus attention at the mean context, against BF16 peak.
    flops = 2 * 15 * GIB / 2 + 4 * 36 * 32 * 128 * 1024
    assert roof.prefill_limit_tps == pytest.approx(989e12 / flops, rel=1e-3)


def test_tensor_parallel_splits_the_bytes_and_a_hybrid_adds_its_state() -> None:
    facts = dense_facts()
    facts.mamba_state_mib = 64.0
    one, two = (roofline.compute_inputs(facts, tp, "NVIDIA_H200", "fp8") for tp in (1, 2))
    assert two.decode_bytes_per_gpu == one.decode_bytes_per_gpu / 2
    assert two.kv_bytes_per_token_per_gpu == one.kv_bytes_per_token_per_gpu / 2  # 8 KV heads split
    assert one.kv_bytes_per_token_per_gpu == 36 * 8 * 128 * 2  # fp8 KV: one byte
    assert two.state_bytes_per_gpu == 32 * MIB


def test_an_moe_token_reads_only_its_experts(project: Project) -> None:
    resolved = resolve(project, model="qwen3.6-35b-a3b", platform="nvidia",
                       overrides=["GPU_DEVICE_NAME=NVIDIA_H200"])
    inputs = roofline.inputs_from_profile(resolved, ENV)
    assert inputs is not None
    experts = 40 * 256 * 3 * 2048 * 512  # FP8: one byte a parameter
    assert inputs["decode_bytes_per_gpu"] == pytest.approx(35 * GIB - experts * (1 - 8 / 256))
    assert inputs["decode_bytes_per_gpu"] < 0.2 * 35 * GIB
    assert inputs["compute_dtype"] == "fp8" and inputs["card"]["fp8_tflops"] == 1979


def test_unknown_cards_and_cpus_say_so(project: Project) -> None:
    cpu = resolve(project, model="tiny", platform="cpu")
    assert roofline.inputs_from_profile(cpu, ENV) is None
    inputs = roofline.compute_inputs(dense_facts(), 1, "NVIDIA_A10G", "auto")
    row = BenchRow.from_json({"pp": 512, "tg": 32, "tg_tps": {"mean": 5.0}}, "test")
    roof = roofline.row_roofline(row, vars(inputs))
    assert roof is not None and roof.to_json() == {"card": None, "note": "unknown card NVIDIA_A10G"}
    assert roofline.cell(BenchRow(roofline=roof)) == "unknown card NVIDIA_A10G"
    assert "CARDS" in (roofline.progress_line(BenchRow(roofline=roof), "pp512 tg32") or "")


def test_every_card_cites_its_numbers() -> None:
    for name, card in roofline.CARDS.items():
        assert card.bandwidth_gbs > 0 and len(card.source) > 30, name
        assert card.fp8_tflops is None or card.bf16_tflops is None or card.fp8_tflops >= card.bf16_tflops


def test_the_report_shows_the_rows_share() -> None:
    row = {"pp": 2048, "tg": 32, "ttft_ms": {"mean": 100.0, "std": 1.0}, "tg_tps": {"mean": 90.0},
           "pp_tps": {"mean": 9000.0}, "errors": 0,
           "roofline": {"card": "NVIDIA_H200", "decode_pct": 41.26, "prefill_pct": 28.0,
                        "decode_limit_tps": 218.0, "prefill_limit_tps": 32000.0}}
    text = render_markdown("bench", [{"ts": 1.8e9, "model": "m", "profile": "p", "results": [row]}])
    assert "| % roofline |" in text and "| tg 41% / pp 28% |" in text
    line = roofline.progress_line(BenchRow.from_json(row, "test"), "pp2048 tg32")
    assert line == ("pp2048 tg32: roofline on NVIDIA_H200: decode 41.26% of 218 t/s (memory bandwidth) "
                    "prefill 28.0% of 32000 t/s (compute)")

"""% of the roofline: how close a measured row comes to what the card could do at best.

* Decode (one stream) is bound by memory bandwidth: each token reads the weights one GPU holds
  (for an MoE model only the routed experts' share: top-k of E, plus everything that is not an
  expert), the KV cache of the context so far, and a hybrid's recurrent state. The limit is the
  card's bandwidth / those bytes; decode % = measured tg t/s / that limit. Speculative decoding
  (MTP) emits more than one token per weight read, so it can exceed 100 %: that is its point.
* Prefill is bound by compute: 2 FLOPs per active parameter per token plus attention over the
  context (4 * layers * heads * head_dim FLOPs per token of context, at the mean context pp/2),
  against the card's dense matrix peak in the dtype the GEMMs run in (FP8 for a W8A8 checkpoint,
  else BF16).

The inputs are read from the profile when the bench starts (`inputs_from_profile`), kept in the
record, and every row gets its `roofline` there; the report and the dashboard print what the row
carries. A card missing from CARDS says so instead of guessing. Vendors' peaks are marketing
peaks (boost clocks, dense where stated): a well-tuned kernel reaches 70-90 % of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from vllmstack.bench.client.row import BenchRow, RowRoofline, Stat, mean_of
from vllmstack.config.modelinfo import GIB, MIB, ModelFacts, kv_bytes_per_token_per_gpu, load_model_facts
from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError


@dataclass(frozen=True)
class Card:
    bandwidth_gbs: float  # GB/s, decimal (vendors' TB/s x 1000)
    bf16_tflops: float | None  # dense matrix peak, FP32 accumulate
    fp8_tflops: float | None  # dense; None: no FP8 matrix units
    source: str


# Keyed by vLLM's device file name (get_device_name_as_file_name), the same GPU_DEVICE_NAME the
# tuned configs use. Dense = the vendor's sparsity figure halved where only that is printed.
CARDS: dict[str, Card] = {
    "NVIDIA_H200": Card(4800, 989, 1979, "NVIDIA H200 Tensor Core GPU datasheet, SXM: 4.8 TB/s "
                        "HBM3e; BF16 1,979 and FP8 3,958 TFLOPS with sparsity"),
    "NVIDIA_H200_NVL": Card(4800, 835, 1671, "NVIDIA H200 datasheet, NVL: 4.8 TB/s; BF16 1,671 "
                            "and FP8 3,341 TFLOPS with sparsity"),
    "NVIDIA_H100_80GB_HBM3": Card(3350, 989, 1979, "NVIDIA H100 Tensor Core GPU datasheet, SXM: "
                                  "3.35 TB/s; BF16 1,979 and FP8 3,958 TFLOPS with sparsity"),
    "NVIDIA_H100_PCIe": Card(2000, 756, 1513, "NVIDIA H100 datasheet, PCIe: 2 TB/s; BF16 1,513 "
                             "and FP8 3,026 TFLOPS with sparsity"),
    "NVIDIA_H100_NVL": Card(3900, 835, 1671, "NVIDIA H100 datasheet, NVL: 3.9 TB/s; BF16 1,671 "
                            "and FP8 3,341 TFLOPS with sparsity"),
    "AMD_Instinct_MI300X": Card(5300, 1307.4, 2614.9, "AMD Instinct MI300X data sheet: 5.3 TB/s; "
                                "FP16/BF16 1,307.4 and FP8 2,614.9 TFLOPS dense"),
    "AMD_Instinct_MI325X": Card(6000, 1307.4, 2614.9, "AMD Instinct MI325X data sheet: 6 TB/s; "
                                "FP16/BF16 1,307.4 and FP8 2,614.9 TFLOPS dense"),
    "NVIDIA_GeForce_RTX_4090": Card(1008, 165.2, 330.3, "NVIDIA Ada Lovelace architecture "
                                    "whitepaper, RTX 4090: 1,008 GB/s; BF16 165.2 and FP8 330.3 "
                                    "TFLOPS dense with FP32 accumulate"),
    "NVIDIA_GeForce_RTX_5090": Card(1792, 209.5, 419.0, "NVIDIA RTX Blackwell GPU architecture "
                                    "whitepaper, RTX 5090: 1,792 GB/s; BF16 209.5 and FP8 419 "
                                    "TFLOPS dense with FP32 accumulate"),
    "AMD_Radeon_RX7900XTX": Card(960, 122.8, None, "AMD Radeon RX 7900 XTX specifications: 960 "
                                 "GB/s; FP16 122.8 TFLOPS (WMMA); RDNA3 has no FP8 matrix units"),
    "AMD_Radeon_R9700": Card(640, 191.0, 383.0, "AMD Radeon AI PRO R9700 specifications: 640 "
                             "GB/s GDDR6; FP16 191 and FP8 383 TFLOPS peak (AMD does not say dense "
                             "or sparse there: the prefill % is approximate)"),
    "AMD_Radeon_8060S": Card(256, None, None, "AMD Ryzen AI Max+ 395 (Strix Halo): 256-bit "
                             "LPDDR5X-8000 = 256 GB/s shared with the CPU; no published matrix peak"),
}
BYTES_PER_PARAM = {"fp8": 1.0, "fp8_w8a8": 1.0, "awq": 0.56, "gptq": 0.56}


class RooflineError(StackError):
    """The profile does not say enough to place a row against the card's limits."""


@dataclass
class Inputs:
    device: str
    tp: int
    decode_bytes_per_gpu: float  # weights one token reads on one GPU
    kv_bytes_per_token_per_gpu: float
    state_bytes_per_gpu: float  # a hybrid's recurrent state, read once per token
    flops_per_token_per_gpu: float  # 2 x active parameters / tp
    attn_flops_per_ctx_per_gpu: float  # per token, per token of context
    compute_dtype: str  # fp8 | bf16
    card: dict[str, Any] | None
    notes: list[str]


def card_for(device: str) -> Card | None:
    return CARDS.get(device)


def inputs_from_profile(resolved: Resolved, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The roofline's inputs for this profile on its platform's card; None on a CPU platform."""
    if (resolved.get_str("GPU_VENDOR") or "none") == "none":
        return None
    facts = load_model_facts(resolved, environ)
    tp = max(1, resolved.get_int("VLLM_TP"))
    return asdict(compute_inputs(facts, tp, resolved.get_str("GPU_DEVICE_NAME"),
                                 resolved.get_str("VLLM_KV_CACHE_DTYPE") or "auto",
                                 resolved.get_int("MODEL_NUM_EXPERTS_PER_TOK")))


def compute_inputs(facts: ModelFacts, tp: int, device: str, kv_dtype: str, topk: int = 0) -> Inputs:
    if not facts.weight_gib:
        raise RooflineError("the model's weight size is unknown", "set MODEL_WEIGHT_GIB in the profile")
    notes: list[str] = []
    quant = (facts.quant or "").lower()
    per_param = BYTES_PER_PARAM.get(quant, 2.0)
    total = facts.weight_gib * GIB
    decode = total
    if facts.num_experts and facts.moe_intermediate_size and facts.hidden_size and facts.num_layers:
        experts = facts.num_layers * facts.num_experts * 3 * facts.hidden_size * facts.moe_intermediate_size
        expert_bytes = min(total, experts * per_param)
        routed = topk or 8
        if not topk:
            notes.append("top-k unknown (MODEL_NUM_EXPERTS_PER_TOK): 8 assumed")
        decode = total - expert_bytes * (1 - routed / facts.num_experts)
    kv = kv_bytes_per_token_per_gpu(facts, tp, kv_dtype) or 0
    if not kv:
        notes.append("KV geometry unknown: the KV cache is left out of the decode bytes")
    heads = facts.num_attention_heads or 0
    attn = 4 * (facts.full_attention_layers or facts.num_layers or 0) * heads * (facts.head_dim or 0)
    card = card_for(device)
    if card is None:
        notes.append(f"card {device or '(GPU_DEVICE_NAME unset)'} is not in the roofline table "
                     "(vllmstack/bench/report/roofline.py CARDS)")
    return Inputs(device=device, tp=tp, decode_bytes_per_gpu=decode / tp,
                  kv_bytes_per_token_per_gpu=float(kv),
                  state_bytes_per_gpu=(facts.mamba_state_mib or 0) * MIB / tp,
                  flops_per_token_per_gpu=2 * decode / per_param / tp,
                  attn_flops_per_ctx_per_gpu=attn / tp,
                  compute_dtype="fp8" if quant in ("fp8", "fp8_w8a8") else "bf16",
                  card=asdict(card) if card else None, notes=notes)


def _rate(stat: Stat | None) -> float | None:
    value = mean_of(stat)
    return value if value is not None and value > 0 else None


def decode_bytes(inputs: Mapping[str, Any], context: float) -> float:
    """What one decoded token reads on one GPU at `context` tokens: the weights, the KV cache of
    the context, a hybrid's recurrent state."""
    return float(inputs["decode_bytes_per_gpu"] + inputs["kv_bytes_per_token_per_gpu"] * context
                 + inputs["state_bytes_per_gpu"])


def decode_context(depth: int, pp: int, tg: int) -> float:
    """The mean context a decoded token attends to in a depth/pp/tg row."""
    return depth + pp + tg / 2


def expected_decode_share(inputs: Mapping[str, Any] | None, base_context: float,
                          context: float) -> float | None:
    """What a memory-bound decode keeps at `context` of its rate at `base_context`: the bytes
    per token there over the bytes here (the card's bandwidth cancels, so an unknown card is no
    obstacle). None without inputs (a CPU platform, a bare --url) or bytes."""
    if not inputs:
        return None
    deep = decode_bytes(inputs, context)
    return decode_bytes(inputs, base_context) / deep if deep > 0 else None


def row_roofline(row: BenchRow, inputs: Mapping[str, Any] | None) -> RowRoofline | None:
    """This row's limits and how much of them it reached; None without inputs (CPU)."""
    if not inputs:
        return None
    card = inputs.get("card")
    if not card:
        return RowRoofline(card=None, note=f"unknown card {inputs.get('device') or '(unset)'}")
    pp, tg, depth = row.pp or 0, row.tg or 0, row.depth or 0
    per_token = decode_bytes(inputs, decode_context(depth, pp, tg))
    decode_limit = decode_pct = prefill_limit = prefill_pct = None
    if per_token > 0:
        decode_limit = round(card["bandwidth_gbs"] * 1e9 / per_token, 1)
        tg_tps = _rate(row.tg_tps)
        if tg_tps is not None:
            decode_pct = round(100 * tg_tps / decode_limit, 1)
    peak = card.get("fp8_tflops") if inputs["compute_dtype"] == "fp8" else card.get("bf16_tflops")
    peak = peak or card.get("bf16_tflops")
    if peak and pp:
        flops = inputs["flops_per_token_per_gpu"] + inputs["attn_flops_per_ctx_per_gpu"] * (depth + pp / 2)
        prefill_limit = round(peak * 1e12 / flops, 1)
        pp_tps = _rate(row.pp_tps)
        if pp_tps is not None:
            prefill_pct = round(100 * pp_tps / prefill_limit, 1)
    return RowRoofline(card=str(inputs["device"]), decode_limit_tps=decode_limit,
                       decode_pct=decode_pct, prefill_limit_tps=prefill_limit,
                       prefill_pct=prefill_pct)


def cell(row: BenchRow) -> str:
    """The report's "% roofline" cell: "tg 41% / pp 28%", "unknown card X", or "-"."""
    roof = row.roofline
    if roof is None:
        return "-"
    if not roof.card:
        return roof.note or "unknown card"
    parts = [f"tg {roof.decode_pct:.0f}%" if roof.decode_pct is not None else "",
             f"pp {roof.prefill_pct:.0f}%" if roof.prefill_pct is not None else ""]
    return " / ".join(p for p in parts if p) or "-"


def progress_line(row: BenchRow, label: str) -> str | None:
    """What `invoke bench` prints under a row: the limits and the share of them reached."""
    roof = row.roofline
    if roof is None:
        return None
    if not roof.card:
        return f"{label}: roofline: {roof.note} (add it to vllmstack/bench/report/roofline.py CARDS)"
    text = [f"{label}: roofline on {roof.card}:"]
    if roof.decode_limit_tps is not None:
        text.append(f"decode {_pct(roof.decode_pct)}% of {roof.decode_limit_tps:.0f} t/s "
                    "(memory bandwidth)")
    if roof.prefill_limit_tps is not None:
        text.append(f"prefill {_pct(roof.prefill_pct)}% of {roof.prefill_limit_tps:.0f} t/s "
                    "(compute)")
    return " ".join(text)


def _pct(value: float | None) -> str:
    return "-" if value is None else str(value)

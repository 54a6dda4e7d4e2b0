"""The kernel shapes a profile makes vLLM look up, and the file names it looks them up under.

vLLM reads a tuned file only when its name matches what it computes at run time, and says nothing
when a near miss sits beside it. So every name here follows vLLM's own code (0.26-0.33, see
shared/reference/vllm-facts.md §1-2):

* fused MoE: `E={E},N={N},device_name={dev}[,dtype={dtype}][,block_shape=[bn,bk]].json`, where E
  is the local expert count and N is w2's per-partition intermediate size (moe_intermediate // TP,
  not x2); an `H200` token in the device name becomes `NVIDIA_H200` (fused_moe.get_config_file_name).
* block-FP8 dense: `N={N},K={K},device_name={dev},dtype=fp8_w8a8,block_shape=[bn,bk].json`, N and
  K the per-partition weight's [out, in] (fp8_utils.get_w8a8_block_fp8_configs); no H200 rename.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.config.hfconfig import LAYERS, HfConfig, read_config
from vllmstack.config.modelinfo import ModelFacts
from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError

# Qwen's and DeepSeek's FP8 checkpoints quantize weights in 128x128 blocks (weight_block_size in
# their config.json); a profile that says only MODEL_QUANT=fp8 is taken to mean the same.
DEFAULT_FP8_BLOCK = (128, 128)
FP8_DTYPE = "fp8_w8a8"
MOE_FOLDER, DENSE_FOLDER = "fused_moe_configs", "fp8_configs"


class TuneShapeError(StackError):
    """The profile does not say enough to know which shape vLLM would look up."""


@dataclass(frozen=True)
class MoeShape:
    experts: int  # E: experts on one GPU
    n: int  # w2's per-partition intermediate size
    hidden: int  # K of the gate/up GEMM
    topk: int
    dtype: str | None  # "fp8_w8a8", or None for bf16/fp16 (no suffix)
    block_shape: tuple[int, int] | None

    def file_name(self, device: str) -> str:
        return moe_file_name(self.experts, self.n, device, self.dtype, self.block_shape)

    def as_json(self) -> dict[str, Any]:
        return {"kind": "moe", "E": self.experts, "N": self.n, "K": self.hidden, "topk": self.topk,
                "dtype": self.dtype, "block_shape": list(self.block_shape) if self.block_shape else None}


@dataclass(frozen=True)
class DenseShape:
    name: str  # which projection: gate_up, down, qkv, o
    n: int
    k: int
    block_shape: tuple[int, int]

    def file_name(self, device: str) -> str:
        return dense_file_name(self.n, self.k, device, self.block_shape)

    def as_json(self) -> dict[str, Any]:
        return {"kind": "fp8-dense", "name": self.name, "N": self.n, "K": self.k,
                "block_shape": list(self.block_shape)}


def moe_device_name(device: str) -> str:
    """fused_moe.get_config_file_name: any H200 variant shares NVIDIA_H200's files."""
    return "NVIDIA_H200" if "H200" in device.split("_") else device


def moe_file_name(experts: int, n: int, device: str, dtype: str | None,
                  block_shape: tuple[int, int] | None) -> str:
    dtype_part = f",dtype={dtype}" if dtype else ""
    # vLLM adds the block only when every entry is non-zero, written without spaces.
    block_part = (f",block_shape=[{block_shape[0]},{block_shape[1]}]"
                  if block_shape and all(block_shape) else "")
    return f"E={experts},N={n},device_name={moe_device_name(device)}{dtype_part}{block_part}.json"


def dense_file_name(n: int, k: int, device: str, block_shape: tuple[int, int]) -> str:
    return (f"N={n},K={k},device_name={device},dtype={FP8_DTYPE},"
            f"block_shape=[{block_shape[0]},{block_shape[1]}].json")


def read_model_config(facts: ModelFacts) -> dict[str, Any]:
    """What the shapes read from config.json when the model is on disk ({} otherwise: the
    profile's keys rule), each field checked as hfconfig reads it (ModelConfigError naming it)."""
    folder = facts.model_dir
    path = folder / "config.json" if folder is not None and folder.is_dir() else None
    data = read_config(path) if path is not None else None
    if data is None:
        return {}
    cfg = HfConfig(data, path)
    merged: dict[str, Any] = {}
    topk = cfg.number("num_experts_per_tok", LAYERS)
    if topk is not None:
        merged["num_experts_per_tok"] = topk
    if cfg.has("attn_output_gate"):
        merged["attn_output_gate"] = cfg.flag("attn_output_gate", False)
    quant = cfg.section("quantization_config")
    if quant is not None:
        block = quant.block("weight_block_size")
        merged["quantization_config"] = {"quant_method": quant.text("quant_method") or "",
                                         "weight_block_size": list(block) if block else None}
    return merged


def quant_block(facts: ModelFacts, config: dict[str, Any]) -> tuple[str | None, tuple[int, int] | None]:
    """(dtype suffix, block shape) of the model's weights as vLLM's MoE and dense lookups see them."""
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8":
        block = quant.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2:
            return FP8_DTYPE, (int(block[0]), int(block[1]))
        return FP8_DTYPE, None  # per-tensor FP8: no block part in the name
    if (facts.quant or "").lower() in ("fp8", FP8_DTYPE):
        return FP8_DTYPE, DEFAULT_FP8_BLOCK
    return None, None


def moe_shape(resolved: Resolved, facts: ModelFacts, tp: int) -> MoeShape:
    """The fused-MoE shape at tensor-parallel size `tp` (no expert parallelism: all experts on
    every GPU, the intermediate size split tp ways, as FusedMoEParallelConfig does)."""
    config = read_model_config(facts)
    experts, inter, hidden = facts.num_experts, facts.moe_intermediate_size, facts.hidden_size
    if not (experts and inter and hidden):
        raise TuneShapeError(
            "this profile is not an MoE model (MODEL_NUM_EXPERTS, MODEL_MOE_INTERMEDIATE_SIZE and "
            "MODEL_HIDDEN_SIZE, or a config.json with them, are needed)",
            "pick an MoE profile (--model), or tune its dense GEMMs: invoke tune fp8-dense")
    if inter % tp:
        raise TuneShapeError(f"the MoE intermediate size {inter} does not split {tp} ways",
                             "use a --tp that divides it")
    topk = config.get("num_experts_per_tok") or resolved.get_int("MODEL_NUM_EXPERTS_PER_TOK")
    if not topk:
        raise TuneShapeError(
            "how many experts each token is routed to is unknown (config.json has no "
            "num_experts_per_tok and the profile no MODEL_NUM_EXPERTS_PER_TOK)",
            "set MODEL_NUM_EXPERTS_PER_TOK in the profile (the model card's 'activated experts')")
    dtype, block = quant_block(facts, config)
    return MoeShape(int(experts), inter // tp, int(hidden), int(topk), dtype, block)


def dense_shapes(facts: ModelFacts, tp: int,
                 which: tuple[str, ...] = ("gate_up", "down")) -> list[DenseShape]:
    """The block-FP8 GEMM shapes of the MLP (and, asked for, attention) at tensor-parallel size `tp`.

    gate_up is a column-parallel merge (N = 2*intermediate/tp, K = hidden); down is row-parallel
    (N = hidden, K = intermediate/tp). qkv and o follow the attention geometry; Qwen3.5/3.6-style
    gated attention doubles q (output_gate). Other projections (GDN in_proj) come from a boot log's
    `Config file not found at .../N=..,K=..` lines and are passed as --shape.
    """
    config = read_model_config(facts)
    dtype, block = quant_block(facts, config)
    if dtype != FP8_DTYPE or block is None:
        raise TuneShapeError("this profile's weights are not block-quantized FP8, so vLLM never "
                             "looks up an fp8_configs/ file for it",
                             "pick a block-FP8 profile (MODEL_QUANT=fp8), or tune MoE: invoke tune moe")
    hidden, inter = facts.hidden_size, facts.intermediate_size
    shapes: list[DenseShape] = []
    for name in which:
        if name in ("gate_up", "down"):
            if not (hidden and inter):
                raise TuneShapeError("the MLP geometry is unknown (MODEL_HIDDEN_SIZE, "
                                     "MODEL_INTERMEDIATE_SIZE)", "set them in the profile")
            n, k = (2 * inter // tp, hidden) if name == "gate_up" else (hidden, inter // tp)
        elif name in ("qkv", "o"):
            heads, kv, head_dim = facts.num_attention_heads, facts.num_kv_heads, facts.head_dim
            if not (hidden and heads and kv and head_dim):
                raise TuneShapeError("the attention geometry is unknown", "set MODEL_NUM_ATTENTION_HEADS, "
                                     "MODEL_NUM_KV_HEADS and MODEL_HEAD_DIM in the profile")
            gate = 2 if config.get("attn_output_gate", facts.is_hybrid) else 1
            # vLLM keeps at least one KV head per GPU (replicated above TP=kv).
            kv_local = max(1, kv // tp)
            n, k = ((gate * heads // tp + 2 * kv_local) * head_dim, hidden) if name == "qkv" else (
                hidden, heads // tp * head_dim)
        else:
            raise TuneShapeError(f"unknown projection {name!r}",
                                 "name one of gate_up, down, qkv, o, or pass --shape N,K")
        shapes.append(DenseShape(name, n, k, block))
    return shapes


def parse_shape(text: str, block: tuple[int, int]) -> DenseShape:
    """--shape N,K (from a boot log's missing-config line)."""
    parts = text.replace("x", ",").split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise TuneShapeError(f"--shape {text!r} is not N,K", "write it as two positive integers, "
                             "e.g. --shape 34816,5120")
    return DenseShape("custom", int(parts[0]), int(parts[1]), block)


def config_path(root: Path, folder: str, name: str) -> Path:
    return root / folder / name

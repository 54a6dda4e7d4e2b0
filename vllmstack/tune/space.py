"""The explicit search space of Triton tile configurations, pruned per batch size.

vLLM's own tuners sweep everything (benchmark_w8a8_block_fp8.py: 1280 tiles a shape; the box we
reproduce: 576) and take hours. Here the axes are vLLM's, and three rules prune what cannot win or
cannot be right, so one shape fits one 10-minute GPU run (the budget in verdict.py cuts the rest,
from a seeded shuffle, so a cut search is a fair sample rather than one corner):

* rows: BLOCK_SIZE_M no larger than the rows one tile can see (M for a dense GEMM; for MoE twice
  the mean tokens per expert, as routing is uneven), and no 16/32-row tiles when there are >= 512
  rows (compute-bound there);
* GROUP_SIZE_M > 1 only where there is more than one tile along M, 8 warps only for tiles of at
  least 64x128, and num_stages only as deep as shared memory holds (227 KiB on Hopper);
* scale groups (block FP8): a K tile must not straddle two quantization groups. vLLM's dense kernel
  loads one scale per K tile (k_start // group_k), so BLOCK_SIZE_K=256 on 128-wide groups is wrong
  numbers, not a slow tile; vLLM's MoE kernel clamps BLOCK_SIZE_K to the block and would silently
  run another tile than the file says. Either way the tile is dropped here, and the numeric gate
  would throw it out if it were not.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
Config = dict[str, int]
# Hopper's largest dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin).
HOPPER_SMEM = 227 * 1024


@dataclass(frozen=True)
class Axes:
    block_m: tuple[int, ...] = (16, 32, 64, 128, 256)
    block_n: tuple[int, ...] = (32, 64, 128, 256)
    block_k: tuple[int, ...] = (64, 128)
    group_m: tuple[int, ...] = (1, 16, 32)
    num_warps: tuple[int, ...] = (4, 8)
    num_stages: tuple[int, ...] = (2, 3, 4, 5)

    def as_json(self) -> dict[str, Any]:
        return {k: list(v) for k, v in asdict(self).items()}


DENSE_AXES = Axes()
# MoE tiles see tokens-per-expert rows, never 256 of them at the batch sizes that decode uses.
MOE_AXES = Axes(block_m=(16, 32, 64, 128))
# Unquantized (bf16) MoE: no scale groups, so K tiles from 32 to 256 are all fair.
MOE_BF16_AXES = Axes(block_m=(16, 32, 64, 128), block_k=(32, 64, 128, 256))

RULES = [
    "BLOCK_SIZE_M <= max(16, next_pow2(rows)); rows = M (dense) or 2*ceil(M*topk/E) (MoE)",
    "no BLOCK_SIZE_M < 64 when rows >= 512",
    "GROUP_SIZE_M > 1 only when rows > BLOCK_SIZE_M",
    "num_warps 8 only for BLOCK_SIZE_M*BLOCK_SIZE_N >= 64*128",
    "num_stages * (BM*BK + BK*BN) * element bytes <= 227 KiB",
    "block FP8: block_k % BLOCK_SIZE_K == 0 (a K tile never spans two scale groups)",
]


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def scale_groups_ok(config: Config, block_shape: tuple[int, int] | list[int] | None) -> bool:
    """A K tile inside one quantization group along K (the block-FP8 kernels' assumption)."""
    if not block_shape or not block_shape[1]:
        return True
    bk = config["BLOCK_SIZE_K"]
    return bk <= block_shape[1] and block_shape[1] % bk == 0


def moe_rows(m: int, topk: int, experts: int) -> int:
    """Mean tokens per expert at batch size m: what one MoE tile's M dimension sees."""
    return max(1, -(-m * topk // experts))


def candidates(rows: int, axes: Axes, block_shape: tuple[int, int] | list[int] | None,
               element_bytes: int) -> list[Config]:
    """Every configuration the rules keep for tiles that see `rows` rows, in a fixed order."""
    out: list[Config] = []
    for bm in axes.block_m:
        if bm > max(16, next_pow2(rows)) or (rows >= 512 and bm < 64):
            continue
        for bn in axes.block_n:
            for bk in axes.block_k:
                for group in axes.group_m:
                    if group > 1 and rows <= bm:
                        continue
                    for warps in axes.num_warps:
                        if warps == 8 and bm * bn < 64 * 128:
                            continue
                        for stages in axes.num_stages:
                            if stages * (bm * bk + bk * bn) * element_bytes > HOPPER_SMEM:
                                continue
                            config = dict(zip(KEYS, (bm, bn, bk, group, warps, stages), strict=True))
                            if scale_groups_ok(config, block_shape):
                                out.append(config)
    return out


def ordered(space: list[Config], stock: Config, seed: int) -> list[Config]:
    """The stock config first (timed in the same harness as the rest), then a seeded shuffle: a
    budget that stops early has sampled the whole space, not its first corner."""
    rest = [c for c in space if not same_tile(c, stock)]
    random.Random(seed).shuffle(rest)
    return [tile_of(stock), *rest]


def tile_of(config: dict[str, Any]) -> Config:
    """The six tuned keys of a config (vLLM's defaults also carry SPLIT_K, forced to 1)."""
    return {k: int(config[k]) for k in KEYS if k in config}


def same_tile(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return tile_of(a) == tile_of(b)


def union(spaces: list[list[Config]]) -> list[Config]:
    """Each distinct tile once, in first-seen order (what the compile warm-up has to build)."""
    seen: dict[tuple[int, ...], Config] = {}
    for space in spaces:
        for config in space:
            seen.setdefault(tuple(config[k] for k in KEYS), config)
    return list(seen.values())

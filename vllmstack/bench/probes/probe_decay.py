"""depth-decay: single-stream decode speed at context depth 8K, 32K and 64K, each as a share of the
8K figure, judged against the share the roofline predicts for that depth: it fails where decode
keeps less than a quarter of what a memory-bound decode would keep (MIN_OF_ROOFLINE).

Why: on two R9700s (gfx1201) the default ROCm prefill-decode attention path decodes about
100 tok/s at 8K and about 14 tok/s at 79K (vllm#46192); AITER unified attention fixes it. A
healthy backend slows with depth (every token reads more KV cache) by what its model's bytes say:
a dense model with a large KV cache may keep 64 % at 64K at best, a hybrid whose few attention
layers keep a KV cache 93 % (bench/report/roofline.expected_decode_share). A fixed share of 8K
failed both healthy H200 curves (benchmarks/2026-12-04-h200-depth-decay.md), so the verdict is
the measured share over the roofline's. Without roofline inputs (a CPU platform, a bare --url, a
profile without MODEL_WEIGHT_GIB) the roofline's share is taken as 100 %: the most any decode
keeps, so the verdict can only be stricter than with them.

The measurement is bench-depth's (`runs/depth_runs.run_depth`, handed in as `ctx.depth_rows`: see
`runs/decay_runs.py`); this module picks the depths and makes the verdict. The depths are capped
by the window: whatever `max_model_len` leaves after the question (`pp`), the answer (`tg`) and
bench-depth's margin. When 64K does not fit, the deepest depth is what does; when 16K does not
fit either, the ladder keeps its shape (1/8, 1/2, 1 of the deepest that fits: 448, 1792 and 3584
on a 4096-token window), and the verdict says which depths ran.

The attention backend is named from `-p attention_backend`, else the profile's ATTENTION_BACKEND
(the server reports it only in its log: `Using ... backend`); the KV dtype and block size from
the server's `vllm:cache_config_info`, else the profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllmstack.bench.client.row import BenchRow, mean_of
from vllmstack.bench.probes.probe_base import ProbeContext
from vllmstack.bench.probes.verdict import INFO, Verdict
from vllmstack.bench.report.roofline import decode_context, expected_decode_share
from vllmstack.config.attention import ALTERNATIVES, UNIFIED_AITER, offer_backends
from vllmstack.workload.ladders import DEFAULT_MARGIN, depth_cap

NOMINAL_DEPTHS = (8192, 32768, 65536)
# The least part of the roofline's share of the first depth that decode keeps at the deepest.
# Measured: a healthy H200 on TRITON_ATTN keeps 0.60 of it on the Qwen3-8B geometry (39 % of 8K
# at 64K, against the roofline's 64 %) and 0.36 on the 27B hybrid with MTP-1 (34 % against 93 %;
# benchmarks/2026-12-04-h200-depth-decay.md). The collapse on 2x R9700 (vllm#46192: 100 -> 14
# t/s from 8K to 79K) keeps 14 % at 79K and about 17 % at 64K (a per-token cost linear in depth
# through the two points), against the 90 % the roofline gives the shipped qwen3.6-27b on
# 2xr9700 at 64K: 0.19 of it. 0.25 lies between the two (their geometric mean is 0.26): the
# healthiest-looking collapse is 1.3x under it, the weakest healthy curve 1.4x over it.
MIN_OF_ROOFLINE = 0.25
# The deepest depth is rounded down to this (a multiple of every KV block size in use: 16, 64).
GRAIN = 256
# A ladder needs a few blocks at its shallowest rung to read a decay from.
MIN_DEEPEST = 2 * GRAIN
AITER_UNIFIED = UNIFIED_AITER
# The arch vllm#46192 measured the collapse and the fix on (2x R9700).
COLLAPSE_ARCHS = ("gfx1201",)


@dataclass(frozen=True)
class DepthPlan:
    depths: tuple[int, ...]
    capped_by: str  # "" when the nominal depths fit, else what capped them


def plan_depths(window: int | None, pp: int, tg: int, max_depth: int | None = None
                ) -> DepthPlan | None:
    """The depths to measure in `window` (None: no ladder fits; no window and no max_depth)."""
    rooms: list[tuple[int, str]] = []
    if window is not None:
        rooms.append((depth_cap(window, pp, tg, DEFAULT_MARGIN),
                      f"max_model_len {window} (less pp {pp}, tg {tg}, margin {DEFAULT_MARGIN})"))
    if max_depth is not None:
        rooms.append((max_depth, f"-p max_depth={max_depth}"))
    if not rooms:
        return None
    room, why = min(rooms)
    deepest = min(NOMINAL_DEPTHS[-1], room // GRAIN * GRAIN)
    if deepest >= NOMINAL_DEPTHS[-1]:
        return DepthPlan(NOMINAL_DEPTHS, "")
    if deepest < MIN_DEEPEST:
        return None
    base = NOMINAL_DEPTHS[0]
    if deepest >= 2 * base:
        # 8K still fits with room to decay in: keep it as the reference, cap the rest.
        depths = [base, *(d for d in NOMINAL_DEPTHS[1:] if d < deepest), deepest]
    else:
        # A small window: the same shape as 8K/32K/64K, scaled to the deepest that fits.
        depths = sorted({deepest // 8, deepest // 2, deepest})
    return DepthPlan(tuple(depths), why)


def label_depth(depth: int) -> str:
    return f"{depth // 1024}K" if depth % 1024 == 0 else str(depth)


def read_rates(rows: list[BenchRow]) -> dict[int, float | None]:
    """Mean decode t/s per depth of bench-depth's rows (None where no request had a rate)."""
    rates: dict[int, float | None] = {}
    for row in rows:
        mean = mean_of(row.tg_tps)
        rates[row.depth or 0] = mean if mean is not None and mean > 0 else None
    return rates


def compute_shares(rates: dict[int, float | None], depths: tuple[int, ...]) -> dict[int, float | None]:
    """Each depth's decode rate as a share of the first depth's."""
    base = rates.get(depths[0])
    return {d: (r / base if base and (r := rates.get(d)) is not None else None) for d in depths}


def suggest_fix(vendor: str, arch: str, backend: str, kv_dtype: str) -> str:
    """What to change when decode collapses with depth, for this GPU, backend and KV dtype."""
    fp8_kv = kv_dtype.lower().startswith("fp8")
    if arch.lower() in COLLAPSE_ARCHS:
        if backend != AITER_UNIFIED:
            return (f"on {arch} the default ROCm attention path collapses at long context: serve "
                    f"ATTENTION_BACKEND={AITER_UNIFIED} with VLLM_ROCM_USE_AITER=1 (EXTENDS="
                    "features/aiter-unified-attention, as the r9700 platforms do), a bf16/fp16 "
                    "KV cache (VLLM_KV_CACHE_DTYPE=auto) and the backend's KV block 64 "
                    "(vllm#46192, ROCm/aiter#3294)")
        if fp8_kv:
            return (f"{AITER_UNIFIED} on {arch} takes a bf16/fp16 KV cache only: set "
                    "VLLM_KV_CACHE_DTYPE=auto (vllm#46192)")
        return (f"the backend already is {AITER_UNIFIED}, the recommended one: the image's vLLM "
                f"or AITER may lack its {arch} support (vllm#46192 lets gfx12 use it; "
                f"ROCm/aiter#3294 tracks {arch} in AITER); check that the engine log's `Using "
                "... backend` line names it and that VLLM_REF/AITER_REF carry those changes")
    # Never the backend the profile already runs (it is the one that decays).
    offer = offer_backends(ALTERNATIVES.get(vendor, ()), backend)
    return (f"try another attention backend ({offer or 'ATTENTION_BACKEND'}) and run this probe "
            "again")


async def _read_kv(ctx: ProbeContext) -> tuple[str, int | None, str]:
    """KV dtype, block size and where they came from."""
    snap = await ctx.metrics()
    config = snap.cache_config if snap is not None else {}
    dtype = config.get("cache_dtype")
    if dtype:
        return dtype, snap.cache_layout.block_size if snap is not None else None, \
            "vllm:cache_config_info"
    return ctx.settings.get("VLLM_KV_CACHE_DTYPE") or "auto", None, "the profile"


def _name_backend(ctx: ProbeContext) -> tuple[str, str]:
    given = str(ctx.param("attention_backend", ""))
    if given:
        return given, "-p attention_backend"
    if ctx.settings.get("ATTENTION_BACKEND"):
        return ctx.settings["ATTENTION_BACKEND"], "the profile's ATTENTION_BACKEND"
    return "vLLM's choice", ("ATTENTION_BACKEND is empty (or no profile): the engine log's "
                             "`Using ... backend` line names it")


async def probe_depth_decay(ctx: ProbeContext) -> Verdict:
    v = Verdict("depth-decay")
    pp, tg = int(ctx.param("pp", 128)), int(ctx.param("tg", 128))
    min_of_roofline = float(ctx.param("min_of_roofline", MIN_OF_ROOFLINE))
    max_depth = ctx.params.get("max_depth")
    plan = plan_depths(ctx.max_model_len, pp, tg, None if max_depth is None else int(max_depth))
    if plan is None:
        return v.inconclusive(
            "no depth ladder fits: " + (f"max_model_len {ctx.max_model_len} less pp {pp}, tg "
                                        f"{tg} and margin {DEFAULT_MARGIN} leaves under "
                                        f"{MIN_DEEPEST} tokens" if ctx.max_model_len else
                                        "the server reports no max_model_len; pass -p max_depth"))
    if ctx.depth_rows is None:
        return v.inconclusive("no depth measurement: this probe needs a tokenizer (--tokenizer "
                              "or VLLM_TOKENIZER) to build contexts of exact length")
    depths = plan.depths
    labels = ", ".join(label_depth(d) for d in depths)
    v.add("depths", labels, INFO, f"capped by {plan.capped_by}: the largest that fit"
          if plan.capped_by else "as specified")
    backend, backend_from = _name_backend(ctx)
    v.add("attention backend", backend, INFO, f"from {backend_from}")
    kv_dtype, block, kv_from = await _read_kv(ctx)
    v.add("KV cache", f"{kv_dtype}" + (f", block {block}" if block else ""), INFO,
          f"from {kv_from}")
    rows, warnings = await ctx.depth_rows(list(depths), pp, tg, int(ctx.param("runs", 2)))
    rates = read_rates(rows)
    shares = compute_shares(rates, depths)
    modes = {r.depth or 0: r.mode or "" for r in rows}
    for depth in depths:
        rate, share = rates.get(depth), shares.get(depth)
        value = (f"{rate:.1f} t/s" + (f" ({share:.0%} of {label_depth(depths[0])})"
                                      if share is not None else "")
                 if rate is not None else "no decode rate")
        v.add(f"decode at {label_depth(depth)}", value, INFO, modes.get(depth, ""))
    deepest = depths[-1]
    vendor = str(ctx.param("gpu_vendor", ctx.settings.get("GPU_VENDOR") or "none")).lower()
    arch = str(ctx.param("gpu_arch", ctx.settings.get("GPU_ARCH") or ""))
    fix = suggest_fix(vendor, arch, backend, kv_dtype)
    expected = expected_decode_share(ctx.roofline, decode_context(depths[0], pp, tg),
                                     decode_context(deepest, pp, tg))
    v.add(f"roofline share at {label_depth(deepest)}",
          f"{expected:.0%}" if expected is not None else "100% (assumed)", INFO,
          "memory-bound decode: the bytes per token at the first depth over those here"
          if expected is not None else "no roofline inputs (a CPU platform, a bare --url or no "
          "MODEL_WEIGHT_GIB): the most any decode keeps")
    v.details = {"depths": list(depths), "capped_by": plan.capped_by,
                 "tg_tps": [rates.get(d) for d in depths],
                 "shares": [shares.get(d) for d in depths],
                 "roofline_share": expected, "of_roofline": None,
                 "min_of_roofline": min_of_roofline,
                 "attention_backend": backend, "backend_from": backend_from,
                 "kv_cache_dtype": kv_dtype, "block_size": block, "gpu_vendor": vendor,
                 "gpu_arch": arch, "pp": pp, "tg": tg, "warnings": warnings, "fix": None}
    share = shares.get(deepest)
    if share is None:
        why = next((w for w in warnings if "burst" in w), None) or (
            f"{sum(r.errors or 0 for r in rows)} request(s) failed")
        return v.inconclusive(f"no decode rate at {label_depth(depths[0])} or "
                              f"{label_depth(deepest)}: {why[:300]}")
    relative = share / (expected or 1.0)
    v.details["of_roofline"] = relative
    ok = relative >= min_of_roofline
    if not ok:
        v.details["fix"] = fix
    v.expect(f"decode at {label_depth(deepest)} / {label_depth(depths[0])}", ok, f"{share:.0%}",
             f"{relative:.2f} of the roofline's {expected or 1.0:.0%}, limit {min_of_roofline:.2f}"
             + ("" if ok else f"; backend {backend}: {fix}"))
    return v

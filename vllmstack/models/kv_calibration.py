"""`invoke calibrate-kv`: per-layer fp8 KV-cache scales measured on text, in a calibrated copy of
the checkpoint that vLLM reads them from (tune/kv_copy.py makes and keeps the copy; `up` uses the
same code to rebuild a stale one), and the quality gate (`--gate`) that serves the source with a
bf16 KV cache and the copy with fp8 and compares perplexity and long-context recall.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllmstack.config.profiles import Resolved
from vllmstack.core.cpu import cpu_flags, describe_isa
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.image.cpu import fp8_kv_serves
from vllmstack.runtime.native.beside import runner_environment
from vllmstack.runtime.native.install import engine_version
from vllmstack.tune.kv_copy import (
    DEFAULT_CORPUS,
    Calibration,
    CalibrationError,
    engine_python,
)
from vllmstack.workload.corpus import split_corpus


def render_calibration(calibration: Calibration) -> str:
    scales = calibration.sidecar.get("scales") or {}
    lines = [("calibrated" if calibration.made else "already calibrated") + f" ({calibration.reason}): "
             f"{calibration.folder}"]
    for layer, pair in scales.items():
        lines.append(f"  {layer}: k_scale {pair['k_scale']:.4g}  v_scale {pair['v_scale']:.4g}")
    lines.append("serve it: VLLM_KV_CACHE_DTYPE=fp8 and VLLM_KV_SCALES=calibrated in the profile (`up` "
                 "then serves this copy, rebuilding it when it goes stale), or --set "
                 f"VLLM_MODEL={calibration.folder} --set VLLM_KV_CACHE_DTYPE=fp8")
    return "\n".join(lines)


# --- quality gate: fp8 KV against bf16 KV on the calibrated copy --------------------------------

PPL_TOLERANCE = 0.02  # fp8-KV perplexity at most 2 % above bf16-KV's
RECALL_FLOOR = 0.95  # fp8-KV long-context recall (the probe's score) at least 95 % of bf16-KV's
# And no depth below 90 % of bf16's there: a cache that loses the far past shows at the first
# depths, but a depth has a fifth of the needles, so the 95 % on each would fail a cache
# that only drew a different few (the real-engine test's tightest depth read 95.7 %).
DEPTH_FLOOR = 0.90
# Below this, bf16 itself barely recalls: "fp8 keeps 95 % of it" would pass on a model that copies
# nothing (a random one scores 0 % and 0 %), so the probe cannot judge and the gate does not pass.
RECALL_MEANINGFUL = 0.5


def quality_verdict(bf16: Mapping[str, Any], fp8: Mapping[str, Any],
                    scales: Mapping[str, Mapping[str, float]]) -> tuple[bool, list[str]]:
    """PASS when fp8 KV keeps perplexity within PPL_TOLERANCE and recall within RECALL_FLOOR of
    bf16 KV, and vLLM really used the calibrated scales (not its default 1.0)."""
    lines, ok = [], True
    # What each run's cache really held, as vLLM resolved it (None: an older runner's result).
    held16, held8 = bf16.get("cache_dtype"), fp8.get("cache_dtype")
    if held16 is not None or held8 is not None:
        right = not str(held16).startswith("fp8") and str(held8).startswith("fp8")
        ok &= right
        lines.append(f"{'PASS' if right else 'FAIL'} KV cache dtypes: baseline {held16}, calibrated {held8}")
    ppl16, ppl8 = float(bf16.get("ppl", math.inf)), float(fp8.get("ppl", math.inf))
    rise = ppl8 / ppl16 - 1 if math.isfinite(ppl16) and ppl16 > 0 else math.inf
    passed = math.isfinite(rise) and rise <= PPL_TOLERANCE
    ok &= passed
    lines.append(f"{'PASS' if passed else 'FAIL'} perplexity: bf16 KV {ppl16:.3f}, fp8 KV {ppl8:.3f} "
                 f"({rise:+.2%}; limit +{PPL_TOLERANCE:.0%})")
    depths16, depths8 = bf16.get("recall") or {}, fp8.get("recall") or {}
    r16, r8 = float(bf16.get("recall_mean", 0)), float(fp8.get("recall_mean", 0))
    short = [d for d, v in depths16.items() if float(depths8.get(d, 0)) < DEPTH_FLOOR * float(v)]
    passed = r8 >= RECALL_FLOOR * r16 and not short and r16 >= RECALL_MEANINGFUL
    ok &= passed
    empty = (f" - bf16 recalls under {RECALL_MEANINGFUL:.0%}: the probe cannot judge this model (a model "
             "that copies from its context can: make-model --trained)" if r16 < RECALL_MEANINGFUL else "")
    per_depth = ", ".join(f"{d}: {float(v):.0%}/{float(depths8.get(d, 0)):.0%}" for d, v in depths16.items())
    lines.append(f"{'PASS' if passed else 'FAIL'} recall: bf16 KV {r16:.1%}, fp8 KV {r8:.1%} "
                 f"(at least {RECALL_FLOOR:.0%} of bf16's, {DEPTH_FLOOR:.0%} at every depth; "
                 f"bf16/fp8 by depth {per_depth or 'none'})"
                 + (f"; short at {', '.join(short)}" if short else "") + empty)
    used = fp8.get("scales") or {}
    # vLLM names the attention module <layer>.attn; the calibration names <layer> (its self_attn).
    missing = [layer for layer, pair in scales.items()
               if not (len(used.get(f"{layer}.attn") or []) == 2
                       and math.isclose(used[f"{layer}.attn"][0], pair["k_scale"], rel_tol=1e-3)
                       and math.isclose(used[f"{layer}.attn"][1], pair["v_scale"], rel_tol=1e-3))]
    loaded = bool(scales) and not missing
    ok &= loaded
    seen = [f"{v[0]:.4g}/{v[1]:.4g}" for v in list(used.values())[:4]]
    lines.append(f"{'PASS' if loaded else 'FAIL'} vLLM used the calibrated scales "
                 f"(k/v seen: {', '.join(seen) or 'none'})"
                 + (f"; not in use for {', '.join(missing[:4])}" if missing else ""))
    return ok, lines


def heldout_text(corpus: Path, work: Path) -> Path:
    """The corpus's last tenth, which neither the calibration nor make-model --trained saw."""
    path = work / "heldout.txt"
    path.write_text(split_corpus(corpus.read_text(encoding="utf-8"))[1], encoding="utf-8")
    return path


def check_fp8_kv_engine(version: str, flags: set[str]) -> None:
    """vLLM's CPU build serves an fp8 KV cache (with the layer's k_scale/v_scale) only on x86 with
    AVX-512 or AMX: vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa (lines 540-542 in 0.32.0)
    raises "FP8 KV cache on CPU requires x86 with AVX-512 or AMX." Say so before a 2-minute boot."""
    if version.endswith("+cpu") and flags and not fp8_kv_serves(flags):
        raise CalibrationError(
            f"vLLM {version} (the CPU build) refuses an fp8 KV cache on this CPU: it needs AVX-512 or "
            "AMX (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa), and this CPU has "
            f"{describe_isa(flags)}",
            "run the gate where the engine can: a CPU with AVX-512/AMX, or a GPU engine "
            "(benchmarks/gpu/h200-kv-calibration-run.sh); the calibrated copy itself is written")


def run_quality_gate(project: Project, resolved: Resolved, runner: Runner, environ: Mapping[str, str],
                     calibration: Calibration, *, python: str | None = None,
                     corpus: Path | None = None, flags: set[str] | None = None) -> tuple[bool, list[str]]:
    """Serve the source checkpoint with a bf16 KV cache and the calibrated copy with fp8, and
    compare. Not the copy twice: vLLM resolves `--kv-cache-dtype auto` to the checkpoint's
    kv_cache_scheme (vllm/utils/torch_utils.py, resolve_kv_cache_dtype_string), so "auto" on the
    copy is fp8 as well, and the two runs agreed to the last digit."""
    check_fp8_kv_engine(engine_version(resolved), cpu_flags() if flags is None else flags)
    interpreter = engine_python(project, resolved, python)
    env = runner_environment(resolved, environ)
    work = Path(tempfile.mkdtemp(prefix="kv-quality-"))
    try:
        heldout = heldout_text(corpus or DEFAULT_CORPUS, work)
        results = {}
        source = str(calibration.sidecar.get("source") or "")
        for dtype, model in (("auto", source), ("fp8", str(calibration.folder))):
            out = work / f"{dtype}.json"
            argv = [interpreter, "-m", "vllmstack.models.kv_quality_runner", model,
                    str(heldout), str(out), "--kv-cache-dtype", dtype,
                    # On the CPU build the share is of the node's memory, which others use too.
                    "--memory-share", "0.1" if engine_version(resolved).endswith("+cpu") else "0.5",
                    # The profile's backend: on the H200's vLLM 0.27.1 FlashAttention does not load.
                    "--attention-backend", resolved.get_str("ATTENTION_BACKEND") or ""]
            done = runner.run(argv, env=env, cwd=project.root, timeout=1800)
            if not out.is_file():
                said = (done.stderr or done.stdout).strip()[-600:]
                raise CalibrationError(f"the quality run with {dtype} KV wrote nothing (exit "
                                       f"{done.returncode}): {said}", "run it by hand to see why")
            results[dtype] = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return quality_verdict(results["auto"], results["fp8"], calibration.sidecar.get("scales") or {})

"""Tasks that tune the box for a profile: tune (Triton kernel configs), calibrate-kv (fp8 KV scales)."""

from __future__ import annotations

import os

from invoke.context import Context

from vllmstack.cli.common import (
    JSON_HELP,
    PROFILE_HELP,
    Opt,
    Sets,
    make_runner,
    print_json,
    project_here,
    resolve_here,
)
from vllmstack.cli.task import exit_with, stack_task
from vllmstack.cli.values import Value, ValueProblemError, choice, text, whole


def _number(low: float, high: float, what: str, example: str) -> Value:
    """A finite number in (low, high]."""

    def convert(t: str) -> float:
        try:
            number = float(t)
        except ValueError:
            raise ValueProblemError(f"is not {what}") from None
        if not low < number <= high:  # NaN fails this too
            raise ValueProblemError(f"is not above {low:g} and at most {high:g}")
        return number

    return Value(f"{what} above {low:g}, at most {high:g}", example, convert)


TUNE_VALUES = {
    "kind": choice(("moe", "fp8-dense")), "tp": whole(0, 64, "a tensor-parallel size", 1),
    "batch_sizes": text("comma-separated batch sizes", "1,2,4,8,16,64,256,1024"),
    "budget_min": _number(0, 24 * 60, "a number of minutes", "8"),
    "shape": text("N,K of a GEMM", "34816,5120", empty=False),
    "projections": text("projections, comma-separated", "gate_up,down", empty=False),
    # Left out, the plan picks cores - 2; a given count is used as it is (0: no compile workers).
    "workers": whole(0, 256, "a number of processes", 8),
    "min_gain": _number(0, 10, "a fraction", "0.05"),
}

TUNE_HELP = {
    **PROFILE_HELP, **JSON_HELP,
    "kind": "moe (fused_moe_configs/) or fp8-dense (fp8_configs/, block-FP8 GEMMs)",
    "tp": "tensor-parallel size the shapes are for (default: VLLM_TP)",
    "batch_sizes": "comma-separated batch sizes (default: vLLM's tuner grid 1..4096)",
    "budget_min": "minutes the search may use, all shapes together (default 8: one 10-minute GPU run)",
    "shape": "fp8-dense: N,K of a GEMM to tune (repeatable; from a boot log's `Config file not "
             "found at .../N=..,K=..` line); default: the MLP's gate_up and down",
    "projections": "fp8-dense: which projections, of gate_up, down, qkv, o (default gate_up,down)",
    "workers": "processes that compile tiles ahead of timing (default: cores - 2, at most 12; "
               "0: none, each tile compiles as it is timed)",
    "min_gain": "keep a batch size's entry only when the re-run gain is at least this (default 0.05)",
    "python": "the engine's Python (default: NATIVE_ENGINE_COMMAND's, else install-engine's)",
    "force": "replace an existing config file (the old one is kept as .bak)",
    "dry_run": "print the plan and the command, measure nothing"}


# `workers` defaults to None (the plan's choice) but holds a count: parsed and shown as an INT.
@stack_task(iterable=["set", "shape"], help=TUNE_HELP, values=TUNE_VALUES, kinds={"workers": int})
def tune(c: Context, kind: str, model: Opt = None, platform: Opt = None, set: Sets = None,
         tp: int = 0, batch_sizes: Opt = None, budget_min: float = 8.0, shape: Sets = None,
         projections: str = "gate_up,down", workers: int | None = None, min_gain: float = 0.05,
         python: Opt = None, force: bool = False, dry_run: bool = False, json: bool = False) -> None:
    """Tune vLLM's Triton configs for this profile's shapes on this GPU; keep only what wins by 5 %."""
    from vllmstack.tune import tuning

    resolved, project = resolve_here(model, platform, set), project_here()
    plan = tuning.plan_tune(project, resolved, os.environ, kind=kind, tp=tp or None,
                            batch_sizes=tuning.parse_batch_sizes(batch_sizes), budget_min=budget_min,
                            projections=tuple(p.strip() for p in projections.split(",") if p.strip()),
                            shapes=list(shape or []), workers=workers,
                            min_gain=min_gain)
    if not json:
        print(tuning.render_plan(plan))
    outcome = tuning.run_tune(project, resolved, make_runner(dry_run), os.environ, plan,
                              python=python, force=force)
    if outcome is None:
        return
    print_json(outcome.as_json()) if json else print(tuning.render_outcome(outcome))


CALIBRATE_HELP = {
    **PROFILE_HELP, **JSON_HELP,
    "corpus": "UTF-8 text to measure K and V on (default: the bundled essays)",
    "tokens": "corpus tokens to run through the model (default 32768)",
    "python": "the engine's Python (default: NATIVE_ENGINE_COMMAND's, else install-engine's)",
    "force": "measure again even when the calibrated copy is fresh",
    "gate": "then serve the copy in vLLM with bf16 and fp8 KV: perplexity within 2 %, recall >= 95 %",
    "dry_run": "print the measuring command, write nothing"}
CALIBRATE_VALUES = {"corpus": text("a text file", "corpus.txt", empty=False),
                    "tokens": whole(64, 100_000_000, "a number of tokens", 32768)}


@stack_task(iterable=["set"], help=CALIBRATE_HELP, values=CALIBRATE_VALUES)
def calibrate_kv(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None,
                 corpus: Opt = None, tokens: int = 32768, python: Opt = None, force: bool = False,
                 gate: bool = False, dry_run: bool = False, json: bool = False) -> None:
    """Measure fp8 KV-cache scales on text; write a calibrated copy of the checkpoint (files linked)."""
    from pathlib import Path

    from vllmstack.models import kv_calibration as kv
    from vllmstack.runtime.native.beside import native_beside
    from vllmstack.tune.kv_copy import ensure_calibrated

    resolved, project = resolve_here(model, platform, set), project_here()
    text = Path(corpus).expanduser() if corpus else None
    where = native_beside(project, resolved, os.environ, make_runner(dry_run), python)
    done = ensure_calibrated(project, resolved, os.environ, beside=where, corpus=text, force=force,
                             tokens=tokens)
    if done is None:
        return
    print_json(done.as_json()) if json else print(kv.render_calibration(done))
    if gate:
        passed, lines = kv.run_quality_gate(project, resolved, make_runner(False), os.environ, done,
                                            python=python, corpus=text)
        print("\n".join(lines))
        exit_with(0 if passed else 1)

"""`invoke tune moe|fp8-dense`: from a profile to tuned Triton configs vLLM will really read.

The plan (shapes, explicit search space per batch size, budget) is made here from the profile's
geometry and TP; the measuring runs where the engine runs, as one command through the Runner
(`python -m vllmstack.tune.kernel_bench SPEC OUT` with the engine's Python and environment); its
result comes back as JSON and is judged here (verdict.judge: the >= 5 % re-run rule) into

* fused_moe_configs/E=..,N=..,device_name=..[,dtype=..][,block_shape=..].json (with
  "triton_version", as vLLM's tuner writes) or fp8_configs/N=..,K=..,device_name=..,... .json
  (no extra key: that loader int()s every key), only when some batch size won, and
* a sidecar of the same name under <folder>/sidecars/ (vLLM/Triton/torch versions, device, search
  space, per batch size stock and tuned time and gain), written also when nothing won, because
  "no gain" is a result.

The file name is computed here and by vLLM's own function on the GPU; they must agree, or nothing
is written (vLLM would ignore the file).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.config.modelinfo import load_model_facts
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import load_schema
from vllmstack.core.errors import StackError
from vllmstack.core.files import write_json
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime.engine_env import engine_environment
from vllmstack.runtime.native.install import engine_interpreter, engine_version
from vllmstack.tune import shapes as sh
from vllmstack.tune import space as sp
from vllmstack.tune import verdict as vd

KINDS = ("moe", "fp8-dense")
# vLLM's tuners' default grid (benchmark_moe.py); the nearest entry serves every other size.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
SIDECARS = "sidecars"
# Imports, CUDA start and the compile workers' start, on top of the search budget.
STARTUP_ALLOWANCE_S = 300


class TuneError(StackError):
    """The tuner cannot run, or its result cannot be written; `fix` says what to do."""


@dataclass
class TunePlan:
    kind: str
    profile: str
    tp: int
    batch_sizes: list[int]
    budget_s: float
    shapes: list[sh.MoeShape | sh.DenseShape]
    spaces: list[dict[int, list[sp.Config]]]
    axes: sp.Axes
    seed: int = 0
    workers: int = 0
    min_gain: float = vd.MIN_GAIN

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "batch_sizes": self.batch_sizes, "budget_s": self.budget_s,
                "seed": self.seed, "workers": self.workers,
                "shapes": [{"shape": s.as_json(), "space": {str(m): c for m, c in space.items()}}
                           for s, space in zip(self.shapes, self.spaces, strict=True)]}


@dataclass
class TuneOutcome:
    plan: TunePlan
    result: dict[str, Any]
    written: list[Path] = field(default_factory=list)
    sidecars: list[Path] = field(default_factory=list)
    tables: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.plan.kind, "profile": self.plan.profile, "tp": self.plan.tp,
                "written": [str(p) for p in self.written], "sidecars": [str(p) for p in self.sidecars],
                "shapes": self.tables, "notes": self.notes}


def parse_batch_sizes(text: str | None) -> list[int]:
    if not text:
        return list(DEFAULT_BATCH_SIZES)
    try:
        sizes = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
    except ValueError:
        raise TuneError(f"--batch-sizes {text!r} is not a comma-separated list of whole numbers",
                        "e.g. --batch-sizes 1,2,4,8,16,64,256,1024") from None
    if not sizes or sizes[0] < 1:
        raise TuneError(f"--batch-sizes {text!r} has no positive batch size", "give sizes >= 1")
    return sizes


def plan_tune(project: Project, resolved: Resolved, environ: Mapping[str, str], *, kind: str,
              tp: int | None = None, batch_sizes: list[int] | None = None, budget_min: float = 8.0,
              projections: tuple[str, ...] = ("gate_up", "down"), shapes: list[str] | None = None,
              workers: int | None = None, min_gain: float = vd.MIN_GAIN) -> TunePlan:
    """The shapes vLLM would look up for this profile at `tp`, and the search space for each."""
    if kind not in KINDS:
        raise TuneError(f"unknown tuning kind {kind!r}", "use: invoke tune moe, or invoke tune fp8-dense")
    if not budget_min > 0:
        raise TuneError(f"--budget-min {budget_min} is not positive", "give the minutes the search may use")
    tp = tp or resolved.get_int("VLLM_TP")
    if tp < 1:
        raise TuneError(f"--tp {tp} is not a tensor-parallel size", "give --tp 1, 2, 4 or 8")
    facts = load_model_facts(resolved, environ)
    sizes = batch_sizes or list(DEFAULT_BATCH_SIZES)
    found: list[sh.MoeShape | sh.DenseShape]
    if kind == "moe":
        moe = sh.moe_shape(resolved, facts, tp)
        if moe.dtype and moe.block_shape is None:
            raise TuneError("per-tensor FP8 MoE is not tuned here (only block-FP8 and bf16)",
                            "tune with vLLM's benchmarks/kernels/benchmark_moe.py --tune")
        found = [moe]
        axes = sp.MOE_AXES if moe.dtype else sp.MOE_BF16_AXES
    else:
        if shapes:
            _, block = sh.quant_block(facts, sh.read_model_config(facts))
            found = [sh.parse_shape(text, block or sh.DEFAULT_FP8_BLOCK) for text in shapes]
        else:
            found = list(sh.dense_shapes(facts, tp, projections))
        axes = sp.DENSE_AXES
    spaces = [_space_for(shape, sizes, axes) for shape in found]
    return TunePlan(kind, resolved.profile, tp, sizes,
                    budget_min * 60, found, spaces, axes,
                    workers=workers if workers is not None else max(0, min(12, (os.cpu_count() or 2) - 2)),
                    min_gain=min_gain)


def _space_for(shape: sh.MoeShape | sh.DenseShape, sizes: list[int],
               axes: sp.Axes) -> dict[int, list[sp.Config]]:
    if isinstance(shape, sh.MoeShape):
        elt = 1 if shape.dtype else 2
        # Routing is uneven: the busiest experts see about twice the mean rows.
        return {m: sp.candidates(2 * sp.moe_rows(m, shape.topk, shape.experts), axes, shape.block_shape,
                                 elt) for m in sizes}
    return {m: sp.candidates(m, axes, shape.block_shape, 1) for m in sizes}


def engine_python(project: Project, resolved: Resolved, python: str | None) -> str:
    """--python, else the Python the engine runs under (install.engine_interpreter)."""
    found = python or engine_interpreter(project, resolved)
    if found:
        return found
    version = engine_version(resolved)
    raise TuneError(f"no engine environment for vLLM {version or '(no version)'} to tune in",
                    "install it (invoke install-engine), or pass --python with the interpreter "
                    "that imports the engine's vLLM and torch")


def tune_command(project: Project, resolved: Resolved, environ: Mapping[str, str], python: str,
                 spec_path: Path, out_path: Path) -> tuple[list[str], dict[str, str]]:
    """argv and environment of the measuring run, where the native engine runs."""
    env = {**environ, "PYTHONNOUSERSITE": "1", **engine_environment(resolved, load_schema())}
    # Stock must be what vLLM ships, not a file of ours found through the tuned-config folder.
    env.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(project.root), environ.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return [python, "-m", "vllmstack.tune.kernel_bench", str(spec_path), str(out_path)], env


def run_tune(project: Project, resolved: Resolved, runner: Runner, environ: Mapping[str, str],
             plan: TunePlan, *, python: str | None = None, force: bool = False) -> TuneOutcome | None:
    """Measure on the GPU, then judge and write. None in --dry-run (the command was printed)."""
    interpreter = engine_python(project, resolved, python)
    work = project.generated / "tune" / f"{plan.kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    spec_path, out_path = work / "spec.json", work / "result.json"
    argv, env = tune_command(project, resolved, environ, interpreter, spec_path, out_path)
    if runner.dry_run:
        runner.run(argv, env=env, cwd=project.root, capture=False)
        return None
    work.mkdir(parents=True, exist_ok=True)
    write_json(spec_path, plan.spec())
    result = runner.run(argv, env=env, cwd=project.root, capture=False,
                        timeout=plan.budget_s + STARTUP_ALLOWANCE_S)
    if not out_path.is_file():
        raise TuneError(f"the tuner wrote no result (exit {result.returncode}); its output is above",
                        f"run it again by hand to see why: {shlex.join(argv)}")
    data = json.loads(out_path.read_text())
    return write_outcome(project, plan, data, force=force)


def write_outcome(project: Project, plan: TunePlan, data: dict[str, Any], *,
                  force: bool = False) -> TuneOutcome:
    """Judge each shape's batch sizes and write its config (when something won) and sidecar."""
    outcome = TuneOutcome(plan, data)
    device = str(data.get("device_file_name") or "")
    folder = sh.MOE_FOLDER if plan.kind == "moe" else sh.DENSE_FOLDER
    for shape, space, measured in zip(plan.shapes, plan.spaces, data.get("shapes") or [], strict=False):
        name = shape.file_name(device)
        if measured.get("vllm_file_name") and measured["vllm_file_name"] != name:
            raise TuneError(f"vLLM on the GPU looks this shape up as {measured['vllm_file_name']}, "
                            f"but the stack computed {name}", "report this: the naming rules in "
                            "vllmstack/tune/shapes.py no longer match this vLLM")
        verdicts = [v for v in (vd.judge(row, plan.min_gain) for row in measured.get("batch_sizes") or [])
                    if v is not None]
        failed = [row for row in measured.get("batch_sizes") or [] if row.get("error")]
        entries = vd.file_entries(verdicts, _int_keys(measured.get("shipped")))
        target = project.root / folder / name
        if entries is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_config(target, entries, plan.kind, str((data.get("versions") or {}).get("triton", "")),
                          force)
            outcome.written.append(target)
        sidecar = project.root / folder / SIDECARS / name
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        table = _sidecar(plan, shape, space, measured, data, verdicts, failed, written=entries is not None)
        write_json(sidecar, table)
        outcome.sidecars.append(sidecar)
        outcome.tables.append(table)
        if measured.get("error"):
            outcome.notes.append(f"{name}: the measurement failed: {str(measured['error']).strip()[-300:]}")
    return outcome


def _int_keys(data: Mapping[str, Any] | None) -> dict[int, dict[str, Any]] | None:
    return {int(k): dict(v) for k, v in data.items()} if data else None


def _write_config(target: Path, entries: dict[int, dict[str, Any]], kind: str, triton: str,
                  force: bool) -> None:
    if target.exists():
        if not force:
            raise TuneError(f"{target} exists (a config someone wrote or an earlier tune)",
                            "compare with the new sidecar, then run again with --force: the old "
                            "file is kept beside it as NAME.json.<time>.bak")
        target.rename(target.with_name(f"{target.name}.{time.strftime('%Y%m%d-%H%M%S')}.bak"))
    body: dict[str, Any] = {}
    if kind == "moe" and triton:
        body["triton_version"] = triton  # popped by the MoE loader; the dense loader would crash on it
    body.update({str(m): config for m, config in entries.items()})
    write_json(target, body)


def _sidecar(plan: TunePlan, shape: sh.MoeShape | sh.DenseShape, space: dict[int, list[sp.Config]],
             measured: dict[str, Any], data: dict[str, Any], verdicts: list[vd.EntryVerdict],
             failed: list[dict[str, Any]], *, written: bool) -> dict[str, Any]:
    return {
        "config_file": shape.file_name(str(data.get("device_file_name") or "")),
        "written": written, "kind": plan.kind, "profile": plan.profile, "tp": plan.tp,
        "shape": shape.as_json(), "versions": data.get("versions"), "device": data.get("device"),
        "device_file_name": data.get("device_file_name"), "started": data.get("started"),
        "stock": measured.get("stock_source"),
        "search_space": {"axes": plan.axes.as_json(), "rules": sp.RULES,
                         "candidates_per_batch_size": {str(m): len(c) for m, c in space.items()},
                         "seed": plan.seed},
        "gate": {"reference": "fp32 from the dequantized operands", "factor": vd.GATE_FACTOR,
                 "slack": vd.GATE_SLACK, "stock_max_error": vd.STOCK_MAX_ERROR},
        "keep_rule": f"re-run median gain >= {plan.min_gain:.0%} (stock and tuned timed in turns)",
        "budget_s": plan.budget_s, "elapsed_s": data.get("elapsed_s"),
        "precompile": data.get("precompile"),
        "batch_sizes": [v.as_json() for v in verdicts],
        "failed_batch_sizes": [{"batch_size": r.get("m"), "error": str(r.get("error"))[-500:]}
                               for r in failed],
    }


def render_table(table: Mapping[str, Any]) -> str:
    """One shape's kernel-level result as a markdown table (also used by benchmark reports)."""
    lines = [f"`{table['config_file']}` ({'written' if table['written'] else 'no entry won: not written'}; "
             f"stock = vLLM's {table.get('stock') or '?'} config)", "",
             "| batch size | stock µs | tuned µs | gain | kept | tried / space | gate rejected |",
             "|---:|---:|---:|---:|:--|---:|---:|"]
    for row in table["batch_sizes"]:
        lines.append(f"| {row['batch_size']} | {row['stock_us']:.1f} | {row['tuned_us']:.1f} | "
                     f"{row['gain']:+.1%} | {'yes' if row['kept'] else 'no'} | {row['tried']} / "
                     f"{row['space']}{' (budget)' if row['budget_cut'] else ''} | "
                     f"{row['rejected_by_gate']} |")
    return "\n".join(lines)


def render_outcome(outcome: TuneOutcome) -> str:
    parts = [render_table(t) for t in outcome.tables]
    parts += [f"wrote {p}" for p in outcome.written]
    parts += [f"sidecar {p}" for p in outcome.sidecars]
    parts += [f"note: {n}" for n in outcome.notes]
    return "\n\n".join(parts)


def render_plan(plan: TunePlan) -> str:
    lines = [f"tune {plan.kind} for {plan.profile} at TP={plan.tp}: budget {plan.budget_s / 60:.1f} min, "
             f"{len(plan.batch_sizes)} batch sizes, {plan.workers} compile workers"]
    for shape, space in zip(plan.shapes, plan.spaces, strict=True):
        total = sum(len(c) for c in space.values())
        lines.append(f"  {shape.file_name('<device>')}: {total} candidates over the batch sizes "
                     f"({min(len(c) for c in space.values())}-{max(len(c) for c in space.values())} each)")
    return "\n".join(lines)

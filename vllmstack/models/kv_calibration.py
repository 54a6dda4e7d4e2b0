"""`invoke calibrate-kv`: per-layer fp8 KV-cache scales measured on text, in a calibrated copy of
the checkpoint that vLLM reads them from.

Stock checkpoints ship no KV scales, and vLLM then quantizes K and V with scale 1.0, which clips
everything beyond the fp8 e4m3 range (448) and wastes its resolution below it. Here:

* the runner (`kv_calibrate_runner.py`, in the engine's Python) measures amax of K after the key
  norm and RoPE and of V, per attention layer, over a corpus (default: the bundled essays);
* every scale (amax / 448) must be finite and above zero, or nothing is written (an upstream
  calibrator silently wrote all-zero scales once; a zero scale divides by zero in the cache);
* the copy links every file of the source (nothing is duplicated), adds `kv_scales.safetensors`
  with `<layer>.self_attn.k_scale` / `.v_scale` (vLLM maps them onto `...self_attn.attn.k_scale`,
  model_loader/weight_utils.maybe_remap_kv_scale_name), and rewrites config.json: an unquantized
  checkpoint gets a compressed-tensors `kv_cache_scheme` (fp8, per tensor, static, symmetric), the
  only way vLLM loads KV scales without quantizing the weights; an FP8 checkpoint's own config
  already loads them (Fp8KVCacheMethod);
* a sidecar (`vllmstack-kv-calibration.json`) names the source snapshot, the corpus hash and the
  tool versions; `ensure_calibrated` rebuilds the copy when any of them changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.checks.kv_scales import SIDECAR, read_sidecar, scale_problems, source_revision
from vllmstack.config.modelinfo import locate_model_dir
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import load_schema
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.models.train_runner import split_corpus
from vllmstack.runtime.engine_env import engine_environment, stack_paths
from vllmstack.runtime.native.install import engine_dir, engine_version, list_engines

FP8_E4M3_MAX = 448.0
SCALES_FILE = "kv_scales.safetensors"
# Bump when what the sidecar promises changes (the measurement, the file layout).
FORMAT_VERSION = 2  # 2: the corpus's held-out tenth is no longer measured
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "bench" / "workload" / "corpus" / "essays.txt"
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


class CalibrationError(StackError):
    """The calibration cannot be made or used; `fix` says what to do."""


@dataclass(frozen=True)
class CalibrationPlan:
    source: Path  # the checkpoint folder
    source_revision: str
    corpus: Path
    corpus_sha256: str
    target: Path  # the calibrated copy
    tokens: int

    def identity(self, versions: Mapping[str, str]) -> dict[str, Any]:
        """What a fresh calibration must match."""
        return {"format": FORMAT_VERSION, "source": str(self.source),
                "source_revision": self.source_revision, "corpus_sha256": self.corpus_sha256,
                "tokens": self.tokens, "versions": dict(versions)}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def plan_calibration(project: Project, resolved: Resolved, environ: Mapping[str, str], *,
                     corpus: Path | None = None, tokens: int = 32768) -> CalibrationPlan:
    name = resolved.get_str("VLLM_MODEL")
    source = locate_model_dir(name, environ, resolved.get_str("HF_CACHE_DIR") or None)
    if source is None:
        raise CalibrationError(f"the model {name or '(VLLM_MODEL unset)'} is not on this machine",
                               "download it first (huggingface-cli download), or point VLLM_MODEL "
                               "at a local folder; nothing is downloaded here")
    if not (source / "config.json").is_file():
        raise CalibrationError(f"{source} has no config.json", "point VLLM_MODEL at a model folder")
    text = corpus or DEFAULT_CORPUS
    if not text.is_file():
        raise CalibrationError(f"the calibration corpus {text} does not exist",
                               "pass --corpus with a UTF-8 text file")
    paths = stack_paths(resolved, environ)
    base = paths.models_dir if paths.models_dir is not None else project.cache
    # A hub snapshot is named by its repo folder (models--ORG--NAME), a plain folder by itself.
    label = source.parent.parent.name if source.parent.name == "snapshots" else source.name
    target = Path(base) / "calibrated" / f"{label}-kv-fp8"
    return CalibrationPlan(source, source_revision(source), text, file_sha256(text), target, tokens)


def staleness(plan: CalibrationPlan, versions: Mapping[str, str]) -> str | None:
    """Why the calibrated copy must be rebuilt (None: it is fresh)."""
    sidecar = read_sidecar(plan.target)
    if sidecar is None:
        return "no calibrated copy yet"
    want = plan.identity(versions)
    for key, label in (("format", "the calibration format"), ("source", "the source folder"),
                       ("source_revision", "the source snapshot"), ("corpus_sha256", "the corpus"),
                       ("tokens", "the token budget"), ("versions", "the tool versions")):
        if sidecar.get(key) != want[key]:
            return f"{label} changed ({sidecar.get(key)!r} -> {want[key]!r})"
    problems = scale_problems(sidecar.get("scales") or {})
    if problems:
        return "its scales are unusable: " + "; ".join(problems)
    return None


def scales_from_amax(layers: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    return {name: {"k_scale": float(v["k_amax"]) / FP8_E4M3_MAX,
                   "v_scale": float(v["v_amax"]) / FP8_E4M3_MAX} for name, v in layers.items()}


def f32_safetensors(tensors: Mapping[str, float]) -> bytes:
    """A safetensors file of 1-element float32 tensors (vLLM's KV scale parameters are [1])."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, value in tensors.items():
        header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]}
        data += struct.pack("<f", value)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def calibrated_config(config: dict[str, Any]) -> dict[str, Any]:
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        method = str(quant.get("quant_method", "")).lower()
        if method == "fp8":
            return config  # Fp8Config loads k_scale/v_scale tensors as they are
        if method == "compressed-tensors":
            return {**config, "quantization_config": {**quant, "kv_cache_scheme": KV_SCHEME}}
        raise CalibrationError(f"the checkpoint is quantized with {method!r}; vLLM loads KV scales "
                               "beside fp8 and compressed-tensors checkpoints only",
                               "serve it with VLLM_KV_CACHE_DTYPE=bfloat16, or calibrate a bf16/FP8 copy")
    return {**config, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": [],
        "kv_cache_scheme": KV_SCHEME}}


def write_calibrated_copy(plan: CalibrationPlan, scales: Mapping[str, Mapping[str, float]],
                          sidecar: Mapping[str, Any]) -> Path:
    """Links to the source's files, the scales, config.json (and the weight index) rewritten;
    built beside the target and renamed into place, so `up` never sees half a copy."""
    problems = scale_problems(scales)
    if problems:
        raise CalibrationError("refusing to write the calibration: " + "; ".join(problems),
                               "check the corpus (enough text?) and the model; nothing was written")
    plan.target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".calibrating-", dir=plan.target.parent))
    try:
        tensors = {f"{layer}.{key}": float(value) for layer, pair in scales.items()
                   for key, value in pair.items()}
        for path in sorted(plan.source.iterdir()):
            if path.name in ("config.json", SIDECAR, SCALES_FILE) or path.name.endswith(".index.json"):
                continue
            os.symlink(path.resolve(), staging / path.name)
        config = json.loads((plan.source / "config.json").read_text())
        (staging / "config.json").write_text(json.dumps(calibrated_config(config), indent=1) + "\n")
        (staging / SCALES_FILE).write_bytes(f32_safetensors(tensors))
        for index in plan.source.glob("*.index.json"):
            # vLLM loads only the files an index names: the scales need their entries.
            data = json.loads(index.read_text())
            data.setdefault("weight_map", {}).update({name: SCALES_FILE for name in tensors})
            (staging / index.name).write_text(json.dumps(data, indent=1) + "\n")
        (staging / SIDECAR).write_text(json.dumps({**sidecar, "scales": scales}, indent=1) + "\n")
        staging.chmod(0o755)
        if plan.target.exists():
            shutil.rmtree(plan.target)
        staging.rename(plan.target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return plan.target


def runner_path(environ: Mapping[str, str]) -> str:
    """PYTHONPATH for `python -m vllmstack.models.*_runner` in the engine's Python: the folder
    that holds this package, which is not the project's root when the stack runs from another
    checkout or an installed package (the runner then was "No module named 'vllmstack'")."""
    return os.pathsep.join(p for p in (str(PACKAGE_PARENT), environ.get("PYTHONPATH", "")) if p)


def engine_python(project: Project, resolved: Resolved, python: str | None, *,
                  any_installed: bool = False) -> str:
    """--python; NATIVE_ENGINE_COMMAND's interpreter (`<python> -m vllm...`); install-engine's for
    the profile's version; with `any_installed` (training needs torch, not a given vLLM), the
    newest complete engine environment when the profile's is not installed."""
    if python:
        return python
    words = (resolved.get_str("NATIVE_ENGINE_COMMAND") or "").split()
    if len(words) >= 2 and words[1] == "-m" and "python" in Path(words[0]).name:
        return words[0]
    version = engine_version(resolved)
    candidate = engine_dir(project, version) / "bin" / "python" if version else None
    if candidate is not None and candidate.is_file():
        return str(candidate)
    others = [env.folder / "bin" / "python" for env in list_engines(project)
              if env.manifest is not None and (env.folder / "bin" / "python").is_file()]
    if any_installed and others:
        return str(others[-1])
    raise CalibrationError(f"no engine environment for vLLM {version or '(no version)'} to run in",
                           "install it (invoke install-engine, --platform cpu for the CPU build), name "
                           "the platform whose engine is installed (--platform cpu), or pass --python "
                           "with an interpreter that has torch and transformers")


@dataclass
class Calibration:
    folder: Path
    made: bool
    reason: str  # why it was (re)built, or "fresh"
    sidecar: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "made": self.made, "reason": self.reason,
                "scales": self.sidecar.get("scales"), "tokens": self.sidecar.get("measured_tokens")}


def ensure_calibrated(project: Project, resolved: Resolved, runner: Runner, environ: Mapping[str, str],
                      *, corpus: Path | None = None, python: str | None = None, force: bool = False,
                      tokens: int = 32768) -> Calibration | None:
    """The calibrated copy for the profile's model: kept when its sidecar is fresh, else measured
    and rebuilt. None in --dry-run (the command was printed)."""
    plan = plan_calibration(project, resolved, environ, corpus=corpus, tokens=tokens)
    interpreter = engine_python(project, resolved, python)
    env = {**environ, "PYTHONNOUSERSITE": "1", **engine_environment(resolved, load_schema()),
           "PYTHONPATH": runner_path(environ)}
    # The engine's version pins its torch and transformers: a new engine re-measures.
    versions = {"engine": engine_version(resolved) or "(unset)", "python": interpreter}
    reason = "forced" if force else staleness(plan, versions)
    if reason is None:
        return Calibration(plan.target, False, "fresh", read_sidecar(plan.target) or {})
    work = Path(tempfile.mkdtemp(prefix="kv-calibration-")) if not runner.dry_run else Path("<tmp>")
    out, text = work / "amax.json", work / "calibration.txt"
    if not runner.dry_run:
        # The last tenth is what --gate scores: scales fitted on it would flatter the gate.
        text.write_text(split_corpus(plan.corpus.read_text(encoding="utf-8"))[0], encoding="utf-8")
    argv = [interpreter, "-m", "vllmstack.models.kv_calibrate_runner", str(plan.source), str(text),
            str(out), "--tokens", str(tokens)]
    result = runner.run(argv, env=env, cwd=project.root, timeout=3600)
    if runner.dry_run:
        return None
    try:
        if not out.is_file():
            said = (result.stderr or result.stdout).strip()[-600:]
            raise CalibrationError(f"the calibration run wrote nothing (exit {result.returncode}): {said}",
                                   "run the command above by hand to see why")
        measured = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    scales = scales_from_amax(measured.get("layers") or {})
    sidecar = {**plan.identity(versions), "corpus": str(plan.corpus),
               "measured_tokens": measured.get("tokens"), "tool_versions": measured.get("versions"),
               "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "reason": reason}
    folder = write_calibrated_copy(plan, scales, sidecar)
    return Calibration(folder, True, reason, {**sidecar, "scales": scales})


def render_calibration(calibration: Calibration) -> str:
    scales = calibration.sidecar.get("scales") or {}
    lines = [("calibrated" if calibration.made else "already calibrated") + f" ({calibration.reason}): "
             f"{calibration.folder}"]
    for layer, pair in scales.items():
        lines.append(f"  {layer}: k_scale {pair['k_scale']:.4g}  v_scale {pair['v_scale']:.4g}")
    lines.append(f"serve it: --set VLLM_MODEL={calibration.folder} --set VLLM_KV_CACHE_DTYPE=fp8")
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


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags")
            for flag in line.split(":", 1)[1].split()}


def check_fp8_kv_engine(version: str, flags: set[str]) -> None:
    """vLLM's CPU build serves an fp8 KV cache (with the layer's k_scale/v_scale) only on x86 with
    AVX-512 or AMX: vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa (lines 540-542 in 0.32.0)
    raises "FP8 KV cache on CPU requires x86 with AVX-512 or AMX." Say so before a 2-minute boot."""
    if version.endswith("+cpu") and flags and not flags & {"avx512f", "amx_tile"}:
        raise CalibrationError(
            f"vLLM {version} (the CPU build) refuses an fp8 KV cache on this CPU: it needs AVX-512 or "
            "AMX (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa), and /proc/cpuinfo lists neither",
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
    env = {**environ, "PYTHONNOUSERSITE": "1", **engine_environment(resolved, load_schema()),
           "PYTHONPATH": runner_path(environ)}
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

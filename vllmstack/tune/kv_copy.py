"""The calibrated copy of a checkpoint that an fp8 KV cache is served from, and the "ensure" that
keeps it fresh.

Stock checkpoints ship no KV scales, and vLLM then quantizes K and V with scale 1.0, which clips
everything beyond the fp8 e4m3 range (448) and wastes its resolution below it. A calibrated copy:

* links every file of the source (hard links where the file system allows, so that a container
  sees them under MODELS_DIR too; nothing is duplicated), adds `kv_scales.safetensors` with
  `<layer>.self_attn.k_scale` / `.v_scale` (vLLM maps them onto `...self_attn.attn.k_scale`,
  model_loader/weight_utils.maybe_remap_kv_scale_name), and rewrites config.json: an unquantized
  checkpoint gets a compressed-tensors `kv_cache_scheme` (fp8, per tensor, static, symmetric), the
  only way vLLM loads KV scales without quantizing the weights; an FP8 checkpoint's own config
  already loads them (Fp8KVCacheMethod);
* holds scales (amax / 448, measured by models/kv_calibrate_runner.py in the engine's Python) that
  are all finite and above zero, or it is not written (an upstream calibrator silently wrote
  all-zero scales once; a zero scale divides by zero in the cache);
* has a sidecar (`vllmstack-kv-calibration.json`) naming the source snapshot, the corpus hash and
  where it was measured (the engine's version and interpreter, or its image).

`ensure_calibrated` rebuilds the copy when any of those changed; `invoke calibrate-kv` calls it,
and so does `up` (`served_model`) when VLLM_KV_SCALES=calibrated or VLLM_MODEL is such a copy:
a stale copy is rebuilt before the engine starts, where the engine runs (runtime.base.Beside), and
one with a zero scale is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.config.modelinfo import locate_model_dir, profile_hf_cache
from vllmstack.config.profiles import Resolved, Setting
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.core.safetensors_file import Tensor, encode_safetensors
from vllmstack.runtime.base import Beside
from vllmstack.runtime.engine_env import stack_paths
from vllmstack.runtime.native.beside import NO_ENGINE_FIX
from vllmstack.runtime.native.install import engine_interpreter, engine_version
from vllmstack.workload.corpus import BUNDLED_CORPUS, split_corpus

SIDECAR = "vllmstack-kv-calibration.json"
FP8_E4M3_MAX = 448.0
SCALES_FILE = "kv_scales.safetensors"
# Bump when what the sidecar promises changes (the measurement, the file layout).
FORMAT_VERSION = 2  # 2: the corpus's held-out tenth is no longer measured
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
DEFAULT_CORPUS = BUNDLED_CORPUS


def source_revision(folder: Path) -> str:
    """A Hugging Face snapshot's revision (its folder name under snapshots/); for any other
    folder a hash of config.json and each weight file's name, size and mtime (hashing tens of GB
    of weights before every `up` would cost minutes)."""
    if folder.parent.name == "snapshots":
        return folder.name
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name == "config.json":
            digest.update(path.read_bytes())
        elif path.suffix in (".safetensors", ".bin") or path.name.endswith(".index.json"):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return "local-" + digest.hexdigest()[:16]


def scale_problems(scales: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every scale must be a finite number above zero (a zero scale divides by zero in the cache)."""
    if not scales:
        return ["no attention layer was measured"]
    bad = []
    for layer, pair in scales.items():
        for key in ("k_scale", "v_scale"):
            value = pair.get(key)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                bad.append(f"{layer}.{key}={value!r}")
    return [f"{len(bad)} scale(s) zero, negative or not finite: {', '.join(bad[:4])}"] if bad else []


def read_sidecar(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / SIDECAR).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
    source = locate_model_dir(name, environ, profile_hf_cache(resolved))
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
    return encode_safetensors([Tensor(name, "F32", (1,), struct.pack("<f", value))
                               for name, value in tensors.items()])


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


def link_file(source: Path, link: Path) -> None:
    """A hard link where the file system allows one: it is the same file wherever the copy is
    mounted (a container sees the copy under MODELS_DIR, but the HF cache at another path, so a
    symbolic link to a snapshot's blob resolves on the host only). Else (another file system,
    or a folder) a symbolic link, for the host."""
    try:
        if source.is_file():
            os.link(source, link)
            return
    except OSError:
        pass
    os.symlink(source, link)


def unseen_links(folder: Path, see: Callable[[Path], str | None]) -> list[str]:
    """The files of a copy whose symbolic links a process with this view of the host cannot
    follow (the engine container's: beside.see)."""
    return [path.name for path in sorted(folder.iterdir())
            if path.is_symlink() and see(path.resolve()) != str(path.resolve())]


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
            link_file(path.resolve(), staging / path.name)
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


def engine_python(project: Project, resolved: Resolved, python: str | None, *,
                  any_installed: bool = False) -> str:
    """--python, else the engine's interpreter (install.engine_interpreter); `any_installed` for
    training, which needs torch, not a given vLLM."""
    found = python or engine_interpreter(project, resolved, any_installed=any_installed)
    if found:
        return found
    version = engine_version(resolved)
    raise CalibrationError(f"no engine environment for vLLM {version or '(no version)'} to run in",
                           NO_ENGINE_FIX)


@dataclass
class Calibration:
    folder: Path
    made: bool
    reason: str  # why it was (re)built, or "fresh"
    sidecar: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "made": self.made, "reason": self.reason,
                "scales": self.sidecar.get("scales"), "tokens": self.sidecar.get("measured_tokens")}


def ensure_calibrated(project: Project, resolved: Resolved, environ: Mapping[str, str], *,
                      beside: Beside, corpus: Path | None = None, force: bool = False,
                      tokens: int = 32768, plan: CalibrationPlan | None = None,
                      say: Callable[[str], None] | None = None) -> Calibration | None:
    """The calibrated copy for the profile's model (or `plan`'s): kept when its sidecar is fresh,
    else measured and rebuilt. `beside`: where the measurement runs (runtime.base; calibrate-kv:
    the engine's interpreter on the host). None in a dry run (the command was printed). `say`
    hears why a measurement starts (`up` prints it: the engine waits minutes for it)."""
    plan = plan or plan_calibration(project, resolved, environ, corpus=corpus, tokens=tokens)
    # The engine's version (or image) pins its torch and transformers: a new engine re-measures.
    reason = "forced" if force else staleness(plan, beside.identity)
    if reason is None:
        return Calibration(plan.target, False, "fresh", read_sidecar(plan.target) or {})
    source = beside.see(plan.source)
    if source is None:
        raise CalibrationError(f"the engine container does not see {plan.source}, the checkpoint to "
                               "measure (it mounts the HF cache and MODELS_DIR only)",
                               "put the model under MODELS_DIR, or use its Hugging Face id")
    if say is not None:
        say(f"fp8 KV scales: calibrating {plan.target} ({reason}): {plan.tokens} tokens of "
            f"{plan.corpus.name} through {plan.source}")
    # Mounted at its own path where the measurement runs in a container.
    work = Path(tempfile.mkdtemp(prefix="kv-calibration-")) if not beside.dry_run else Path("<tmp>")
    out, text = work / "amax.json", work / "calibration.txt"
    argv = ["-m", "vllmstack.models.kv_calibrate_runner", source, str(text), str(out),
            "--tokens", str(plan.tokens)]
    if beside.dry_run:
        beside.run(argv, [work], 3600)
        return None
    try:  # the work folder goes however this ends (a SIGTERM from `down` stops `up` here too)
        # The last tenth is what --gate scores: scales fitted on it would flatter the gate.
        text.write_text(split_corpus(plan.corpus.read_text(encoding="utf-8"))[0], encoding="utf-8")
        result = beside.run(argv, [work], 3600)
        if not out.is_file():
            said = (result.stderr or result.stdout).strip()[-600:]
            raise CalibrationError(f"the calibration run wrote nothing (exit {result.returncode}): {said}",
                                   "run the command above by hand to see why")
        measured = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    scales = scales_from_amax(measured.get("layers") or {})
    sidecar = {**plan.identity(beside.identity), "corpus": str(plan.corpus),
               "measured_tokens": measured.get("tokens"), "tool_versions": measured.get("versions"),
               "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "reason": reason}
    folder = write_calibrated_copy(plan, scales, sidecar)
    return Calibration(folder, True, reason, {**sidecar, "scales": scales})


# --- what `up` serves: "ensure" semantics -------------------------------------------------------

KV_SCALES_KEY = "VLLM_KV_SCALES"


def is_fp8_kv(resolved: Resolved) -> bool:
    return resolved.get_str("VLLM_KV_CACHE_DTYPE").startswith("fp8")


def plan_from_copy(folder: Path, sidecar: Mapping[str, Any]) -> CalibrationPlan | None:
    """Rebuilding an existing copy in place: from the source, corpus and budget its sidecar names
    (a corpus that is gone: the bundled one). None when the source is gone (nothing to measure)."""
    source = Path(str(sidecar.get("source") or ""))
    if not (source / "config.json").is_file():
        return None
    corpus = Path(str(sidecar.get("corpus") or ""))
    corpus = corpus if corpus.is_file() else DEFAULT_CORPUS
    tokens = sidecar.get("tokens")
    return CalibrationPlan(source, source_revision(source), corpus, file_sha256(corpus), folder,
                           tokens if isinstance(tokens, int) and tokens > 0 else 32768)


def with_model(resolved: Resolved, folder: Path, why: str) -> Resolved:
    """The profile with VLLM_MODEL pointed at `folder`; the setting it replaces stays in history."""
    old = resolved.values.get("VLLM_MODEL")
    origin = old.source if old is not None else "default"
    setting = Setting("VLLM_MODEL", str(folder), f"{origin}, {why}")
    history = {**resolved.history,
               "VLLM_MODEL": [*resolved.history.get("VLLM_MODEL", []), setting]}
    return dataclasses.replace(resolved, values={**resolved.values, "VLLM_MODEL": setting},
                               history=history)


def require_seen(folder: Path, beside: Beside) -> None:
    """Where the engine runs, the copy's folder is there (a container: under MODELS_DIR)."""
    if beside.see(folder) is None:
        raise CalibrationError(f"the engine container does not see {folder}, where the calibrated "
                               "copy goes (it mounts MODELS_DIR and the caches only)",
                               "set MODELS_DIR in .env (a folder for local model copies)")


def require_links(folder: Path, beside: Beside) -> None:
    """Where the engine runs, the copy's links lead to the checkpoint's files (a container:
    hard links; symbolic ones name host paths it does not have)."""
    unseen = unseen_links(folder, beside.see) if folder.is_dir() else []
    if unseen:
        raise CalibrationError(
            f"the engine container cannot follow the links of {folder} ({', '.join(unseen[:3])}): "
            "they point at the checkpoint by its host path, since a hard link to it was not possible "
            "(another file system)", "put MODELS_DIR on the file system of the HF cache (then "
            "`invoke calibrate-kv --force`), or serve with RUNTIME=native")


def served_model(project: Project, resolved: Resolved, environ: Mapping[str, str], *,
                 beside: Callable[[], Beside], say: Callable[[str], None]) -> Resolved:
    """The profile `up` serves. With an fp8 KV cache:

    * VLLM_MODEL is a calibrated copy: a stale one (its source snapshot, corpus, engine or format
      changed) is rebuilt in place first. One with a zero or non-finite scale is left as it is,
      for `check` to refuse: measuring again would hide whatever wrote it;
    * VLLM_KV_SCALES=calibrated: the copy of VLLM_MODEL is made when missing, rebuilt when stale,
      and served instead of VLLM_MODEL.

    `beside` is asked only then: where the engine runs, the measurement runs (runtime.base)."""
    if not is_fp8_kv(resolved):
        return resolved
    folder = locate_model_dir(resolved.get_str("VLLM_MODEL"), environ,
                              profile_hf_cache(resolved))
    sidecar = read_sidecar(folder) if folder is not None else None
    if sidecar is None and resolved.get_str(KV_SCALES_KEY) != "calibrated":
        return resolved
    if sidecar is not None:
        assert folder is not None
        plan = plan_from_copy(folder, sidecar)
        if plan is None or scale_problems(sidecar.get("scales") or {}):
            return resolved  # a source that is gone, or a zero scale: `check` refuses and says why
        done = _ensure(project, resolved, environ, plan, beside(), say)
        if done is not None and not done.made:
            say(f"fp8 KV scales: {folder} is fresh")
        return resolved
    plan = plan_calibration(project, resolved, environ)
    why = f"calibrated copy ({KV_SCALES_KEY}=calibrated)"
    existing = read_sidecar(plan.target)
    if existing is not None and scale_problems(existing.get("scales") or {}):
        return with_model(resolved, plan.target, why)  # served as it is: `check` refuses it
    done = _ensure(project, resolved, environ, plan, beside(), say)
    if done is None and not plan.target.is_dir():  # a dry run: there is no copy to check yet
        say(f"(dry run) once measured, {plan.target} is served in place of "
            f"{resolved.get_str('VLLM_MODEL')}; the checks and the command below are the source's")
        return resolved
    if done is not None and not done.made:
        say(f"fp8 KV scales: serving the calibrated copy {plan.target} (fresh)")
    return with_model(resolved, plan.target, why)


def _ensure(project: Project, resolved: Resolved, environ: Mapping[str, str], plan: CalibrationPlan,
            where: Beside, say: Callable[[str], None]) -> Calibration | None:
    """ensure_calibrated where the engine runs, and the copy visible there: the folder before
    anything is measured, its links once it is fresh (a copy with links a container cannot follow
    is one the file system did not let link hard: measuring again would not change that)."""
    require_seen(plan.target, where)
    done = ensure_calibrated(project, resolved, environ, beside=where, plan=plan, say=say)
    if done is not None:
        require_links(plan.target, where)
    return done

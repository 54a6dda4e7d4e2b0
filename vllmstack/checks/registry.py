"""Checks before boot: every problem we can find without starting the engine.

Each rule is a function `(ctx) -> list[Finding]`, registered in RULES in the order the report
shows them. Findings name the key, the file:line that set it, and a fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.checks import deep as vllm_parser
from vllmstack.config.modelinfo import (
    GIB,
    MIB,
    ModelFacts,
    estimate_mamba_blocks,
    is_local_path,
    kv_bytes_per_token_per_gpu,
    load_model_facts,
)
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema, as_bool, as_list, load_schema
from vllmstack.config.vllm_args import ArgvError, ServeCommand, build_serve_argv, spec_config
from vllmstack.core.findings import Finding, sort_findings
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.image import build, patches

# MTP with more than one draft token corrupts output from this many concurrent sequences on.
MTP_CORRUPTION_SEQS = 4
# vLLM's gated-delta chunk for hybrid MoE models; a smaller step budget cannot hold one chunk.
MOE_GDN_BLOCK = 2112
# Activations, CUDA/HIP graphs and runtime buffers per GPU, beyond weights and KV cache. A
# deliberately round estimate: the projection is for "clearly won't fit", not for tuning.
OVERHEAD_GIB = 2.0
FULL_BUILD_IMAGE = "localhost/vllm-fullbuild:latest"
# Archs the ROCm images compile kernels for (PYTORCH_ROCM_ARCH of vLLM's ROCm base).
IMAGE_ARCHS = {"gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1200", "gfx1201",
               "gfx1150", "gfx1151"}
# Where AITER has kernels at all: CK paths on gfx9, its Triton kernels on RDNA4.
AITER_ARCH_PREFIXES = ("gfx9", "gfx120")


@dataclass
class CheckContext:
    project: Project
    resolved: Resolved
    schema: Schema
    facts: ModelFacts
    environ: Mapping[str, str]
    command: ServeCommand | None = None
    # The runtime `up` will use when it is known (--runtime); else the RUNTIME setting.
    runtime_name: str | None = None

    def get(self, key: str) -> str:
        return self.resolved.get(key) or ""

    @property
    def bad_keys(self) -> set[str]:
        """Keys whose value already failed validation: rules built on them stay quiet, so one
        mistake gives one message instead of a cascade."""
        return {f.key for f in self.resolved.problems if f.severity == "error" and f.key}

    def usable(self, *keys: str) -> bool:
        return not (set(keys) & self.bad_keys)

    def int(self, key: str) -> int | None:
        try:
            return int(self.get(key))
        except ValueError:
            return None

    def float(self, key: str) -> float | None:
        try:
            return float(self.get(key))
        except ValueError:
            return None

    def src(self, key: str) -> str | None:
        return self.resolved.source(key)

    def finding(self, severity: str, code: str, key: str | None, message: str,
                fix: str | None = None) -> Finding:
        return Finding(severity, code, message, key=key,
                       source=self.src(key) if key else None, fix=fix)

    @property
    def runtime(self) -> str:
        return self.runtime_name or self.get("RUNTIME") or "auto"

    @property
    def is_amd(self) -> bool:
        return self.get("GPU_VENDOR") == "amd"

    @property
    def arch(self) -> str:
        return self.get("GPU_ARCH")


Rule = Callable[[CheckContext], list[Finding]]


def rule_profile_problems(ctx: CheckContext) -> list[Finding]:
    """Syntax, duplicates, unknown keys, types and ranges met while resolving."""
    return list(ctx.resolved.problems)


def rule_required(ctx: CheckContext) -> list[Finding]:
    out = []
    for key in ctx.schema.keys.values():
        if key.required and not ctx.get(key.name).strip():
            out.append(ctx.finding(
                "error", "missing-required", key.name,
                f"{key.name} is required and empty: {key.description}",
                fix=f"set {key.name} in env/models/{ctx.resolved.profile}.env or with --set"))
    return out


def rule_argv(ctx: CheckContext) -> list[Finding]:
    """The vllm serve argv can be built; notes from building it (spec decode implies...)."""
    if not ctx.get("VLLM_MODEL"):
        return []
    try:
        ctx.command = build_serve_argv(ctx.resolved)
    except ArgvError as exc:
        if ctx.bad_keys:
            return []  # the bad value is already reported, with its file and line
        return [Finding("error", "argv", str(exc), fix="fix the value named above")]
    return list(ctx.command.notes)


def rule_profile_platform(ctx: CheckContext) -> list[Finding]:
    platforms = as_list(ctx.get("PROFILE_PLATFORMS"))
    if platforms and ctx.resolved.platform not in platforms:
        return [ctx.finding(
            "warning", "untested-platform", "PROFILE_PLATFORMS",
            f"profile {ctx.resolved.profile} is made for {', '.join(platforms)}, "
            f"not {ctx.resolved.platform}",
            fix=f"use --platform {platforms[0]}, or add {ctx.resolved.platform} to PROFILE_PLATFORMS "
                "once it has run there")]
    return []


def rule_dotenv_overrides(ctx: CheckContext) -> list[Finding]:
    """Say when the host file overrides what a profile layer chose (it applies to every profile)."""
    out = []
    for key, history in ctx.resolved.history.items():
        final = ctx.resolved.values.get(key)
        if final is None or not final.source.startswith(".env"):
            continue
        layered = [s for s in history if s.source.startswith("env/")]
        if layered and layered[-1].value != final.value:
            out.append(Finding(
                "info", "dotenv-override",
                f"{key}={final.value!r} from {final.source} overrides {layered[-1].value!r} "
                f"from {layered[-1].source} (for every profile)",
                key=key, source=final.source,
                fix="move it into the model profile if it is meant for this model only"))
    return out


def rule_files_exist(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    model = ctx.get("VLLM_MODEL")
    if model and is_local_path(model):
        path = Path(model).expanduser()
        if not path.is_dir():
            out.append(ctx.finding("error", "missing-model-dir", "VLLM_MODEL",
                                   f"model folder {path} does not exist",
                                   fix="download or copy the model there, or use a Hugging Face id"))
        elif not (path / "config.json").is_file():
            out.append(ctx.finding("error", "missing-model-config", "VLLM_MODEL",
                                   f"{path} has no config.json: not a model folder",
                                   fix="point VLLM_MODEL at the folder that holds config.json"))
        out += _mounted(ctx, "VLLM_MODEL", path)
    tokenizer = ctx.get("VLLM_TOKENIZER")
    if tokenizer and is_local_path(tokenizer):
        path = Path(tokenizer).expanduser()
        if not path.exists():
            out.append(ctx.finding("error", "missing-tokenizer", "VLLM_TOKENIZER",
                                   f"tokenizer path {path} does not exist",
                                   fix="point it at the model folder or use a Hugging Face id"))
        else:
            out += _mounted(ctx, "VLLM_TOKENIZER", path)
    template = ctx.get("VLLM_CHAT_TEMPLATE")
    if template:
        path = ctx.project.root / "chat-templates" / template
        if not path.is_file():
            have = sorted(p.name for p in (ctx.project.root / "chat-templates").glob("*.jinja"))
            out.append(ctx.finding("error", "missing-chat-template", "VLLM_CHAT_TEMPLATE",
                                   f"chat template chat-templates/{template} does not exist",
                                   fix="use one of: " + (", ".join(have) or "(none shipped)")
                                   + ", or leave it empty for the model's own template"))
    hf_config = ctx.get("VLLM_HF_CONFIG_PATH")
    if hf_config:
        path = Path(hf_config).expanduser()
        if not (path / "config.json").is_file():
            out.append(ctx.finding("error", "missing-hf-config", "VLLM_HF_CONFIG_PATH",
                                   f"{path}/config.json does not exist",
                                   fix="point it at a folder holding the replacement config.json"))
        else:
            out += _mounted(ctx, "VLLM_HF_CONFIG_PATH", path)
    return out


def _mounted(ctx: CheckContext, key: str, path: Path) -> list[Finding]:
    """Local paths reach the container only through MODELS_DIR (mounted read-only)."""
    if ctx.runtime == "native":
        return []
    models_dir = ctx.get("MODELS_DIR")
    if models_dir and _is_within(path, Path(models_dir).expanduser()):
        return []
    return [ctx.finding(
        "error", "path-not-mounted", key,
        f"{path} is a local path, but only MODELS_DIR is mounted into the engine container"
        + (f" ({models_dir})" if models_dir else " (MODELS_DIR is not set)"),
        fix=f"set MODELS_DIR in .env to a folder that contains {path}")]


def _is_within(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def rule_spec_decode(ctx: CheckContext) -> list[Finding]:
    if not ctx.usable("VLLM_SPEC_DECODE", "VLLM_MAX_NUM_SEQS"):
        return []
    try:
        spec = spec_config(ctx.resolved)
    except ArgvError:
        return []  # reported by the argv rule
    if spec is None:
        return []
    out: list[Finding] = []
    drafts = spec.get("num_speculative_tokens")
    seqs = ctx.int("VLLM_MAX_NUM_SEQS") or 0
    method = str(spec.get("method", ""))
    if "mtp" in method and isinstance(drafts, int) and drafts > 1 and seqs >= MTP_CORRUPTION_SEQS:
        out.append(ctx.finding(
            "error", "mtp-depth-vs-seqs", "VLLM_SPEC_DECODE",
            f"MTP with {drafts} draft tokens at max_num_seqs={seqs} (from "
            f"{ctx.src('VLLM_MAX_NUM_SEQS')}) corrupts output from {MTP_CORRUPTION_SEQS} "
            "sequences on",
            fix=f'set "num_speculative_tokens": 1, or VLLM_MAX_NUM_SEQS={MTP_CORRUPTION_SEQS - 1}'))
    if drafts is None:
        out.append(ctx.finding(
            "error", "spec-missing-tokens", "VLLM_SPEC_DECODE",
            "the speculative config has no num_speculative_tokens (vLLM requires it for MTP)",
            fix='add "num_speculative_tokens": 1'))
    elif not isinstance(drafts, int) or drafts < 1:
        out.append(ctx.finding("error", "spec-bad-tokens", "VLLM_SPEC_DECODE",
                               f"num_speculative_tokens must be a positive integer, got {drafts!r}",
                               fix='use e.g. "num_speculative_tokens": 1'))
    return out


def rule_scheduler(ctx: CheckContext) -> list[Finding]:
    if not ctx.usable("VLLM_MAX_BATCHED_TOKENS", "VLLM_MAX_NUM_SEQS", "VLLM_MAX_MODEL_LEN",
                      "MAMBA_CACHE_BLOCKS"):
        return []
    out: list[Finding] = []
    batched = ctx.int("VLLM_MAX_BATCHED_TOKENS")
    seqs = ctx.int("VLLM_MAX_NUM_SEQS")
    if batched is not None and seqs is not None and batched < seqs:
        out.append(ctx.finding(
            "error", "batched-below-seqs", "VLLM_MAX_BATCHED_TOKENS",
            f"max_num_batched_tokens ({batched}) must be greater than or equal to max_num_seqs "
            f"({seqs})", fix=f"set VLLM_MAX_BATCHED_TOKENS to at least {seqs}"))
    facts = ctx.facts
    if facts.is_hybrid and facts.is_moe and batched is not None and batched < MOE_GDN_BLOCK:
        out.append(ctx.finding(
            "error", "moe-gdn-block", "VLLM_MAX_BATCHED_TOKENS",
            f"max_num_batched_tokens ({batched}) is below the hybrid MoE gated-delta block size "
            f"({MOE_GDN_BLOCK})", fix="set VLLM_MAX_BATCHED_TOKENS=4096"))
    max_len = ctx.int("VLLM_MAX_MODEL_LEN")
    if max_len and facts.max_position_embeddings and max_len > facts.max_position_embeddings:
        allowed = as_bool(ctx.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"))
        out.append(ctx.finding(
            "warning" if allowed else "error", "max-len-over-model", "VLLM_MAX_MODEL_LEN",
            f"max_model_len {max_len} is greater than the model's max_position_embeddings "
            f"{facts.max_position_embeddings} ({facts.sources.get('max_position_embeddings')})",
            fix=f"set VLLM_MAX_MODEL_LEN={facts.max_position_embeddings} or less"))
    known_blocks = ctx.int("MAMBA_CACHE_BLOCKS")
    if facts.is_hybrid and known_blocks and seqs and seqs > known_blocks:
        out.append(ctx.finding(
            "error", "mamba-blocks", "VLLM_MAX_NUM_SEQS",
            f"max_num_seqs ({seqs}) exceeds available Mamba cache blocks ({known_blocks}, "
            f"MAMBA_CACHE_BLOCKS @ {ctx.src('MAMBA_CACHE_BLOCKS')}): each decoding sequence needs "
            "one block and graph capture fails",
            fix=f"set VLLM_MAX_NUM_SEQS={known_blocks} or less, or raise VLLM_GPU_MEM_UTIL"))
    return out


def rule_parallelism(ctx: CheckContext) -> list[Finding]:
    if not ctx.usable("VLLM_TP", "GPU_COUNT"):
        return []
    out: list[Finding] = []
    tp = ctx.int("VLLM_TP") or 1
    gpus = ctx.int("GPU_COUNT")
    visible_key = "CUDA_VISIBLE_DEVICES" if ctx.get("GPU_VENDOR") == "nvidia" else "HIP_VISIBLE_DEVICES"
    visible = as_list(ctx.get(visible_key))
    if ctx.get("GPU_VENDOR") == "none":
        if tp != 1:
            out.append(ctx.finding("error", "tp-without-gpus", "VLLM_TP",
                                   f"tensor parallel {tp} on a platform without GPUs",
                                   fix="set VLLM_TP=1"))
        return out
    if gpus is not None and tp > gpus:
        out.append(ctx.finding(
            "error", "tp-over-gpus", "VLLM_TP",
            f"tensor parallel size {tp} needs {tp} GPUs; platform {ctx.resolved.platform} has "
            f"{gpus} (GPU_COUNT @ {ctx.src('GPU_COUNT')})",
            fix=f"set VLLM_TP={gpus}, or use a platform with {tp} GPUs"))
    elif visible and tp > len(visible):
        out.append(ctx.finding(
            "error", "tp-over-visible", "VLLM_TP",
            f"tensor parallel size {tp} but {visible_key}={','.join(visible)} exposes "
            f"{len(visible)} GPU(s)", fix=f"list {tp} GPUs in {visible_key} or lower VLLM_TP"))
    heads = ctx.facts.num_attention_heads
    if heads and heads % tp:
        out.append(ctx.finding(
            "error", "tp-heads", "VLLM_TP",
            f"Total number of attention heads ({heads}) must be divisible by tensor parallel "
            f"size ({tp})", fix="choose a VLLM_TP that divides the head count"))
    return out


def rule_memory(ctx: CheckContext) -> list[Finding]:
    """Weights + KV at max_model_len + overhead against usable memory per GPU."""
    if not ctx.usable("VLLM_TP", "VLLM_GPU_MEM_UTIL", "VLLM_MAX_MODEL_LEN", "GPU_VRAM_GIB",
                      "VLLM_KV_CACHE_DTYPE", "VLLM_MAX_NUM_SEQS", "MODEL_WEIGHT_GIB"):
        return []
    facts = ctx.facts
    vram = ctx.float("GPU_VRAM_GIB")
    util = ctx.float("VLLM_GPU_MEM_UTIL")
    tp = ctx.int("VLLM_TP") or 1
    max_len = ctx.int("VLLM_MAX_MODEL_LEN")
    out: list[Finding] = []
    if ctx.get("GPU_VENDOR") == "none" or not vram or not util:
        return out
    if util > 0.95 and as_bool(ctx.get("UNIFIED_MEMORY")):
        out.append(ctx.finding(
            "warning", "unified-memory-util", "VLLM_GPU_MEM_UTIL",
            f"gpu_memory_utilization {util} on unified memory leaves almost nothing for the OS",
            fix="use 0.85-0.9 on an APU"))
    if facts.weight_gib is None or max_len is None:
        return [*out, Finding("info", "memory-unknown",
                              "no weight size known: memory projection skipped",
                              fix="set MODEL_WEIGHT_GIB in the profile or download the model")]
    usable = vram * util
    weights = facts.weight_gib / tp
    kv_available = usable - weights - OVERHEAD_GIB
    where = (f"{vram:g} GiB × {util:g} = {usable:.1f} GiB usable per GPU; weights "
             f"{facts.weight_gib:g} GiB / TP {tp} = {weights:.1f} GiB; overhead ≈ {OVERHEAD_GIB:g} GiB")
    if kv_available <= 0:
        return [*out, ctx.finding(
            "error", "weights-do-not-fit", "VLLM_GPU_MEM_UTIL",
            f"the weights do not fit: {where}; {-kv_available:.1f} GiB short before any KV cache",
            fix="raise VLLM_TP (more GPUs), use a quantized profile, or raise VLLM_GPU_MEM_UTIL")]
    kv_dtype = ctx.get("VLLM_KV_CACHE_DTYPE") or "auto"
    per_token = kv_bytes_per_token_per_gpu(facts, tp, kv_dtype)
    if per_token is None:
        return out
    mamba = (facts.mamba_state_mib or 0) * MIB / tp * 2  # align mode keeps two state blocks
    need = per_token * max_len + mamba
    if need > kv_available * GIB:
        fit_len = int((kv_available * GIB - mamba) // per_token)
        out.append(ctx.finding(
            "error", "kv-does-not-fit", "VLLM_MAX_MODEL_LEN",
            f"one request at max_model_len {max_len} needs {need / GIB:.1f} GiB of KV cache per "
            f"GPU but only ≈{kv_available:.1f} GiB is left ({where})",
            fix=f"set VLLM_MAX_MODEL_LEN={max(fit_len // 1024 * 1024, 0)} or less"
                + ("" if kv_dtype.startswith("fp8") else ", use VLLM_KV_CACHE_DTYPE=fp8")
                + ", or raise VLLM_GPU_MEM_UTIL"))
        return out
    seqs = ctx.int("VLLM_MAX_NUM_SEQS") or 1
    full = int(kv_available * GIB // need)
    out.append(Finding(
        "info", "memory-projection",
        f"≈{kv_available:.1f} GiB KV cache per GPU: {full} request(s) at the full "
        f"{max_len}-token window ({where})", key="VLLM_MAX_MODEL_LEN",
        source=ctx.src("VLLM_MAX_MODEL_LEN")))
    blocks = estimate_mamba_blocks(facts, tp, kv_dtype, kv_available * GIB)
    if blocks is not None and not ctx.int("MAMBA_CACHE_BLOCKS") and seqs > blocks:
        # An estimate (activation peak and graph memory vary), so a warning; the exact
        # count from a boot log goes in MAMBA_CACHE_BLOCKS and makes this an error.
        out.append(ctx.finding(
            "warning", "mamba-blocks-estimate", "VLLM_MAX_NUM_SEQS",
            f"max_num_seqs ({seqs}) is above the ≈{blocks} Mamba cache blocks these settings "
            "probably give; vLLM then refuses to capture graphs",
            fix=f"set VLLM_MAX_NUM_SEQS to at most {blocks}, or record the block count from the "
                "boot log in MAMBA_CACHE_BLOCKS for an exact check"))
    return out


TUNED_NAME = re.compile(r"^(?P<fields>(?:[A-Za-z_]+=[^,]+,?)+)\.json$")


def _parse_tuned_name(name: str) -> dict[str, str] | None:
    """`E=256,N=256,device_name=X,dtype=fp8_w8a8,block_shape=[128,128].json` -> fields."""
    if not name.endswith(".json"):
        return None
    stem = name[: -len(".json")]
    fields: dict[str, str] = {}
    # block_shape holds a comma: split on commas that start a new key=.
    for part in re.split(r",(?=[A-Za-z_]+=)", stem):
        key, sep, value = part.partition("=")
        if not sep:
            return None
        fields[key] = value
    return fields


def rule_tuned_configs(ctx: CheckContext) -> list[Finding]:
    if not ctx.usable("VLLM_TP"):
        return []
    out: list[Finding] = []
    facts = ctx.facts
    tp = ctx.int("VLLM_TP") or 1
    device = ctx.get("GPU_DEVICE_NAME")
    dtype = "fp8_w8a8" if facts.quant in ("fp8", "fp8_w8a8") else None
    for folder, required in (("fused_moe_configs", ("E", "N", "device_name")),
                             ("fp8_configs", ("N", "K", "device_name", "dtype", "block_shape"))):
        root = ctx.project.root / folder
        for path in sorted(root.glob("*.json")) if root.is_dir() else []:
            rel = f"{folder}/{path.name}"
            fields = _parse_tuned_name(path.name)
            if fields is None or any(k not in fields for k in required):
                out.append(Finding("warning", "tuned-bad-name",
                                   f"{rel}: vLLM never reads a file named like this",
                                   source=rel, fix=f"name it {','.join(f'{k}=…' for k in required)}.json"))
                continue
            try:
                content = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                out.append(Finding("error", "tuned-bad-json", f"{rel} is not valid JSON ({exc})",
                                   source=rel, fix="regenerate it with the tuner"))
                continue
            if folder == "fp8_configs" and isinstance(content, dict) and "triton_version" in content:
                out.append(Finding("error", "tuned-triton-version",
                                   f"{rel} has a \"triton_version\" key: the block-FP8 loader does "
                                   "int(key) on every key and would crash", source=rel,
                                   fix="delete the triton_version entry (only MoE files may have it)"))
            if device and fields["device_name"] != device:
                out.append(Finding("warning", "tuned-other-device",
                                   f"{rel} is for device {fields['device_name']}, this platform is "
                                   f"{device}: vLLM ignores it here", source=rel,
                                   fix="tune for this device, or ignore if the file serves another box"))
                continue
            if folder == "fused_moe_configs":
                out += _check_moe_file(rel, fields, facts, tp, dtype)
            else:
                out += _check_dense_file(rel, fields, facts, tp)
    return out


def _check_moe_file(rel: str, fields: dict[str, str], facts: ModelFacts, tp: int,
                    dtype: str | None) -> list[Finding]:
    if not (facts.num_experts and facts.moe_intermediate_size):
        return []
    if fields["E"] != str(facts.num_experts):
        return []  # another model's file
    want_n = facts.moe_intermediate_size // tp
    if fields["N"] != str(want_n):
        tuned_tp = facts.moe_intermediate_size // int(fields["N"]) if fields["N"].isdigit() and int(
            fields["N"]) else None
        return [Finding("warning", "tuned-wrong-tp",
                        f"{rel} has N={fields['N']}, but this model at TP={tp} looks up N={want_n}"
                        + (f" (the file fits TP={tuned_tp})" if tuned_tp else "")
                        + ": vLLM silently ignores it", source=rel,
                        fix=f"re-tune at TP={tp} (benchmark_moe.py -tp {tp}) or rename after checking")]
    if dtype and fields.get("dtype") != dtype:
        return [Finding("warning", "tuned-wrong-dtype",
                        f"{rel} has dtype={fields.get('dtype', '(none)')}, this model looks up "
                        f"dtype={dtype}", source=rel, fix="re-tune with --dtype fp8_w8a8")]
    return []


def _check_dense_file(rel: str, fields: dict[str, str], facts: ModelFacts,
                      tp: int) -> list[Finding]:
    """Flag files that fit this model's MLP at another tensor-parallel size."""
    hidden, inter = facts.hidden_size, facts.intermediate_size
    if not (hidden and inter) or not (fields["N"].isdigit() and fields["K"].isdigit()):
        return []
    n, k = int(fields["N"]), int(fields["K"])
    shapes_at = {t: {(2 * inter // t, hidden), (hidden, inter // t)} for t in (1, 2, 4, 8)}
    if (n, k) in shapes_at.get(tp, set()):
        return []
    for other, shapes in shapes_at.items():
        if other != tp and (n, k) in shapes:
            return [Finding("warning", "tuned-wrong-tp",
                            f"{rel} matches this model's MLP at TP={other}, but it runs at TP={tp}: "
                            "vLLM never looks it up", source=rel,
                            fix=f"re-tune the shape for TP={tp}")]
    return []


def rule_rocm(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    values = ctx.resolved.values
    override = values.get("HSA_OVERRIDE_GFX_VERSION")
    if override is not None and not override.value.strip():
        out.append(ctx.finding(
            "error", "hsa-override-empty", "HSA_OVERRIDE_GFX_VERSION",
            "HSA_OVERRIDE_GFX_VERSION is set but empty: the HSA runtime then finds no GPU at all",
            fix="delete the line, or set a version such as 11.0.0"))
    elif override is not None and ctx.is_amd and ctx.arch in IMAGE_ARCHS:
        out.append(ctx.finding(
            "warning", "hsa-override-unneeded", "HSA_OVERRIDE_GFX_VERSION",
            f"{ctx.arch} has its own kernels in the image; the override makes vLLM's arch checks "
            "and the loaded kernels disagree", fix="delete HSA_OVERRIDE_GFX_VERSION"))
    if ctx.is_amd and ctx.arch and ctx.arch not in IMAGE_ARCHS and override is None:
        out.append(ctx.finding(
            "warning", "hsa-override-missing", "GPU_ARCH",
            f"{ctx.arch} has no kernels in the ROCm images; without an override no kernel loads",
            fix="set HSA_OVERRIDE_GFX_VERSION=11.0.0 (RDNA3) in the platform layer"))
    aiter_on = as_bool(ctx.get("VLLM_ROCM_USE_AITER"))
    has_aiter = ctx.is_amd and ctx.arch.startswith(AITER_ARCH_PREFIXES)
    backend = ctx.get("ATTENTION_BACKEND")
    if backend.startswith("ROCM_AITER") and not has_aiter:
        out.append(ctx.finding(
            "error", "aiter-backend-unsupported", "ATTENTION_BACKEND",
            f"attention backend {backend} needs AITER, which has no kernels for "
            f"{ctx.arch or ctx.get('GPU_VENDOR')}",
            fix="use ATTENTION_BACKEND=TRITON_ATTN (or leave it empty)"))
    elif aiter_on and not has_aiter:
        out.append(ctx.finding(
            "warning", "aiter-no-effect", "VLLM_ROCM_USE_AITER",
            f"AITER is enabled but has no path on {ctx.arch or ctx.get('GPU_VENDOR')}: it does nothing",
            fix="remove VLLM_ROCM_USE_AITER* from this platform's layers"))
    if ctx.get("GPU_VENDOR") == "nvidia":
        rocm_keys = [k for k in values if k.startswith(("HIP_", "HSA_", "ROCR_"))]
        if rocm_keys:
            out.append(ctx.finding("warning", "rocm-env-on-nvidia", rocm_keys[0],
                                   f"ROCm variables on an NVIDIA platform: {', '.join(rocm_keys)}",
                                   fix="remove them; use CUDA_VISIBLE_DEVICES"))
    return out


VERSION_TAG = re.compile(r"^v?(\d+\.\d+\.\d+(?:(?:rc|\.post|\.dev)\d+)?)$")
ROCM_SUFFIX = re.compile(r"\+rocm(\d+\.\d+(?:\.\d+)?)")
IMAGE_ROCM = re.compile(r":(\d+\.\d+(?:\.\d+)?)")


def rule_pins(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    if ctx.get("VLLM_IMAGE") == FULL_BUILD_IMAGE and ctx.is_amd:
        # The engine image is built here: everything the build needs must be there.
        out += build.pin_findings(ctx.project, ctx.resolved)
    ref, version = ctx.get("VLLM_REF"), ctx.get("VLLM_VERSION")
    match = VERSION_TAG.match(ref)
    if match and version and match.group(1) != version:
        out.append(ctx.finding(
            "error", "pin-vllm-mismatch", "VLLM_VERSION",
            f"VLLM_REF={ref} ({ctx.src('VLLM_REF')}) is release {match.group(1)} but "
            f"VLLM_VERSION={version}", fix=f"set VLLM_VERSION={match.group(1)} (bump both together)"))
    image_match = IMAGE_ROCM.search(ctx.get("ROCM_IMAGE").rsplit("/", 1)[-1])
    torch_match = ROCM_SUFFIX.search(ctx.get("TORCH_VERSION"))
    if image_match and torch_match and not _same_version(image_match.group(1), torch_match.group(1)):
        out.append(ctx.finding(
            "error", "pin-rocm-mismatch", "TORCH_VERSION",
            f"TORCH_VERSION is built for ROCm {torch_match.group(1)} but ROCM_IMAGE is ROCm "
            f"{image_match.group(1)}", fix="pick torch wheels whose +rocm suffix matches the image"))
    if torch_match:
        for key in ("TORCHVISION_VERSION", "TORCHAUDIO_VERSION"):
            other = ROCM_SUFFIX.search(ctx.get(key))
            if other and not _same_version(other.group(1), torch_match.group(1)):
                out.append(ctx.finding(
                    "error", "pin-rocm-mismatch", key,
                    f"{key} is built for ROCm {other.group(1)}, TORCH_VERSION for "
                    f"{torch_match.group(1)}", fix="use the same +rocm suffix for all torch wheels"))
    return out


def _same_version(a: str, b: str) -> bool:
    def norm(v: str) -> tuple[int, ...]:
        parts = [int(p) for p in v.split(".")]
        return tuple(parts + [0] * (3 - len(parts)))
    return norm(a) == norm(b)


def rule_overlays(ctx: CheckContext) -> list[Finding]:
    """Overlays replace vLLM files wholesale: one made for another ref silently reverts code."""
    try:
        overlays = patches.load_overlays(ctx.project)
    except (ValueError, OSError) as exc:
        return [Finding("error", "overlay-manifest", str(exc), fix="fix the overlay manifest")]
    out: list[Finding] = []
    pin = ctx.get("VLLM_REF")
    for overlay in overlays:
        if not Path(overlay.file).is_file():
            out.append(Finding("error", "overlay-missing", f"overlay file {overlay.file} is missing",
                               fix="restore it or remove it from the manifest"))
        elif pin and overlay.ref != pin:
            out.append(ctx.finding(
                "error", "overlay-ref-mismatch", "VLLM_REF",
                f"overlay {overlay.name} is locked to vLLM {overlay.ref} but VLLM_REF={pin}: it "
                "would replace newer upstream code", fix="invoke verify-patches, then re-derive the "
                "overlay from the new upstream file and update its manifest"))
    return out


RULES: tuple[Rule, ...] = (
    rule_profile_problems,
    rule_required,
    rule_argv,
    rule_profile_platform,
    rule_dotenv_overrides,
    rule_files_exist,
    rule_spec_decode,
    rule_scheduler,
    rule_parallelism,
    rule_memory,
    rule_tuned_configs,
    rule_rocm,
    rule_pins,
    rule_overlays,
)


def run_checks(
    project: Project,
    resolved: Resolved,
    environ: Mapping[str, str],
    *,
    rules: tuple[Rule, ...] = RULES,
    schema: Schema | None = None,
    runtime: str | None = None,
) -> tuple[list[Finding], CheckContext]:
    ctx = CheckContext(project, resolved, schema or load_schema(), load_model_facts(resolved, environ),
                       environ, runtime_name=runtime)
    findings: list[Finding] = []
    for rule in rules:
        findings.extend(rule(ctx))
    return sort_findings(findings), ctx


def report_json(resolved: Resolved, findings: list[Finding]) -> dict[str, Any]:
    return {
        "profile": resolved.profile,
        "platform": resolved.platform,
        "ok": not any(f.severity == "error" for f in findings),
        "findings": [f.to_json() for f in findings],
    }


def render_report(resolved: Resolved, findings: list[Finding], *, verbose: bool = False) -> str:
    shown = [f for f in findings if verbose or f.severity != "info" or f.code in (
        "memory-projection", "spec-implies-no-async", "no-dotenv", "vllm-parser-ok")]
    errors = sum(f.severity == "error" for f in findings)
    warnings = sum(f.severity == "warning" for f in findings)
    lines = [f"profile {resolved.profile} on {resolved.platform}"]
    lines += [f.render() for f in shown]
    verdict = "FAILED" if errors else "OK"
    lines.append(f"{verdict}: {errors} error(s), {warnings} warning(s)")
    return "\n".join(lines)

def check_profile(
    project: Project,
    resolved: Resolved,
    environ: Mapping[str, str],
    runner: Runner,
    *,
    deep: bool = False,
) -> list[Finding]:
    """`invoke check`: every rule, plus vLLM's own parser on the argv with `deep`."""
    findings, ctx = run_checks(project, resolved, environ)
    if deep and ctx.command is not None:
        parsed = vllm_parser.check_with_vllm_parser(project, runner, ctx.command.argv, resolved)
        if not [f for f in parsed if f.severity != "info"]:
            parsed.append(Finding("info", "vllm-parser-ok",
                                  f"vLLM {resolved.get('VLLM_VERSION')}'s own parser accepts the argv"))
        findings += parsed
    docker = resolved.get("DOCKER") or "docker"
    labels = build.read_image_labels(runner, docker, resolved.get("VLLM_IMAGE") or "")
    findings += build.image_label_findings(project, resolved, labels)
    return sort_findings(findings)

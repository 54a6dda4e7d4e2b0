"""Checks of the tuned Triton kernel configs (fused_moe_configs/, fp8_configs/): file names vLLM
can look up, valid JSON, and a device, tensor-parallel size and dtype that match this profile.

A new check goes here when it is about those shipped JSON files; vLLM ignores a mismatched file
silently, so every finding says which lookup the file misses.
"""

from __future__ import annotations

import json
import re

from vllmstack.checks.context import CheckContext
from vllmstack.config.modelinfo import ModelFacts
from vllmstack.core.findings import Finding

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
    tp = ctx.resolved.get_int("VLLM_TP")
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

"""The GPUs present compared with the platform's pins: GPU_COUNT, GPU_VRAM_GIB, GPU_ARCH and
GPU_DEVICE_NAME.

The cards come from the runtime layer's detection (runtime/gpu.py: amdgpu's sysfs counters, or
nvidia-smi), the AMD archs from the KFD topology (gfx_target_version: what rocminfo and amd-smi
report too, read without starting them). Only pinned values are compared: a value the platform
leaves open is taken from the card by `invoke check`.

FAIL only on positive evidence that the engine cannot run as pinned (another arch, fewer GPUs
than tensor parallel needs). A card that cannot be described at all is a WARN here: the missing
device guard and the devices check already say why.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllmstack.checks.capacity import VRAM_TOLERANCE
from vllmstack.checks.context import cards_in_use, pinned
from vllmstack.checks.host.amd import kfd_nodes, override_arch
from vllmstack.checks.host.model import FAIL, PASS, SKIP, WARN, HostCheck, HostView
from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError
from vllmstack.runtime.gpu import GIB, GpuInventory, detect_amd, detect_nvidia

TITLE = "GPUs vs the platform's pins"


def _pin(resolved: Resolved, key: str) -> str:
    return resolved.get_raw(key).strip() if pinned(resolved, key) else ""


def _where(resolved: Resolved, key: str) -> str:
    return f"{key}={resolved.get_raw(key)} (at {resolved.source(key)})"


def check_gpus(view: HostView, resolved: Resolved) -> HostCheck:
    vendor = resolved.get_str("GPU_VENDOR")
    if vendor not in ("amd", "nvidia"):
        return HostCheck("gpus", TITLE, SKIP, f"platform {resolved.platform} uses no GPU",
                         guard=True)
    inventory: GpuInventory | None
    nodes = None
    if vendor == "amd":
        inventory = detect_amd(view.root, unified_memory=resolved.get_bool("UNIFIED_MEMORY"))
        nodes = kfd_nodes(view)
    else:
        inventory = detect_nvidia(view.runner) if view.runner is not None else None
    pins = {k: _pin(resolved, k) for k in ("GPU_COUNT", "GPU_VRAM_GIB", "GPU_ARCH",
                                           "GPU_DEVICE_NAME")}
    data: dict[str, Any] = {
        "source": inventory.source if inventory else None,
        "cards": [{"index": c.index, "name": c.name or None,
                   "vram_gib": round(c.total_bytes / GIB, 2)} for c in (inventory.cards
                                                                        if inventory else ())],
        "kfd_nodes": [{"node": n.index, "arch": n.arch, "device_id": f"{n.device_id:#06x}"}
                      for n in nodes or []],
        "pins": {k: v or None for k, v in pins.items()}}
    if inventory is None and not nodes:
        tool = "nvidia-smi" if vendor == "nvidia" else "amdgpu's sysfs (mem_info_*, KFD topology)"
        return HostCheck("gpus", TITLE, WARN, f"{tool} describes no {vendor.upper()} GPU on this "
                         "host, so the pins cannot be compared", "run on the GPU host with the "
                         "driver loaded (see devices / nvidia-driver)", data, guard=True)
    fails: list[tuple[str, str]] = []
    warns: list[tuple[str, str]] = []
    found = len(inventory.cards) if inventory else len(nodes or [])
    # AMD: the arch the HIP runtime will report (an override replaces the card's own).
    override = override_arch(resolved.get_raw("HSA_OVERRIDE_GFX_VERSION"))
    archs = [override or n.arch for n in nodes or []]
    arch_pin = pins["GPU_ARCH"] if vendor == "amd" else ""
    if arch_pin and archs:
        found = archs.count(arch_pin)
        if not found:
            seen = ", ".join(sorted(set(archs)))
            fails.append((f"{_where(resolved, 'GPU_ARCH')} but the host's GPUs are {seen}"
                          + (f" (HSA_OVERRIDE_GFX_VERSION makes them {override})" if override
                             else ""),
                          f"use the platform made for {seen} (invoke profiles), or set GPU_ARCH="
                          f"{archs[0]} and rebuild the image; an RDNA3 card without kernels of "
                          "its own runs with HSA_OVERRIDE_GFX_VERSION=11.0.0"))
        # HIP numbers the GPU nodes of the KFD topology in order (CPU nodes left out).
        ours = [str(i) for i, a in enumerate(archs) if a == arch_pin]
        others = sorted({a for a in archs if a != arch_pin})
        visible = resolved.get_list("HIP_VISIBLE_DEVICES")
        chosen = [archs[int(v)] if v.isdigit() and int(v) < len(archs) else "no GPU"
                  for v in visible]
        if found and others and visible and any(a != arch_pin for a in chosen):
            fails.append((f"{_where(resolved, 'HIP_VISIBLE_DEVICES')} selects "
                          f"{', '.join(chosen)}; the {arch_pin} GPUs are HIP devices "
                          f"{','.join(ours)} (beside {', '.join(others)})",
                          f"set HIP_VISIBLE_DEVICES={','.join(ours)} and ROCR_VISIBLE_DEVICES="
                          f"{','.join(ours)}"))
        elif found and others and not visible:
            warns.append((f"besides {found} × {arch_pin} this host has {', '.join(others)} (an "
                          "integrated GPU?), which the engine may pick up",
                          f"set HIP_VISIBLE_DEVICES={','.join(ours)} (the {arch_pin} GPUs)"))
    try:
        tp = resolved.get_int("VLLM_TP")
    except StackError:
        tp = 1  # a bad value is `invoke check`'s finding, not the host's
    if not fails and tp > found:
        fails.append((f"VLLM_TP={tp} needs {tp} GPUs; {found} found",
                      f"set VLLM_TP={found or 1}, or use a platform with fewer GPUs"))
    count = pins["GPU_COUNT"]
    if count.isdigit() and int(count) > found and not fails:
        warns.append((f"{_where(resolved, 'GPU_COUNT')} but {found} GPU(s) found",
                      "use the platform that matches this host (invoke profiles)"))
    used = cards_in_use(resolved, inventory) if inventory else ()
    if used and pins["GPU_VRAM_GIB"]:
        card_gib = min(c.total_bytes for c in used) / GIB
        try:
            vram = float(pins["GPU_VRAM_GIB"])
        except ValueError:
            vram = card_gib
        if abs(vram - card_gib) > VRAM_TOLERANCE * card_gib:
            warns.append((f"{_where(resolved, 'GPU_VRAM_GIB')} but the card has {card_gib:.2f} GiB",
                          f"set GPU_VRAM_GIB={card_gib:.2f}, or remove it so the card's figure is "
                          "used (on unified memory the GPU's share follows ttm.pages_limit)"))
    names = {c.name for c in used if c.name}
    if pins["GPU_DEVICE_NAME"] and len(names) == 1 and pins["GPU_DEVICE_NAME"] not in names:
        warns.append((f"{_where(resolved, 'GPU_DEVICE_NAME')} but vLLM names this card "
                      f"{next(iter(names))}", f"set GPU_DEVICE_NAME={next(iter(names))}: tuned "
                      "configs are looked up by vLLM's name"))
    kinds = Counter((c.name or "unknown card", round(c.total_bytes / GIB, 1))
                    for c in (inventory.cards if inventory else ()))
    seen_text = "; ".join(f"{n} × {name} {gib:g} GiB" for (name, gib), n in sorted(kinds.items()))
    if archs:
        seen_text += f" ({', '.join(f'{n} × {a}' for a, n in sorted(Counter(archs).items()))})"
    source = inventory.source if inventory else "KFD topology"
    if fails or warns:
        status, items = (FAIL, fails) if fails else (WARN, warns)
        extra = f"; also: {'; '.join(w for w, _ in warns)}" if fails and warns else ""
        return HostCheck("gpus", TITLE, status,
                         f"{'; '.join(m for m, _ in items)}{extra} [{source}: {seen_text}]",
                         "; ".join(f for _, f in items), data, guard=True)
    pinned_text = ", ".join(f"{k}={v}" for k, v in pins.items() if v) or "nothing pinned"
    return HostCheck("gpus", TITLE, PASS, f"{source}: {seen_text}; matches {pinned_text}",
                     data=data, guard=True)

"""The router's memory store, generated/router/memory.json: per profile what this host measured
of it (per tier, its residue on the card and its wake times; from stopped, its load times) and
why its sleep fell back to restart, read into the plan's needs (`apply_store`).

The format since issue 37 keeps the figures per tier (`tiers`: {"kv-released": {"residue_bytes",
"wake_s"}, "asleep": {...}, "stopped": {"wake_s"}}); the one before it (`residue_bytes` with
`frees`: kv or all) is still read, as kv-released or level 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllmstack.core.files import JsonFileError, read_json_file, write_json
from vllmstack.core.paths import Project
from vllmstack.router.plan import ALL, KV, RESTART, SLEEP, STORE, Need
from vllmstack.router.tiers import HOST, KV_RELEASED, WAKES_KEPT, Tier


def store_path(project: Project) -> Path:
    return project.generated / "router" / STORE


def read_store(project: Project) -> dict[str, dict[str, Any]]:
    """Per profile: its measured residue, or why it swaps by restart after a failed release. A
    damaged file is ignored (it is rewritten at the next measurement)."""
    try:
        data = read_json_file(store_path(project))
    except JsonFileError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, dict)}


def write_store(project: Project, profile: str, **fields: Any) -> None:
    """Merge `fields` into the profile's entry; `tiers` ({tier: {"residue_bytes", "wake_s"}})
    is merged per tier, so one tier's figures never drop another's."""
    data = read_store(project)
    entry = dict(data.get(profile, {}))
    tiers = fields.pop("tiers", None)
    if isinstance(tiers, dict):
        kept = entry.get("tiers")
        merged: dict[str, Any] = dict(kept) if isinstance(kept, dict) else {}
        for name, figures in tiers.items():
            before = merged.get(name)
            merged[name] = {**(before if isinstance(before, dict) else {}), **figures}
        entry["tiers"] = merged
    data[profile] = {**entry, **fields, "at": time.time()}
    path = store_path(project)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)


def _stored_tiers(stored: Mapping[str, Any]) -> dict[Tier, dict[str, Any]]:
    """Per tier, what the store measured: the current format (`tiers`) over the format before
    issue 37 (`residue_bytes` with `frees`: kv is kv-released, all is level 1)."""
    found: dict[Tier, dict[str, Any]] = {}
    old = stored.get("residue_bytes")
    if isinstance(old, int) and not isinstance(old, bool) and old >= 0:
        found[KV_RELEASED if stored.get("frees", ALL) == KV else HOST] = {"residue": old}
    tiers = stored.get("tiers")
    for name, figures in (tiers.items() if isinstance(tiers, dict) else ()):
        if name not in {str(t) for t in Tier} or not isinstance(figures, dict):
            continue
        got = found.setdefault(Tier(name), {})
        residue = figures.get("residue_bytes")
        if isinstance(residue, int) and not isinstance(residue, bool) and residue >= 0:
            got["residue"] = residue
        wakes = figures.get("wake_s")
        if isinstance(wakes, list):
            got["wakes"] = tuple(float(w) for w in wakes[-WAKES_KEPT:]
                                 if isinstance(w, (int, float)) and not isinstance(w, bool)
                                 and math.isfinite(w) and w >= 0)
    return found


def apply_store(need: Need, stored: Mapping[str, Any]) -> Need:
    """A need with what the store says of its profile: the residue measured in each tier (a
    sleep that kept the weights holds more), the wake times measured per tier, or the
    fallback."""
    found = _stored_tiers(stored)
    first = need.sleep_tiers[0] if need.sleep_tiers else HOST
    if "residue" in found.get(first, {}):
        need = replace(need, residue=found[first]["residue"], measured=True)
    if first != HOST and "residue" in found.get(HOST, {}):
        need = replace(need, host_residue=found[HOST]["residue"], host_measured=True)
    wakes = {str(t): f["wakes"] for t, f in found.items() if f.get("wakes")}
    if wakes:
        need = replace(need, wakes=wakes)
    fallback = stored.get("fallback")
    if need.mode == SLEEP and isinstance(fallback, str) and fallback:
        need = replace(need, mode=RESTART,
                       why=f"{fallback} (recorded in generated/router/{STORE}; delete its entry "
                           "to try sleep again)")
    return need

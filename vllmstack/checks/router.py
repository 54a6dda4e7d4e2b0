"""The router's swap settings (ROUTER_SWAP, ROUTER_SLEEP_FREES): `sleep` forced where vLLM does
not sleep, and `kv` sleeps forced where they were not measured, are warnings, never errors (the
router then starts engines vLLM may refuse, or a Compose router refuses to start; a sleep that
does not release falls back to restart)."""

from __future__ import annotations

from vllmstack.checks.context import CheckContext
from vllmstack.config.engines.table import engine_kind
from vllmstack.core.findings import Finding

# Where vLLM's sleep mode works (its CuMemAllocator): CUDA, and ROCm.
SLEEP_VENDORS = ("nvidia", "amd")


def rule_router_swap(ctx: CheckContext) -> list[Finding]:
    out: list[Finding] = []
    vendor = ctx.resolved.get_str("GPU_VENDOR")
    if ctx.usable("ROUTER_SLEEP_FREES") and ctx.get("ROUTER_SLEEP_FREES") == "kv" \
            and vendor != "nvidia":
        out.append(ctx.finding(
            "warning", "sleep-kv-unmeasured", "ROUTER_SLEEP_FREES",
            f"ROUTER_SLEEP_FREES=kv with GPU_VENDOR={vendor}: a sleep that keeps the weights on "
            "the card was measured on CUDA only; where it does not release the KV cache the "
            "router's check after the sleep sends the profile back to restart",
            fix="ROUTER_SLEEP_FREES=auto (per engine: kv-released then level 1 on CUDA, "
                "vLLM's own level 1 elsewhere)"))
    if not ctx.usable("ROUTER_SWAP") or ctx.get("ROUTER_SWAP") != "sleep":
        return out
    if vendor not in SLEEP_VENDORS:
        out.append(ctx.finding(
            "warning", "sleep-unsupported", "ROUTER_SWAP",
            f"ROUTER_SWAP=sleep with GPU_VENDOR={vendor}: vLLM's sleep mode works on CUDA and "
            "ROCm only, so the router's engines may refuse --enable-sleep-mode or never free "
            "memory (the router then falls back to restart for that profile)",
            fix="ROUTER_SWAP=auto (sleep where vLLM supports it, restart elsewhere)"))
    kind = engine_kind(ctx.resolved)
    if not kind.sleeps:
        out.append(ctx.finding(
            "info", "sleep-llamacpp", "ROUTER_SWAP",
            f"ROUTER_SWAP=sleep: {kind.display} has no sleep mode, so the router swaps this profile by "
            "restart (a load takes about a second)"))
    if ctx.runtime not in ("native", "auto"):
        out.append(ctx.finding(
            "warning", "sleep-one-engine", "ROUTER_SWAP",
            f"ROUTER_SWAP=sleep with the {ctx.runtime} runtime, which runs one engine per "
            "checkout: `invoke router` refuses to start in sleep mode there",
            fix="RUNTIME=native (or invoke router --runtime native), or ROUTER_SWAP=auto"))
    return out

"""The router's swap setting (ROUTER_SWAP): `sleep` forced where vLLM does not sleep is a
warning, never an error (the router then starts engines vLLM may refuse, or a Compose router
refuses to start)."""

from __future__ import annotations

from vllmstack.checks.context import CheckContext
from vllmstack.core.findings import Finding

# Where vLLM's sleep mode works (its CuMemAllocator): CUDA, and ROCm.
SLEEP_VENDORS = ("nvidia", "amd")


def rule_router_swap(ctx: CheckContext) -> list[Finding]:
    if not ctx.usable("ROUTER_SWAP") or ctx.get("ROUTER_SWAP") != "sleep":
        return []
    out: list[Finding] = []
    vendor = ctx.resolved.get_str("GPU_VENDOR")
    if vendor not in SLEEP_VENDORS:
        out.append(ctx.finding(
            "warning", "sleep-unsupported", "ROUTER_SWAP",
            f"ROUTER_SWAP=sleep with GPU_VENDOR={vendor}: vLLM's sleep mode works on CUDA and "
            "ROCm only, so the router's engines may refuse --enable-sleep-mode or never free "
            "memory (the router then falls back to restart for that profile)",
            fix="ROUTER_SWAP=auto (sleep where vLLM supports it, restart elsewhere)"))
    if ctx.resolved.get_str("ENGINE") == "llamacpp":
        out.append(ctx.finding(
            "info", "sleep-llamacpp", "ROUTER_SWAP",
            "ROUTER_SWAP=sleep: llama.cpp has no sleep mode, so the router swaps this profile by "
            "restart (a load takes about a second)"))
    if ctx.runtime not in ("native", "auto"):
        out.append(ctx.finding(
            "warning", "sleep-one-engine", "ROUTER_SWAP",
            f"ROUTER_SWAP=sleep with the {ctx.runtime} runtime, which runs one engine per "
            "checkout: `invoke router` refuses to start in sleep mode there",
            fix="RUNTIME=native (or invoke router --runtime native), or ROUTER_SWAP=auto"))
    return out

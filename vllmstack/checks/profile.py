"""Checks of the profile itself: values, required keys, the serve argv, platform, .env overrides.

A new check goes here when it needs nothing beyond the settings and their provenance (no files,
no hardware, no model facts), e.g. "key X makes no sense together with key Y".
"""

from __future__ import annotations

from vllmstack.checks.context import CheckContext
from vllmstack.config.engines import vllm
from vllmstack.config.vllm_args import ArgvError
from vllmstack.core.findings import Finding


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
        ctx.command = vllm.build(ctx.resolved, ctx.placement)
    except ArgvError as exc:
        if ctx.bad_keys:
            return []  # the bad value is already reported, with its file and line
        return [Finding("error", "argv", str(exc), fix="fix the value named above")]
    return list(ctx.command.notes)


def rule_profile_platform(ctx: CheckContext) -> list[Finding]:
    platforms = ctx.resolved.get_list("PROFILE_PLATFORMS")
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

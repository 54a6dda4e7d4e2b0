"""`check` says whether the profile's next boot will find its torch.compile cache
(runtime.compile_cache: the key of what invalidates it, and the boots `up` recorded with it)."""

from __future__ import annotations

from vllmstack.checks.context import CheckContext
from vllmstack.core.findings import Finding
from vllmstack.runtime.compile_cache import (
    cache_has_compiles,
    compile_key,
    predict_next_boot,
    read_boots_with,
)
from vllmstack.runtime.engine_env import stack_paths

# What the verdict is called where `check` prints it.
SAID = {"warm": "should hit the compile cache", "cold": "will compile (a cold boot)",
        "eager": "compiles nothing", "unknown": "may or may not hit the compile cache"}


def rule_compile_cache(ctx: CheckContext) -> list[Finding]:
    if ctx.command is None:
        return []  # no argv: rule_argv says why
    key = compile_key(ctx.resolved, ctx.command.argv)
    boots = read_boots_with(ctx.project, key)
    filled = cache_has_compiles(stack_paths(ctx.resolved, ctx.environ).engine_cache)
    prediction = predict_next_boot(boots, filled)
    fix = None
    if prediction.verdict == "cold" and boots:
        fix = "`invoke startup --history 5` shows the recorded boots and their compile phases"
    return [ctx.finding(
        "info", "compile-cache", None,
        f"the next boot on the {ctx.runtime} runtime {SAID[prediction.verdict]}: "
        f"{prediction.reason} (compile key {key}; {len(boots)} recorded boot(s) with it)", fix)]

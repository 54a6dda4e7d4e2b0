"""Checks before boot: every problem we can find without starting the engine.

This module is the index: RULES lists every rule in the order the report shows them, and
`check_profile` (`invoke check`) runs them, with `--deep` also vLLM's own parser (deep.py).
Each rule is a function `rule_<what>(ctx) -> list[Finding]` in the module of its concern (see
the package docstring); findings name the key, the file:line that set it, and a fix.
A new rule: write it in its module, add it to RULES here, and add a test in tests/test_checks.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllmstack.checks import deep as vllm_parser
from vllmstack.checks.capacity import rule_memory, rule_parallelism
from vllmstack.checks.context import CheckContext, Rule, build_context
from vllmstack.checks.files import rule_files_exist
from vllmstack.checks.pins import rule_overlays, rule_pins
from vllmstack.checks.profile import (
    rule_argv,
    rule_dotenv_overrides,
    rule_profile_platform,
    rule_profile_problems,
    rule_required,
)
from vllmstack.checks.rocm import rule_rocm
from vllmstack.checks.scheduler import rule_scheduler, rule_spec_decode
from vllmstack.checks.tuned_configs import rule_tuned_configs
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema
from vllmstack.core.findings import Finding, sort_findings
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.image import build

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
    ctx = build_context(project, resolved, environ, schema=schema, runtime=runtime)
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
    docker = resolved.get_str("DOCKER")
    labels = build.read_image_labels(runner, docker, resolved.get("VLLM_IMAGE") or "")
    findings += build.image_label_findings(project, resolved, labels)
    return sort_findings(findings)

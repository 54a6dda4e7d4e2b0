"""Checks before boot: every problem we can find without starting the engine.

This module is the index: RULES lists every rule in the order the report shows them, and
`check_profile` (`invoke check`) runs them, with `--deep` also vLLM's own parser (deep.py).
Each rule is a function `rule_<what>(ctx) -> list[Finding]` in the module of its concern (see
the package docstring); findings name the key, the file:line that set it, and a fix.
A rule applies to every engine unless RULE_ENGINES names the engines it is for (the vLLM argv,
scheduler and memory rules; llamacpp.py's rules), so no rule tests ENGINE itself.
A new rule: write it in its module, add it to RULES here (and to RULE_ENGINES when it is about
one engine), and add a test in tests/test_checks.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from vllmstack.checks import deep as vllm_parser
from vllmstack.checks.capacity import rule_detected_gpus, rule_memory, rule_parallelism
from vllmstack.checks.compile_cache import rule_compile_cache
from vllmstack.checks.context import CheckContext, Rule, build_context
from vllmstack.checks.files import rule_files_exist
from vllmstack.checks.inputs import (
    rule_bind_addresses,
    rule_engine_env,
    rule_env_file_values,
    rule_mount_paths,
    rule_profile_host_keys,
)
from vllmstack.checks.kv_scales import rule_cpu_fp8_kv, rule_kv_scales
from vllmstack.checks.llamacpp import (
    rule_gguf_arch,
    rule_gguf_files,
    rule_llamacpp_argv,
    rule_llamacpp_context,
    rule_llamacpp_memory,
    rule_llamacpp_required,
    rule_llamacpp_settings,
)
from vllmstack.checks.pins import rule_overlays, rule_pins
from vllmstack.checks.profile import (
    rule_argv,
    rule_dotenv_overrides,
    rule_profile_platform,
    rule_profile_problems,
    rule_required,
)
from vllmstack.checks.rdna4 import rule_fp8_kv_backend, rule_rccl_ll_protocol, with_image_labels
from vllmstack.checks.rocm import rule_rocm
from vllmstack.checks.router import rule_router_swap
from vllmstack.checks.scheduler import rule_scheduler, rule_spec_decode
from vllmstack.checks.template import rule_chat_template
from vllmstack.checks.tuned_configs import rule_tuned_configs
from vllmstack.config.engines import llamacpp, vllm
from vllmstack.config.engines.table import DEFAULT, engine_kind
from vllmstack.config.engines.table import ENGINES as KINDS
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema
from vllmstack.core.errors import StackError
from vllmstack.core.findings import Finding, sort_findings
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner, mask_text
from vllmstack.image import build
from vllmstack.runtime.select import engine_placement, image_client

RULES: tuple[Rule, ...] = (
    rule_profile_problems,
    rule_required,
    rule_llamacpp_required,
    rule_argv,
    rule_llamacpp_argv,
    rule_profile_platform,
    rule_dotenv_overrides,
    rule_env_file_values,
    rule_mount_paths,
    rule_bind_addresses,
    rule_engine_env,
    rule_profile_host_keys,
    rule_files_exist,
    rule_chat_template,
    rule_gguf_files,
    rule_gguf_arch,
    rule_llamacpp_context,
    rule_llamacpp_settings,
    rule_spec_decode,
    rule_scheduler,
    rule_detected_gpus,
    rule_parallelism,
    rule_memory,
    rule_llamacpp_memory,
    rule_tuned_configs,
    rule_kv_scales,
    rule_cpu_fp8_kv,
    rule_rocm,
    rule_rccl_ll_protocol,
    rule_fp8_kv_backend,
    rule_pins,
    rule_overlays,
    rule_router_swap,
    rule_compile_cache,  # after rule_argv: it keys the argv that rule built
)
ENGINES = tuple(KINDS)
_VLLM = (vllm.KIND.name,)
_LLAMACPP = (llamacpp.KIND.name,)
# The engines a rule is for; a rule not listed applies to every engine.
RULE_ENGINES: Mapping[Rule, tuple[str, ...]] = MappingProxyType({
    rule_required: _VLLM,  # VLLM_MODEL; rule_llamacpp_required asks for LLAMACPP_MODEL instead
    rule_argv: _VLLM,
    rule_files_exist: _VLLM,
    rule_kv_scales: _VLLM,
    rule_cpu_fp8_kv: _VLLM,
    rule_chat_template: _VLLM,
    rule_spec_decode: _VLLM,
    rule_scheduler: _VLLM,
    rule_parallelism: _VLLM,
    rule_memory: _VLLM,
    rule_tuned_configs: _VLLM,
    rule_pins: _VLLM,
    rule_overlays: _VLLM,
    rule_rccl_ll_protocol: _VLLM,  # vLLM's tensor parallelism all-reduces through RCCL
    rule_fp8_kv_backend: _VLLM,
    rule_compile_cache: _VLLM,  # llama.cpp compiles nothing at boot
    rule_llamacpp_required: _LLAMACPP,
    rule_llamacpp_argv: _LLAMACPP,
    rule_gguf_files: _LLAMACPP,
    rule_gguf_arch: _LLAMACPP,
    rule_llamacpp_context: _LLAMACPP,
    rule_llamacpp_settings: _LLAMACPP,
    rule_llamacpp_memory: _LLAMACPP,
})


def applies(rule: Rule, engine: str) -> bool:
    return engine in RULE_ENGINES.get(rule, ENGINES)


def run_checks(
    project: Project,
    resolved: Resolved,
    environ: Mapping[str, str],
    *,
    rules: tuple[Rule, ...] = RULES,
    schema: Schema | None = None,
    runtime: str | None = None,
    runner: Runner | None = None,
) -> tuple[list[Finding], CheckContext]:
    """Every rule of the profile's engine; with a `runner`, the host's GPUs fill in what the
    platform does not pin."""
    ctx = build_context(project, resolved, environ, schema=schema, runtime=runtime, runner=runner)
    findings: list[Finding] = []
    try:
        # The argv is built once, for where it runs: the one `up` records and the runtime starts.
        ctx.placement = engine_placement(project, resolved, environ, ctx.runtime)
    except StackError as exc:
        findings.append(Finding("error", "argv", exc.cause, fix=exc.fix))
    for rule in rules:
        if applies(rule, ctx.engine):
            findings.extend(rule(ctx))
    # A message may quote a value (".env overrides ..."): never a token's.
    secrets = resolved.secrets()
    findings = [replace(f, message=mask_text(f.message, secrets),
                        fix=mask_text(f.fix, secrets) if f.fix else f.fix) for f in findings]
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
        "memory-projection", "spec-implies-no-async", "no-dotenv", "vllm-parser-ok", "gpu-detected",
        "gpu-not-detected", "gguf-header", "llamacpp-memory-projection", "compile-cache")]
    errors = sum(f.severity == "error" for f in findings)
    warnings = sum(f.severity == "warning" for f in findings)
    kind = engine_kind(resolved)
    lines = [f"profile {resolved.profile} on {resolved.platform}"
             + ("" if kind is DEFAULT else f" ({kind.display})")]
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
    runtime: str | None = None,
) -> list[Finding]:
    """`invoke check`: every rule, plus vLLM's own parser on the argv with `deep`; `runtime`
    (native, compose, ...) as `up --runtime` would use, for the rules that depend on it."""
    findings, ctx = run_checks(project, resolved, environ, runner=runner, runtime=runtime)
    if not engine_kind(resolved).vllm_cli:
        # The vLLM parser and the vLLM image's labels say nothing about llama-server.
        if deep:
            findings.append(Finding("info", "deep-vllm-only",
                                    "--deep runs vLLM's own parser; a llama.cpp profile has no "
                                    "vLLM argv to parse"))
        return sort_findings(findings)
    if deep and ctx.command is not None:
        argv = ctx.placement.unplace(ctx.command.argv, vllm.ENTRYPOINT[0])
        parsed = vllm_parser.check_with_vllm_parser(project, runner, argv, resolved)
        if not [f for f in parsed if f.severity != "info"]:
            parsed.append(Finding("info", "vllm-parser-ok",
                                  f"vLLM {resolved.get('VLLM_VERSION')}'s own parser accepts the argv"))
        findings += parsed
    findings, labels = with_engine_image(findings, ctx, runner)
    findings += [_missing_image_for_containers(f, ctx) for f in
                 build.image_label_findings(project, resolved, labels)]
    return sort_findings(findings)


def with_engine_image(findings: list[Finding], ctx: CheckContext, runner: Runner,
                      flavour: str | None = None) -> tuple[list[Finding], dict[str, str] | None]:
    """The rules that read the engine image's build labels (checks/rdna4: the GPU archs it has
    code objects for, its ROCm release's RCCL) applied to `run_checks`' findings, and the labels
    (None: no such image). `check` and `up`'s preflight both call this, so an image that would
    abort on the card is refused before boot by either. `flavour`: the concrete runtime (podman
    keeps its own image store), else the context's runtime."""
    client = image_client(ctx.resolved, flavour or ctx.runtime)
    labels = build.read_image_labels(runner, client, ctx.get("VLLM_IMAGE"))
    return with_image_labels(findings, ctx.resolved, labels), labels


def _missing_image_for_containers(finding: Finding, ctx: CheckContext) -> Finding:
    """Without its image a container runtime cannot start the engine: a warning, with the build
    command. The native runtime runs no image, so there it stays information."""
    if finding.code != "image-missing" or ctx.runtime == "native":
        return finding
    build_it = f"invoke build --platform {ctx.resolved.platform}"
    return replace(finding, severity="warning",
                   message=f"{ctx.resolved.get('VLLM_IMAGE')} does not exist: `invoke up` on the "
                           f"{ctx.runtime} runtime needs it",
                   fix=build_it + ("   (or run natively: invoke install-engine --platform "
                                   f"{ctx.resolved.platform}; invoke up --runtime native)"
                                   if ctx.get("GPU_VENDOR") == "none" else ""))

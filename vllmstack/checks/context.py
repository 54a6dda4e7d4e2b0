"""What every check rule receives: the CheckContext, and how `run_checks` builds it.

A rule is a function `(ctx) -> list[Finding]`. The context holds the resolved settings, the
schema, the model's facts and the environment, plus helpers that read a setting without raising
(`ctx.int`, `ctx.float` give None for a bad value) and `ctx.usable(...)`, which tells a rule to
stay quiet when a setting it builds on already failed validation. Add a helper here only when
several rule modules need it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from vllmstack.config.modelinfo import ModelFacts, load_model_facts
from vllmstack.config.profiles import Resolved
from vllmstack.config.schema import Schema, load_schema
from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project


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
        """The raw text of a setting, "" when unset (no schema default: rules validate it)."""
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
        return self.runtime_name or self.resolved.get_str("RUNTIME")

    @property
    def is_amd(self) -> bool:
        return self.get("GPU_VENDOR") == "amd"

    @property
    def arch(self) -> str:
        return self.get("GPU_ARCH")


Rule = Callable[[CheckContext], list[Finding]]


def build_context(
    project: Project,
    resolved: Resolved,
    environ: Mapping[str, str],
    *,
    schema: Schema | None = None,
    runtime: str | None = None,
) -> CheckContext:
    """The context for one run of the rules: the model's facts are read once, here."""
    return CheckContext(project, resolved, schema or load_schema(),
                        load_model_facts(resolved, environ), environ, runtime_name=runtime)

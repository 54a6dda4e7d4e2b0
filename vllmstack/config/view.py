"""Text and JSON views of resolved settings (`invoke config`, `invoke profiles`)."""

from __future__ import annotations

import json
import shlex

from vllmstack.config.engines.kind import Placement
from vllmstack.config.engines.table import engine_kind
from vllmstack.config.profiles import ProfileInfo, Resolved
from vllmstack.config.vllm_args import ArgvError
from vllmstack.core.errors import StackError
from vllmstack.core.runner import MASK, is_secret_name, mask_argv, mask_text


class ConfigError(StackError):
    """The resolved settings cannot be shown as asked (the argv cannot be built)."""


def shown_values(resolved: Resolved) -> dict[str, str]:
    """What `invoke config` prints for each setting: a secret's value never (*** when set), nor
    a token inside another value (VLLM_EXTRA_ARGS='--api-key ***')."""
    secrets = resolved.secrets()
    return {k: MASK if s.value and is_secret_name(k) else mask_text(s.value, secrets)
            for k, s in sorted(resolved.values.items())}


def explain_table(resolved: Resolved) -> dict[str, dict[str, str]]:
    shown = shown_values(resolved)
    return {k: {"value": shown[k], "source": s.source} for k, s in sorted(resolved.values.items())}


def render_config(
    resolved: Resolved, *, explain: bool = False, vllm_args: bool = False, as_json: bool = False
) -> str:
    if vllm_args:
        try:
            # The engine's own command: llama-server's for a llama.cpp profile (as `up` renders it).
            command = engine_kind(resolved).build(resolved, Placement())
        except ArgvError as exc:
            raise ConfigError(str(exc), exc.fix) from exc
        # A token given through VLLM_EXTRA_ARGS (--api-key) is masked; generated/vllm-argv.txt
        # (mode 0600) keeps the real line.
        argv = mask_argv(command.argv)
        masked = [mask_text(word, resolved.secrets()) for word in argv]
        return json.dumps(masked, indent=2) if as_json else shlex.join(masked)
    if explain:
        table = explain_table(resolved)
        if as_json:
            return json.dumps(table, indent=2)
        width = max(len(k) for k in table)
        lines = [f"{k:<{width}}  {v['value']!r:<40}  {v['source']}" for k, v in table.items()]
        # What the layers got wrong (an EXTENDS loop, a layer not read) explains values too.
        problems = [f.render() for f in resolved.problems if f.severity != "info"]
        if problems:
            lines += ["", f"{len(problems)} problem(s) in these layers (`invoke check` lists "
                      "every check):", *problems]
        return "\n".join(lines)
    values = shown_values(resolved)
    if as_json:
        return json.dumps(values, indent=2)
    header = f"# platform={resolved.platform} profile={resolved.profile}"
    return "\n".join([header, *(f"{k}={printable(v)}" for k, v in values.items())])


def printable(value: str) -> str:
    """`value` with every character a terminal would act on (newline, escape sequences, bidi
    overrides) written as its escape, so one setting is one line and shows what it holds."""
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in value)


def render_profiles(infos: list[ProfileInfo]) -> str:
    lines: list[str] = []
    for kind, title in (("platform", "Platforms (--platform)"), ("model", "Model profiles (--model)")):
        group = [i for i in infos if i.kind == kind]
        if not group:
            continue
        width = max(len(i.name) for i in group)
        lines.append(title)
        for info in group:
            extra = f"  [{', '.join(info.platforms)}]" if info.platforms else ""
            lines.append(f"  {info.name:<{width}}  {info.description}{extra}")
        lines.append("")
    return "\n".join(lines).rstrip()

"""`invoke template-check`: which template a profile serves with, and its tokenizer for the
token-waste column; the properties themselves are checks/template.py's (so `invoke check` runs
them too).

The template is `--template PATH`, else the profile's VLLM_CHAT_TEMPLATE under chat-templates/,
else the model's own (chat_template.jinja or tokenizer_config.json beside the tokenizer, found
on disk or in the local Hugging Face cache; nothing is downloaded).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllmstack.bench.workload.prompts import TokenizerError, load_tokenizer, resolve_tokenizer
from vllmstack.checks.chat_render import ChatTemplate, TemplateError
from vllmstack.checks.template import (
    TEMPLATE_DIR,
    Counter,
    TemplateReport,
    check_template,
    model_template,
    profile_kwargs,
    profile_parser,
    profile_template,
    read_template,
    shipped_names,
)
from vllmstack.config.modelinfo import profile_hf_cache
from vllmstack.config.profiles import Resolved
from vllmstack.core.paths import Project


def run_template_check(project: Project, environ: Mapping[str, str], *,
                       resolved: Resolved | None, template: str | None = None,
                       parser: str | None = None, kwargs: str | None = None) -> TemplateReport:
    """The report of one template: `template` (a path) or the profile's; the profile gives the
    tool-call parser, the default kwargs and the tokenizer unless `parser`/`kwargs` say."""
    notes: list[str] = []
    if template:
        chosen = read_template(_path(project, template), template)
    elif resolved is not None:
        chosen = _profile_template(project, resolved, environ)
    else:
        raise TemplateError("no template to check", "pass --template PATH or --model PROFILE")
    defaults = _kwargs(kwargs) if kwargs is not None else (
        profile_kwargs(resolved) if resolved is not None else {})
    tool_parser = parser or (profile_parser(resolved) if resolved is not None else None)
    counter = None
    if resolved is not None:
        counter, note = _token_counter(resolved, environ)
        notes += [note] if note else []
    else:
        notes.append("token waste not measured: no profile, so no tokenizer (add --model)")
    report = check_template(chosen, parser=tool_parser, kwargs=defaults, count_tokens=counter)
    report.notes += notes
    return report


def _path(project: Project, given: str) -> Path:
    path = Path(given).expanduser()
    return path if path.is_absolute() or path.exists() else project.root / path


def _profile_template(project: Project, resolved: Resolved,
                      environ: Mapping[str, str]) -> ChatTemplate:
    path = profile_template(project, resolved)
    if path is not None:
        if not path.is_file():
            raise TemplateError(
                f"VLLM_CHAT_TEMPLATE={path.name} ({resolved.source('VLLM_CHAT_TEMPLATE')}): "
                f"{TEMPLATE_DIR}/{path.name} does not exist",
                f"use one of: {shipped_names(path.parent)}, or leave it empty for the model's own")
        return read_template(path, f"{TEMPLATE_DIR}/{path.name}")
    spec = resolved.get_str("VLLM_TOKENIZER") or resolved.get_str("VLLM_MODEL")
    try:
        folder = resolve_tokenizer(spec, environ, profile_hf_cache(resolved)).parent
    except TokenizerError as exc:
        raise TemplateError(
            f"profile {resolved.profile} sets no VLLM_CHAT_TEMPLATE and its model's own template "
            f"is not on this machine: {exc.cause}",
            "pass --template PATH, or fetch the model into the Hugging Face cache first") from exc
    source = model_template(folder)
    if source is None:
        raise TemplateError(f"{folder} has no chat template (no chat_template.jinja, no "
                            "chat_template in tokenizer_config.json)", "pass --template PATH")
    return ChatTemplate(source, f"{spec} (the model's own template)")


def _kwargs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError as exc:
        raise TemplateError(f"--kwargs {text!r} is not JSON: {exc}",
                            "write a JSON object, e.g. --kwargs '{\"tool_call_format\": \"xml\"}'") from exc
    if not isinstance(value, dict):
        raise TemplateError(f"--kwargs {text!r} is not a JSON object", "write {\"name\": value, ...}")
    return value


def _token_counter(resolved: Resolved, environ: Mapping[str, str]) -> tuple[Counter | None, str]:
    """The profile's tokenizer as a counter, or why there is none (never a download)."""
    spec = resolved.get_str("VLLM_TOKENIZER") or resolved.get_str("VLLM_MODEL")
    try:
        tokenizer = load_tokenizer(resolve_tokenizer(spec, environ, profile_hf_cache(resolved)))
    except TokenizerError as exc:
        return None, f"token waste not measured: {exc.cause}"

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count, ""

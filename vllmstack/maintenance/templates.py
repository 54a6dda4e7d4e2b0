"""`invoke template-check`: which template a profile serves with, and its tokenizer for the
token-waste column; the properties themselves are checks/template.py's (so `invoke check` runs
them too).

The template is `--template PATH`, else the profile's VLLM_CHAT_TEMPLATE under chat-templates/,
else the model's own (chat_template.jinja or tokenizer_config.json beside the tokenizer, found
on disk or in the local Hugging Face cache; nothing is downloaded). Whichever it is, it is read
with the checks' guards and rendered in their bounded child (checks/chat_render.py's LIMITS).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllmstack.checks.chat_render import LIMITS, TemplateError, read_template_text
from vllmstack.checks.template import (
    TEMPLATE_DIR,
    Counter,
    TemplateReport,
    check_source,
    profile_kwargs,
    profile_parser,
    profile_template,
    read_template_source,
    shipped_names,
)
from vllmstack.config.modelinfo import profile_hf_cache
from vllmstack.config.profiles import Resolved
from vllmstack.core.files import parse_json
from vllmstack.core.paths import Project
from vllmstack.workload.prompts import TokenizerError, load_tokenizer, resolve_tokenizer


def run_template_check(project: Project, environ: Mapping[str, str], *,
                       resolved: Resolved | None, template: str | None = None,
                       parser: str | None = None, kwargs: str | None = None) -> TemplateReport:
    """The report of one template: `template` (a path) or the profile's; the profile gives the
    tool-call parser, the default kwargs and the tokenizer unless `parser`/`kwargs` say."""
    notes: list[str] = []
    if template:
        chosen = read_template_source(_path(project, template), template), template
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
    report = check_source(*chosen, parser=tool_parser, kwargs=defaults, count_tokens=counter)
    report.notes += notes
    return report


def _path(project: Project, given: str) -> Path:
    path = Path(given).expanduser()
    return path if path.is_absolute() or path.exists() else project.root / path


def _profile_template(project: Project, resolved: Resolved,
                      environ: Mapping[str, str]) -> tuple[str, str]:
    """(the template's text, its name in the report)."""
    path = profile_template(project, resolved)
    if path is not None:
        if not path.exists():  # a FIFO or a device there is refused, by name, as it is read
            raise TemplateError(
                f"VLLM_CHAT_TEMPLATE={path.name} ({resolved.source('VLLM_CHAT_TEMPLATE')}): "
                f"{TEMPLATE_DIR}/{path.name} does not exist",
                f"use one of: {shipped_names(path.parent)}, or leave it empty for the model's own")
        shown = f"{TEMPLATE_DIR}/{path.name}"
        return read_template_source(path, shown), shown
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
    return source, f"{spec} (the model's own template)"


def model_template(folder: Path) -> str | None:
    """The model's own template from its tokenizer files: chat_template.jinja, else
    tokenizer_config.json's chat_template (a string, or named templates: the "default" one);
    both are read with the template guards (a regular file of bounded size)."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return read_template_text(jinja, str(jinja), missing_fix="pass --template PATH")
    config = folder / "tokenizer_config.json"
    if not config.exists():
        return None
    text = read_template_text(config, str(config), missing_fix="pass --template PATH",
                              max_bytes=16 * LIMITS.file_bytes)  # added tokens can make it large
    try:
        data = parse_json(text)
    except ValueError:
        return None
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


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

"""Broken variants of chat-templates/qwen3.jinja, each with one defect seen in real templates.

Each is the shipped template with one passage replaced; the passage must be there (a changed
template must update its variant here, or the tests that use it fail loudly)."""

from __future__ import annotations

from helpers import ROOT

SHIPPED = ROOT / "chat-templates" / "qwen3.jinja"

# name -> (passage of the shipped template, what replaces it), and the property it breaks.
VARIANTS: dict[str, tuple[str, str, str]] = {
    # Qwen's own templates: an earlier turn without reasoning loses its (empty) think block, so
    # the thinking-off generation prompt's "<think>\n\n</think>\n\n" is gone next turn.
    "drops-empty-think": (
        "{{- '<|im_start|>assistant\\n<think>\\n' ~ reasoning.strip('\\n') ~ '\\n</think>\\n\\n'"
        " ~ content -}}",
        "{{- '<|im_start|>assistant\\n' ~ (('<think>\\n' ~ reasoning.strip('\\n') ~ '\\n</think>\\n\\n')"
        " if reasoning.strip('\\n') else '') ~ content -}}",
        "prefix-stable"),
    "ignores-enable-thinking": (
        "{%- set thinking = not (", "{%- set thinking = true or not (", "thinking-off"),
    "never-shows-tools": ("    {{- tool_section() -}}\n", "", "tools"),
    # Tool results cut to a fixed length (long JSON results lose their tail).
    "truncates-tool-results": (
        "{{- '\\n<tool_response>\\n' ~ text_of(message.content) ~ '\\n</tool_response>' -}}",
        "{{- '\\n<tool_response>\\n' ~ text_of(message.content)[:400] ~ '\\n</tool_response>' -}}",
        "tools"),
    # `| length` of a null content: a TypeError, as `message.content + ...` would be.
    "fails-on-null-content": (
        "{%- set content = text_of(message.content) -%}",
        "{%- set content = text_of(message.content) ~ ('' if message.content | length else '') -%}",
        "renders"),
}


def variant(name: str) -> str:
    """The shipped template with the defect `name`."""
    passage, replacement, _ = VARIANTS[name]
    source = SHIPPED.read_text(encoding="utf-8")
    assert source.count(passage) == 1, f"{name}: the shipped template no longer has {passage!r}"
    return source.replace(passage, replacement)

"""The upkeep tasks: template-check (and update-check), re-exported by tasks.py."""

from __future__ import annotations

import os

from invoke.context import Context

from vllmstack.cli.common import JSON_HELP, PROFILE_HELP, Opt, Sets, print_json, project_here, resolve_here
from vllmstack.cli.task import exit_with, stack_task


@stack_task(iterable=["set"], help={
    **PROFILE_HELP, **JSON_HELP,
    "template": "a template file to check (default: the profile's VLLM_CHAT_TEMPLATE, else the "
                "model's own)",
    "tool_parser": "the --tool-call-parser whose reading of rendered calls is checked "
                   "(default: the profile's)",
    "kwargs": "chat-template kwargs as JSON (default: the profile's VLLM_CHAT_TEMPLATE_KWARGS)"})
def template_check(c: Context, template: Opt = None, model: Opt = None, platform: Opt = None,
                   set: Sets = None, tool_parser: Opt = None, kwargs: Opt = None,
                   json: bool = False) -> None:
    """Render a chat template as vLLM does over a built-in corpus; exit 1 naming a broken property."""
    from vllmstack.checks.template import render_report
    from vllmstack.maintenance.templates import run_template_check

    # With only --template, no profile is needed (and none is resolved unless asked for).
    resolved = resolve_here(model, platform, set) if (model or platform or set or not template) else None
    report = run_template_check(project_here(), os.environ, resolved=resolved, template=template,
                                parser=tool_parser, kwargs=kwargs)
    print_json(report.as_json()) if json else print(render_report(report))
    exit_with(1 if report.failed else 0)

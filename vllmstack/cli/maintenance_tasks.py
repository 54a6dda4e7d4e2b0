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


@stack_task(iterable=["set", "repo", "patches"], help={
    **PROFILE_HELP, **JSON_HELP,
    "model": "check only this profile's argv against the candidate's parser (default: every "
             "vLLM profile); the pins come from .env and --set either way",
    "repo": "NAME=PATH_OR_URL: list and verify NAME (vllm, aiter, flash-attention, llamacpp) "
            "from this repository instead of <NAME>_REPO (a local mirror works offline)",
    "patches": "NAME=DIR: verify this patch folder instead of patches/NAME",
    "offline": "ask no network source (git hosts, the package index, registries, GitHub): "
               "they report unknown (offline); local repositories still answer",
    "download": "fetch the newest vLLM's sdist from the index when its git host is not "
                "mirrored here, to verify the patches on it",
    "deep": "create the newest vLLM's parser environment when it is missing (downloads the "
            "wheel once, as check --deep does) to check every profile's argv against it",
    "write_plan": "also write the bump (pins, patches to drop) as a diff to review and git apply"})
def update_check(c: Context, model: Opt = None, platform: Opt = None, set: Sets = None,
                 repo: Sets = None, patches: Sets = None, offline: bool = False,
                 download: bool = False, deep: bool = False, write_plan: bool = False,
                 json: bool = False) -> None:
    """Compare the pins with upstream, read-only: candidates, patches and argv at the newest,
    the watchlist; a report under results/updates/."""
    import sys

    from vllmstack.cli.common import make_runner
    from vllmstack.image.patches import parse_component_pairs
    from vllmstack.maintenance import update_report, updates

    project = project_here()
    options = updates.Options(repos=parse_component_pairs(repo or [], "--repo"),
                              patch_dirs=parse_component_pairs(patches or [], "--patches"),
                              offline=offline, download=download, deep=deep,
                              profiles=[model] if model else (), sets=set or ())
    report = updates.run_update_check(project, resolve_here(model, platform, set), make_runner(False),
                                      os.environ, options)
    written = update_report.write_report(project, report, plan=write_plan)
    print_json(report.as_json()) if json else print(update_report.render_markdown(report))
    print("wrote " + ", ".join(str(p.relative_to(project.root)) for p in written), file=sys.stderr)

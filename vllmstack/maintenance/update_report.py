"""What `invoke update-check` writes: the Markdown report under results/updates/, and with
--write-plan the bump as a unified diff (pins in .env.example or the schema's defaults, the
patches that became upstream deleted) that `git apply` takes after review. Nothing here edits
a pin."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path

from vllmstack.core.files import write_json, write_text
from vllmstack.core.paths import Project
from vllmstack.maintenance.updates import COMPONENTS, ComponentUpdate, UpdateReport
from vllmstack.maintenance.watchlist import DEFAULT_REPO

REPORT_DIR = "updates"
SHOWN = 8  # candidates listed in the table; the JSON has all
SCHEMA = Path("vllmstack") / "config" / "schema.yaml"


@dataclass
class Plan:
    """The bump as edits: (file, key, old value, new value) and patches to delete."""

    pins: list[tuple[str, str, str, str]] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def report_paths(project: Project, day: str) -> tuple[Path, Path, Path]:
    folder = project.results / REPORT_DIR
    return (folder / f"{day}-update-check.md", folder / f"{day}-update-check.json",
            folder / f"{day}-bump.diff")


def write_report(project: Project, report: UpdateReport, *, plan: bool) -> list[Path]:
    markdown, data, diff = report_paths(project, report.day)
    markdown.parent.mkdir(parents=True, exist_ok=True)
    write_text(markdown, render_markdown(report), 0o644)
    write_json(data, report.as_json())
    written = [markdown, data]
    if plan:
        write_text(diff, render_plan(project, bump_plan(report)), 0o644)
        written.append(diff)
    return written


# --- Markdown ----------------------------------------------------------------------------------

def render_markdown(report: UpdateReport) -> str:
    lines = [f"# Update check, {report.day}", "",
             "Read-only: `invoke update-check` changed nothing. "
             + ("Run offline: every source that needs the network says \"unknown (offline)\"."
                if report.offline else "Sources that did not answer say \"unknown\"."), "",
             "## Pins and candidates", "",
             "| component | pinned | newest candidate | newer (newest first) | looked up |",
             "|---|---|---|---|---|"]
    for c in report.components:
        newer = ", ".join(x.ref for x in c.candidates[:SHOWN])
        newer += f" (+{len(c.candidates) - SHOWN} more)" if len(c.candidates) > SHOWN else ""
        if not c.candidates:
            newer = "none" if c.known else "unknown (offline)"
        lookups = "; ".join(f"{k}: {v}" for k, v in c.lookups.items())
        lines.append(f"| {c.name} | `{c.pinned}` ({c.key}) | "
                     f"{('`' + c.newest.ref + '`') if c.newest else '-'} | {newer} | {_cell(lookups)} |")
    for c in report.components:
        if c.newest is not None and c.name not in ("rocm-image",):
            lines += ["", *_component_section(c)]
    lines += ["", *_deep_section(report), "", "## Watchlist (AGENTS.md)", "",
              "| item | upstream | state |", "|---|---|---|"]
    for item in report.watch:
        refs = item.references or []
        names = [f"#{n}" if r == DEFAULT_REPO else f"{r}#{n}" for r, n in refs]
        states = ", ".join(f"{name}: {item.states.get(f'{r}#{n}', {}).get('state', 'unknown')}"
                           for name, (r, n) in zip(names, refs, strict=True)) or "-"
        lines.append(f"| {_cell(item.summary())} | {', '.join(names) or '-'} | {states} |")
    lines += ["", "## Next", "",
              "1. Drop the `upstream` patches, rebase the `fails` ones, re-derive drifted overlays.",
              "2. `invoke update-check --write-plan` writes the bump as a diff beside this report; "
              "review it, then `git apply` it.",
              "3. `invoke check --deep` every profile, `invoke build`, then the benchmarks and probes "
              "(AGENTS.md, bump checklist)."]
    return "\n".join(lines) + "\n"


def _component_section(c: ComponentUpdate) -> list[str]:
    newest = c.newest
    assert newest is not None
    lines = [f"## {c.name} at `{newest.ref}`", "", c.verification_note or "not verified", ""]
    data = c.verification or {}
    if data.get("patches"):
        lines += ["| patch | status | detail |", "|---|---|---|"]
        lines += [f"| {p['name']} | **{p['status']}** | {_cell(p['detail'])} |" for p in data["patches"]]
        lines.append("")
    if data.get("overlays"):
        lines += ["| overlay | status | detail |", "|---|---|---|"]
        lines += [f"| {o['name']} | **{o['status']}** | {_cell(o['detail'])} |" for o in data["overlays"]]
        lines.append("")
    lines.append(f"Droppable (already upstream): {', '.join(c.droppable) or 'none'}.")
    if c.failing:
        lines.append(f"Failing (rebase): {'; '.join(c.failing)}.")
    if c.drifted:
        lines.append(f"Drifted overlays (re-derive): {', '.join(c.drifted)}.")
    lines += [f"Note: {n}" for n in c.notes]
    return lines


def _deep_section(report: UpdateReport) -> list[str]:
    if not report.deep:
        return ["## Profiles against the candidate's parser", "", "not run: no vLLM candidate."]
    deep = report.deep
    lines = [f"## Profiles against vLLM {deep['version']}'s own parser (`check --deep`)", ""]
    if not deep.get("run"):
        return [*lines, deep.get("note", "not run")]
    lines += [f"Parser: {deep['where']}", "", "| profile | result |", "|---|---|"]
    for name, result in deep.get("profiles", {}).items():
        lines.append(f"| {name} | {'ok' if result == 'ok' else _cell('; '.join(result))} |")
    lines += [f"| {name} | not checked: {_cell(why)} |" for name, why in deep.get("skipped", {}).items()]
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --- the bump plan ---------------------------------------------------------------------------------

def bump_plan(report: UpdateReport) -> Plan:
    plan = Plan()
    for c in report.components:
        newest = c.newest
        if newest is None or c.name.startswith("chat-template"):
            continue
        plan.pins.append((c.name, c.key, c.pinned, newest.ref))
        if c.name == "vllm" and newest.version:
            plan.pins.append((c.name, "VLLM_VERSION", "", newest.version))
            plan.notes += [f"vLLM {newest.version}: pin the parser's requirements for it in "
                           "vllmstack/checks/parser-requirements.txt (check --deep works without, "
                           "slower)",
                           "the cpu platform's NATIVE_ENGINE_VERSION (env/platforms/cpu.env) follows "
                           "vLLM's CPU wheels, bumped on its own (vllmstack/image/cpu.py)"]
        pinned = next((k for k in COMPONENTS if k.name == c.name), None)
        if pinned is not None and pinned.bump_note:
            plan.notes.append(pinned.bump_note.format(ref=newest.ref))
        plan.drop += [str(Path(c.patch_folder) / name) for name in c.droppable]
    return plan


def render_plan(project: Project, plan: Plan) -> str:
    """The plan as one unified diff against the checkout (git apply --check takes it)."""
    edited: dict[str, list[str]] = {}
    lines = [f"# {n}" for n in plan.notes]
    for _name, key, _old, new in plan.pins:
        where = _pin_file(project, key, edited)
        if where is None:
            lines.append(f"# {key}: no line in .env.example or the schema sets it; set {key}={new} "
                         "where your pins live")
            continue
        path, text = where
        edited[path] = _set_pin(text, key, new, path)
    out = ["\n".join(lines)] if lines else []
    for path, new_lines in edited.items():
        old_lines = (project.root / path).read_text(encoding="utf-8").splitlines(keepends=True)
        diff = "".join(difflib.unified_diff(old_lines, new_lines, f"a/{path}", f"b/{path}"))
        if diff:
            out.append(f"diff --git a/{path} b/{path}\n{diff}")
    for path in plan.drop:
        if Path(path).is_absolute():
            out.append(f"# drop {path} (outside this checkout, so not part of the diff)\n")
            continue
        old = (project.root / path).read_text(encoding="utf-8").splitlines(keepends=True)
        body = "".join(f"-{line}" for line in old)
        out.append(f"diff --git a/{path} b/{path}\ndeleted file mode 100644\n--- a/{path}\n+++ /dev/null\n"
                   f"@@ -1,{len(old)} +0,0 @@\n{body}")
    return "\n".join(out) + ("\n" if out and not out[-1].endswith("\n") else "")


def _pin_file(project: Project, key: str, edited: dict[str, list[str]]) -> tuple[str, list[str]] | None:
    """The tracked file whose line pins `key`: .env.example, else the schema's default."""
    for path in (".env.example", str(SCHEMA)):
        if path in edited:
            lines = edited[path]
        elif (project.root / path).is_file():
            lines = (project.root / path).read_text(encoding="utf-8").splitlines(keepends=True)
        else:
            continue
        if path == ".env.example" and any(line.startswith(f"{key}=") for line in lines):
            return path, lines
        if path != ".env.example" and any(line.rstrip() == f"{key}:" for line in lines):
            return path, lines
    return None


def _set_pin(lines: list[str], key: str, value: str, path: str) -> list[str]:
    out = list(lines)
    if path == ".env.example":
        return [f"{key}={value}\n" if line.startswith(f"{key}=") else line for line in out]
    start = next(i for i, line in enumerate(out) if line.rstrip() == f"{key}:")
    for i in range(start + 1, len(out)):
        if not out[i].startswith("  "):
            break
        if re.match(r"\s+default:", out[i]):
            out[i] = f'  default: "{value}"\n'
            break
    return out

"""`invoke template-check`, and the chat-template rule of `invoke check`: does a chat template
keep the promises the stack's probes and the prefix cache rely on?

The corpus (template_corpus.py) is played turn by turn through the template, rendered as vLLM
renders it (chat_render.py), in both thinking modes. Properties:

* `renders`: every prompt of every conversation renders (content null, parts, tools included).
* `thinking-off`: with enable_thinking=false the generation prompt pre-closes the think block,
  and no earlier turn leaves one open; with thinking on, the generation prompt does not close it.
* `tools`: the tool definitions are in the prompt; earlier calls and tool results render in full,
  and the profile's --tool-call-parser reads each rendered call back as the client sent it.
* `prefix-stable`: prompt of turn k + what the model generated there (end token included) is a
  byte prefix of the prompt of turn k+1: the prefix cache can reuse the whole history.

Token waste (template tokens per message, beyond the messages' own) is measured when a
tokenizer is given. The properties need no tokenizer and take milliseconds, so `invoke check`
runs them for every profile that sets VLLM_CHAT_TEMPLATE. Both commands render through
`check_source`: the file read with chat_render's guards, every render of the check in one child
under chat_render's LIMITS (10 s, 512 MiB); what a template says is quoted in the report.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllmstack.checks.chat_render import (
    LIMITS,
    ChatTemplate,
    RenderLimits,
    TemplateError,
    TemplateLimitError,
    quote,
    read_template_text,
    run_sandboxed,
)
from vllmstack.checks.template_corpus import (
    ASSISTANT_HEADER,
    CONTEXT_BYTES,
    CORPUS,
    END,
    THINK_CLOSE,
    THINK_OPEN,
    Conversation,
    Reply,
    around,
    content_text,
    echoed_message,
    first_difference,
    generated_text,
    longest_prefix_in,
    short,
)
from vllmstack.checks.tool_formats import FORMATS, ToolFormatError, parser_format, read_calls

if TYPE_CHECKING:  # annotations only: the render's child imports this module, and imports little
    from vllmstack.checks.context import CheckContext
    from vllmstack.config.profiles import Resolved
    from vllmstack.core.findings import Finding
    from vllmstack.core.paths import Project

PROPERTIES = ("renders", "thinking-off", "tools", "prefix-stable")
TEMPLATE_DIR = "chat-templates"
TEMPLATE_KEY = "VLLM_CHAT_TEMPLATE"
KWARGS_KEY = "VLLM_CHAT_TEMPLATE_KWARGS"
VERSION_LINE = re.compile(r"template_version\s*[:=]\s*([A-Za-z0-9][\w.+-]*)")

Counter = Callable[[str], int]


@dataclass(frozen=True)
class Failure:
    prop: str
    conversation: str
    mode: str  # "thinking on" / "thinking off"
    message: str

    def render(self) -> str:
        return f"{self.prop}: conversation {self.conversation!r} ({self.mode}): {self.message}"

    def as_json(self) -> dict[str, str]:
        return {"property": self.prop, "conversation": self.conversation, "mode": self.mode,
                "message": self.message}


@dataclass
class TemplateReport:
    name: str
    version: str | None
    content_format: str
    parser: str | None
    call_format: str
    kwargs: dict[str, Any]
    failures: list[Failure] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROPERTIES, 0))
    notes: list[str] = field(default_factory=list)
    waste: list[dict[str, Any]] = field(default_factory=list)

    def failed_properties(self) -> list[str]:
        return [p for p in PROPERTIES if any(f.prop == p for f in self.failures)]

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    def as_json(self) -> dict[str, Any]:
        return {"template": self.name, "template_version": self.version,
                "content_format": self.content_format, "tool_call_parser": self.parser,
                "tool_call_format": self.call_format, "kwargs": self.kwargs,
                "ok": not self.failed,
                "properties": {p: {"ok": p not in self.failed_properties(), "checks": self.checked[p]}
                               for p in PROPERTIES},
                "failures": [f.as_json() for f in self.failures], "notes": self.notes,
                "token_waste": self.waste}


@dataclass
class Played:
    """One conversation played through the template in one thinking mode."""

    conversation: Conversation
    thinking: bool
    prompts: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    final: str = ""  # the whole history rendered without a generation prompt

    @property
    def mode(self) -> str:
        return "thinking on" if self.thinking else "thinking off"


# --- where a template comes from --------------------------------------------------------------

def template_version(source: str) -> str | None:
    """The `template_version` a template carries on a line of its own (update-check reads it)."""
    found = VERSION_LINE.search(source)
    return found.group(1) if found else None


def read_template_source(path: Path, name: str | None = None) -> str:
    """The template's text; refused unless a regular UTF-8 file within the size limit."""
    return read_template_text(path, name or str(path), max_bytes=LIMITS.file_bytes,
                              missing_fix=f"pass an existing file; shipped: {shipped_names(path.parent)}")


def shipped_names(folder: Path) -> str:
    names = sorted(p.name for p in folder.glob("*.jinja")) if folder.is_dir() else []
    return ", ".join(names) or "(none)"


def profile_template(project: Project, resolved: Resolved) -> Path | None:
    name = resolved.get_str(TEMPLATE_KEY).strip()
    return project.root / TEMPLATE_DIR / name if name else None


def profile_parser(resolved: Resolved) -> str | None:
    """The --tool-call-parser the profile's argv gives vLLM, if any."""
    words: list[str] = []
    for key in ("VLLM_TOOL_CHOICE", "VLLM_EXTRA_ARGS"):
        try:
            words += shlex.split(resolved.get_str(key))
        except ValueError:
            continue  # the argv rules report unbalanced quotes
    parser = None
    for i, word in enumerate(words):
        if word == "--tool-call-parser" and i + 1 < len(words):
            parser = words[i + 1]
        elif word.startswith("--tool-call-parser="):
            parser = word.split("=", 1)[1]
    return parser


def profile_kwargs(resolved: Resolved) -> dict[str, Any]:
    """The server's default chat-template kwargs (VLLM_CHAT_TEMPLATE_KWARGS); {} when unset or
    not a JSON object (the settings check names that error)."""
    try:
        value = json.loads(resolved.get_str(KWARGS_KEY) or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# --- playing the corpus ---------------------------------------------------------------------

def check_source(source: str, name: str, *, parser: str | None = None,
                 kwargs: Mapping[str, Any] | None = None, count_tokens: Counter | None = None,
                 limits: RenderLimits = LIMITS) -> TemplateReport:
    """check_template of a template's text, every render in one child under `limits`: a
    template that does not compile is a TemplateError, one past a limit a TemplateLimitError."""
    answer = run_sandboxed("vllmstack.checks.template:sandboxed_report",
                           {"source": source, "name": name, "parser": parser,
                            "kwargs": dict(kwargs or {}), "waste": count_tokens is not None},
                           name, limits, remember=count_tokens is None)
    data = dict(answer["report"])
    report = TemplateReport(**{**data, "failures": [Failure(**f) for f in data["failures"]]})
    if count_tokens is not None:
        report.waste = [_waste(w, count_tokens) for w in answer["waste"]]
    return report


def sandboxed_report(payload: Mapping[str, Any]) -> dict[str, Any]:
    """check_source's side in the child: the report, and the texts token waste is counted on."""
    template = ChatTemplate(payload["source"], payload["name"])
    report, played = _play_corpus(template, payload["parser"], payload["kwargs"], CORPUS, None)
    waste = [_waste_texts(run) for run in played if not run.thinking] if payload["waste"] else []
    return {"report": asdict(report), "waste": waste}


def check_template(template: ChatTemplate, *, parser: str | None = None,
                   kwargs: Mapping[str, Any] | None = None, count_tokens: Counter | None = None,
                   corpus: Sequence[Conversation] = CORPUS,
                   special_tokens: Mapping[str, str] | None = None) -> TemplateReport:
    """Every property over every conversation of `corpus`, in both thinking modes, here and
    without limits (check_source is the bounded one, for templates from outside)."""
    report, played = _play_corpus(template, parser, kwargs, corpus, special_tokens)
    if count_tokens is not None:
        report.waste = [_waste(_waste_texts(run), count_tokens) for run in played if not run.thinking]
    return report


def _play_corpus(template: ChatTemplate, parser: str | None, kwargs: Mapping[str, Any] | None,
                 corpus: Sequence[Conversation], special_tokens: Mapping[str, str] | None,
                 ) -> tuple[TemplateReport, list[Played]]:
    defaults = dict(kwargs or {})
    wanted = defaults.get("tool_call_format")
    call_format = parser_format(parser) or (wanted if wanted in FORMATS else "json")
    report = TemplateReport(template.name, template_version(template.source),
                            template.content_format, parser, call_format, defaults)
    if parser and parser_format(parser) is None:
        report.notes.append(f"--tool-call-parser {parser}: the checker reads back hermes, qwen3_coder "
                            "and qwen3_xml calls only, so rendered calls were not read back")
    played: list[Played] = []
    for conversation in corpus:
        for thinking in (True, False):
            report.checked["renders"] += 1
            done = _play(template, conversation, thinking, call_format, defaults, special_tokens,
                         report)
            if done is not None:
                played.append(done)
    chatml = all(ASSISTANT_HEADER in p for run in played for p in run.prompts)
    if not chatml:
        report.notes.append("the generation prompt is not ChatML (<|im_start|>assistant), so "
                            "thinking-off and prefix-stable were not checked: the checker knows "
                            "the reply conventions of Qwen's models only")
    for run in played:
        if chatml:
            _check_thinking(run, report)
            _check_prefix(run, report)
        _check_tools(run, parser, report)
    return report, played


def _play(template: ChatTemplate, conversation: Conversation, thinking: bool, call_format: str,
          defaults: Mapping[str, Any], special_tokens: Mapping[str, str] | None,
          report: TemplateReport) -> Played | None:
    run = Played(conversation, thinking)
    kwargs = {**defaults, "enable_thinking": thinking}
    history: list[dict[str, Any]] = []
    turn = 0
    try:
        for step in conversation.steps:
            if not isinstance(step, Reply):
                history.append(step)
                continue
            turn += 1
            prompt = template.render(history, tools=conversation.tools, kwargs=kwargs,
                                     special_tokens=special_tokens)
            output = generated_text(prompt, step, call_format, thinking=thinking)
            run.prompts.append(prompt)
            run.outputs.append(output)
            # Clients echo reasoning under either name; alternate, so both are rendered.
            history.append(echoed_message(output, call_format, thinking=thinking,
                                          reasoning_field=("reasoning_content", "reasoning")[turn % 2],
                                          tools=conversation.tools))
        turn += 1
        run.final = template.render(history, tools=conversation.tools, kwargs=kwargs,
                                    add_generation_prompt=False, special_tokens=special_tokens)
    except MemoryError:
        raise  # the memory limit, reported as such (check_source), not as this case's failure
    except Exception as exc:  # a template can raise anything (TypeError on None + str, ...)
        kind = "raise_exception" if type(exc).__name__ == "TemplateError" else type(exc).__name__
        nulls = [str(i) for i, m in enumerate(history) if m.get("content") is None]
        report.failures.append(Failure(
            "renders", conversation.name, run.mode,
            f"turn {turn} does not render: {kind}: {quote(exc)}{_template_line(exc)}"
            + (f" (content is null in message {', '.join(nulls)} of {len(history)})" if nulls else "")))
        return None
    run.messages = history
    return run


def _template_line(exc: BaseException) -> str:
    """Where in the template it raised: Jinja maps its frames to the template's lines."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at template line {line}" if line else ""


def _check_thinking(run: Played, report: TemplateReport) -> None:
    for turn, prompt in enumerate(run.prompts, 1):
        report.checked["thinking-off"] += 1
        head, _, suffix = prompt.rpartition(ASSISTANT_HEADER)
        if run.thinking:
            if THINK_CLOSE in suffix:
                report.failures.append(Failure(
                    "thinking-off", run.conversation.name, run.mode,
                    f"turn {turn}: the generation prompt closes the think block with thinking on (it "
                    f"ends {prompt.encode()[-2 * CONTEXT_BYTES:]!r}): the template ignores enable_thinking"))
            continue
        opened = suffix.find(THINK_OPEN)
        if opened < 0 or not suffix.rstrip().endswith(THINK_CLOSE) or suffix.rfind(THINK_CLOSE) < opened:
            report.failures.append(Failure(
                "thinking-off", run.conversation.name, run.mode,
                f"turn {turn}: with enable_thinking=false the generation prompt must end in a closed "
                f"{THINK_OPEN}...{THINK_CLOSE} block, but it ends {prompt.encode()[-2 * CONTEXT_BYTES:]!r}"))
        unclosed = _unclosed_think(head)
        if unclosed is not None:
            report.failures.append(Failure(
                "thinking-off", run.conversation.name, run.mode,
                f"turn {turn}: the history reopens a think block at byte {unclosed} that is never "
                f"closed: {around(head, unclosed)}"))


def _unclosed_think(text: str) -> int | None:
    """The offset of a <think> with no </think> before the next <think> or the end."""
    start = text.find(THINK_OPEN)
    while start >= 0:
        close = text.find(THINK_CLOSE, start)
        following = text.find(THINK_OPEN, start + len(THINK_OPEN))
        if close < 0 or (0 <= following < close):
            return len(text[:start].encode())
        start = following
    return None


def _check_prefix(run: Played, report: TemplateReport) -> None:
    nexts = [*run.prompts[1:], run.final]
    for turn, (prompt, output, following) in enumerate(zip(run.prompts, run.outputs, nexts,
                                                           strict=True), 1):
        report.checked["prefix-stable"] += 1
        expected = prompt + output
        if not following.startswith(expected):
            what = f"turn {turn + 1}'s prompt" if turn < len(run.prompts) else "the rendered history"
            report.failures.append(Failure(
                "prefix-stable", run.conversation.name, run.mode,
                f"turn {turn}'s prompt + the reply is not a prefix of {what}: "
                + first_difference(expected, following)))


def _check_tools(run: Played, parser: str | None, report: TemplateReport) -> None:
    tools = run.conversation.tools
    if not tools:
        return
    report.checked["tools"] += 1
    for tool in tools:
        function = tool.get("function", tool)
        needles = [function["name"], function.get("description", "")]
        for name, spec in (function.get("parameters") or {}).get("properties", {}).items():
            needles += [f'"{name}"', spec.get("description", "")]
        missing = [n for n in needles if n and n not in run.prompts[0]]
        if missing:
            report.failures.append(Failure("tools", run.conversation.name, run.mode,
                                           f"the definition of tool {function['name']!r} is not in "
                                           f"the prompt (missing: {', '.join(missing[:4])})"))
    sent = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for m in run.messages for c in m.get("tool_calls") or []]
    for name, arguments in sent:
        pieces = [name] + [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                           for v in arguments.values()]
        missing = [p for p in pieces if p not in run.final]
        if missing:
            report.failures.append(Failure("tools", run.conversation.name, run.mode,
                                           f"the call of {name!r} is not rendered in full "
                                           f"(missing: {', '.join(map(repr, missing[:4]))})"))
    call_format = parser_format(parser)
    if call_format is not None:
        _read_back(run, parser or "", call_format, sent, report)
    for message in run.messages:
        if message.get("role") == "tool":
            text = content_text(message.get("content"))
            if text not in run.final:
                kept = longest_prefix_in(text, run.final)
                report.failures.append(Failure(
                    "tools", run.conversation.name, run.mode,
                    f"the result of {message.get('tool_call_id')} is not rendered in full: the "
                    f"prompt has its first {kept} of {len(text.encode())} bytes, then "
                    f"{around(text, kept)} is missing"))


def _read_back(run: Played, parser: str, call_format: str,
               sent: list[tuple[str, dict[str, Any]]], report: TemplateReport) -> None:
    """Does --tool-call-parser read the calls of the rendered history back as they were sent?"""
    read: list[tuple[str, dict[str, Any]]] = []
    for segment in run.final.split(ASSISTANT_HEADER)[1:]:
        try:
            read += [(c.name, dict(c.arguments)) for c in
                     read_calls(segment.split(END)[0], call_format, run.conversation.tools)]
        except ToolFormatError as exc:
            report.failures.append(Failure("tools", run.conversation.name, run.mode,
                                           f"--tool-call-parser {parser} cannot read a rendered call: {exc}"))
            return
    if read != sent:
        report.failures.append(Failure(
            "tools", run.conversation.name, run.mode,
            f"--tool-call-parser {parser} reads {short(read)} from the rendered history, but the "
            f"client sent {short(sent)} (does the template write calls in the {call_format} format? "
            f"set it in {KWARGS_KEY})"))


def _waste_texts(run: Played) -> dict[str, Any]:
    return {"conversation": run.conversation.name, "messages": len(run.messages),
            "final": run.final, "own": list(_own_texts(run))}


def _waste(texts: Mapping[str, Any], count: Counter) -> dict[str, Any]:
    own = sum(count(text) for text in texts["own"])
    total = count(texts["final"])
    return {"conversation": texts["conversation"], "messages": texts["messages"],
            "prompt_tokens": total, "message_tokens": own, "template_tokens": total - own,
            "per_message": round((total - own) / max(1, texts["messages"]), 1)}


def _own_texts(run: Played) -> Iterable[str]:
    for tool in run.conversation.tools:
        yield json.dumps(tool.get("function", tool), ensure_ascii=False)
    for message in run.messages:
        yield content_text(message.get("content"))
        yield str(message.get("reasoning_content") or message.get("reasoning") or "").strip("\n")
        for call in message.get("tool_calls") or []:
            yield call["function"]["name"] + call["function"]["arguments"]


# --- reporting ----------------------------------------------------------------------------------

def render_report(report: TemplateReport) -> str:
    version = f" (template_version {report.version})" if report.version else ""
    lines = [f"{report.name}{version}: content format {report.content_format}, tool calls "
             f"{report.call_format}" + (f" for --tool-call-parser {report.parser}" if report.parser else "")
             + (f", kwargs {json.dumps(report.kwargs)}" if report.kwargs else "")]
    failed = report.failed_properties()
    for prop in PROPERTIES:
        state = "FAIL" if prop in failed else ("ok" if report.checked[prop] else "not checked")
        lines.append(f"  {state:11} {prop} ({report.checked[prop]} checks)")
        lines += [f"              {f.render()}" for f in report.failures if f.prop == prop][:6]
    lines += [f"  note: {n}" for n in report.notes]
    if report.waste:
        lines.append("  token waste (thinking off; template tokens beyond the messages' own):")
        lines += [f"    {w['conversation']:18} {w['template_tokens']:5} of {w['prompt_tokens']:5} tokens, "
                  f"{w['per_message']} per message" for w in report.waste]
    lines.append(f"FAILED: {', '.join(failed)}" if failed else "OK: every property holds")
    return "\n".join(lines)


# --- the rule of `invoke check` ----------------------------------------------------------------

def rule_chat_template(ctx: CheckContext) -> list[Finding]:
    """The profile's VLLM_CHAT_TEMPLATE keeps every property (a missing file is files.py's)."""
    path = profile_template(ctx.project, ctx.resolved)
    if path is None or not path.exists() or not ctx.usable(KWARGS_KEY):
        return []  # a FIFO, device or folder there: read_template_source names what it is
    shown = f"{TEMPLATE_DIR}/{path.name}"
    try:
        report = check_source(read_template_source(path, shown), shown,
                              parser=profile_parser(ctx.resolved), kwargs=profile_kwargs(ctx.resolved))
    except TemplateError as exc:
        code = "chat-template-limit" if isinstance(exc, TemplateLimitError) else "chat-template-broken"
        return [ctx.finding("error", code, TEMPLATE_KEY, exc.cause, fix=exc.fix)]
    findings = []
    for prop in report.failed_properties():
        first = next(f for f in report.failures if f.prop == prop)
        # A history that re-renders differently costs prefix-cache hits, not correctness: the
        # engine may start; the other properties break requests, tools or the thinking switch.
        findings.append(ctx.finding(
            "warning" if prop == "prefix-stable" else "error", f"chat-template-{prop}",
            KWARGS_KEY if "read" in first.message else TEMPLATE_KEY,
            f"{shown} fails {first.render()}",
            fix=f"invoke template-check --model {ctx.resolved.profile} lists every failing case"))
    if not findings:
        findings.append(ctx.finding("info", "chat-template-ok", TEMPLATE_KEY,
                                    f"{shown} ({report.version or 'no template_version'}) keeps "
                                    f"{', '.join(PROPERTIES)} over {len(CORPUS)} conversations"))
    return findings

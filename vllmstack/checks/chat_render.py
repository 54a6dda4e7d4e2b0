"""A chat template rendered the way vLLM renders it, without vLLM or transformers installed.

vLLM hands the messages to transformers' `apply_chat_template`, which compiles the template in
a Jinja `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
`loopcontrols` extension and a `{% generation %}` tag, replaces `tojson` with a plain
`json.dumps` (no HTML escaping, `ensure_ascii=False`), and adds `raise_exception` and
`strftime_now`. The render gets `messages`, `tools`, `documents`, `add_generation_prompt`, the
tokenizer's special tokens and the chat-template kwargs (request's over the server's defaults).

Before that, vLLM prepares the messages (`prepare_messages` here): a tool call's `arguments`
string becomes a dict, and content becomes a list of parts when the template loops over
`message.content` (vLLM's "openai" content format), else one string of the text parts joined
by newlines ("string" format). What a template sees here is what it sees in the engine.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vllmstack.core.errors import StackError

Message = dict[str, Any]


class TemplateError(StackError, ValueError):
    """A chat template that does not compile or that raises while rendering."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: marks the assistant's tokens for
    training masks; rendering outputs the body unchanged, which is all a prompt needs."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads this class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template and the content format vLLM picks for it."""

    def __init__(self, source: str, name: str = "template") -> None:
        self.source = source
        self.name = name
        self.env = make_environment()
        try:
            self.ast = self.env.parse(source)
            self.compiled = self.env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"{name}:{exc.lineno}: the template does not compile: {exc.message}",
                                "fix the Jinja syntax at that line") from exc
        self.content_format = detect_content_format(self.ast)
        # The names it reads that it does not declare: the kwargs it takes (vLLM passes only those).
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(self.ast))

    def render(self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, kwargs: Mapping[str, Any] | None = None,
               special_tokens: Mapping[str, str] | None = None) -> str:
        """The prompt text; a template error (or a Python error it triggers, e.g. adding None to
        a string) is a jinja2 or Python exception, for the caller to report with its case."""
        prepared = prepare_messages(messages, self.content_format)
        chosen = {k: v for k, v in (kwargs or {}).items() if k in self.variables}
        return str(self.compiled.render(messages=prepared, tools=list(tools) if tools else None,
                                        documents=None, add_generation_prompt=add_generation_prompt,
                                        **{**(special_tokens or {}), **chosen}))


def detect_content_format(ast: jinja2.nodes.Template) -> str:
    """"openai" when the template loops over a message's content (`for x in message.content`,
    with `message` the variable of a loop over `messages`), else "string": vLLM's rule."""
    message_vars = {loop.target.name for loop in ast.find_all(jinja2.nodes.For)
                    if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, "messages")}
    for loop in ast.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, var, "content") for var in message_vars):
            return "openai"
    return "string"


def _reads(node: jinja2.nodes.Node, var: str, key: str | None = None) -> bool:
    """`node` is `var` (or `var.key` / `var['key']`), possibly under filters, tests or a slice."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        return _reads(node.node, var, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, var, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.name == var
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _reads(node.node, var)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return node.arg.value == key and _reads(node.node, var)
    return False


def prepare_messages(messages: Sequence[Message], content_format: str) -> list[Message]:
    """The messages as vLLM hands them to the template (the caller's are never changed)."""
    out: list[Message] = []
    for original in messages:
        message = copy.deepcopy(original)
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                # OpenAI sends arguments as a JSON string; templates expect the object.
                arguments = function.get("arguments")
                if isinstance(arguments, str) and arguments.strip():
                    function["arguments"] = json.loads(arguments)
                elif not arguments:
                    function["arguments"] = {}
        content = message.get("content")
        if content_format == "openai" and isinstance(content, str):
            message["content"] = [{"type": "text", "text": content}]
        elif content_format == "string" and isinstance(content, list):
            message["content"] = "\n".join(p.get("text", "") for p in content
                                           if isinstance(p, dict) and p.get("type") == "text")
        out.append(message)
    return out

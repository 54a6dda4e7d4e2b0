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

A template is a program, and vLLM runs it without bounds (the sandbox only keeps it from unsafe
attributes; `range()` stops at 100000, but two nested loops of that are 10^10 steps). The stack's
checks render it before every `up` and every router load, so they bound it (`LIMITS`):

* the file: a regular file of at most 1 MiB (`MAX_TEMPLATE_BYTES`), refused before it is read
  (/dev/zero, a FIFO or a folder named as a template never reaches `read`);
* the renders: every render of one check (the whole corpus, both thinking modes) runs in one child
  Python (`run_sandboxed`) with a 10 s wall-clock deadline (`RENDER_WALL_S`), an address-space
  limit of 512 MiB (`RENDER_MEMORY_BYTES`, RLIMIT_AS) and a CPU limit just above the deadline
  (RLIMIT_CPU, so a child whose parent died stops by itself) - in a child, not by signals or
  tracing in the caller, because the router renders from worker threads (no SIGALRM there) and a
  trace hook would slow every render; one child per check, not per render, because starting one
  (an interpreter, jinja2) costs more than rendering the whole corpus;
* nesting: a template nested past Python's recursion limit is refused when it compiles.

A check's answer is remembered in the process (`remember`), so the router's later loads of a
profile, and the other profiles of a family, reuse it instead of starting a child again.

What exceeds a limit is a TemplateLimitError naming the template, the limit and what to look for.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import json
import math
import os
import resource
import signal
import stat
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vllmstack.core.errors import StackError
from vllmstack.core.files import path_kind

Message = dict[str, Any]


MIB = 1024 * 1024
MAX_TEMPLATE_BYTES = 1 * MIB  # the shipped template is 9 KB; Qwen's and Llama's own are under 20 KB
RENDER_WALL_S = 10.0  # the shipped template renders the whole corpus in about 0.1 s
RENDER_MEMORY_BYTES = 512 * MIB  # the child's whole address space; the shipped template's peaks at 30 MiB
MAX_RESULT_BYTES = 64 * MIB  # the child's answer (reports and the rendered histories)
QUOTED_CHARS = 200  # what a template says (raise_exception, an error's text) is cut here


@dataclass(frozen=True)
class RenderLimits:
    wall_s: float = RENDER_WALL_S
    memory_bytes: int = RENDER_MEMORY_BYTES
    file_bytes: int = MAX_TEMPLATE_BYTES

    def describe(self) -> str:
        return (f"the limits of one check's renders: {self.wall_s:g} s wall clock, "
                f"{self.memory_bytes // MIB} MiB of memory")


LIMITS = RenderLimits()


class TemplateError(StackError, ValueError):
    """A chat template that does not compile or that raises while rendering."""


class TemplateLimitError(TemplateError):
    """A chat template that is not a file of sane size, or that needs more time, memory or
    nesting than the limits give a render."""


def quote(text: object, limit: int = QUOTED_CHARS) -> str:
    """Text a template controls, as it may reach a terminal: repr-quoted (no escape sequence,
    no newline survives) and cut at `limit` characters."""
    value = str(text)
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


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
            raise TemplateError(f"{name}:{exc.lineno}: the template does not compile: "
                                f"{quote(exc.message or exc)}", "fix the Jinja syntax at that line") from exc
        except RecursionError as exc:
            raise TemplateLimitError(
                f"chat template {name} nests too deeply to compile (past Python's recursion limit "
                f"of {sys.getrecursionlimit()} frames)",
                "flatten the nesting (blocks, parentheses, filters): a chat template needs a few "
                "dozen levels at most") from exc
        except SyntaxError as exc:  # Jinja's Python is refused, e.g. "too many statically nested blocks"
            raise TemplateLimitError(f"chat template {name} compiles to Python that Python refuses: "
                                     f"{quote(exc.msg)}", "nest fewer loops and blocks") from exc
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


# --- a template file, refused before it is read unless it is a sane one -------------------------

NOT_A_FILE_FIX = "point it at a template file (.jinja): a chat template is a text file of a few KB"


def _too_large(shown: str, size: int, max_bytes: int) -> TemplateLimitError:
    return TemplateLimitError(f"chat template {shown} is {size} bytes, over the "
                              f"{max_bytes // MIB} MiB limit of a template file",
                              f"{NOT_A_FILE_FIX}, not a model or data file")


def read_template_text(path: Path, shown: str, *, missing_fix: str,
                       max_bytes: int = MAX_TEMPLATE_BYTES) -> str:
    """The text of the template file `path` (`shown` names it). Missing, not a regular file
    (/dev/zero, a FIFO, a folder), over `max_bytes` or not UTF-8 is a TemplateError; kind and
    size are judged on the open file before a byte is read, so nothing blocks or fills memory."""
    try:
        # Non-blocking: opening a FIFO must not wait for a writer (the kind check refuses it next).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise TemplateError(f"chat template {shown} does not exist", missing_fix) from exc
    except OSError as exc:  # a socket cannot be opened at all (ENXIO): say what it is
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise TemplateLimitError(f"chat template {shown} is {path_kind(mode)}, not a regular file",
                                     NOT_A_FILE_FIX) from exc
        raise TemplateError(f"chat template {shown} cannot be read ({exc.strerror or exc})",
                            f"make it readable for this user (ls -l {path})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TemplateLimitError(f"chat template {shown} is {path_kind(info.st_mode)}, not a regular "
                                     "file", NOT_A_FILE_FIX)
        if info.st_size > max_bytes:
            raise _too_large(shown, info.st_size, max_bytes)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(max_bytes + 1)  # bounded: it may grow while it is read
    except OSError as exc:
        raise TemplateError(f"chat template {shown} cannot be read ({exc.strerror or exc})",
                            f"make it readable for this user (ls -l {path})") from exc
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise _too_large(shown, len(data), max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TemplateError(f"chat template {shown} is not UTF-8 text (byte 0x{data[exc.start]:02x} "
                            f"at offset {exc.start})", "save it as UTF-8 text") from exc


# --- renders in a child with limits ---------------------------------------------------------------

SANDBOX_CHILD = "from vllmstack.checks.chat_render import sandbox_child; sandbox_child()"


def run_sandboxed(entry: str, payload: Mapping[str, Any], name: str,
                  limits: RenderLimits = LIMITS, *, remember: bool = False) -> Any:
    """What `entry(payload)` returns ("package.module:function", a function of this package
    that returns JSON data), called in a child Python under `limits`. A TemplateError it raises
    comes back as one; a limit it hits is a TemplateLimitError naming the template `name`.

    `remember`: the same call again in this process gets the answer of the first (a fresh copy)
    without a child: a render is a function of its payload, and the router's every load of a
    profile, or every profile of a family, renders the same template with the same kwargs. Only
    answers are remembered, never errors (a deadline missed on a busy host may be met next time).

    Not through a Runner: this is the checks' own sandbox, not a program the stack starts; it
    runs in every `check` (unit tests included), a dry run has nothing to show of it, and it
    needs a deadline and a kill that `Runner.run` does not give."""
    text = json.dumps(payload, sort_keys=True)
    if remember:
        return json.loads(_remembered(entry, text, name, limits))
    return _run(entry, text, name, limits)


@functools.lru_cache(maxsize=32)
def _remembered(entry: str, payload: str, name: str, limits: RenderLimits) -> str:
    return json.dumps(_run(entry, payload, name, limits))


def _run(entry: str, payload: str, name: str, limits: RenderLimits) -> Any:
    cpu_s = math.ceil(limits.wall_s) + 1
    argv = [sys.executable, "-c", SANDBOX_CHILD, entry, str(limits.memory_bytes), str(cpu_s)]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=_child_env())
    except OSError as exc:  # no process left to start (EAGAIN, ENOMEM): say so, not a traceback
        raise TemplateError(f"chat template {name} cannot be checked: its renderer does not start "
                            f"({exc.strerror or exc})", "free memory or processes, then run this "
                            "again") from exc
    try:
        out, err = proc.communicate(payload.encode(), timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        raise TemplateLimitError(
            f"chat template {name} did not finish rendering the corpus within the "
            f"{limits.wall_s:g} s wall-clock limit ({limits.describe()})",
            "look for a loop that does not end soon (nested range() loops, a recursive macro): "
            "vLLM renders the template for every request, where it would stall the engine") from None
    finally:
        if proc.poll() is None:  # timed out, or interrupted: the child never outlives the check
            proc.kill()
            proc.communicate()
    return _answer(proc.returncode, out, err, name, limits, cpu_s)


def _answer(code: int, out: bytes, err: bytes, name: str, limits: RenderLimits, cpu_s: int) -> Any:
    memory = TemplateLimitError(
        f"chat template {name} needs more than the {limits.memory_bytes // MIB} MiB memory limit "
        f"to render ({limits.describe()})",
        "look for a string or list multiplied by a large number, or a loop that keeps appending: "
        "a chat template's prompt is a few KB")
    if code == -signal.SIGXCPU:
        raise TemplateLimitError(f"chat template {name} used up the {cpu_s} s CPU-time limit of its "
                                 f"renders ({limits.describe()})",
                                 "look for a loop that does not end soon (nested range() loops)")
    try:
        answer = json.loads(out) if code == 0 else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        text = err.decode("utf-8", "replace").strip()
        if "MemoryError" in text:
            raise memory
        how = f"signal {_signal_name(-code)}" if code < 0 else f"exit {code}"
        raise TemplateLimitError(
            f"rendering chat template {name} stopped its renderer ({how}): "
            f"{quote(text.splitlines()[-1] if text else 'no output')}",
            "the renderer should never stop: report it with the template; until then, simplify "
            "the template where it nests or repeats most")
    if answer.get("limit") == "memory":
        raise memory
    if answer.get("limit"):
        what = {"output": f"the {MAX_RESULT_BYTES // MIB} MiB limit of rendered text",
                "recursion": f"Python's recursion limit of {sys.getrecursionlimit()} frames"}
        raise TemplateLimitError(f"chat template {name} went past {what.get(answer['limit'], 'a limit')} "
                                 f"({limits.describe()})", "a chat template's prompt is a few KB: "
                                 "look for what repeats or nests without end")
    if "error" in answer:
        error = answer["error"]
        raise (TemplateLimitError if error.get("limit") else TemplateError)(error["cause"], error["fix"])
    return answer.get("value")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _child_env() -> dict[str, str]:
    """The child imports this very package (not whatever the working folder holds); nothing else
    of the caller's environment reaches a template."""
    return {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PYTHONSAFEPATH": "1",
            "PYTHONUTF8": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def _limit(kind: int, soft: int, hard: int) -> None:
    current = resource.getrlimit(kind)[1]
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    # A platform without this limit keeps the wall-clock deadline, which the caller holds.
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(kind, (soft, hard))


def sandbox_child() -> None:
    """The child of run_sandboxed: limits on itself, then argv[1] on the JSON payload of stdin;
    one JSON answer on stdout ({"value"}, {"error"} or {"limit"})."""
    entry, memory, cpu_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    _limit(resource.RLIMIT_CORE, 0, 0)  # SIGXCPU dumps core by default: never one in the checkout
    _limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU, then SIGKILL a second later
    _limit(resource.RLIMIT_AS, memory, memory)
    answer: dict[str, Any]
    try:
        payload = json.loads(sys.stdin.buffer.read())
        module, _, function = entry.partition(":")
        answer = {"value": getattr(importlib.import_module(module), function)(payload)}
    except TemplateError as exc:
        answer = {"error": {"cause": exc.cause, "fix": exc.fix,
                            "limit": isinstance(exc, TemplateLimitError)}}
    except MemoryError:
        answer = {"limit": "memory"}
    except RecursionError:
        answer = {"limit": "recursion"}
    try:
        text = json.dumps(answer)
    except MemoryError:
        text = json.dumps({"limit": "memory"})
    if len(text) > MAX_RESULT_BYTES:
        text = json.dumps({"limit": "output"})
    sys.stdout.write(text)

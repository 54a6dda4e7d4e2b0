"""Tool calls in the two text formats of Qwen models, written and read as vLLM's parsers read them.

* "json" (`--tool-call-parser hermes`): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
  the parser takes the JSON between the tags.
* "xml" (`qwen3_coder`, `qwen3_xml`; Qwen3.5 and later):
  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
  a value is converted by the type the tool's schema gives the parameter (a string as written,
  integers, numbers and booleans parsed, objects and arrays as JSON), and taken as written when
  the schema does not name it.

`write_call` is the model's side (what `template-check` feeds back as a generated reply);
`read_calls` the parser's (does the profile's parser get back the call the template rendered?).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# --tool-call-parser -> the format it reads. Others are not read back by the checker.
PARSER_FORMATS = {"hermes": "json", "qwen3_coder": "xml", "qwen3_xml": "xml"}
FORMATS = ("json", "xml")

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.DOTALL)


class ToolFormatError(ValueError):
    """A tool-call block the parser would not read; the message says why."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


def parser_format(parser: str | None) -> str | None:
    return PARSER_FORMATS.get(parser or "")


def write_call(call: ToolCall, call_format: str) -> str:
    """One call as the model generates it in `call_format`."""
    if call_format == "xml":
        params = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
            "\n</parameter>\n" for key, value in call.arguments.items())
        return f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>"
    payload = json.dumps({"name": call.name, "arguments": dict(call.arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


def read_calls(text: str, call_format: str,
               tools: Sequence[Mapping[str, Any]] = ()) -> list[ToolCall]:
    """Every complete <tool_call> block of `text`, as the parser of `call_format` reads it;
    a block it cannot read raises ToolFormatError."""
    calls: list[ToolCall] = []
    for block in _BLOCK.findall(text):
        calls.append(_read_xml(block, tools) if call_format == "xml" else _read_json(block))
    return calls


def _read_json(block: str) -> ToolCall:
    try:
        data = json.loads(block.strip())
    except json.JSONDecodeError as exc:
        raise ToolFormatError(f"the hermes parser needs JSON inside <tool_call>: {exc.msg} "
                              f"in {block.strip()[:80]!r}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ToolFormatError(f"no \"name\" in the tool call {block.strip()[:80]!r}")
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return ToolCall(data["name"], arguments if isinstance(arguments, dict) else {})


def _read_xml(block: str, tools: Sequence[Mapping[str, Any]]) -> ToolCall:
    found = _FUNCTION.search(block)
    if found is None:
        raise ToolFormatError("the qwen3_coder parser needs <function=NAME>...</function> inside "
                              f"<tool_call>, got {block.strip()[:80]!r}")
    name, body = found.group(1), found.group(2)
    schema = _parameters(tools, name)
    arguments = {key: _convert(value, schema.get(key)) for key, value in _PARAMETER.findall(body)}
    return ToolCall(name, arguments)


def _parameters(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return properties if isinstance(properties, Mapping) else {}
    return {}


def _convert(value: str, schema: Any) -> Any:
    """The parameter's value by its schema type, as qwen3_coder converts it."""
    kind = str(schema.get("type", "string")).lower() if isinstance(schema, Mapping) else None
    if kind is None or kind in ("string", "str", "text", "enum"):
        return value
    if value.lower() in ("null", "none"):
        return None
    try:
        if kind.startswith("int"):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            return int(number) if number.is_integer() else number
        if kind in ("boolean", "bool"):
            return value.lower() == "true"
        return json.loads(value)
    except ValueError:
        return value

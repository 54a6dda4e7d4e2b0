"""The shipped protocol.py overlay's tool check, run on request bodies like clients send.

The validator is compiled from the overlay file itself (vLLM is not installed
here), with vLLM's error type stood in by a local exception.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllmstack.core.paths import Project
from vllmstack.image.patches import load_overlays

ROOT = Path(__file__).resolve().parents[1]


class VLLMValidationError(ValueError):
    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


@pytest.fixture(scope="module")
def check_tool_usage() -> Callable[[dict[str, Any]], Any]:
    [overlay] = [o for o in load_overlays(Project(ROOT)) if o.name == "tools-empty-list"]
    module = ast.parse(overlay.file.read_text())
    [method] = [node for node in ast.walk(module)
                if isinstance(node, ast.FunctionDef) and node.name == "check_tool_usage"]
    method.decorator_list = []
    namespace: dict[str, Any] = {"VLLMValidationError": VLLMValidationError}
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(overlay.file), "exec"), namespace)
    function = namespace["check_tool_usage"]
    return lambda data: function(None, data)


@pytest.mark.parametrize("choice", [None, "none"])
def test_empty_tools_without_a_tool_choice_is_accepted_as_no_tools(
    check_tool_usage: Callable[[dict[str, Any]], Any], choice: str | None
) -> None:
    body: dict[str, Any] = {"model": "m", "messages": [], "tools": []}
    if choice is not None:
        body["tool_choice"] = choice
    out = check_tool_usage(body)
    assert "tools" not in out
    assert out.get("tool_choice") == choice


@pytest.mark.parametrize("choice", ["auto", "required",
                                    {"type": "function", "function": {"name": "f"}}])
def test_empty_tools_with_a_real_tool_choice_is_still_rejected(
    check_tool_usage: Callable[[dict[str, Any]], Any], choice: object
) -> None:
    with pytest.raises(VLLMValidationError, match="must not be an empty array") as err:
        check_tool_usage({"tools": [], "tool_choice": choice})
    assert err.value.parameter == "tools"


def test_requests_with_tools_keep_upstream_behaviour(
    check_tool_usage: Callable[[dict[str, Any]], Any]
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert check_tool_usage({"tools": tools})["tool_choice"] == "auto"
    with pytest.raises(VLLMValidationError, match="`tools` must be set"):
        check_tool_usage({"tool_choice": "auto"})

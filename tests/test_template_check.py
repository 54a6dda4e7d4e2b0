"""`invoke template-check` and the chat-template rule of `invoke check` (issue 24).

The shipped template keeps every property in both tool-call formats; each broken variant fails
exactly the property its defect breaks, and the task names it with the conversation and the
first differing bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from template_variants import SHIPPED, VARIANTS, variant

from vllmstack.checks.chat_render import ChatTemplate, TemplateError, prepare_messages
from vllmstack.checks.registry import run_checks
from vllmstack.checks.template import PROPERTIES, check_template, template_version
from vllmstack.checks.template_corpus import Reply, echoed_message, generated_text
from vllmstack.checks.tool_formats import ToolCall, read_calls, write_call
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.models.chat_template import CHAT_TEMPLATE as TINY_OWN_TEMPLATE


def shipped_template() -> ChatTemplate:
    return ChatTemplate(SHIPPED.read_text(encoding="utf-8"), "chat-templates/qwen3.jinja")


@pytest.mark.parametrize(("parser", "kwargs"), [(None, {}), ("hermes", {}),
                                                ("qwen3_coder", {"tool_call_format": "xml"}),
                                                ("qwen3_xml", {"tool_call_format": "xml"})])
def test_the_shipped_template_keeps_every_property(parser: str | None, kwargs: dict[str, str]) -> None:
    report = check_template(shipped_template(), parser=parser, kwargs=kwargs)
    assert report.failures == []
    assert all(report.checked[p] > 0 for p in PROPERTIES), report.checked
    assert report.version == "vllmstack-qwen3-2026.12.01"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_broken_variant_fails_exactly_its_property(name: str) -> None:
    report = check_template(ChatTemplate(variant(name), name), parser="hermes")
    assert report.failed_properties() == [VARIANTS[name][2]]


def test_a_parser_that_cannot_read_the_rendered_calls_fails_tools() -> None:
    # The qwen3.6 family reads XML calls; without the kwarg the template writes JSON ones.
    report = check_template(shipped_template(), parser="qwen3_coder", kwargs={})
    assert "tools" in report.failed_properties()
    assert any("cannot read a rendered call" in f.message for f in report.failures)


def test_qwen3_own_convention_of_dropping_think_blocks_is_caught_in_the_made_model() -> None:
    # The tiny model's own template drops earlier think blocks, as Qwen3's does: not prefix-stable.
    report = check_template(ChatTemplate(TINY_OWN_TEMPLATE, "tiny"), parser="hermes")
    assert report.failed_properties() == ["prefix-stable"]
    assert report.content_format == "string"


def test_the_task_exits_1_naming_property_conversation_and_bytes(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text(variant("drops-empty-think"), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "invoke", "template-check", "--template", str(broken)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: prefix-stable" in done.stdout
    assert "conversation 'chat' (thinking off): turn 1's prompt + the reply is not a prefix" in done.stdout
    assert "expected b'|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\nIt keeps" in done.stdout
    ok = subprocess.run([sys.executable, "-m", "invoke", "template-check", "--template",
                         "chat-templates/qwen3.jinja", "--tool-parser", "qwen3_coder",
                         "--kwargs", '{"tool_call_format": "xml"}', "--json"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "HOME": str(tmp_path)})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout)["ok"] is True


def test_a_missing_template_is_an_error_with_a_fix(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "invoke", "template-check", "--template",
                           "chat-templates/nope.jinja"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 1
    assert "error: chat template chat-templates/nope.jinja does not exist" in done.stderr
    assert "qwen3.jinja" in done.stderr and "Traceback" not in done.stderr


def test_a_syntax_error_names_the_line() -> None:
    with pytest.raises(TemplateError, match=r"broken:2: the template does not compile"):
        ChatTemplate("ok\n{% if %}", "broken")


def test_check_runs_the_properties_for_a_profile_that_sets_a_template(project: Project) -> None:
    env = {"HOME": "/nonexistent"}
    fine = resolve(project, model="qwen3.8-27b", platform="2xr9700", environ=env)
    findings, _ = run_checks(project, fine, env)
    assert [f.code for f in findings if f.code.startswith("chat-template")] == ["chat-template-ok"]
    # The family's parser reads XML calls: dropping the kwarg that asks the template for them
    # is caught before boot, on the setting that was changed.
    wrong = resolve(project, model="qwen3.8-27b", platform="2xr9700", environ=env,
                    overrides=["VLLM_CHAT_TEMPLATE_KWARGS={}"])
    findings, _ = run_checks(project, wrong, env)
    tools = next(f for f in findings if f.code == "chat-template-tools")
    assert tools.severity == "error" and tools.key == "VLLM_CHAT_TEMPLATE_KWARGS"
    assert "template-check --model qwen3.8-27b" in (tools.fix or "")
    broken = project.root / "chat-templates" / "broken.jinja"
    broken.write_text(variant("ignores-enable-thinking"), encoding="utf-8")
    findings, _ = run_checks(project, resolve(project, model="tiny", platform="cpu", environ=env,
                                              overrides=["VLLM_CHAT_TEMPLATE=broken.jinja"]), env)
    assert [f.code for f in findings if f.code.startswith("chat-template")] == ["chat-template-thinking-off"]
    # Not prefix-stable: slower multi-turn chats, not broken ones - a warning, the engine may start.
    broken.write_text(variant("drops-empty-think"), encoding="utf-8")
    findings, _ = run_checks(project, resolve(project, model="tiny", platform="cpu", environ=env,
                                              overrides=["VLLM_CHAT_TEMPLATE=broken.jinja"]), env)
    [stable] = [f for f in findings if f.code.startswith("chat-template")]
    assert (stable.code, stable.severity) == ("chat-template-prefix-stable", "warning")


def test_every_qwen_vllm_profile_uses_the_template_and_its_version_is_readable(shipped: Project) -> None:
    for model, platform in [("qwen3-0.6b", "nvidia"), ("tiny", "cpu"), ("qwen3.6-27b", "2xr9700"),
                            ("qwen3.6-35b-a3b", "2xr9700"), ("qwen3.8-27b", "2xr9700"),
                            ("qwen3.8-27b-awq", "2xr9700")]:
        resolved = resolve(shipped, model=model, platform=platform, environ={"HOME": "/x"})
        assert resolved.get_str("VLLM_CHAT_TEMPLATE") == "qwen3.jinja", model
    assert template_version("{#- template_version: abc-1.2 -#}\n") == "abc-1.2"
    assert template_version("no version here") is None


def test_messages_reach_the_template_as_vllm_prepares_them() -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "1", "type": "function",
                                 "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    openai = prepare_messages(messages, "openai")
    assert openai[0]["content"] == [{"type": "text", "text": "hi"}]
    assert openai[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # untouched
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"},
                                           {"type": "text", "text": "b"}]}]
    assert prepare_messages(parts, "string")[0]["content"] == "a\nb"
    assert shipped_template().content_format == "openai"


def test_the_environment_is_transformers() -> None:
    template = ChatTemplate("{{ {'k': '<é>'} | tojson }}{% generation %}x{% endgeneration %}"
                            "{% for i in [1, 2] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}")
    # No HTML escaping and no \u escapes (Jinja's own tojson does both).
    assert template.render([], add_generation_prompt=False) == '{"k": "<é>"}x1'
    with pytest.raises(Exception, match="stop here"):
        ChatTemplate("{{ raise_exception('stop here') }}").render([])


@pytest.mark.parametrize("call_format", ["json", "xml"])
def test_calls_round_trip_through_the_parser_format(call_format: str) -> None:
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"}}}}},)
    call = ToolCall("f", {"n": 3, "s": "two words", "o": {"x": [1, "y"]}})
    assert read_calls(write_call(call, call_format), call_format, tools) == [call]


def test_the_echo_is_what_vllm_parsers_hand_back() -> None:
    prompt = "<|im_start|>assistant\n<think>\n"
    output = generated_text(prompt, Reply("Sure.", "why", (ToolCall("f", {"a": 1}),)), "json",
                            thinking=True)
    assert output == ('why\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
                      '</tool_call><|im_end|>')
    echo = echoed_message(output, "json", thinking=True)
    assert echo["reasoning_content"] == "why\n" and echo["content"] == "\n\nSure.\n"
    assert echo["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    off = echoed_message(generated_text(prompt + "\n</think>\n\n", Reply("", "", (ToolCall("f", {}),)),
                                        "json", thinking=False), "json", thinking=False)
    assert off["content"] is None and "reasoning_content" not in off

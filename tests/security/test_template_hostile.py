"""A hostile pass over chat-template rendering (issue 36, rows 5, 6 and 13).

`invoke check` (so `invoke up`, and every router load) and `invoke template-check` render a
template as vLLM does, and vLLM runs it without bounds. A template nested past Python's recursion
limit, one that loops 10^10 times, one that builds a string of gigabytes, and /dev/zero (or a
FIFO, a folder, a huge file) named as the template must each be one named error with its fix,
soon: never a traceback, a hang, or a machine out of memory. The limits are chat_render's LIMITS
(10 s wall clock and 512 MiB for every render of one check; a template file of 1 MiB at most).

Each `invoke` here runs with a 4 GiB address-space cap of its own, so a regression fails the
test with a MemoryError instead of taking the test machine's memory.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, copy_project

from vllmstack.checks.chat_render import (
    LIMITS,
    ChatTemplate,
    RenderLimits,
    TemplateLimitError,
    read_template_text,
)
from vllmstack.checks.template import check_source, check_template

DEEP = "{% if true %}" * 3000 + "x" + "{% endif %}" * 3000  # row 5: 3000 levels
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # row 6
HUGE = "{{ 'x' * 100000 * 100000 }}"  # 10 GB of one string
SHOUTS = "{{ raise_exception('\x1b[2J\x1b[31mowned\nerror: fake line') }}"
BOUND_S = 30  # well within the subprocess timeout; the wall limit itself is 10 s
CAP = 4 * 1024**3


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


def invoke(root: Path, *args: str, home: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=root, text=True,
                          capture_output=True, check=False, timeout=60, preexec_fn=_cap_memory,
                          env={**os.environ, "HOME": str(home)})
    return done, time.monotonic() - started


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project copy whose chat-templates/ holds the hostile templates."""
    root = copy_project(tmp_path_factory.mktemp("template-hostile"))
    for name, text in {"deep.jinja": DEEP, "loop.jinja": LOOP, "huge.jinja": HUGE}.items():
        (root / "chat-templates" / name).write_text(text, encoding="utf-8")
    return root


def check(root: Path, template: str, home: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    return invoke(root, "check", "--model", "tiny", "--platform", "cpu",
                  "--set", f"VLLM_CHAT_TEMPLATE={template}", home=home)


def the_finding(done: subprocess.CompletedProcess[str], code: str) -> tuple[str, str]:
    """The ERROR line of `code` and its fix line, from `invoke check`'s report."""
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith(f"ERROR   {code} ")), None)
    assert at is not None, done.stdout
    assert lines[at + 1].strip().startswith("fix: "), done.stdout
    return lines[at], lines[at + 1]


def error_and_fix(done: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    error, fix = done.stderr.splitlines()[-2:]
    assert error.startswith("error: ") and fix.startswith("fix:"), done.stderr
    return error, fix


# --- row 5: nesting ---------------------------------------------------------------------------------

def test_row5_a_template_nested_3000_deep_is_a_named_error_not_a_recursion_error(
        root: Path, tmp_path: Path) -> None:
    done, took = check(root, "deep.jinja", tmp_path)
    error, fix = the_finding(done, "chat-template-limit")
    assert "[VLLM_CHAT_TEMPLATE @ --set]: chat template chat-templates/deep.jinja nests too deeply" in error
    assert "recursion limit" in error and "flatten the nesting" in fix
    assert took < BOUND_S
    error, fix = error_and_fix(invoke(root, "template-check", "--template", "chat-templates/deep.jinja",
                                      home=tmp_path)[0])
    assert "chat-templates/deep.jinja nests too deeply to compile" in error


# --- row 6: time ------------------------------------------------------------------------------------

@pytest.mark.slow  # it runs into the 10 s limit on purpose; the quick variant is below
def test_row6_a_template_looping_10_to_the_10_stops_check_at_the_wall_limit(
        root: Path, tmp_path: Path) -> None:
    done, took = check(root, "loop.jinja", tmp_path)
    error, fix = the_finding(done, "chat-template-limit")
    assert "chat template chat-templates/loop.jinja did not finish rendering" in error
    assert f"{LIMITS.wall_s:g} s wall-clock limit" in error and "512 MiB" in error
    assert "loop" in fix
    assert LIMITS.wall_s <= took < BOUND_S


def test_the_wall_limit_holds_for_every_render_of_a_check_together() -> None:
    started = time.monotonic()
    with pytest.raises(TemplateLimitError, match=r"loop\.jinja did not finish rendering the corpus "
                                                 r"within the 1 s wall-clock limit"):
        check_source(LOOP, "loop.jinja", limits=RenderLimits(wall_s=1.0))
    assert time.monotonic() - started < 10


# --- row 13: what is not a template file ------------------------------------------------------------

@pytest.mark.parametrize(("kind", "said"), [
    ("/dev/zero", "is a device, not a regular file"),
    ("fifo", "is a FIFO (named pipe), not a regular file"),
    ("folder", "is a folder, not a regular file"),
    ("2 MiB", "is 2097152 bytes, over the 1 MiB limit of a template file"),
])
def test_row13_dev_zero_a_fifo_a_folder_or_a_huge_file_is_refused_before_it_is_read(
        root: Path, tmp_path: Path, kind: str, said: str) -> None:
    path = Path(kind)
    if kind == "fifo":
        path = tmp_path / "t.jinja"
        os.mkfifo(path)  # opening it for reading would wait for a writer for ever
    elif kind == "folder":
        path = tmp_path / "t.jinja"
        path.mkdir()
    elif kind == "2 MiB":
        path = tmp_path / "t.jinja"
        path.write_bytes(b"x" * (2 * 1024 * 1024))
    done, took = invoke(root, "template-check", "--template", str(path), home=tmp_path)
    error, fix = error_and_fix(done)
    assert error == f"error: chat template {path} {said}"
    assert "a chat template is a text file of a few KB" in fix
    assert took < BOUND_S


def test_the_file_guard_never_reads_what_it_refuses(tmp_path: Path) -> None:
    with pytest.raises(TemplateLimitError, match="is a device"):
        read_template_text(Path("/dev/zero"), "zero", missing_fix="-")
    sparse = tmp_path / "sparse.jinja"
    with sparse.open("wb") as handle:
        handle.truncate(64 * 1024**3)  # 64 GiB on paper, nothing on disk
    with pytest.raises(TemplateLimitError, match="68719476736 bytes, over the 1 MiB limit"):
        read_template_text(sparse, "sparse", missing_fix="-")


# --- memory, and what a template says ---------------------------------------------------------------

def test_a_template_building_10_gb_is_the_memory_limit_named(root: Path, tmp_path: Path) -> None:
    done, took = check(root, "huge.jinja", tmp_path)
    error, fix = the_finding(done, "chat-template-limit")
    assert "chat-templates/huge.jinja needs more than the 512 MiB memory limit to render" in error
    assert "multiplied by a large number" in fix
    assert took < BOUND_S


def test_what_a_template_raises_reaches_the_terminal_quoted(root: Path, tmp_path: Path) -> None:
    path = tmp_path / "shouts.jinja"
    path.write_text(SHOUTS, encoding="utf-8")
    done, _ = invoke(root, "template-check", "--template", str(path), home=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr
    assert "\x1b" not in done.stdout + done.stderr
    assert not any(line.startswith("error: fake") for line in done.stdout.splitlines())
    assert "raise_exception: '\\x1b[2J\\x1b[31mowned\\nerror: fake line'" in done.stdout


# --- the bounded path renders what the in-process one does -----------------------------------------

def test_the_sandboxed_check_reports_what_the_in_process_one_does() -> None:
    source = (ROOT / "chat-templates" / "qwen3.jinja").read_text(encoding="utf-8")
    kwargs = {"tool_call_format": "xml"}

    def count(text: str) -> int:
        return len(text.split())

    inside = check_template(ChatTemplate(source, "qwen3"), parser="qwen3_coder", kwargs=kwargs,
                            count_tokens=count)
    bounded = check_source(source, "qwen3", parser="qwen3_coder", kwargs=kwargs, count_tokens=count)
    assert bounded == inside and bounded.waste and not bounded.failed
    broken = check_source(source.replace("{%- set thinking = not (", "{%- set thinking = true or not ("),
                          "broken", parser="hermes")
    assert broken.failed_properties() == ["thinking-off"]
    # Asked again (the router's next load), the answer is remembered: equal, never shared.
    again = check_source(source.replace("{%- set thinking = not (", "{%- set thinking = true or not ("),
                         "broken", parser="hermes")
    assert again == broken and again.failures is not broken.failures and again.notes is not broken.notes


def test_check_says_what_a_template_that_is_not_a_file_is(tmp_path: Path) -> None:
    # A FIFO named as the profile's template: one finding that says it is a FIFO (not "does
    # not exist"), from the template rule, and `check` returns at once (a FIFO is never opened
    # for a blocking read).
    import os

    from helpers import copy_project

    from vllmstack.checks.registry import check_profile
    from vllmstack.config.profiles import resolve
    from vllmstack.core.paths import Project
    from vllmstack.core.runner import RecordingRunner

    project = Project(copy_project(tmp_path / "stack"))
    os.mkfifo(project.root / "chat-templates" / "pipe.jinja")
    resolved = resolve(project, platform="cpu", model="tiny", overrides=["VLLM_CHAT_TEMPLATE=pipe.jinja"])
    findings = check_profile(project, resolved, {}, RecordingRunner())
    codes = [f.code for f in findings if f.severity == "error"]
    assert "missing-chat-template" not in codes
    (limit,) = [f for f in findings if f.code == "chat-template-limit"]
    assert "is a FIFO (named pipe), not a regular file" in limit.message

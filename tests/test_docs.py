"""README.md and docs/ say only what the tasks accept, and link only to what exists (issue 34, item 7).

README.md keeps the set-up, the quick starts and a map of docs/ (at most 15 KB); every other
command family has a page in docs/. What a page shows must stay true without a GPU to run it on:

* every `invoke ...` line of every fenced block, and every inline `invoke ...` span, goes through
  invoke's own parser with the Collection tasks.py builds (the generated bench tasks included):
  the task exists, takes those options, and takes those values (the options' declared `Value`s
  refuse a bad one while invoke parses, vllmstack/cli/values.py);
* every task of that Collection is shown somewhere (`invoke NAME` in README.md or docs/);
* every relative link resolves to a file, and every `#anchor` to a heading of its page;
* a docs/ ```bash block is run by the README walk on a CPU-only fresh clone, so its lines must be
  ones that start nothing and finish in seconds; what needs a GPU or a long build is ```sh.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from docs_blocks import (
    README,
    RUNNABLE,
    STATIC,
    command_lines,
    doc_pages,
    fences,
    invoke_commands,
    outside_fences,
    shown,
)
from helpers import load_tasks
from invoke.collection import Collection
from invoke.exceptions import ParseError
from invoke.parser.context import ParserContext
from invoke.parser.parser import Parser
from invoke.program import Program

README_MAX_BYTES = 15_000
PAGES = [README, *doc_pages()]
COLLECTION = Collection.from_module(load_tasks())
LANGUAGES = {RUNNABLE, *STATIC, "json", "yaml", "text", "jinja"}
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*")  # `invoke TASK -h`: a name the reader fills in
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]+`")
# What a docs/ ```bash line may run: tasks that only read (and write only git-ignored files), in
# the forms that start nothing. Anything else there would make the README walk slow or need a GPU.
READ_ONLY = {"profiles", "config", "check", "engines", "template-check", "export",
             "startup"}  # reads a log or the recorded boots
STARTS_NOTHING = {"--dry-run", "--plan"}
ONLY_WITH = {"update-check": "--offline"}  # asks github, PyPI and Docker Hub otherwise
SLOW_FORMS = {"--deep"}  # check --deep creates a 2 GB parser environment the first time


def parse_problem(argv: list[str], complete: bool = True) -> str | None:
    """Why invoke would refuse `invoke ARGV` while reading it (unknown task or option, a value
    the option's declaration refuses, a missing positional argument unless `complete` is False:
    prose names a task without its KIND); None when it would run. A placeholder value (`--timeout
    S`) is read as the option's own example, which its refusal names."""
    words = argv[:argv.index("--")] if "--" in argv else list(argv)
    for _ in range(len(words) + 1):
        contexts = COLLECTION.to_contexts()  # fresh: a parse fills in the arguments' values
        parser = Parser(initial=ParserContext(args=Program().core_args()), contexts=contexts)
        try:
            parser.parse_argv(words)
            return None
        except ParseError as exc:
            said = str(exc)
        if not complete and "did not receive required positional arguments" in said:
            return None
        filled = re.match(r"error: (\S+) '([A-Z][A-Z_]*)' .*\nfix: .*, e\.g\. \1 (\S+)$", said, re.S)
        if not filled or filled[2] not in words:
            return said.splitlines()[0]
        words[words.index(filled[2])] = filled[3]
    return None


def block_commands() -> Iterator[tuple[str, str, list[str]]]:
    """(where, line, argv) of every invoke command in a shell block of README.md and docs/."""
    for page in PAGES:
        for fence in fences(page):
            if fence.lang in (RUNNABLE, *STATIC):
                for line in command_lines(fence.body):
                    for argv in invoke_commands(line):
                        yield fence.where, line, argv


def inline_commands(page: Path) -> Iterator[tuple[str, str, list[str]]]:
    """(where, span, argv) of every inline code span of a page that is an invoke command."""
    text = outside_fences(page)
    for match in INLINE_CODE.finditer(text):
        span = " ".join(match[0].strip("`").split())
        if span.startswith("invoke "):
            where = f"{shown(page)}:{text.count(chr(10), 0, match.start()) + 1}"
            for argv in invoke_commands(span):
                yield where, span, argv


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation (backticks too) dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", outside_fences(page), re.M):
        base = slug(match[1])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problems(page: Path) -> list[str]:
    """Each relative link of a page (outside code) that names no file, or no heading of it."""
    problems = []
    text = INLINE_CODE.sub(lambda m: " " * len(m[0]), outside_fences(page))
    for match in LINK.finditer(text):
        target = match[1]
        if re.match(r"[a-z]+:", target):  # https:, mailto: are not the checkout's to resolve
            continue
        where = f"{shown(page)}:{text.count(chr(10), 0, match.start()) + 1}"
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{where}: {target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            problems.append(f"{where}: {target}: no heading #{anchor} in {shown(file)}")
    return problems


def test_the_readme_stays_within_its_budget() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move a section to docs/"


def test_the_readme_maps_every_docs_page() -> None:
    pages = doc_pages()
    assert len(pages) >= 10, "docs/ lost its pages"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", README.read_text(encoding="utf-8")))
    assert {f"docs/{p.name}" for p in pages} <= linked, "a docs/ page the README's map omits"


def test_every_relative_link_resolves() -> None:
    problems = [problem for page in PAGES for problem in link_problems(page)]
    assert problems == []


def test_the_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: yes\n")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](other.md#a-code-heading-yes) [here](#title) "
                    "[gone](missing.md) [bad](other.md#nope) [self](#nope)\n"
                    "`[in code](missing.md)`\n\n```sh\n[in a block](missing.md)\n```\n")
    assert [p.split(": ", 1)[1] for p in link_problems(page)] == [
        "missing.md: no such file", f"other.md#nope: no heading #nope in {tmp_path / 'other.md'}",
        f"#nope: no heading #nope in {page}"]


def test_every_file_the_pages_name_exists() -> None:
    """A module, test, script or benchmark named in backticks is there (a moved module moves its
    mention); names with a placeholder or a wildcard in them are patterns, not files."""
    named = re.compile(r"`((?:vllmstack|tests|benchmarks|scripts|patches|env|chat-templates|"
                       r"engine-plugins)/[\w./-]+\.(?:py|md|sh|json|yaml|toml|txt|env|jinja|patch))`")
    root = README.parent
    missing = [f"{shown(page)}: {path}" for page in PAGES
               for path in named.findall(page.read_text(encoding="utf-8")) if not (root / path).exists()]
    assert missing == []


def test_every_fence_says_what_it_is() -> None:
    """A docs block's language decides whether the README walk runs it: none may be left out."""
    unknown = [f"{fence.where}: ```{fence.lang}" for page in PAGES for fence in fences(page)
               if fence.lang not in LANGUAGES]
    assert unknown == []


def test_every_invoke_line_in_a_block_is_one_invoke_accepts() -> None:
    checked = list(block_commands())
    assert len(checked) >= 50, "the blocks' invoke lines were not found"
    problems = [f"{where}: {line.strip()}: {problem}" for where, line, argv in checked
                if (problem := parse_problem(argv))]
    assert problems == []


def test_every_inline_invoke_span_is_one_invoke_accepts() -> None:
    checked = [(w, s, a) for page in PAGES for w, s, a in inline_commands(page)
               if not (a and PLACEHOLDER.fullmatch(a[0]))]
    assert len(checked) >= 100, "the pages' inline invoke commands were not found"
    problems = [f"{where}: `{span}`: {problem}" for where, span, argv in checked
                if (problem := parse_problem(argv, complete=False))]
    assert problems == []


@pytest.mark.parametrize(("argv", "refused"), [
    (["up", "--runtime", "native", "--dry-run"], None),
    (["probe", "thinkoff"], None),
    (["bench", "-h"], None),
    (["exec", "--", "ls", "-l"], None),
    (["--list"], None),
    (["up", "--no-such-flag"], "No idea what '--no-such-flag' is!"),
    (["no-such-task"], "No idea what 'no-such-task' is!"),
    (["logs", "--tail", "abc"], "error: --tail 'abc' is not a number of lines"),
    (["probe", "no-such-probe"], "error: NAME 'no-such-probe' is not one of"),
    (["probe"], "'probe' did not receive required positional arguments: 'name'"),
    (["up", "--timeout", "S"], None),  # a placeholder: the reader fills it in
    (["up", "--timeout", "soon"], "error: --timeout 'soon' is not a number of seconds"),
])
def test_the_check_refuses_what_invoke_refuses(argv: list[str], refused: str | None) -> None:
    problem = parse_problem(argv)
    assert (problem if refused is None else (problem or "")[:len(refused)]) == refused


def test_docs_lines_are_read_as_a_shell_reads_them() -> None:
    assert invoke_commands("invoke probe itl-stall|thinkoff   # one of them") == [
        ["probe", "itl-stall"], ["probe", "thinkoff"]]
    assert invoke_commands("invoke check [--model M] [--set K=V ...] && invoke down &") == [
        ["check", "--model", "M", "--set", "K=V"], ["down"]]
    assert invoke_commands("curl -sSf http://127.0.0.1:8080/v1/models | jq .") == []
    assert command_lines(["# a comment", "invoke up \\", "  --dry-run", ""]) == [
        "invoke up    --dry-run"]


def test_every_task_is_documented() -> None:
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    names = sorted(COLLECTION.task_names)
    assert {"bench", "bench-conc", "probe", "export", "router"} <= set(names)
    missing = [name for name in names if not re.search(rf"invoke {re.escape(name)}(?![\w-])", text)]
    assert missing == [], f"tasks no page shows as `invoke NAME`: {missing}"


def test_docs_bash_blocks_start_nothing() -> None:
    """The README walk runs every docs/ ```bash line on its clone: read-only tasks and
    --dry-run/--plan forms only, so the walk stays minutes and leaves nothing running."""
    runnable = [(fence.where, line) for page in doc_pages() for fence in fences(page)
                if fence.lang == RUNNABLE for line in command_lines(fence.body)]
    assert runnable, "no docs/ page has a runnable block any more"
    problems = []
    for where, line in runnable:
        commands = invoke_commands(line)
        if not commands:
            problems.append(f"{where}: {line.strip()}: not an invoke command")
        for argv in commands:
            words = set(argv)
            allowed = argv[0] in READ_ONLY or ONLY_WITH.get(argv[0]) in words or words & STARTS_NOTHING
            if not allowed or words & SLOW_FORMS:
                problems.append(f"{where}: {line.strip()}: may start something; use ```sh")
    assert problems == []

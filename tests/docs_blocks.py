"""README.md's and docs/'s fenced blocks and the `invoke` commands in them, read one way for both
tests that use them: the README walk (tests/integration/test_readme_blocks.py) runs the ```bash
blocks of every docs/ page on its fresh clone, and tests/test_docs.py checks every `invoke` line
of every block against the tasks tasks.py declares.

The fence's language is the contract (docs/ pages only; the README's runnable sections are the
walk's own): ```bash runs on a CPU-only machine after the README's walk, so it must be cheap and
must not start a server; ```sh (or ```console) needs a GPU, a network or a long build and is only
checked statically. Standard library only, like helpers.py.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RUNNABLE = "bash"
STATIC = ("sh", "console")
# Shell words that end one command and may start the next one on the same line.
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}
FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>```+)(?P<lang>[\w-]*)\s*$")


@dataclass(frozen=True)
class Fence:
    """One fenced block: its file, the line of its opening fence (1-based), language and body."""

    path: Path
    line: int
    lang: str
    body: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{shown(self.path)}:{self.line}"


def shown(path: Path) -> str:
    """A path as a message names it: relative to the checkout when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def doc_pages() -> list[Path]:
    """Every page of docs/, in name order (the order the README walk runs their blocks in)."""
    return sorted(DOCS.glob("*.md"))


def fences(path: Path) -> list[Fence]:
    """The fenced blocks of a markdown file, indented ones (inside a list item) included; an
    unclosed fence runs to the end of the file, as a renderer shows it."""
    found: list[Fence] = []
    opened: tuple[int, str, str, int] | None = None  # line, lang, ticks, indent
    body: list[str] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = FENCE.match(raw)
        if opened is None:
            if match:
                opened, body = (number, match["lang"], match["ticks"], len(match["indent"])), []
            continue
        if match and not match["lang"] and match["ticks"] == opened[2]:
            found.append(Fence(path, opened[0], opened[1], tuple(body)))
            opened = None
            continue
        body.append(raw[opened[3]:] if raw[:opened[3]].strip() == "" else raw)
    if opened is not None:
        found.append(Fence(path, opened[0], opened[1], tuple(body)))
    return found


def command_lines(body: list[str] | tuple[str, ...]) -> list[str]:
    """A block's command lines as bash reads them: comment-only and blank lines dropped,
    backslash-continued lines joined into one."""
    lines: list[str] = []
    pending = ""
    for raw in body:
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            lines.append(line)
    return lines


def outside_fences(path: Path) -> str:
    """The file's text with every fenced block blanked out (line numbers kept)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for fence in fences(path):
        for index in range(fence.line - 1, min(fence.line + len(fence.body) + 1, len(lines))):
            lines[index] = ""
    return "\n".join(lines)


def shell_words(line: str) -> list[str]:
    """The words of one shell line, comments dropped and operators as words of their own."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def alternatives(line: str) -> list[str]:
    """`invoke probe itl-stall|thinkoff` is the docs' way to say 'one of': one line per choice.
    A real pipe has spaces around it, so only `a|b` inside one unquoted word is a choice."""
    words = re.split(r"(\s+)", line)
    for index, word in enumerate(words):
        choices = word.split("|")
        if len(choices) > 1 and all(choices) and not re.search(r"['\"]", word):
            return [expanded for choice in choices
                    for expanded in alternatives("".join([*words[:index], choice, *words[index + 1:]]))]
    return [line]


def invoke_commands(line: str) -> list[list[str]]:
    """The argv after `invoke` of every invoke command on a shell line (optional `[--flag V]`
    brackets opened up, `...` dropped): [] when the line runs no invoke."""
    found = []
    for choice in alternatives(line):
        try:
            words = shell_words(choice)
        except ValueError:  # an unbalanced quote: not a line a shell would run either
            words = choice.split()
        start = 0
        for index, word in enumerate([*words, ";"]):
            if word not in SEPARATORS:
                continue
            command = words[start:index]
            start = index + 1
            if command and command[0] in ("invoke", "inv"):
                argv = [w.strip("[]") for w in command[1:] if w.strip("[]") not in ("", "...")]
                found.append(argv)
    return found

"""The upstream watchlist of AGENTS.md: the bugs this stack works around, with their state.

Each bullet of the "Upstream watchlist" section is one item; `#NNNN` in it names a vLLM issue or
pull request (vLLM's unless the bullet names another repository as `owner/name#NNNN`). Looking
a number up asks GitHub's API; offline every state is "unknown".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SECTION = "## Upstream watchlist"
DEFAULT_REPO = "vllm-project/vllm"
REFERENCE = re.compile(r"(?:([\w.-]+/[\w.-]+))?#(\d+)")

Lookup = Callable[[int, str], "dict[str, str] | None"]


@dataclass
class WatchItem:
    text: str
    line: int
    references: list[tuple[str, int]] = field(default_factory=list)  # (repo, number)
    states: dict[str, dict[str, str]] = field(default_factory=dict)   # "repo#n" -> state, title

    def summary(self) -> str:
        """The item's first clause (up to its dash), for a table."""
        return self.text.split(" — ")[0].split(" - ")[0].strip()

    def as_json(self) -> dict[str, Any]:
        return {"item": self.summary(), "line": self.line,
                "references": [{"ref": f"{r}#{n}", **self.states.get(f"{r}#{n}", {"state": "unknown"})}
                               for r, n in self.references]}


def read_watchlist(agents: Path) -> list[WatchItem]:
    """The bullets of AGENTS.md's watchlist section (continuation lines joined); [] without it."""
    try:
        lines = agents.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    items: list[WatchItem] = []
    inside = False
    for number, line in enumerate(lines, 1):
        if line.startswith("## "):
            inside = line.strip() == SECTION
            continue
        if not inside:
            continue
        if line.startswith("* "):
            items.append(WatchItem(line[2:].strip(), number))
        elif line.startswith("  ") and items:
            items[-1].text += " " + line.strip()
    for item in items:
        item.references = [(repo or DEFAULT_REPO, int(n)) for repo, n in REFERENCE.findall(item.text)]
    return items


def look_up(items: list[WatchItem], lookup: Lookup) -> None:
    """Fill each reference's state (open, closed, merged) where `lookup` answers."""
    for item in items:
        for repo, number in item.references:
            found = lookup(number, repo)
            item.states[f"{repo}#{number}"] = found or {"state": "unknown"}

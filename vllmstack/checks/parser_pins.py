"""The pinned packages of the `check --deep` parser environment (deep.py), per vLLM release.

The lists live in parser-requirements.txt beside this module, read on first use (never at
import). A new vLLM release gets a new `[VERSION]` section there; nothing here changes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from importlib import resources

REQUIREMENTS_FILE = "parser-requirements.txt"


def parse_pinned_requirements(text: str) -> dict[str, tuple[str, ...]]:
    """REQUIREMENTS_FILE's text: `[VERSION]` headers, each followed by one requirement a line."""
    pins: dict[str, list[str]] = {}
    current: list[str] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            version = line[1:-1].strip()
            if not version or version in pins:
                raise ValueError(f"{REQUIREMENTS_FILE}:{number}: empty or repeated release {line}")
            current = pins[version] = []
        elif current is None:
            raise ValueError(f"{REQUIREMENTS_FILE}:{number}: {line!r} comes before any [VERSION]")
        else:
            current.append(line)
    return {version: tuple(lines) for version, lines in pins.items()}


@functools.cache
def _load_pinned_requirements() -> dict[str, tuple[str, ...]]:
    text = resources.files("vllmstack.checks").joinpath(REQUIREMENTS_FILE).read_text(encoding="utf-8")
    return parse_pinned_requirements(text)


class _PinnedRequirements(Mapping[str, tuple[str, ...]]):
    """vLLM release -> pinned install list, read from REQUIREMENTS_FILE on first use."""

    def __getitem__(self, version: str) -> tuple[str, ...]:
        return _load_pinned_requirements()[version]

    def __iter__(self) -> Iterator[str]:
        return iter(_load_pinned_requirements())

    def __len__(self) -> int:
        return len(_load_pinned_requirements())


PINNED_REQUIREMENTS: Mapping[str, tuple[str, ...]] = _PinnedRequirements()

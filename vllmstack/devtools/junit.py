"""What a test run's JUnit XML files (pytest `--junitxml`, one per tier) say: the counts of the
summary line `invoke test` ends with. Read from the XML, never from pytest's terminal output,
whose wording and layout change between pytest and xdist releases."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Counts:
    """Test outcomes, one per <testcase>; `skip_reasons` counts each skip's reason."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    skip_reasons: Counter[str] = field(default_factory=Counter)

    @property
    def tests(self) -> int:
        return self.passed + self.failed + self.errors + self.skipped

    def add(self, other: Counts) -> None:
        self.passed += other.passed
        self.failed += other.failed
        self.errors += other.errors
        self.skipped += other.skipped
        self.skip_reasons.update(other.skip_reasons)


def _skip_reason(element: ET.Element) -> str:
    # pytest writes the reason as `message` (the text is "file:line: reason"); an xfail is
    # written as a skip too, and says so, so that it is not read as a missing facility.
    reason = (element.get("message") or element.text or "").strip() or "no reason given"
    return f"xfail: {reason}" if element.get("type") == "pytest.xfail" else reason


def read_counts(path: Path) -> Counts:
    """The outcomes in one JUnit XML file. A test case counts once, by its worst outcome: a
    failure, else an error (setup or teardown), else a skip, else a pass. ET.ParseError or
    OSError when the file is not there or not XML (the tier died before pytest wrote it)."""
    counts = Counts()
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if "failure" in tags:
            counts.failed += 1
        elif "error" in tags:
            counts.errors += 1
        elif "skipped" in tags:
            counts.skipped += 1
            skip = case.find("skipped")
            assert skip is not None
            counts.skip_reasons[_skip_reason(skip)] += 1
        else:
            counts.passed += 1
    return counts


def merge(paths: Iterable[Path]) -> tuple[Counts, list[Path]]:
    """The outcomes of every readable file, and the files that were missing or unreadable."""
    total, unread = Counts(), []
    for path in paths:
        try:
            total.add(read_counts(path))
        except (OSError, ET.ParseError):
            unread.append(path)
    return total, unread

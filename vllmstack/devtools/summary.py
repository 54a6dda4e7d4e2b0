"""The one line `invoke test` ends with: where the minutes went and what the tests did, so CI's
log answers "how long, and what ran" without scrolling through pytest's output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllmstack.devtools.junit import Counts

# A skip reason is shortened to this many characters in the line (pytest's `-rs` block above it
# has them whole); long ones name the CPU flags they miss.
REASON_WIDTH = 70


@dataclass(frozen=True)
class Timed:
    """One step: its name (ruff, unit, ...), the group the line sums it under (provision,
    static, unit, integration), how long it took and its exit code."""

    name: str
    group: str
    seconds: float
    returncode: int


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def step_line(step: Timed) -> str:
    """What `invoke test` prints as each step ends."""
    outcome = "ok" if step.returncode == 0 else f"exit {step.returncode}"
    return f"invoke test: {step.name} took {minutes(step.seconds)} min ({outcome})"


def _reason(text: str) -> str:
    one_line = " ".join(text.split())  # the summary is one line, whatever the reason holds
    if len(one_line) <= REASON_WIDTH:
        return one_line
    return one_line[: REASON_WIDTH - 3].rstrip() + "..."


def _plural(n: int, word: str) -> str:
    return word if n == 1 else f"{word}s"


def tests_part(counts: Counts) -> str:
    """`4,571 tests: 4,550 passed, 0 failed, 0 errors, 21 skipped (12 "why", 9 "why")`."""
    text = (f"{counts.tests:,} {_plural(counts.tests, 'test')}: {counts.passed:,} passed, "
            f"{counts.failed:,} failed, {counts.errors:,} {_plural(counts.errors, 'error')}, "
            f"{counts.skipped:,} skipped")
    # Most frequent first; equal counts by reason, so the line is the same for the same run.
    ranked = sorted(counts.skip_reasons.items(), key=lambda item: (-item[1], item[0]))
    if ranked:
        text += " (" + ", ".join(f'{n:,} "{_reason(why)}"' for why, n in ranked) + ")"
    return text


def summary_line(total_seconds: float, steps: Sequence[Timed], counts: Counts | None,
                 unread: Sequence[str] = (), failure: Timed | None = None) -> str:
    """`invoke test: 31.4 min (provision 1.2, static 1.9, unit 3.1, integration 25.2); <tests>`,
    then where a tier wrote no report and which step failed first. `counts` is None when no
    pytest tier ran (a static check failed first)."""
    groups: dict[str, float] = {}
    for step in steps:
        groups[step.group] = groups.get(step.group, 0.0) + step.seconds
    parts = ", ".join(f"{group} {minutes(seconds)}" for group, seconds in groups.items())
    line = f"invoke test: {minutes(total_seconds)} min ({parts})"
    line += f"; {tests_part(counts)}" if counts is not None else "; no tests ran"
    if unread:
        line += f"; no JUnit report from {', '.join(unread)}"
    if failure is not None:
        line += f"; first failure: {failure.name} (exit {failure.returncode})"
    return line

"""Pass / fail / inconclusive results with a check table, shared by probes and stability runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}
INFO = "info"


@dataclass
class Check:
    name: str
    value: str
    verdict: str  # pass | fail | inconclusive | info
    note: str = ""


@dataclass
class Verdict:
    """A named run's checks; the overall verdict is the worst check (info rows never count)."""

    name: str
    checks: list[Check] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    forced: str | None = None  # set when the run could not reach its checks at all

    def add(self, name: str, value: object, verdict: str, note: str = "") -> None:
        self.checks.append(Check(name, str(value), verdict, note))

    def expect(self, name: str, ok: bool, value: object, note: str = "") -> bool:
        self.add(name, value, PASS if ok else FAIL, note)
        return ok

    def inconclusive(self, reason: str) -> Verdict:
        self.forced = INCONCLUSIVE
        self.add("outcome", reason, INCONCLUSIVE)
        return self

    @property
    def verdict(self) -> str:
        if self.forced:
            return self.forced
        counted = [c.verdict for c in self.checks if c.verdict != INFO]
        if FAIL in counted:
            return FAIL
        if INCONCLUSIVE in counted or not counted:
            return INCONCLUSIVE
        return PASS

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def table(self) -> str:
        """A plain-text table: check, value, verdict, note; then the overall line."""
        rows = [("check", "value", "result", "note")] + [
            (c.name, c.value, c.verdict.upper(), c.note) for c in self.checks]
        widths = [min(48, max(len(r[i]) for r in rows)) for i in range(4)]
        lines = []
        for n, row in enumerate(rows):
            cells = [row[i][:48].ljust(widths[i]) for i in range(3)] + [row[3]]
            lines.append("  ".join(cells).rstrip())
            if n == 0:
                lines.append("  ".join("-" * w for w in widths[:3]) + "  ----")
            elif len(row[1]) > 48:
                lines.append(f"  {row[0]}: {row[1]}")  # a long reason is read in full, not cut
        lines.append(f"{self.name.upper()}: {self.verdict.upper()}")
        return "\n".join(lines)

    def as_record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "checks": [c.__dict__ for c in self.checks],
            "details": self.details,
        }

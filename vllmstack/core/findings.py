"""Findings: one problem (or note) about the resolved settings, with where it came from and a fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    severity: str
    code: str
    message: str
    key: str | None = None
    source: str | None = None
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        where = f" [{self.key} @ {self.source}]" if self.key and self.source else ""
        if self.key and not self.source:
            where = f" [{self.key}]"
        text = f"{self.severity.upper():7} {self.code}{where}: {self.message}"
        if self.fix:
            text += f"\n        fix: {self.fix}"
        return text


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: order[f.severity])

"""The one error base: every failure a user can act on says its cause and, where known, the fix.

Domain errors (profile selection, lifecycle, runtimes, builds, patches, benchmarks) subclass
`StackError`, so `tasks.py` turns all of them into an exit with one decorator, and a layer can
let a lower layer's error through unchanged instead of re-wrapping it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StackError(Exception):
    """A step failed for a reason the user can fix; `render()` is what they read last."""

    def __init__(self, cause: str, fix: str | None = None, details: Sequence[str] = ()) -> None:
        super().__init__(cause)
        self.cause = cause
        self.fix = fix
        self.details = list(details)

    def render(self) -> str:
        lines = [*self.details, f"error: {self.cause}"]
        if self.fix:
            lines.append(f"fix:   {self.fix}")
        return "\n".join(lines)


class SettingError(StackError):
    """A setting's value cannot be used as its schema type (named with the file:line it came from)."""

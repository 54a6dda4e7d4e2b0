"""What `invoke doctor` reports and what it reads the host through.

`HostCheck` is one line of the report; `DoctorReport` is all of them with the JSON contract
(documented in the package docstring); `HostView` is the host itself: a root folder for sysfs,
/dev and /etc (a recorded tree in tests), a runner for the tools, the invoking user and how a
device node is looked at. Nothing here reads the host until a check asks.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllmstack.core.runner import Result, Runner

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
STATUSES = (PASS, WARN, FAIL, SKIP)
# Bumped only when a field changes meaning or goes away; new fields do not bump it.
JSON_SCHEMA = 1


@dataclass(frozen=True)
class HostCheck:
    """One prerequisite: PASS/WARN/FAIL (SKIP: does not apply here) with what was seen and a fix."""

    id: str  # stable: scripts and `up`'s guard codes (host-<id>) use it
    title: str
    status: str
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    guard: bool = False  # part of the fast subset `up` runs as guards

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "status": self.status, "detail": self.detail,
                "fix": self.fix, "guard": self.guard, "data": self.data}


@dataclass(frozen=True)
class DoctorReport:
    platform: str
    vendor: str
    checks: tuple[HostCheck, ...]

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s.lower(): sum(c.status == s for c in self.checks) for s in STATUSES}

    def check(self, check_id: str) -> HostCheck:
        return next(c for c in self.checks if c.id == check_id)

    def as_json(self) -> dict[str, Any]:
        return {"schema": JSON_SCHEMA, "platform": self.platform, "vendor": self.vendor,
                "ok": not self.failed, "counts": self.counts(),
                "checks": [c.as_json() for c in self.checks]}


def render_doctor(report: DoctorReport) -> str:
    width = max((len(c.id) for c in report.checks), default=0)
    lines = [f"host prerequisites for platform {report.platform} (GPU_VENDOR={report.vendor})"]
    for check in report.checks:
        lines.append(f"{check.status:4}  {check.id:{width}}  {check.detail}")
        if check.fix and check.status in (WARN, FAIL):
            lines.append(f"{'':4}  {'':{width}}  fix: {check.fix}")
    counts = report.counts()
    lines.append(", ".join(f"{counts[s.lower()]} {s}" for s in STATUSES if counts[s.lower()]))
    return "\n".join(lines)


# --- the host --------------------------------------------------------------------------------


@dataclass(frozen=True)
class UserIds:
    """Who runs the stack: the groups of this session (what the kernel checks) and the names."""

    uid: int
    name: str
    gids: frozenset[int]

    @classmethod
    def current(cls) -> UserIds:
        uid = os.getuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        return cls(uid, name, frozenset({os.getgid(), *os.getgroups()}))


@dataclass(frozen=True)
class NodeStat:
    """A device node: permission bits, owner, group, and whether this user may read and write it
    (access(2), so ACLs such as logind's uaccess count)."""

    mode: int
    uid: int
    gid: int
    user_rw: bool


def stat_node(path: Path) -> NodeStat | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return NodeStat(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                    os.access(path, os.R_OK | os.W_OK))


@dataclass
class HostView:
    """The host as the checks read it. `runner` None: no program may run (the fast subset on
    AMD reads sysfs only); a check that needs one says it could not look."""

    root: Path = Path("/")
    runner: Runner | None = None
    user: UserIds = field(default_factory=UserIds.current)
    node_stat: Callable[[Path], NodeStat | None] = stat_node
    # Results of read-only commands, so two checks asking the same thing run it once.
    _memo: dict[tuple[str, ...], Result] = field(default_factory=dict, repr=False)

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")

    def read(self, host_path: str) -> str | None:
        try:
            return self.path(host_path).read_text(errors="replace")
        except OSError:
            return None

    def run(self, *argv: str, timeout: float = 20) -> Result:
        """A read-only query through the runner (memoised); exit 127 when no runner is given."""
        if argv not in self._memo:
            self._memo[argv] = (self.runner.run(list(argv), mutates=False, timeout=timeout)
                                if self.runner is not None else
                                Result(argv, 127, "", "not run: no runner"))
        return self._memo[argv]

    def group(self, name: str) -> tuple[int, tuple[str, ...]] | None:
        """gid and listed members of a group, from <root>/etc/group (the render and video groups
        are local system groups); the live database when the root is the real one."""
        text = self.read("/etc/group")
        for line in (text or "").splitlines():
            parts = line.split(":")
            if len(parts) >= 4 and parts[0] == name and parts[2].isdigit():
                return int(parts[2]), tuple(m for m in parts[3].split(",") if m)
        if self.root == Path("/"):
            try:
                entry = grp.getgrnam(name)
            except KeyError:
                return None
            return entry.gr_gid, tuple(entry.gr_mem)
        return None

    def group_name(self, gid: int) -> str:
        text = self.read("/etc/group") or ""
        for line in text.splitlines():
            parts = line.split(":")
            if len(parts) >= 3 and parts[2] == str(gid):
                return parts[0]
        return str(gid)

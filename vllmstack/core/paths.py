"""Where the stack's files live. Built from a root passed in, never from import-time state."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Project:
    root: Path

    @classmethod
    def find(cls, start: Path | None = None) -> Project:
        """The nearest folder upward from `start` that holds tasks.py and env/."""
        here = (start or Path.cwd()).resolve()
        for folder in (here, *here.parents):
            if (folder / "tasks.py").is_file() and (folder / "env").is_dir():
                return cls(folder)
        return cls(here)

    @property
    def env_dir(self) -> Path:
        return self.root / "env"

    @property
    def dotenv(self) -> Path:
        return self.root / ".env"

    @property
    def dotenv_example(self) -> Path:
        return self.root / ".env.example"

    @property
    def generated(self) -> Path:
        """Git-ignored: rendered compose override, resolved env, argv, run state."""
        return self.root / "generated"

    @property
    def cache(self) -> Path:
        """Git-ignored caches the tasks create (bare mirrors, parser venvs)."""
        return self.root / ".cache"

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def benchmarks(self) -> Path:
        """Tracked: the scripts that measure the stack and their reports."""
        return self.root / "benchmarks"

    @property
    def results(self) -> Path:
        """Git-ignored: this host's benchmark history (bench, bench-vs, burn). Use
        `results_folder`, which also brings over what older versions wrote into benchmarks/."""
        return self.root / "results"


# What benchmark runs wrote into benchmarks/ before the history moved to results/ (a clone's
# `git status` stayed dirty). Append-only files are merged, oldest first; for the others the
# file in results/ is the newer one, and the old one is kept beside it as NAME.from-benchmarks.
APPEND_ONLY = ("*_history.jsonl", "bench-vs-history.md",
               "burn-[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9].md")
REPLACED = ("*_history.jsonl.[0-9]", "bench-vs-results.md", "burn-latest.md")


def results_folder(project: Project) -> Path:
    """results/ (created), with any history left in benchmarks/ moved into it first; nothing
    is lost: see APPEND_ONLY and REPLACED. Returns the folder."""
    folder = project.results
    folder.mkdir(parents=True, exist_ok=True)
    old = project.benchmarks
    if not old.is_dir():
        return folder
    for pattern in (*APPEND_ONLY, *REPLACED):
        for legacy in sorted(old.glob(pattern)):
            if not legacy.is_file():
                continue
            target = folder / legacy.name
            if not target.exists():
                os.replace(legacy, target)
            elif pattern in APPEND_ONLY:
                _merge(legacy, target)
            else:
                os.replace(legacy, target.with_name(f"{target.name}.from-benchmarks"))
    return folder


def _merge(legacy: Path, target: Path) -> None:
    """legacy's lines, then target's, into target; under the lock every history writer takes
    (bench.report.history.lock_path), so a run appending now loses nothing."""
    fd = os.open(target.with_name(target.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        merged = target.with_name(f".{target.name}.merging")
        merged.write_bytes(_complete(legacy.read_bytes()) + target.read_bytes())
        os.replace(merged, target)
        legacy.unlink()
    finally:
        os.close(fd)


def _complete(data: bytes) -> bytes:
    """Text that ends its last line, so the next file's first line stays a line of its own."""
    return data if not data or data.endswith(b"\n") else data + b"\n"


def home_dir(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or os.path.expanduser("~"))

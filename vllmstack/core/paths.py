"""Where the stack's files live. Built from a root passed in, never from import-time state."""

from __future__ import annotations

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
        return self.root / "benchmarks"


def home_dir(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or os.path.expanduser("~"))

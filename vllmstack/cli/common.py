"""What every task module shares: the project of the working folder, the resolver, the runner,
JSON output and the help texts of the common options."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from vllmstack.config.profiles import Resolved, resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import SubprocessRunner

# Help shared by every task that resolves a profile.
PROFILE_HELP = {"model": "model profile (env/models/NAME.env); default: MODEL_PROFILE in .env",
                "platform": "platform layer (env/platforms/NAME.env); default: PLATFORM in .env",
                "set": "KEY=VALUE override, repeatable; applied last"}
# The commands that talk to the running stack (status, logs, down) default to what runs.
RUNNING_HELP = {**PROFILE_HELP,
                "model": "model profile; default: the running stack's (generated/state.json), "
                         "else MODEL_PROFILE in .env",
                "platform": "platform layer; default: the running stack's, else PLATFORM in .env"}
JSON_HELP = {"json": "print JSON instead of text"}
Opt = str | None  # a flag that may be left out
Sets = list[str] | None  # --set KEY=VALUE, repeatable

project_here = Project.find  # the project of the working folder
make_runner = SubprocessRunner  # make_runner(dry_run)


def resolve_here(model: Opt, platform: Opt, sets: Sets) -> Resolved:
    return resolve(project_here(), platform=platform, model=model, overrides=sets or [],
                   environ=os.environ)


def follow_here(model: Opt, platform: Opt, sets: Sets) -> Resolved:
    """For the commands that talk to the running stack: its recorded profile and platform where
    the flags name none (serve.running), .env's only when nothing runs; a note on stderr when the
    two differ."""
    from vllmstack.serve.running import resolve_following

    return resolve_following(project_here(), model=model, platform=platform, overrides=sets or [],
                             environ=os.environ, say=lambda line: print(line, file=sys.stderr),
                             fallback=True)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))
    sys.stdout.flush()

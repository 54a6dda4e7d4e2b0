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
JSON_HELP = {"json": "print JSON instead of text"}
Opt = str | None  # a flag that may be left out
Sets = list[str] | None  # --set KEY=VALUE, repeatable

project_here = Project.find  # the project of the working folder
make_runner = SubprocessRunner  # make_runner(dry_run)


def resolve_here(model: Opt, platform: Opt, sets: Sets) -> Resolved:
    return resolve(project_here(), platform=platform, model=model, overrides=sets or [],
                   environ=os.environ)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))
    sys.stdout.flush()

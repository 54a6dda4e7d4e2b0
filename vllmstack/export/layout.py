"""The engine container's layout as compose.yaml states it, read once for every export target.

compose.yaml is where the stack says what the engine container looks like inside: the cache
folders and their variables (HOME, HF_HOME, VLLM_CACHE_ROOT, ...), where the chat templates and the
fused-MoE configs are mounted, the health check. An export carries exactly that layout to a pod
or a Quadlet unit instead of restating it, so a change to compose.yaml reaches every target (and
a change this module cannot place fails loudly, naming compose.yaml).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.runtime.compose_files import ENGINE_SERVICE

# What each host side of a compose.yaml volume is, by the variable or folder that names it.
HF_CACHE = "hf-cache"
ENGINE_CACHE = "engine-cache"
CHAT_TEMPLATES = "chat-templates"
MOE_CONFIGS = "fused_moe_configs"
ROLES = {"${VLLMSTACK_HF_CACHE_DIR": HF_CACHE, "${VLLMSTACK_ENGINE_CACHE_DIR": ENGINE_CACHE,
         "./chat-templates": CHAT_TEMPLATES, "./fused_moe_configs": MOE_CONFIGS}
DURATION = re.compile(r"^(\d+)s$")
PORT_VARIABLE = re.compile(r"\$\{VLLMSTACK_VLLM_PORT[^}]*\}")


class LayoutError(StackError):
    """compose.yaml's engine service is not what the export knows how to carry."""


@dataclass(frozen=True)
class Health:
    """compose.yaml's health check of the engine: the command (with ${VLLMSTACK_VLLM_PORT} still
    in it) and its timing in seconds."""

    test: tuple[str, ...]
    interval: int
    timeout: int
    retries: int

    def command(self, port: int) -> list[str]:
        """The check's command (after compose's CMD marker) for an engine on `port`."""
        words = self.test[1:] if self.test and self.test[0] == "CMD" else self.test
        return [PORT_VARIABLE.sub(str(port), w) for w in words]


@dataclass(frozen=True)
class Layout:
    environment: dict[str, str]   # the static engine environment (cache folders, tuned configs)
    mounts: dict[str, str]        # role (HF_CACHE, ...) -> folder inside the container
    health: Health
    stop_grace: int               # seconds between SIGTERM and SIGKILL


def read_layout(project: Project) -> Layout:
    """The engine service of the project's compose.yaml; LayoutError when a part is missing."""
    path = project.root / "compose.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        service = data["services"][ENGINE_SERVICE]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise LayoutError(f"cannot read the {ENGINE_SERVICE} service of {path}: {exc}",
                          "restore compose.yaml from git (git checkout -- compose.yaml)") from exc
    env = service.get("environment") or {}
    if not isinstance(env, dict) or any("${" in str(v) for v in env.values()):
        raise _unexpected(path, "environment", "a mapping of literal values")
    mounts: dict[str, str] = {}
    for entry in service.get("volumes") or []:
        text = str(entry)
        # The host side may be `${VAR:?message}`, whose colon is not the separator.
        source, _, rest = text.partition("}:") if text.startswith("${") else text.partition(":")
        role = next((r for prefix, r in ROLES.items() if source.startswith(prefix)), None)
        target = rest.partition(":")[0]
        if role is None or not target.startswith("/"):
            raise _unexpected(path, f"volume {entry!r}", "one of the known folders "
                              f"({', '.join(sorted(ROLES))}) mounted at an absolute path")
        mounts[role] = target
    missing = sorted(set(ROLES.values()) - set(mounts))
    if missing:
        raise _unexpected(path, "volumes", f"mounts for {', '.join(missing)}")
    check = service.get("healthcheck") or {}
    test = check.get("test")
    if not isinstance(test, list) or not all(isinstance(w, str) for w in test):
        raise _unexpected(path, "healthcheck.test", "a list of words")
    health = Health(tuple(test), _seconds(path, check, "interval"), _seconds(path, check, "timeout"),
                    int(check.get("retries", 3)))
    grace = _seconds(path, service, "stop_grace_period")
    return Layout({str(k): str(v) for k, v in env.items()}, mounts, health, grace)


def _seconds(path: Path, part: dict[str, Any], key: str) -> int:
    match = DURATION.match(str(part.get(key, "")))
    if not match:
        raise _unexpected(path, key, "a duration in seconds such as 30s")
    return int(match.group(1))


def _unexpected(path: Path, what: str, wanted: str) -> LayoutError:
    return LayoutError(f"{path}: the {ENGINE_SERVICE} service's {what} is not {wanted}, so "
                       "`invoke export` cannot carry the container's layout",
                       "keep compose.yaml's engine service in the shape vllmstack/export/layout.py "
                       "reads, or teach that module the new part")

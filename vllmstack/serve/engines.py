"""The checkout's engines: `invoke up`'s default one and the named ones (the router runs one per
profile, several at once on the native runtime), for the guards, `status` and `down`.

A named engine's files are in generated/engines/NAME/ (core.checkout.engine_dir); its state file
names its profile and URL. Nothing here assumes a single engine: `up` refuses while an engine of
the checkout that is not one of its siblings answers (the router's engines are each other's
siblings, so they never block one another; a user's `invoke up` engine blocks them, and they
block it), `status` lists every one, and `down` of the default engine stops them all.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from vllmstack.config.profiles import resolve
from vllmstack.core.checkout import engine_names
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project
from vllmstack.observe.health import health_status, is_sleeping
from vllmstack.serve.stack import Stack, open_stack
from vllmstack.serve.state import StateError, read_state


@dataclass(frozen=True)
class OtherEngine:
    """Another engine of the checkout, as its state file records it."""

    slot: str  # "" = the default engine
    profile: str
    url: str

    @property
    def shown(self) -> str:
        who = f"the engine {self.slot!r}" if self.slot else "the default engine (`invoke up`)"
        return f"{who} of profile {self.profile or '?'} at {self.url or '?'}"


def recorded_engines(project: Project) -> list[OtherEngine]:
    """Every engine of the checkout with a state file (started and not stopped by `down`);
    a damaged state file counts too (its engine may run), with what is known."""
    found = []
    for slot in ["", *engine_names(project.generated)]:
        try:
            state = read_state(project, slot)
        except StateError:
            found.append(OtherEngine(slot, "", ""))
            continue
        if state is not None:
            found.append(OtherEngine(slot, str(state.get("profile") or ""),
                                     str(state.get("url") or "")))
    return found


def answering_others(project: Project, slot: str, siblings: frozenset[str]) -> list[OtherEngine]:
    """The checkout's other engines that answer on their port now, siblings left out."""
    return [e for e in recorded_engines(project)
            if e.slot != slot and e.slot not in siblings and e.url
            and health_status(e.url, timeout=1.0) is not None]


def named_report(project: Project) -> list[dict[str, Any]]:
    """`status` for every named engine: profile, URL, whether it answers, and asleep or awake
    (vLLM's /is_sleeping, for an engine in sleep mode)."""
    out = []
    for engine in recorded_engines(project):
        if not engine.slot:
            continue
        code = health_status(engine.url, timeout=1.0) if engine.url else None
        asleep = is_sleeping(engine.url, timeout=1.0) if code == 200 else None
        state = ("not answering" if code is None else "asleep" if asleep else
                 "healthy" if code == 200 else f"/health {code}")
        out.append({"name": engine.slot, "profile": engine.profile or None, "url": engine.url,
                    "healthy": code == 200, "asleep": bool(asleep), "state": state})
    return out


def named_stack(stack: Stack, slot: str) -> Stack:
    """One of the checkout's named engines, resolved as it was started (its state's profile,
    platform and overrides); the caller's profile where that no longer resolves (stopping it
    needs only its runtime's record)."""
    resolved = stack.resolved
    try:
        state = read_state(stack.project, slot) or {}
    except StateError:
        state = {}
    if isinstance(state.get("profile"), str) and isinstance(state.get("platform"), str):
        sets = [s for s in state.get("sets") or [] if isinstance(s, str)]
        with contextlib.suppress(StackError):
            resolved = resolve(stack.project, platform=state["platform"], model=state["profile"],
                               overrides=sets, environ=stack.environ)
    return open_stack(stack.project, resolved, stack.environ, stack.runner, probe=stack.probe,
                      out=stack.out, slot=slot)

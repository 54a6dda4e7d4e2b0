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
import os
from dataclasses import dataclass
from typing import Any

import requests

from vllmstack.config.profiles import resolve
from vllmstack.core.checkout import engine_names
from vllmstack.core.errors import StackError
from vllmstack.core.files import JsonFileError, read_json_file
from vllmstack.core.paths import Project
from vllmstack.observe.health import health_status, is_sleeping
from vllmstack.serve.running import ROUTER_FILE, router_alive, router_tiers
from vllmstack.serve.stack import LifecycleError, Stack, open_stack
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
    (vLLM's /is_sleeping, for an engine in sleep mode); with a live router, its tier and the
    swap back the router expects from there (generated/router.json)."""
    out = []
    tiers = router_tiers(project)
    for engine in recorded_engines(project):
        if not engine.slot:
            continue
        code = health_status(engine.url, timeout=1.0) if engine.url else None
        asleep = is_sleeping(engine.url, timeout=1.0) if code == 200 else None
        state = ("not answering" if code is None else "asleep" if asleep else
                 "healthy" if code == 200 else f"/health {code}")
        tier = tiers.get(engine.profile or "", {})
        try:
            boot = (read_state(project, engine.slot) or {}).get("boot")
        except StateError:
            boot = None
        out.append({"name": engine.slot, "profile": engine.profile or None, "url": engine.url,
                    "healthy": code == 200, "asleep": bool(asleep), "state": state,
                    "tier": tier.get("tier"), "swap_s": tier.get("swap_s"),
                    "boot": boot})  # its last boot's phases, as `up` measured them
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


# The router's key for its token (router.options.TOKEN_VAR; the router is a layer above this one).
ROUTER_TOKEN_VAR = "ROUTER_TOKEN"
# A router's /v1/unload waits for every engine's `down` (120 s each, at most).
UNLOAD_TIMEOUT_S = 300.0


def unload_through_router(stack: Stack) -> bool:
    """`invoke down` while a router serves the checkout: its engines are the router's, which
    would load them again (and a `down` under it failed, "report how it escaped"), so they are
    stopped through it, POST /v1/unload with the router's token (ROUTER_TOKEN, environment or
    .env). False when no router runs (or this process is the router); LifecycleError naming the
    router when it does not unload them."""
    try:
        record = read_json_file(stack.project.generated / ROUTER_FILE)
    except JsonFileError:
        return False
    if not isinstance(record, dict) or not router_alive(record) or record.get("pid") == os.getpid():
        return False
    url, pid = str(record.get("url") or ""), record.get("pid")
    token = stack.environ.get(ROUTER_TOKEN_VAR) or stack.resolved.get_raw(ROUTER_TOKEN_VAR)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    stop_it = (f"stop the router (Ctrl-C in its terminal, or kill {pid}): it stops every engine "
               "it runs; then `invoke down` again for anything else")
    try:
        answer = requests.post(url + "/v1/unload", json={}, headers=headers,
                               timeout=UNLOAD_TIMEOUT_S)
    except requests.RequestException as exc:
        raise LifecycleError(f"the router (pid {pid}, {url}) serves this checkout and runs its "
                             f"engines, but did not answer POST /v1/unload: {exc}",
                             stop_it) from None
    if answer.status_code != 200:
        why = (f"it refused the request ({answer.status_code}: {ROUTER_TOKEN_VAR} is not the "
               "router's token here, or it started with --token-file)"
               if answer.status_code in (401, 403) else f"it answered {answer.status_code}: "
               f"{answer.text[:200]}")
        raise LifecycleError(f"the router (pid {pid}, {url}) serves this checkout and runs its "
                             f"engines; `down` stops them through it, but {why}; nothing was "
                             "stopped", stop_it)
    print(f"the router (pid {pid}, {url}) serves this checkout: its engines were stopped "
          "through it (POST /v1/unload); it loads a model again on its next request, so stop "
          f"the router itself (kill {pid}) to end it", file=stack.out)
    return True

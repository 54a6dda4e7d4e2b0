"""Which profile the stack runs now: what the commands that talk to it default to.

`invoke up` records its profile, platform and `--set` overrides in generated/state.json; a router
records the profile it has resident in generated/router.json. `status`, `logs`, `exec`, `down`,
`bench`, `probe`, `stability` and the dashboard take their selection from there, so `.env`'s
MODEL_PROFILE and PLATFORM are the default only when nothing runs: a newcomer who ran
`invoke up --platform cpu --model tiny` must not have `invoke bench` look for .env's 27B model.
An explicit --model or --platform (or --set MODEL_PROFILE=/PLATFORM=) still wins, field by field.
When the followed selection differs from .env's, one line says which is used and why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllmstack.config.profiles import ProfileError, Resolved, resolve
from vllmstack.core.errors import StackError
from vllmstack.core.files import JsonFileError, read_json_file
from vllmstack.core.paths import Project
from vllmstack.runtime.native.procs import ProcTable
from vllmstack.serve.state import STATE_FILE, read_state

# The router (a layer above this one) writes it: vllmstack.router.record.ROUTER_FILE.
ROUTER_FILE = "router.json"
# Keys that name the selection itself: recorded apart from the other --set overrides.
SELECTION_KEYS = ("PLATFORM", "MODEL_PROFILE")


@dataclass(frozen=True)
class Running:
    """The selection a running stack was started with, and which file says so."""

    profile: str
    platform: str
    sets: tuple[str, ...]
    source: str  # "generated/state.json" (what `invoke up` started) or "generated/router.json"


def recorded_overrides(resolved: Resolved) -> list[str]:
    """The `--set KEY=VALUE` overrides a profile was resolved with (for state.json), so that a
    command following the running stack resolves exactly what `up` started (its port, its model)."""
    return [f"{key}={setting.value}" for key, setting in resolved.values.items()
            if setting.source == "--set" and key not in SELECTION_KEYS]


def running_selection(project: Project) -> Running | None:
    """What runs: generated/state.json (written by `up`, removed by a successful `down`), else
    the resident profile of a live router; None when neither says anything runs.

    A damaged state.json raises StateError (serve.state): `down` must not guess either."""
    state = read_state(project)
    if state is not None and isinstance(state.get("profile"), str) \
            and isinstance(state.get("platform"), str):
        sets = state.get("sets")
        words = tuple(s for s in sets if isinstance(s, str)) if isinstance(sets, list) else ()
        return Running(state["profile"], state["platform"], words, f"generated/{STATE_FILE}")
    return _router_resident(project)


def _router_resident(project: Project) -> Running | None:
    try:  # damaged (deep, cut short, not JSON): it says nothing about what runs
        data = read_json_file(project.generated / ROUTER_FILE)
    except JsonFileError:
        return None
    if not isinstance(data, dict) or not router_alive(data):
        return None  # a record left by a router that died says nothing about now
    profile, platform = data.get("profile"), data.get("platform")
    if not (isinstance(profile, str) and profile and isinstance(platform, str) and platform):
        return None
    return Running(profile, platform, (), f"generated/{ROUTER_FILE} (the router's resident model)")


def router_tiers(project: Project) -> dict[str, dict[str, Any]]:
    """Per profile, the tier a live router's record says its engine is in (awake, kv-released,
    asleep, stopped) and the swap back from there it expects (`swap_s`); {} with no router."""
    try:
        data = read_json_file(project.generated / ROUTER_FILE)
    except JsonFileError:
        return {}
    if not isinstance(data, dict) or not router_alive(data):
        return {}
    engines = data.get("engines")
    found: dict[str, dict[str, Any]] = {}
    for figures in engines.values() if isinstance(engines, dict) else ():
        if isinstance(figures, dict) and isinstance(figures.get("profile"), str) \
                and isinstance(figures.get("tier"), str):
            swap_s = figures.get("swap_s")
            found[figures["profile"]] = {
                "tier": figures["tier"],
                "swap_s": swap_s if isinstance(swap_s, (int, float)) else None}
    return found


def router_alive(record: dict[str, Any], procs: ProcTable | None = None) -> bool:
    """Whether the router a router.json names still runs: the same pid, start time (clock ticks
    after boot) and boot, so a pid a later program reused is not taken for the router."""
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    procs = procs or ProcTable()
    proc = procs.get(pid)
    if proc is None or proc.zombie:
        return False
    return (record.get("pid_start") == proc.start_ticks
            and record.get("boot_id") == procs.boot_id())


def _named_in(overrides: Sequence[str], key: str) -> bool:
    return any(word.partition("=")[0].strip() == key for word in overrides)


def resolve_following(project: Project, *, model: str | None, platform: str | None,
                      overrides: Sequence[str], environ: Mapping[str, str],
                      say: Callable[[str], None] | None = None,
                      fallback: bool = False) -> Resolved:
    """Resolve the running stack's selection where the caller named none; `.env`'s otherwise.

    `say` gets one line when the followed selection differs from the one .env makes (nothing is
    said when they agree, or when nothing runs). A recorded profile that no longer resolves is
    an error, or with `fallback` (status, logs, down: they find the engine through the state
    file, not the profile) a note and .env's selection."""
    running = running_selection(project)
    if running is None:
        return resolve(project, platform=platform, model=model, overrides=overrides,
                       environ=environ)
    follow_model = model is None and not _named_in(overrides, "MODEL_PROFILE")
    follow_platform = platform is None and not _named_in(overrides, "PLATFORM")
    try:
        chosen = resolve(project, model=running.profile if follow_model else model,
                         platform=running.platform if follow_platform else platform,
                         overrides=[*running.sets, *overrides], environ=environ)
    except ProfileError as exc:
        if fallback:
            if say is not None:
                say(f"note: {running.source} names profile {running.profile} on "
                    f"{running.platform}, which does not resolve here ({exc.cause}); using "
                    ".env's selection")
            return resolve(project, platform=platform, model=model, overrides=overrides,
                           environ=environ)
        raise StackError(
            f"{running.source} says the stack runs profile {running.profile} on "
            f"{running.platform}, which does not resolve here: {exc.cause}",
            "pass --model and --platform, or if nothing runs any more: invoke down") from exc
    if say is not None and (follow_model or follow_platform):
        _say_difference(project, chosen, running, model, platform, overrides, environ, say)
    return chosen


def _say_difference(project: Project, chosen: Resolved, running: Running, model: str | None,
                    platform: str | None, overrides: Sequence[str], environ: Mapping[str, str],
                    say: Callable[[str], None]) -> None:
    try:
        default = resolve(project, platform=platform, model=model, overrides=overrides,
                          environ=environ)
    except StackError:
        default = None  # .env names something that does not exist: any difference is news
    if default is not None and (default.profile, default.platform) == (chosen.profile,
                                                                        chosen.platform):
        return
    instead = (f", not .env's {default.profile} on {default.platform}" if default is not None
               else "")
    say(f"note: using profile {chosen.profile} on {chosen.platform}, which the running stack "
        f"was started with ({running.source}){instead}; --model/--platform pick another")

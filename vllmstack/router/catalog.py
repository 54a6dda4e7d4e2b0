"""The models the router offers: the model profiles made for one platform, by served name.

Every env/models profile whose PROFILE_PLATFORMS names the platform (or exactly the profiles
named with --profiles) is resolved with the stack's one resolver, so a load runs what `invoke up
--model NAME` would run. Clients name a model by its served name (VLLM_SERVED_NAME, what the
engine answers to); the profile's own name is accepted as an alias. The router never starts
anything that is not an entry here.

Where several engines run side by side (the native runtime: `several`), each profile gets an
engine of its own (`slot`, its name in the checkout) on a port of its own: its VLLM_PORT, or the
next free one up when an earlier profile has it; every engine listens on loopback only (the
router is the door; a sleep-mode engine's dev endpoints must not be reachable), and the pool's
ports leave OTHER_ENGINE_PORTS, so the router's own engines never count as another engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from vllmstack.config.engines.kind import EngineKind
from vllmstack.config.engines.table import engine_kind, kind_named
from vllmstack.config.profiles import MODEL_DIR, Resolved, available, resolve
from vllmstack.core.checkout import engine_name as checkout_engine_name
from vllmstack.core.errors import StackError
from vllmstack.core.paths import Project

LOOPBACK = "127.0.0.1"


class CatalogError(StackError):
    """The router cannot start with these profiles; the message names them and the fix."""


@dataclass(frozen=True)
class Entry:
    """One model the router can load."""

    id: str  # the served name: what requests put in "model"
    profile: str
    engine: str  # its engine kind's name (ENGINE)
    resolved: Resolved
    ttl: float  # idle seconds before it is unloaded; 0 = never
    slot: str = ""  # its engine's name in the checkout ("": the default engine, one at a time)

    @property
    def kind(self) -> EngineKind:
        return kind_named(self.engine)

    @property
    def url(self) -> str:
        """Where its engine answers once loaded (the same address `invoke up` serves on)."""
        return f"http://127.0.0.1:{self.resolved.get_int('VLLM_PORT')}"

    @property
    def up_timeout(self) -> float:
        return self.resolved.get_float("UP_TIMEOUT")


@dataclass
class Catalog:
    platform: str
    entries: dict[str, Entry]  # by served name, in profile order
    aliases: dict[str, str]  # profile name -> served name, where they differ
    notes: list[str] = field(default_factory=list)  # what the router changed, to say at start

    @property
    def ids(self) -> list[str]:
        return list(self.entries)

    def find(self, name: str) -> Entry | None:
        """The entry a request's `model` names: its served name, else its profile name."""
        entry = self.entries.get(name)
        if entry is None and name in self.aliases:
            entry = self.entries[self.aliases[name]]
        return entry

    def by_profile(self, profile: str) -> Entry | None:
        return next((e for e in self.entries.values() if e.profile == profile), None)


def engine_name(resolved: Resolved) -> str:
    """The profile's engine kind's name (ENGINE; empty means vLLM)."""
    return engine_kind(resolved).name


def build_catalog(project: Project, environ: Mapping[str, str], *, platform: str | None = None,
                  profiles: Sequence[str] = (), ttl: float | None = None,
                  router_port: int | None = None, overrides: Sequence[str] = (),
                  several: bool = False) -> Catalog:
    """Resolve the router's profiles. `ttl` (--ttl) overrides every profile's IDLE_TTL;
    `router_port` is taken out of OTHER_ENGINE_PORTS (the router answers there, and `up`'s guard
    would otherwise take it for another engine holding the GPU). `several`: one named engine per
    profile, each on its own loopback port (see the module's doc)."""
    known = available(project, MODEL_DIR)
    unknown = [name for name in profiles if name not in known]
    if unknown:
        raise CatalogError(f"--profiles names unknown model profile(s): {', '.join(unknown)} "
                           f"(no env/models/NAME.env)",
                           f"choose among: {', '.join(known) or 'none'}")
    chosen: list[Resolved] = []
    for name in profiles or known:
        resolved = _resolve(project, environ, platform, name, overrides, router_port)
        if profiles or resolved.platform in resolved.get_list("PROFILE_PLATFORMS"):
            chosen.append(resolved)
    if not chosen:
        platform_name = platform or (resolve(project, model=known[0], environ=environ).platform
                                     if known else "?")
        raise CatalogError(f"no model profile lists platform {platform_name} in PROFILE_PLATFORMS, "
                           "so the router has nothing to offer",
                           f"name profiles with --profiles a,b, or add {platform_name} to "
                           "PROFILE_PLATFORMS of the profiles made for it (env/models/*.env)")
    platform_name = chosen[0].platform
    entries: dict[str, Entry] = {}
    for resolved in chosen:
        served = resolved.get_str("VLLM_SERVED_NAME")
        if served in entries:
            other = entries[served]
            raise CatalogError(
                f"profiles {other.profile} and {resolved.profile} both serve the name {served!r} "
                f"on platform {platform_name} (VLLM_SERVED_NAME set at "
                f"{other.resolved.source('VLLM_SERVED_NAME')} and "
                f"{resolved.source('VLLM_SERVED_NAME')}); a request could not say which to load",
                "give one of them another VLLM_SERVED_NAME, or leave one out with --profiles")
        if router_port is not None and resolved.get_int("VLLM_PORT") == router_port:
            raise CatalogError(
                f"the router's port {router_port} is the engine port of profile {resolved.profile} "
                f"(VLLM_PORT set at {resolved.source('VLLM_PORT')})",
                "choose another --port for the router (it forwards to VLLM_PORT)")
        entries[served] = Entry(served, resolved.profile, engine_name(resolved), resolved,
                                float(ttl if ttl is not None else resolved.get_int("IDLE_TTL")))
    aliases = {e.profile: e.id for e in entries.values()
               if e.profile != e.id and e.profile not in entries}
    catalog = Catalog(platform_name, entries, aliases)
    if several:
        _own_engines(project, environ, platform, overrides, router_port, catalog)
    return catalog


def _own_engines(project: Project, environ: Mapping[str, str], platform: str | None,
                 overrides: Sequence[str], router_port: int | None, catalog: Catalog) -> None:
    """Give every entry its engine name, its own port and a loopback bind (resolved again with
    those as --set overrides, so state.json records them and `status` finds each engine)."""
    taken = {router_port} if router_port is not None else set()
    ports: dict[str, int] = {}
    for entry in catalog.entries.values():
        port = entry.resolved.get_int("VLLM_PORT")
        while port in taken and port < 65535:
            port += 1
        taken.add(port)
        ports[entry.id] = port
    for entry in list(catalog.entries.values()):
        own = ports[entry.id]
        rest = [p for p in entry.resolved.get_list("OTHER_ENGINE_PORTS")
                if not (p.isdigit() and int(p) in taken)]
        bind = entry.resolved.get_str("VLLM_BIND")
        if bind != LOOPBACK:
            catalog.notes.append(
                f"{entry.id}: its engine listens on {LOOPBACK}, not VLLM_BIND={bind} (set at "
                f"{entry.resolved.source('VLLM_BIND')}): clients reach it through the router")
        if own != entry.resolved.get_int("VLLM_PORT"):
            catalog.notes.append(f"{entry.id}: its engine listens on port {own} (VLLM_PORT "
                                 f"{entry.resolved.get_int('VLLM_PORT')} is another profile's)")
        resolved = resolve(project, platform=platform, model=entry.profile, environ=environ,
                           overrides=[*overrides, f"VLLM_PORT={own}", f"VLLM_BIND={LOOPBACK}",
                                      f"OTHER_ENGINE_PORTS={','.join(rest) or ','}"])
        catalog.entries[entry.id] = replace(entry, resolved=resolved,
                                            slot=checkout_engine_name(entry.profile))


def _resolve(project: Project, environ: Mapping[str, str], platform: str | None, model: str,
             overrides: Sequence[str], router_port: int | None) -> Resolved:
    resolved = resolve(project, platform=platform, model=model, overrides=overrides, environ=environ)
    ports = resolved.get_list("OTHER_ENGINE_PORTS")
    if router_port is None or str(router_port) not in ports:
        return resolved
    # "," is an empty list that is not empty text (empty text would mean the schema default).
    rest = ",".join(p for p in ports if p != str(router_port)) or ","
    return resolve(project, platform=platform, model=model, environ=environ,
                   overrides=[*overrides, f"OTHER_ENGINE_PORTS={rest}"])

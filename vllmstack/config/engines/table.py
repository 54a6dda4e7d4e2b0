"""The engine kinds, by ENGINE value, and the lookup every layer uses."""

from __future__ import annotations

from vllmstack.config.engines import llamacpp, vllm
from vllmstack.config.engines.kind import EngineKind
from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError

ENGINES: dict[str, EngineKind] = {kind.name: kind for kind in (vllm.KIND, llamacpp.KIND)}
DEFAULT = vllm.KIND  # ENGINE left empty (or a schema without the key)


class UnknownEngineError(StackError):
    """A name of no engine kind of the table."""


def engine_of(resolved: Resolved) -> str:
    """The profile's engine name (ENGINE; empty means vLLM)."""
    return resolved.get_str("ENGINE") or DEFAULT.name


def engine_kind(resolved: Resolved) -> EngineKind:
    """The profile's engine kind. An ENGINE that is none of the table's is already an error of
    the resolver (the schema's choices, with its file and line), which stops `check`, `up` and
    `export`; until then the profile is taken as the default engine's, as a typo'd one ran."""
    return ENGINES.get(engine_of(resolved), DEFAULT)


def kind_named(name: str) -> EngineKind:
    """The kind a record or an option names (generated/state.json, `-t vllm:NAME`)."""
    try:
        return ENGINES[name or DEFAULT.name]
    except KeyError:
        raise UnknownEngineError(f"engine {name!r} is none of {', '.join(ENGINES)}",
                                 f"use one of: {', '.join(ENGINES)}") from None


def display_name(name: str) -> str:
    """How an engine (a name a record holds) is shown; an unknown one as it is."""
    kind = ENGINES.get(name)
    return kind.display if kind is not None else name


def others(kind: EngineKind) -> list[EngineKind]:
    return [k for k in ENGINES.values() if k is not kind]

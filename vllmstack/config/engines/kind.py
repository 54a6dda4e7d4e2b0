"""What the layers ask of an engine kind: a frozen record of data and the argv builder.

A field answers one question a caller has (the image's entrypoint, whether /health answers 503
while loading, ...): a new difference between engines is a new field, set in every kind's module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllmstack.config.profiles import Resolved
from vllmstack.config.vllm_args import ServeCommand


@dataclass(frozen=True)
class Placement:
    """Where an engine's argv runs, which is what makes the same profile's argv differ.

    A container binds every address (its port is published on VLLM_BIND), reads the chat
    templates at their mount and starts with the image's entrypoint; a host process binds
    VLLM_BIND itself, reads the checkout's templates and starts its environment's program."""

    host: str = "0.0.0.0"
    chat_template_dir: str | None = None  # None: where the engine image mounts them
    models_dir: str | None = None  # where MODELS_DIR is seen (None: MODELS_DIR or its default)
    # The words that replace the argv's first (the program: `vllm`, `llama-server`): a host
    # environment's own executable, or NATIVE_ENGINE_COMMAND; empty: the program by its name.
    program: tuple[str, ...] = ()

    def place(self, argv: list[str]) -> list[str]:
        return [*self.program, *argv[1:]] if self.program else argv

    def unplace(self, argv: list[str], name: str) -> list[str]:
        """`argv` with its program by `name` again (what vLLM's own parser is given)."""
        return [name, *argv[len(self.program):]] if self.program else argv


@dataclass(frozen=True)
class EngineKind:
    name: str  # ENGINE's value
    display: str  # how people read it (tables, guards, status)
    # The words the engine image's entrypoint already is: a container's command is the rest of
    # the argv (compose's `command:`, a pod's `args:`).
    entrypoint: tuple[str, ...]
    model_key: str  # the setting naming what it serves
    image_key: str  # the setting naming its container image
    image: Callable[[Resolved], str]  # the container image a profile of this kind runs
    # The argv for `placement`: what `check` validates, `up` records and the runtime starts.
    build: Callable[[Resolved, Placement], ServeCommand]
    # The model a client asks for, as the bench and export show it.
    model_label: Callable[[Resolved], str]
    # The speculative draft it runs with, as tables show it ("-": none).
    draft_label: Callable[[Resolved], str]
    # (key, its schema `becomes`): a setting only another kind reads, which a record of this
    # kind's settings leaves out while it is at its default.
    foreign_setting: Callable[[str, str | None], bool]
    loading_503: bool  # /health answers 503 while the model loads (rather than not at all)
    sleeps: bool  # vLLM's dev-mode /sleep and /wake_up: the router can swap it by sleep
    # It serves one local model file under MODELS_DIR (a GGUF): nothing to download, and
    # MODELS_DIR has a default folder.
    model_file: bool
    # Its argv is `vllm serve`'s: vLLM's own parser can check it (`check --deep`, update-check),
    # the production-stack chart runs it, and the VLLM_* scheduler settings are its limits.
    vllm_cli: bool
    # A client may send the next request on a connection that carried a streamed answer.
    keep_alive: bool
    # Its GPUs are its parallelism's (tp x pp x dp from the argv), not the whole node's.
    gpus_from_argv: bool
    # The POST routes that name a model (the router forwards these by the model they name).
    routes: frozenset[str]
    # (GiB its image takes, GiB free to build it); None: by platform (vLLM's images differ).
    image_gib: tuple[float, float] | None = None

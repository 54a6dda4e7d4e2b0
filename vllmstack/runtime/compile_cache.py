"""Whether a profile's next boot will find its torch.compile cache: the key of what invalidates
it, and the boots `up` recorded with that key.

vLLM keys its own compile cache (torch_compile_cache/<hash>/, torch_aot_compile/<hash>/) by the
model's config, the compile, parallel and cache configs and its own version; the stack cannot
compute that hash without vLLM. What it can say is whether anything that goes into it changed
since a boot that filled the cache: `compile_key` hashes the argv the engine runs (the program,
so the native engine's environment and version, the model, every flag but the front end's own),
the engine image and version pins, torch's pin, the platform and GPU, and the model's config.json
where it is a local folder. `up` writes the key with each boot into results/boot_history.jsonl
(serve.boot_history); `check` reads the boots with the profile's key back (`predict_next_boot`).
Anything unknown counts as a change: a false "cold" costs nothing, a false "warm" misleads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.config.profiles import Resolved
from vllmstack.core.files import parse_json, tail_lines
from vllmstack.core.paths import Project

HISTORY_FILE = "boot_history.jsonl"  # under results/ (serve.boot_history writes it)
# The compile phase's name in a recorded boot (serve.boot_markers.COMPILE: serve sits above).
COMPILE_PHASE = "compiling"
# How many of the latest boots a prediction reads (a few KB each).
HISTORY_READ = 500
# Front-end flags (vLLM's own names, `vllm serve --help`): they shape the HTTP server, never the
# compiled graphs. A flag takes its value along when it has one.
FRONT_END_FLAGS = frozenset({
    "--host", "--port", "--served-model-name", "--api-key", "--chat-template",
    "--chat-template-content-format", "--tool-call-parser", "--reasoning-parser",
    "--uvicorn-log-level", "--allowed-origins", "--root-path", "--ssl-keyfile", "--ssl-certfile",
})
FRONT_END_SWITCHES = frozenset({"--enable-auto-tool-choice", "--disable-log-requests",
                                "--enable-log-requests", "--disable-uvicorn-access-log",
                                "--disable-fastapi-docs", "--enable-prompt-tokens-details"})
# The settings outside the argv that change what is compiled or what compiles it.
KEY_SETTINGS = ("VLLM_IMAGE", "VLLM_VERSION", "NATIVE_ENGINE_VERSION", "TORCH_VERSION",
                "GPU_DEVICE_NAME", "ENGINE_ENV")


def compile_argv(argv: Sequence[str]) -> list[str]:
    """`argv` without the front end's flags (and their values, also in `--flag=value` form)."""
    kept: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in FRONT_END_SWITCHES or name in FRONT_END_FLAGS:
            skip = name in FRONT_END_FLAGS and "=" not in word
            continue
        kept.append(word)
    return kept


def compile_key(resolved: Resolved, argv: Sequence[str]) -> str:
    """16 hex digits naming what the profile's compile cache depends on (see the module)."""
    parts: dict[str, Any] = {
        "argv": compile_argv(argv), "platform": resolved.platform,
        "settings": {key: resolved.get(key) or "" for key in KEY_SETTINGS},
        "model_config": _model_config_digest(argv),
    }
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_config_digest(argv: Sequence[str]) -> str:
    """The sha256 of config.json of a local model folder (its geometry), "" for a hub id."""
    words = list(argv)
    if "serve" not in words or words.index("serve") + 1 >= len(words):
        return ""
    config = Path(words[words.index("serve") + 1]) / "config.json"
    try:
        return hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else ""
    except OSError:
        return ""


@dataclass(frozen=True)
class CachePrediction:
    """What the next boot with a key will do: `verdict` "warm" (the cache should load), "cold"
    (it will compile), "eager" (nothing is compiled) or "unknown" (vLLM does not log it
    there), and why."""

    verdict: str
    reason: str


def read_boots_with(project: Project, key: str) -> list[dict[str, Any]]:
    """The recorded boots (their `boot` objects, with `recorded`) whose compile key is `key`,
    oldest first; a line that cannot be read is skipped."""
    found: list[dict[str, Any]] = []
    for text in tail_lines(project.results / HISTORY_FILE, HISTORY_READ):
        try:
            data = parse_json(text)
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("compile_key") == key \
                and isinstance(data.get("boot"), dict):
            found.append({**data["boot"], "recorded": data.get("recorded")})
    return found


def predict_next_boot(boots: Sequence[Mapping[str, Any]], cache_filled: bool) -> CachePrediction:
    """The verdict from the boots with the profile's key (`read_boots_with`) and whether the
    engine cache folder still holds a compile cache (`cache_has_compiles`)."""
    if not boots:
        return CachePrediction("cold", "no boot with this engine, model, GPU and compile flags is "
                                       "recorded yet: the first one compiles")
    last = boots[-1]
    phases = last.get("phases")
    seconds = sum(_seconds(p) for p in phases) if isinstance(phases, list) else 0.0
    if last.get("compile") is None and seconds == 0:
        return CachePrediction("eager", "its last boot ran no torch.compile (eager): nothing "
                                        "to compile, nothing to miss")
    if not cache_filled:
        return CachePrediction("cold", "the engine's compile cache folder is empty or gone "
                                       "(`invoke clear-caches`?): the next boot compiles again")
    if last.get("compile") == "warm":
        return CachePrediction("warm", "its last boot loaded torch.compile's graphs from the cache")
    if last.get("compile") is None:
        return CachePrediction("unknown", f"vLLM logs no cache hit or miss here; its last boot "
                                          f"compiled for {seconds:.1f} s")
    if len(boots) >= 2 and boots[-2].get("compile") == "cold":
        return CachePrediction("cold", "its last two boots both compiled although the first one "
                                       "filled the cache: the engine does not load it (vLLM "
                                       "0.32's CPU build cannot read its AOT artefact; "
                                       "ENGINE_ENV=VLLM_USE_AOT_COMPILE=0 works there)")
    return CachePrediction("warm", "its last boot compiled and filled the cache")


def _seconds(phase: object) -> float:
    """A recorded phase's seconds when it is the compile's (serve.boot_markers.COMPILE)."""
    if not isinstance(phase, dict) or phase.get("name") != COMPILE_PHASE:
        return 0.0
    value = phase.get("seconds")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def cache_has_compiles(engine_cache: Path) -> bool:
    """Whether the engine cache (the runtime's folder: containers' vllm/, the native engines'
    native/VERSION/vllm/) holds a torch.compile cache."""
    return any(_nonempty(folder) for folder in _compile_folders(engine_cache))


def _compile_folders(engine_cache: Path) -> Iterable[Path]:
    yield engine_cache / "vllm" / "torch_compile_cache"
    native = engine_cache / "native"
    if native.is_dir():
        yield from (version / "vllm" / "torch_compile_cache" for version in native.iterdir())


def _nonempty(folder: Path) -> bool:
    try:
        return folder.is_dir() and any(folder.iterdir())
    except OSError:
        return False

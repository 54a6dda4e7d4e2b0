"""What every check rule receives: the CheckContext, and how `run_checks` builds it.

A rule is a function `(ctx) -> list[Finding]`. The context holds the resolved settings, the
schema, the model's facts and the environment, plus helpers that read a setting without raising
(`ctx.int`, `ctx.float` give None for a bad value) and `ctx.usable(...)`, which tells a rule to
stay quiet when a setting it builds on already failed validation. Add a helper here only when
several rule modules need it. For ENGINE=llamacpp the context also holds the GGUF header of
LLAMACPP_MODEL (read once, here) and the rules build `command` from llama-server's argv.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllmstack.checks.gguf import GgufRead, read_setting
from vllmstack.config.engines.kind import Placement
from vllmstack.config.engines.table import engine_kind, engine_of
from vllmstack.config.modelinfo import ModelFacts, load_model_facts
from vllmstack.config.profiles import Resolved, Setting
from vllmstack.config.schema import Schema, load_schema
from vllmstack.config.vllm_args import ServeCommand
from vllmstack.core.cpu import cpu_flags as read_cpu_flags
from vllmstack.core.findings import Finding
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner
from vllmstack.runtime.gpu import GIB, GpuCard, GpuInventory, detect_cards

# What a platform may leave to the card: read from it when no layer sets them.
DETECTABLE = ("GPU_COUNT", "GPU_VRAM_GIB", "GPU_DEVICE_NAME")


@dataclass
class CheckContext:
    project: Project
    resolved: Resolved
    schema: Schema
    facts: ModelFacts
    environ: Mapping[str, str]
    command: ServeCommand | None = None
    # Where the argv runs (the runtime's placement): the argv rules build `command` for it.
    placement: Placement = field(default_factory=Placement)
    # The runtime `up` will use when it is known (--runtime); else the RUNTIME setting.
    runtime_name: str | None = None
    # The host's cards when a runner was given to look (None: not looked, or nothing answered),
    # the ones the platform uses, and the settings taken from them (key -> value).
    hardware: GpuInventory | None = None
    used_cards: tuple[GpuCard, ...] = ()
    detected: dict[str, str] = field(default_factory=dict)
    looked_for_gpus: bool = False
    # ENGINE=llamacpp: the header of LLAMACPP_MODEL, or why it could not be read.
    gguf: GgufRead | None = None
    # This host's CPU flags (core/cpu.py) where a rule asks; None: read /proc/cpuinfo then.
    cpu_flags: frozenset[str] | None = None

    def host_cpu_flags(self) -> frozenset[str]:
        return self.cpu_flags if self.cpu_flags is not None else frozenset(read_cpu_flags())

    def get(self, key: str) -> str:
        """The raw text of a setting, "" when unset (no schema default: rules validate it)."""
        return self.resolved.get(key) or ""

    @property
    def bad_keys(self) -> set[str]:
        """Keys whose value already failed validation: rules built on them stay quiet, so one
        mistake gives one message instead of a cascade."""
        return {f.key for f in self.resolved.problems if f.severity == "error" and f.key}

    def usable(self, *keys: str) -> bool:
        return not (set(keys) & self.bad_keys)

    def int(self, key: str) -> int | None:
        try:
            return int(self.get(key))
        except ValueError:
            return None

    def float(self, key: str) -> float | None:
        try:
            return float(self.get(key))
        except ValueError:
            return None

    def src(self, key: str) -> str | None:
        return self.resolved.source(key)

    def finding(self, severity: str, code: str, key: str | None, message: str,
                fix: str | None = None) -> Finding:
        return Finding(severity, code, message, key=key,
                       source=self.src(key) if key else None, fix=fix)

    @property
    def engine(self) -> str:
        """vllm or llamacpp: which rules apply (registry.RULE_ENGINES) and which argv is built."""
        return engine_of(self.resolved)

    @property
    def runtime(self) -> str:
        return self.runtime_name or self.resolved.get_str("RUNTIME")

    @property
    def is_amd(self) -> bool:
        return self.get("GPU_VENDOR") == "amd"

    @property
    def arch(self) -> str:
        return self.get("GPU_ARCH")


Rule = Callable[[CheckContext], list[Finding]]


def build_context(
    project: Project,
    resolved: Resolved,
    environ: Mapping[str, str],
    *,
    schema: Schema | None = None,
    runtime: str | None = None,
    runner: Runner | None = None,
    device_root: Path = Path("/"),
) -> CheckContext:
    """The context for one run of the rules: the model's facts are read once, here.

    With a `runner`, the host's GPUs are read (nvidia-smi, or amdgpu's sysfs counters) and fill
    in the count, memory and device name the platform does not pin (source "detected: TOOL").
    """
    hardware = used = None
    detected: dict[str, str] = {}
    vendor = resolved.get_str("GPU_VENDOR")
    looked = runner is not None and vendor in ("amd", "nvidia")
    if runner is not None and looked:
        hardware = detect_cards(vendor, runner, root=device_root,
                                unified_memory=resolved.get_bool("UNIFIED_MEMORY"))
    if hardware is not None:
        used = cards_in_use(resolved, hardware)
        resolved, detected = with_detected(resolved, hardware, used)
    return CheckContext(project, resolved, schema or load_schema(),
                        load_model_facts(resolved, environ, strict=False), environ,
                        runtime_name=runtime,
                        hardware=hardware, used_cards=used or (), detected=detected,
                        looked_for_gpus=looked,
                        gguf=read_setting(resolved) if engine_kind(resolved).model_file else None)


def pinned(resolved: Resolved, key: str) -> bool:
    """A layer, .env or --set gives the key a value (a schema default is no pin)."""
    return bool(resolved.get_raw(key).strip()) and resolved.source(key) not in (None, "default")


def cards_in_use(resolved: Resolved, hardware: GpuInventory) -> tuple[GpuCard, ...]:
    """The cards the engine gets: those *_VISIBLE_DEVICES lists by index, else the first
    GPU_COUNT (when pinned), else all."""
    key = "CUDA_VISIBLE_DEVICES" if resolved.get_str("GPU_VENDOR") == "nvidia" else "HIP_VISIBLE_DEVICES"
    visible = resolved.get_list(key)
    if visible and all(v.isdigit() for v in visible):
        chosen = tuple(c for c in hardware.cards if str(c.index) in visible)
        if chosen:
            return chosen
    count = resolved.get_raw("GPU_COUNT").strip()
    if pinned(resolved, "GPU_COUNT") and count.isdigit():
        return hardware.cards[: int(count)]
    return hardware.cards


def with_detected(resolved: Resolved, hardware: GpuInventory,
                  used: tuple[GpuCard, ...]) -> tuple[Resolved, dict[str, str]]:
    """`resolved` with the unpinned DETECTABLE keys taken from the cards in use."""
    if not used:
        return resolved, {}
    names = {c.name for c in used}
    values = {
        "GPU_COUNT": str(len(used)),
        # The smallest card bounds what every tensor-parallel rank can hold.
        "GPU_VRAM_GIB": f"{min(c.total_bytes for c in used) / GIB:.2f}",
        "GPU_DEVICE_NAME": names.pop() if len(names) == 1 else "",
    }
    detected = {k: v for k, v in values.items() if v and not pinned(resolved, k)}
    if not detected:
        return resolved, {}
    source = f"detected: {hardware.source}"
    settings = {**resolved.values, **{k: Setting(k, v, source) for k, v in detected.items()}}
    return replace(resolved, values=settings), detected

"""What the host's GPUs look like: device nodes and memory in use.

Read through a probe object so guards and tests can swap the host for a fake one:
AMD from sysfs (`mem_info_vram_*`, or `mem_info_gtt_*` on unified-memory APUs), NVIDIA from
nvidia-smi. Nothing here starts or stops anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vllmstack.core.runner import Runner

GIB = 1024**3


@dataclass(frozen=True)
class GpuMemory:
    index: int
    total_bytes: int
    used_bytes: int

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes)


class GpuProbe(Protocol):
    def missing_devices(self) -> list[str]:
        """Device nodes or tools the vendor needs that this host lacks (empty when fine)."""
        ...

    def memory(self) -> list[GpuMemory] | None:
        """Per-GPU memory, or None when it cannot be read."""
        ...


@dataclass
class AmdSysfsProbe:
    """Reads /sys/class/drm/card*/device/mem_info_* (the amdgpu driver's own counters)."""

    root: Path = Path("/")
    unified_memory: bool = False

    def missing_devices(self) -> list[str]:
        return [dev for dev in ("/dev/kfd", "/dev/dri") if not (self.root / dev.lstrip("/")).exists()]

    def memory(self) -> list[GpuMemory] | None:
        kind = "gtt" if self.unified_memory else "vram"
        cards = sorted((self.root / "sys/class/drm").glob("card[0-9]*/device"))
        out: list[GpuMemory] = []
        for device in cards:
            total = device / f"mem_info_{kind}_total"
            used = device / f"mem_info_{kind}_used"
            if not (total.is_file() and used.is_file()):
                continue
            try:
                out.append(GpuMemory(len(out), int(total.read_text()), int(used.read_text())))
            except (OSError, ValueError):
                continue
        return out or None


@dataclass
class NvidiaSmiProbe:
    runner: Runner

    def missing_devices(self) -> list[str]:
        result = self.runner.run(["nvidia-smi", "-L"], mutates=False, timeout=10)
        return [] if result.ok else ["nvidia-smi (NVIDIA driver)"]

    def memory(self) -> list[GpuMemory] | None:
        result = self.runner.run(
            ["nvidia-smi", "--query-gpu=index,memory.total,memory.used",
             "--format=csv,noheader,nounits"], mutates=False, timeout=10)
        if not result.ok:
            return None
        out = []
        for line in result.stdout.strip().splitlines():
            try:
                index, total, used = (int(x.strip()) for x in line.split(","))
            except ValueError:
                continue
            out.append(GpuMemory(index, total * 1024**2, used * 1024**2))
        return out or None


class NoGpuProbe:
    def missing_devices(self) -> list[str]:
        return []

    def memory(self) -> list[GpuMemory] | None:
        return None


def probe_for(vendor: str, runner: Runner, *, unified_memory: bool = False,
              root: Path = Path("/")) -> GpuProbe:
    if vendor == "amd":
        return AmdSysfsProbe(root, unified_memory)
    if vendor == "nvidia":
        return NvidiaSmiProbe(runner)
    return NoGpuProbe()


def total_used(memory: list[GpuMemory] | None) -> int | None:
    return sum(m.used_bytes for m in memory) if memory else None

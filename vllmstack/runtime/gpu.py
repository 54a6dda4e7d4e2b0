"""What the host's GPUs look like: device nodes, memory in use, and the cards themselves.

Read through a probe object so guards and tests can swap the host for a fake one:
AMD from sysfs (`mem_info_vram_*`, or `mem_info_gtt_*` on unified-memory APUs), NVIDIA from
nvidia-smi; GPU_MEMORY_DIR names a folder that stands in for the card (`StandinProbe`: the
engine simulator writes what it "holds" there, so the router's memory checks are tested without
a GPU). `detect_cards` reads count, memory and vLLM's device name for `invoke check`, where
a platform does not pin them. Nothing here starts or stops anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vllmstack.core.runner import Runner

GIB = 1024**3
MIB = 1024**2
# nvidia-smi's fields for `detect_cards`. memory.reserved is what the driver and firmware keep:
# CUDA (so vLLM) reports total minus that (an H200: 143771 - 591 MiB = 139.8 GiB).
NVIDIA_QUERY = "index,name,memory.total,memory.reserved"
# vLLM's names for AMD device ids, which its tuned-config files carry (vllm/platforms/rocm.py,
# _ROCM_DEVICE_ID_NAME_MAP, v0.27.1); other ids are left to the platform's GPU_DEVICE_NAME.
AMD_DEVICE_NAMES = {
    "0x74a0": "AMD_Instinct_MI300A", "0x74a1": "AMD_Instinct_MI300X",
    "0x74b5": "AMD_Instinct_MI300X", "0x74a2": "AMD_Instinct_MI308X",
    "0x74a5": "AMD_Instinct_MI325X", "0x74b9": "AMD_Instinct_MI325X",
    "0x74a9": "AMD_Instinct_MI300X_HF", "0x74bd": "AMD_Instinct_MI300X_HF",
    "0x744c": "AMD_Radeon_RX7900XTX", "0x150e": "AMD_Radeon_890M", "0x1586": "AMD_Radeon_8060S",
    "0x7550": "AMD_Radeon_RX9070XT", "0x7551": "AMD_Radeon_R9700",
}
AMD_PCI_VENDOR = "0x1002"


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


STANDIN_TOTAL = "total"  # one line per card: its bytes
STANDIN_USED = ".used"  # PID.used: one line per card: the bytes that process holds there


@dataclass
class StandinProbe:
    """A folder that stands in for the cards (GPU_MEMORY_DIR). `total` holds each card's bytes,
    one line per card; each `PID.used` what process PID holds on each card, counted only while
    that process lives, as a driver frees a dead process's memory. None without `total`."""

    folder: Path
    proc: Path = Path("/proc")

    def missing_devices(self) -> list[str]:
        return []

    def memory(self) -> list[GpuMemory] | None:
        totals = _numbers(self.folder / STANDIN_TOTAL)
        if not totals:
            return None
        used = [0] * len(totals)
        for path in sorted(self.folder.glob("*" + STANDIN_USED)):
            pid = path.name.removesuffix(STANDIN_USED)
            if not pid.isdigit() or not self._alive(pid):
                continue
            for index, value in enumerate(_numbers(path)[:len(totals)]):
                used[index] += value
        return [GpuMemory(i, total, used[i]) for i, total in enumerate(totals)]

    def _alive(self, pid: str) -> bool:
        try:
            stat = (self.proc / pid / "stat").read_text()
        except OSError:
            return False
        fields = stat.rpartition(")")[2].split()
        return bool(fields) and fields[0] not in ("Z", "X", "x")


def _numbers(path: Path) -> list[int]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.split():
        if not line.isdigit() or not line.isascii():
            return []
        out.append(int(line))
    return out


def probe_for(vendor: str, runner: Runner, *, unified_memory: bool = False,
              root: Path = Path("/"), standin: str = "") -> GpuProbe:
    if standin:
        return StandinProbe(Path(standin))
    if vendor == "amd":
        return AmdSysfsProbe(root, unified_memory)
    if vendor == "nvidia":
        return NvidiaSmiProbe(runner)
    return NoGpuProbe()


def total_used(memory: list[GpuMemory] | None) -> int | None:
    return sum(m.used_bytes for m in memory) if memory else None


# --- the cards, for `invoke check` ---------------------------------------------------------------


@dataclass(frozen=True)
class GpuCard:
    index: int
    name: str  # vLLM's device file name (NVIDIA_H200, AMD_Radeon_R9700); "" when unknown
    total_bytes: int  # per card, as the engine sees it
    note: str = ""  # how the total was read, for the finding


@dataclass(frozen=True)
class GpuInventory:
    source: str  # the tool or file that answered: nvidia-smi, sysfs
    cards: tuple[GpuCard, ...]


def device_file_name(name: str) -> str:
    """vLLM's get_device_name_as_file_name: whitespace and slashes become underscores."""
    return re.sub(r"[\s/]+", "_", name.strip())


def _mib(text: str) -> int | None:
    text = text.strip().removesuffix("MiB").strip()
    return int(text) if text.isdigit() else None


def detect_nvidia(runner: Runner) -> GpuInventory | None:
    """nvidia-smi's cards; an older driver without memory.reserved is asked without it."""
    fmt = "--format=csv,noheader,nounits"
    result = runner.run(["nvidia-smi", f"--query-gpu={NVIDIA_QUERY}", fmt], mutates=False,
                        timeout=15)
    if not result.ok:
        result = runner.run(["nvidia-smi", "--query-gpu=index,name,memory.total", fmt],
                            mutates=False, timeout=15)
    if not result.ok:
        return None
    cards: list[GpuCard] = []
    for line in result.stdout.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3 or not fields[0].isdigit():
            continue
        total = _mib(fields[2])
        if total is None:
            continue
        reserved = (_mib(fields[3]) if len(fields) > 3 else None) or 0
        note = (f"{total} MiB total - {reserved} MiB reserved by the driver" if reserved else
                f"{total} MiB total")
        cards.append(GpuCard(int(fields[0]), device_file_name(fields[1]),
                             (total - reserved) * MIB, note))
    return GpuInventory("nvidia-smi", tuple(cards)) if cards else None


def detect_amd(root: Path = Path("/"), *, unified_memory: bool = False) -> GpuInventory | None:
    """The amdgpu driver's own counters in sysfs (what amd-smi and rocminfo read too)."""
    kind = "gtt" if unified_memory else "vram"
    drm = root / "sys/class/drm"
    numbered = [p for p in drm.glob("card*") if re.fullmatch(r"card\d+", p.name)]
    cards: list[GpuCard] = []
    for card in sorted(numbered, key=lambda p: int(p.name[4:])):
        device = card / "device"
        try:
            if (device / "vendor").read_text().strip() != AMD_PCI_VENDOR:
                continue  # an Intel or NVIDIA card beside the AMD ones
            total = int((device / f"mem_info_{kind}_total").read_text())
            pci_id = (device / "device").read_text().strip().lower()
        except (OSError, ValueError):
            continue
        cards.append(GpuCard(len(cards), AMD_DEVICE_NAMES.get(pci_id, ""), total,
                             f"mem_info_{kind}_total, device id {pci_id}"))
    return GpuInventory("sysfs", tuple(cards)) if cards else None


def detect_cards(vendor: str, runner: Runner, *, root: Path = Path("/"),
                 unified_memory: bool = False) -> GpuInventory | None:
    """The host's cards of `vendor`, or None when nothing answers (no driver, another host)."""
    if vendor == "nvidia":
        return detect_nvidia(runner)
    if vendor == "amd":
        return detect_amd(root, unified_memory=unified_memory)
    return None

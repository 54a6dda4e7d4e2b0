"""What this host's CPU can execute: its instruction-set flags as the kernel lists them.

Machines of one kind differ (one has AVX-512 and AMX, the next only AVX2), and a library built for
an instruction set the CPU lacks does not fail to load: the process dies of SIGILL at its first
such instruction. So the decisions that depend on it (which of vLLM's CPU libraries an install must
load, whether the CPU build can hold an fp8 KV cache, which tests can run) read these flags, passed
in so that tests can fake either kind of host.
"""

from __future__ import annotations

import platform
import signal
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The flags worth naming when something fails for want of one (the full list is ~150 words).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
             "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
# torch's is_avx512_supported (aten/src/ATen/cpu/Utils.cpp): AVX-512 VL, BW and DQ, and FMA3.
# vLLM's CPU platform and its attention backend ask torch, so the stack asks the same question.
AVX512 = frozenset({"avx512f", "avx512vl", "avx512bw", "avx512dq", "fma"})


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The `flags` of /proc/cpuinfo (every core lists the same); empty where it cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags")
            for flag in line.split(":", 1)[1].split()}


def has_avx512(flags: set[str]) -> bool:
    return flags >= AVX512


def describe_isa(flags: set[str]) -> str:
    """The instruction-set flags of ISA_FLAGS this CPU has, in that order ("none of ..." else)."""
    have = [flag for flag in ISA_FLAGS if flag in flags]
    return " ".join(have) if have else f"none of {' '.join(ISA_FLAGS)}"


def is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64", "i686", "i386")


def signal_name(returncode: int) -> str | None:
    """SIGILL for a process killed by signal 4: -4 from subprocess, 132 (128 + 4) through a shell.
    None for an ordinary exit status."""
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 128 + 65 else 0
    if not number:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"

"""The boot diagnosis names the RDNA4 failures from the threads' own log lines (tests/data/rdna4,
README.md there names each thread), with the AMD fix; a silent boot at TP >= 2 on AMD is named
as the RCCL hang at the timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllmstack.serve.diagnosis import diagnose
from vllmstack.serve.watch import HANG_SILENCE_S, hang_hint

DATA = Path(__file__).parent / "data" / "rdna4"


def lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


def test_the_lds_overflow_is_named_with_the_rdna_fix() -> None:
    d = diagnose(lines("lds-overflow.log"), exit_code=1, vendor="amd")
    assert d.code == "triton-lds-overflow"
    assert "65792" in d.cause and "65536" in d.cause
    assert "ROCm/aiter#5229" in d.fix and "TRITON_ATTN" in d.fix
    assert "aiter" not in diagnose(lines("lds-overflow.log"), vendor="nvidia").fix.lower()


@pytest.mark.parametrize("name", ["page-fault-hsa.log", "page-fault-dmesg.log"])
def test_a_gpu_page_fault_is_named_with_the_rdna_image_hint(name: str) -> None:
    d = diagnose(lines(name), exit_code=134, vendor="amd")
    assert d.code == "gpu-page-fault"
    assert "ROCm/legacy-rocm-build#6630" in d.fix and "7.14" in d.fix


def test_a_silent_abort_points_at_missing_gfx_kernels_on_amd() -> None:
    d = diagnose(lines("silent-abort.log"), exit_code=1, vendor="amd")
    assert d.code == "engine-core-died" and "missing gfx kernels" in d.fix


def test_a_silent_boot_at_tp2_on_amd_is_named_as_the_rccl_hang() -> None:
    hint = hang_hint(HANG_SILENCE_S + 5, "amd", 2)
    assert f"no log line for {HANG_SILENCE_S + 5:.0f} s" in hint
    assert "NCCL_PROTO=Simple" in hint and "ROCm/rocm-systems#5480" in hint
    assert hang_hint(HANG_SILENCE_S + 5, "amd", 1) == ""
    assert hang_hint(HANG_SILENCE_S + 5, "nvidia", 2) == ""
    assert hang_hint(HANG_SILENCE_S - 1, "amd", 2) == ""

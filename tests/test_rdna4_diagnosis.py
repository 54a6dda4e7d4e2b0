"""The boot diagnosis names the RDNA4 failures from the threads' own log lines (tests/data/rdna4,
README.md there names each thread), with the AMD fix; a silent boot at TP >= 2 on AMD is named
as the RCCL hang at the timeout."""

from __future__ import annotations

import io
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


def test_the_lds_overflow_never_offers_the_backend_already_in_use() -> None:
    log = lines("lds-overflow.log")
    # vLLM's own TRITON_ATTN runs a Triton unified_attention too: then the other family.
    on_triton = diagnose(log, exit_code=1, vendor="amd", backend="TRITON_ATTN")
    assert "ATTENTION_BACKEND=ROCM_ATTN (it uses TRITON_ATTN already)" in on_triton.fix
    assert "=TRITON_ATTN" not in on_triton.fix
    on_aiter = diagnose(log, exit_code=1, vendor="amd", backend="ROCM_AITER_UNIFIED_ATTN")
    assert "ATTENTION_BACKEND=TRITON_ATTN or ROCM_ATTN" in on_aiter.fix
    assert "already" not in on_aiter.fix
    nvidia = diagnose(log, exit_code=1, vendor="nvidia", backend="TRITON_ATTN")
    assert "ATTENTION_BACKEND=FLASH_ATTN (it uses TRITON_ATTN already)" in nvidia.fix


def test_the_backend_reaches_the_diagnosis_from_the_boot_watch() -> None:
    from vllmstack.runtime.base import EngineState
    from vllmstack.serve import lifecycle, watch

    class Dead:
        name = flavour = "fake"

        def state(self) -> EngineState:
            return EngineState(True, False, "exited", 0, 1)

        def log_lines(self, tail: int = 400) -> list[str]:
            return lines("lds-overflow.log")

    with pytest.raises(lifecycle.LifecycleError) as died:
        watch.wait_until_healthy(Dead(), "http://x", 60, watch.Progress(io.StringIO(), False),
                                 health=lambda url: None, sleep=lambda s: None, vendor="amd",
                                 backend="TRITON_ATTN")
    assert died.value.fix is not None and "(it uses TRITON_ATTN already)" in died.value.fix


@pytest.mark.parametrize("name", ["page-fault-hsa.log", "page-fault-dmesg.log",
                                  "page-fault-r9700-rdna-image.log"])
def test_a_gpu_page_fault_is_named_with_the_rdna_image_hint(name: str) -> None:
    d = diagnose(lines(name), exit_code=134, vendor="amd")
    assert d.code == "gpu-page-fault"
    assert "ROCm/legacy-rocm-build#6630" in d.fix and "7.14" in d.fix


def test_the_r9700_fault_is_read_from_the_threads_own_kernel_line() -> None:
    # ROCm/legacy-rocm-build#6413 (the run #6630 reports): the first line of the kernel's report.
    d = diagnose(lines("page-fault-r9700-rdna-image.log"), exit_code=134, vendor="amd")
    assert d.line_number == 1
    assert d.line == "amdgpu 0000:07:00.0: [gfxhub] page fault (src_id:0 ring:24 vmid:8 pasid:41)"
    # The older hub-numbered form (ROCm/amdgpu#172) is the same failure.
    older = ("[ 4778.915423] amdgpu 0000:c6:00.0: amdgpu: [gfxhub0] no-retry page fault "
             "(src_id:0 ring:24 vmid:3 pasid:32769)")
    assert diagnose([older], exit_code=134, vendor="amd").code == "gpu-page-fault"
    # A line that only mentions the words is not a fault report.
    assert diagnose(["INFO see the [gfxhub] page fault notes"], 1, "amd").code != "gpu-page-fault"


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

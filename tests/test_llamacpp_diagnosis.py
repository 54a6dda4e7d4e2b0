"""Diagnosis of llama-server failures from their real log lines (tests/data/llamacpp/, llama.cpp
b9993, CPU build; tests/data/llamacpp/README.md says how each was made).

GPU failures cannot happen on a CPU build: those tests build their lines from the pinned source's
own format strings (file and line named at each), as the server would print them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllmstack.serve import diagnosis

DATA = Path(__file__).parent / "data" / "llamacpp"
# llama.cpp's log prefix (timestamp, level) as the real logs carry it.
PREFIX = "0.01.234.567 E "
AMD_WORDS = ("HSA_OVERRIDE", "gfx", "/dev/kfd", "RENDER_GID", "ROCm", "AITER", "HIP_VISIBLE")


def lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


@pytest.mark.parametrize(("log", "code", "cause", "fix"), [
    ("fail-model-missing.log", "llamacpp-model-missing", "/tmp/h1/models/Qwen3-0.6B-Q8_0.gguf",
     "invoke gguf-convert"),
    ("fail-model-unreadable.log", "llamacpp-model-unreadable", "Permission denied", "chmod a+r"),
    ("fail-not-gguf.log", "llamacpp-not-gguf", "invalid magic characters: '<!DO'", "download"),
    ("fail-truncated.log", "llamacpp-not-gguf", "failed to read key-value pairs", "gguf-convert"),
    ("fail-unknown-arch.log", "llamacpp-unknown-arch", "'qwen99'", "LLAMACPP_REF"),
    ("fail-port-in-use.log", "llamacpp-port-in-use", "127.0.0.1:50285", "VLLM_PORT"),
    ("fail-cpu-oom.log", "llamacpp-out-of-memory", "insufficient memory (attempted to allocate "
     "262144.00 MB)", "LLAMACPP_CTX"),
])
def test_each_real_failure_gets_its_cause_and_fix(log: str, code: str, cause: str, fix: str) -> None:
    found = diagnosis.diagnose(lines(log), 1, "none")
    assert found.code == code
    assert cause in found.cause and fix in found.fix
    assert found.line is not None and found.line_number is not None
    assert lines(log)[found.line_number - 1] == found.line


def test_the_cpu_out_of_memory_fix_is_about_system_memory() -> None:
    # The server died of SIGSEGV after the failed allocation: the allocation is still the cause.
    found = diagnosis.diagnose(lines("fail-cpu-oom.log"), -11, "none")
    assert found.code == "llamacpp-out-of-memory" and "system memory" in found.fix
    assert "GPU" not in found.fix


def test_a_healthy_boot_matches_no_signature() -> None:
    found = diagnosis.diagnose(lines("boot-tiny-cpu.log"), 0, "none")
    assert found.code == "unknown"


def cuda_oom_lines(buft: str) -> list[str]:
    """A model load that ran out of GPU memory, in the pinned source's words."""
    return [
        # ggml/src/ggml-cuda/ggml-cuda.cu:819: "%s: allocating %.2f MiB on device %d: cudaMalloc
        # failed: %s\n" (a HIP build maps cudaGetErrorString to hipGetErrorString).
        PREFIX + f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating {27340.25:.2f} MiB on "
        f"device {0}: cudaMalloc failed: {'out of memory'}",
        # ggml/src/ggml-alloc.c:1133: "%s: failed to allocate %s buffer of size %zu\n".
        PREFIX + f"alloc_tensor_range: failed to allocate {buft} buffer of size {28668678144}",
        # src/llama-model.cpp:1576 + src/llama.cpp:336: "%s: error loading model: %s\n".
        PREFIX + f"llama_model_load: error loading model: unable to allocate {buft} buffer",
        PREFIX + "llama_model_load_from_file_impl: failed to load model",
        PREFIX + "srv  llama_server: exiting due to model loading error",
    ]


@pytest.mark.parametrize(("vendor", "buft"), [("nvidia", "CUDA0"), ("amd", "ROCm0")])
def test_gpu_out_of_memory_from_the_sources_format_strings(vendor: str, buft: str) -> None:
    found = diagnosis.diagnose(cuda_oom_lines(buft), 1, vendor)
    assert found.code == "llamacpp-out-of-memory"
    assert "cudaMalloc failed: out of memory" in found.cause
    assert "LLAMACPP_GPU_LAYERS" in found.fix and "LLAMACPP_CTX" in found.fix
    assert not [w for w in AMD_WORDS if w in found.fix]


def test_vulkan_out_of_memory_from_the_sources_format_strings() -> None:
    log = [
        # ggml/src/ggml-vulkan/ggml-vulkan.cpp:3311-3312 (std::cerr, no log prefix).
        f"ggml_vulkan: Device memory allocation of size {17179869184} failed.",
        "ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory",
        PREFIX + "llama_model_load: error loading model: unable to allocate Vulkan0 buffer",
    ]
    found = diagnosis.diagnose(log, 1, "amd")
    assert found.code == "llamacpp-out-of-memory" and "Device memory allocation" in found.cause


def test_gpu_layers_that_do_not_fit_name_the_setting() -> None:
    # common/fit.cpp:376 + :804: --fit gives up on a user's --n-gpu-layers ("%s: failed to fit
    # params to free device memory: %s\n"), then the load runs out of memory.
    fit = (PREFIX.replace(" E ", " W ") + "common_fit_params: failed to fit params to free device "
           f"memory: n_gpu_layers already set by user to {-2}, abort")
    found = diagnosis.diagnose([fit, *cuda_oom_lines("CUDA0")], 1, "nvidia")
    assert found.code == "llamacpp-gpu-layers-do-not-fit"
    assert "--n-gpu-layers -2" in found.cause and "all" in found.cause
    assert "LLAMACPP_GPU_LAYERS=auto" in found.fix
    # The same warning where the load then succeeded is no failure of its own.
    healthy = [fit, PREFIX.replace(" E ", " I ") + "srv  llama_server: model loaded"]
    assert diagnosis.diagnose(healthy, 1, "nvidia").code != "llamacpp-gpu-layers-do-not-fit"


def test_llama_cpp_signatures_leave_vllm_logs_alone() -> None:
    vllm_log = (Path(__file__).parent / "data" / "fail-no-kv-memory.log").read_text().splitlines()
    assert not diagnosis.diagnose(vllm_log, 1, "nvidia").code.startswith("llamacpp-")

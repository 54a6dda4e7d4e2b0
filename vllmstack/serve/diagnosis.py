"""Why did the engine die? Known failure signatures in vLLM's log, each with a cause and a fix.

vLLM ends most boot failures with the generic `Engine core initialization failed. See root
cause above. Failed core proc(s): {}`; the real cause sits above it. So every line is matched
against the table, the most specific signature wins, and the generic line is only a fallback.
Texts come from vLLM's source and captured logs (shared/reference/vllm-captures, vllm-facts §9).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Signature:
    code: str
    pattern: re.Pattern[str]
    cause: str  # may use {named groups}
    fix: str  # may use {named groups}


@dataclass(frozen=True)
class Diagnosis:
    code: str
    cause: str
    fix: str
    line: str | None  # the log line that matched
    line_number: int | None

    def render(self) -> str:
        text = f"cause: {self.cause}\nfix:   {self.fix}"
        if self.line:
            text = f"log line {self.line_number}: {self.line.strip()}\n" + text
        return text


def _sig(code: str, pattern: str, cause: str, fix: str) -> Signature:
    return Signature(code, re.compile(pattern), cause, fix)


# Most specific first: the first signature that matches any line wins.
SIGNATURES: tuple[Signature, ...] = (
    _sig("kv-too-small-for-max-len",
         r"To serve at least one request with the model's max seq len \((?P<len>\d+)\).*estimated "
         r"maximum model length is (?P<fit>\d+)",
         "the KV cache cannot hold one request at max_model_len {len}",
         "set VLLM_MAX_MODEL_LEN={fit} (or less), VLLM_KV_CACHE_DTYPE=fp8, or raise VLLM_GPU_MEM_UTIL"),
    _sig("kv-cache-oom", r"No available memory for the cache blocks",
         "out of memory for the KV cache: weights and activations took the whole "
         "gpu_memory_utilization budget",
         "raise VLLM_GPU_MEM_UTIL, lower VLLM_MAX_NUM_BATCHED_TOKENS / VLLM_MAX_NUM_SEQS, or use a "
         "smaller (quantized) model"),
    _sig("free-memory-below-util",
         r"Free memory on device (?P<dev>\S+) \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on startup "
         r"is less than desired GPU memory utilization \((?P<util>[\d.]+)",
         "another process holds GPU memory: only {free} of {total} GiB was free, but "
         "gpu_memory_utilization {util} asks for more",
         "stop the other GPU user (another engine, a desktop app), or lower VLLM_GPU_MEM_UTIL"),
    _sig("free-memory-below-budget",
         r"is less than the engine's budget after excluding external process",
         "another process holds GPU memory the engine's budget needs",
         "stop the other GPU user, or lower VLLM_GPU_MEM_UTIL"),
    _sig("mamba-blocks",
         r"max_num_seqs \((?P<seqs>\d+)\) exceeds available Mamba cache blocks \((?P<blocks>\d+)\)",
         "max_num_seqs {seqs} is above the {blocks} Mamba cache blocks (one per decoding sequence)",
         "set VLLM_MAX_NUM_SEQS={blocks} or less (and MAMBA_CACHE_BLOCKS={blocks} so `invoke check` "
         "catches it next time), or raise VLLM_GPU_MEM_UTIL"),
    _sig("max-len-over-model",
         r"User-specified max_model_len \((?P<len>\d+)\) is greater than the derived max_model_len "
         r"\((?P<derived>[^)]*)\)",
         "max_model_len {len} is above what the model supports ({derived})",
         "lower VLLM_MAX_MODEL_LEN (or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 knowingly)"),
    _sig("unknown-flag", r"error: unrecognized arguments: (?P<args>.+)",
         "vLLM does not know the flag(s) {args}",
         "remove them from VLLM_EXTRA_ARGS / VLLM_TOOL_CHOICE, or run `invoke check --deep` against "
         "this image's vLLM version"),
    _sig("bad-flag-value", r"serve: error: argument (?P<arg>\S+): (?P<msg>.+)",
         "vLLM rejected the value of {arg}: {msg}",
         "fix the setting behind {arg} (`invoke config --explain` shows where it is set)"),
    _sig("heads-vs-tp",
         r"Total number of attention heads \((?P<heads>\d+)\) must be divisible by tensor parallel "
         r"size \((?P<tp>\d+)\)",
         "tensor parallel size {tp} does not divide the model's {heads} attention heads",
         "choose a VLLM_TP that divides {heads}"),
    _sig("bad-kv-dtype", r"Invalid kv_cache_dtype: '(?P<dtype>[^']+)'",
         "KV cache dtype {dtype} is not one vLLM knows", "use auto, bfloat16 or fp8"),
    _sig("bad-attention-backend", r"Unknown attention backend: '(?P<name>[^']+)'",
         "attention backend {name} does not exist in this vLLM",
         "fix ATTENTION_BACKEND (e.g. TRITON_ATTN, ROCM_AITER_UNIFIED_ATTN) or leave it empty"),
    _sig("bad-parser", r"invalid (?P<what>tool call|reasoning) parser: (?P<name>\S+)",
         "{what} parser {name} does not exist in this vLLM",
         "fix the parser name in VLLM_TOOL_CHOICE"),
    _sig("tool-choice-needs-parser", r"--enable-auto-tool-choice requires --tool-call-parser",
         "auto tool choice is on without a tool-call parser",
         "add --tool-call-parser NAME to VLLM_TOOL_CHOICE"),
    _sig("missing-gfx-kernels",
         r"hipErrorNoBinaryForGpu|no kernel image is available|invalid device function|"
         r"No compatible code objects found|Cannot find Symbol",
         "the image has no kernels for this GPU's architecture",
         "build the image for this GPU_ARCH (invoke build), or on RDNA3 gfx1101/1102 set "
         "HSA_OVERRIDE_GFX_VERSION=11.0.0 in the platform layer"),
    _sig("gpu-oom-loading", r"(HIP|CUDA) out of memory|OutOfMemoryError",
         "the GPU ran out of memory while loading or profiling",
         "lower VLLM_GPU_MEM_UTIL's competitors: stop other GPU users, lower VLLM_MAX_NUM_BATCHED_TOKENS, "
         "or use more GPUs (VLLM_TP)"),
    _sig("no-gpu-visible",
         r"No HIP GPUs are available|No CUDA GPUs are available|Failed to infer device type|"
         r"hipErrorNoDevice|no ROCm-capable device",
         "the engine sees no GPU",
         "check the platform's devices (/dev/kfd, /dev/dri or the NVIDIA runtime), RENDER_GID, and "
         "that HSA_OVERRIDE_GFX_VERSION / HIP_VISIBLE_DEVICES are not empty"),
    _sig("device-permission", r"Permission denied: '/dev/(?P<dev>kfd|dri[^']*)'",
         "the container user may not open /dev/{dev}",
         "set RENDER_GID (and VIDEO_GID) in .env to the host's group ids: stat -c %g /dev/dri/renderD128"),
    _sig("llvm-double-registration", r"LLVM ERROR: .*(registered more than once|Option)",
         "LLVM options were registered twice (libtorch_cpu promoted to RTLD_GLOBAL next to the ROCm SDK)",
         "apply the rocm-skip-libtorch-global-promotion patch, or check `import vllm` in a throwaway "
         "container"),
    _sig("engine-start-timeout", r"Timed out waiting for engine core processes to start",
         "the engine core took longer than VLLM_ENGINE_READY_TIMEOUT_S (default 600 s) to start",
         "set VLLM_ENGINE_READY_TIMEOUT_S=1800 for long first-time compiles, or look for a hang above"),
    _sig("model-not-found",
         r"Repository Not Found|401 Client Error|is not a local folder and is not a valid model "
         r"identifier|We couldn't connect to 'https://huggingface.co'|LocalEntryNotFoundError",
         "the model is not in the local cache and cannot be downloaded (offline, gated or misspelled)",
         "download it into the HF cache first (huggingface-cli download ID), check VLLM_MODEL, or "
         "set HF_TOKEN for gated models"),
    _sig("port-in-use", r"Address already in use|address already in use",
         "the engine's port is taken by another process",
         "stop whatever listens on VLLM_PORT, or change VLLM_PORT"),
    _sig("aiter-jit-race", r"ModuleNotFoundError: No module named '(?P<mod>module_\w+|aiter\w*)'",
         "AITER's JIT build raced between tensor-parallel workers ({mod})",
         "start again (the JIT cache is warm now); if it repeats, clear ~/.cache/aiter/jit"),
    _sig("engine-core-died", r"Engine core initialization failed|EngineDeadError|Failed core proc",
         "the engine core process died during start-up without a known error above",
         "read the lines above in `invoke logs`; a silent death on AMD usually means missing gfx "
         "kernels (try HSA_OVERRIDE_GFX_VERSION on RDNA3) or a crash in a native library"),
)


def diagnose(lines: Sequence[str], exit_code: int | None = None) -> Diagnosis:
    """The best explanation for a dead engine, from its log lines (oldest first)."""
    for signature in SIGNATURES:
        for number, line in enumerate(lines, start=1):
            match = signature.pattern.search(line)
            if match:
                groups = {k: (v or "").strip() for k, v in match.groupdict().items()}
                return Diagnosis(signature.code, signature.cause.format(**groups),
                                 signature.fix.format(**groups), line, number)
    if exit_code in (134, 139) or (exit_code is not None and exit_code < 0):
        return Diagnosis("native-crash",
                         f"the engine crashed in native code (exit code {exit_code}) before logging "
                         "a Python error", "check `import vllm` in a throwaway container; on AMD "
                         "check the image's GPU_ARCH against the card", None, None)
    return Diagnosis("unknown",
                     f"the engine exited (code {exit_code}) with no known error signature in its log",
                     "read the log tail above (`invoke logs`)", None, None)

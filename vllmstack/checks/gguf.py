"""What a GGUF file's header says, and the sums the llama.cpp checks need. The header is read by
gguf_header.py's bounded parser (limits on sizes, counts and types; a named GgufError for any
file that breaks them); the `gguf` package (llama.cpp's own gguf-py, pinned to the version the
pinned llama.cpp source carries) gives only its tables of tensor and file types.

Nothing here judges a profile: `read_gguf` returns the facts (architecture, trained context,
file type, layers, heads, tensor bytes per layer), and the methods answer "how many bytes does
llama.cpp put on the GPU for these layers" and "how many bytes of KV cache per token" the way
the pinned llama.cpp's loader and KV cache do (src/llama-model.cpp, src/llama-kv-cache.cpp,
src/llama-hparams.cpp). The rules that use them are in llamacpp.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from vllmstack.checks.gguf_header import GgufError as GgufError  # re-exported: the error callers catch
from vllmstack.checks.gguf_header import GgufHeader, open_header, shown
from vllmstack.config.llamacpp_args import MODEL_KEY, gguf_path
from vllmstack.config.profiles import Resolved
from vllmstack.core.errors import StackError

# The ref the vendored architecture list was taken from (llamacpp-archs.txt; tests check that it
# is the schema's LLAMACPP_REF default, so a bump regenerates the list).
ARCHS_REF = "9993"
LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
# MoE expert tensors, the ones --n-cpu-moe keeps in system RAM (llm_ffn_exps_block_regex).
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")
OUTPUT_TENSORS = ("output.weight", "output.bias", "output_norm.weight", "output_norm.bias")
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# Archs whose hybrid layout defaults to every 4th layer being full attention when the file
# has no full_attention_interval (src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp).
INTERVAL_4_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
F32_BYTES = 4  # recurrent (Mamba/GDN) state is kept in f32
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS (src/llama-hparams.h): llama.cpp refuses more


@dataclass(frozen=True)
class GgufInfo:
    path: Path
    arch: str
    name: str
    file_type: str | None          # general.file_type as llama.cpp names it (Q8_0, F16, ...)
    context_length: int | None     # the trained context (<arch>.context_length)
    block_count: int               # repeating layers, MTP/NextN layers included
    embedding_length: int | None
    head_count: int | None
    head_count_kv: tuple[int, ...]  # per layer (a file may give one number for all)
    key_length: int | None
    value_length: int | None
    expert_count: int
    sliding_window: int | None
    recurrent: tuple[bool, ...]    # per layer: a Mamba/GDN layer (no KV cache, a fixed state)
    recurrent_state_bytes: int     # per sequence per recurrent layer
    tensor_bytes: int              # all tensors, every split file
    layer_bytes: dict[int, int] = field(default_factory=dict)
    expert_bytes: dict[int, int] = field(default_factory=dict)
    output_bytes: int = 0          # output head and norm (on the GPU when any layer is)
    token_embd_bytes: int = 0      # stays in system RAM (llama.cpp never offloads the input)
    tied_output: bool = False      # no output.weight: llama.cpp copies token_embd to the output
    dominant_type: str | None = None  # the tensor type holding most bytes

    @property
    def quant(self) -> str:
        return self.file_type or self.dominant_type or "unknown"

    @property
    def head_dim(self) -> int | None:
        return self.key_length

    def kv_layers(self) -> list[int]:
        return [il for il in range(self.block_count)
                if not self.recurrent[il] and self.head_count_kv[il] > 0]

    def kv_bytes_per_token(self, layers: Sequence[int], k_type: str, v_type: str) -> float | None:
        """KV bytes per cached token over `layers` (only those with a KV cache count)."""
        if self.key_length is None or self.value_length is None:
            return None
        k_size, v_size = type_bytes(k_type), type_bytes(v_type)
        total = 0.0
        for il in layers:
            if il < self.block_count and not self.recurrent[il] and self.head_count_kv[il] > 0:
                heads = self.head_count_kv[il]
                total += heads * (self.key_length * k_size + self.value_length * v_size)
        return total

    def gpu_layers(self, n_gpu_layers: int) -> tuple[list[int], bool]:
        """The repeating layers llama.cpp puts on the GPU, and whether the output layer goes too
        (src/llama-model.cpp: the last `n_gpu_layers` of layers + output, the output first)."""
        start = max(self.block_count + 1 - n_gpu_layers, 0)
        return list(range(start, self.block_count)), n_gpu_layers >= 1

    def gpu_weight_bytes(self, n_gpu_layers: int, n_cpu_moe: int = 0) -> int:
        layers, output = self.gpu_layers(n_gpu_layers)
        total = sum(self.layer_bytes.get(il, 0) for il in layers)
        total -= sum(self.expert_bytes.get(il, 0) for il in layers if il < n_cpu_moe)
        if output:
            total += self.output_bytes + (self.token_embd_bytes if self.tied_output else 0)
        return total


@dataclass(frozen=True)
class GgufRead:
    """One attempt to read a profile's GGUF: its facts, or why there are none."""

    key: str
    path: Path | None            # None: the setting is empty, or a relative path without MODELS_DIR
    info: GgufInfo | None = None
    error: GgufError | StackError | None = None


def read_setting(resolved: Resolved, key: str = MODEL_KEY) -> GgufRead:
    """Read the GGUF a setting names (LLAMACPP_MODEL, LLAMACPP_DRAFT_MODEL); never raises."""
    try:
        path = gguf_path(resolved, key)
    except StackError as exc:  # a relative path without MODELS_DIR
        return GgufRead(key, None, error=exc)
    if path is None:
        return GgufRead(key, None)
    try:
        return GgufRead(key, path, info=read_gguf(path))
    except GgufError as exc:
        return GgufRead(key, path, error=exc)


def type_bytes(name: str) -> float:
    """Bytes per element of a ggml type (a block type's block bytes / block size)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
    return size / block


def known_archs() -> frozenset[str]:
    """The architectures the pinned llama.cpp loads (vendored from its src/llama-arch.cpp)."""
    text = resources.files("vllmstack.checks").joinpath("llamacpp-archs.txt").read_text(
        encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines()
                     if line.strip() and not line.startswith("#"))


def read_gguf(path: Path) -> GgufInfo:
    """The header facts of a GGUF file (and its sibling split files). Raises GgufError: a file
    that is not GGUF, is cut short, lies about a count or length, or holds a value of the wrong
    type (a string block_count, a NaN) is "invalid", never a traceback or "0 layers"."""
    with open_header(path) as header:
        return _facts(path, header)


def _facts(path: Path, header: GgufHeader) -> GgufInfo:
    arch = header.string("general.architecture")
    if not arch:
        raise GgufError("invalid", f"{path} has no general.architecture: not a llama.cpp model GGUF")
    tensors = [(t.name, t.type_name, t.n_bytes) for t in header.tensors]
    split = SPLIT_NAME.match(path.name)
    if split and (header.count("split.count") or 1) > 1:
        for index in range(2, int(split.group("count")) + 1):
            part = path.with_name(f"{split.group('stem')}-{index:05d}-of-{split.group('count')}.gguf")
            with open_header(part) as other:
                tensors += [(t.name, t.type_name, t.n_bytes) for t in other.tensors]
    blocks = header.count(f"{arch}.block_count", most=2**64 - 1)
    if blocks is None:
        if arch in known_archs():  # llama.cpp requires it (llama_model::load_hparams)
            raise GgufError("invalid", f"{path} has no {shown(arch + '.block_count')}: not a "
                            "GGUF file llama.cpp can load")
        blocks = 0  # an architecture llama.cpp does not know: rule_gguf_arch says so
    if not 0 <= blocks <= len(tensors):
        # Every layer holds tensors of its own: a count beyond them is a header that lies, and
        # the per-layer tables below would be that long (10^12 layers: MemoryError).
        raise GgufError("invalid", f"{path} claims {blocks} layers but holds {len(tensors)} "
                        "tensors: not a GGUF file llama.cpp can load")
    if blocks > MAX_LAYERS:
        raise GgufError("invalid", f"{path} claims {blocks} layers: llama.cpp loads at most "
                        f"{MAX_LAYERS} (LLAMA_MAX_LAYERS)")
    layer_bytes: dict[int, int] = {}
    expert_bytes: dict[int, int] = {}
    by_type: dict[str, int] = {}
    output = token_embd = 0
    for name, kind, size in tensors:
        by_type[kind] = by_type.get(kind, 0) + size
        if match := LAYER_TENSOR.match(name):
            layer_bytes[int(match.group(1))] = layer_bytes.get(int(match.group(1)), 0) + size
            if expert := EXPERT_TENSOR.match(name):
                expert_bytes[int(expert.group(1))] = expert_bytes.get(int(expert.group(1)), 0) + size
        elif name in OUTPUT_TENSORS:
            output += size
        elif name == "token_embd.weight":
            token_embd = size

    def count(suffix: str) -> int | None:
        return header.count(f"{arch}.{suffix}")

    n_embd, n_head = count("embedding_length"), count("attention.head_count")
    default_dim = n_embd // n_head if n_embd and n_head else None
    kv_heads = _per_layer(header.counts(f"{arch}.attention.head_count_kv"), blocks, n_head or 0)
    recurrent = _recurrent_layers(header, arch, blocks, kv_heads)
    return GgufInfo(
        path=path, arch=arch, name=header.string("general.name") or path.stem,
        file_type=_file_type_name(header.count("general.file_type")),
        context_length=count("context_length"),
        block_count=blocks, embedding_length=n_embd, head_count=n_head, head_count_kv=kv_heads,
        key_length=count("attention.key_length") or default_dim,
        value_length=count("attention.value_length") or default_dim,
        expert_count=count("expert_count") or 0,
        sliding_window=count("attention.sliding_window"),
        recurrent=recurrent, recurrent_state_bytes=_recurrent_state_bytes(header, arch),
        tensor_bytes=sum(size for _, _, size in tensors), layer_bytes=layer_bytes,
        expert_bytes=expert_bytes, output_bytes=output, token_embd_bytes=token_embd,
        tied_output=not any(name == "output.weight" for name, _, _ in tensors),
        dominant_type=max(by_type, key=lambda k: by_type[k]) if by_type else None,
    )


def _per_layer(value: int | list[int] | None, blocks: int, fallback: int) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(value[:blocks]) + (fallback,) * max(0, blocks - len(value))
    return (fallback if value is None else value,) * blocks


def _recurrent_layers(header: GgufHeader, arch: str, blocks: int,
                      kv_heads: tuple[int, ...]) -> tuple[bool, ...]:
    """Which layers are Mamba/GDN layers (src/llama-hparams, the arch's load_arch_hparams)."""
    listed = header.flags(f"{arch}.attention.recurrent_layers")
    if listed is not None:
        return tuple(listed[:blocks]) + (False,) * max(0, blocks - len(listed))
    if header.count(f"{arch}.ssm.inner_size") is None:
        return (False,) * blocks
    interval = header.count(f"{arch}.full_attention_interval")
    if interval is None and arch in INTERVAL_4_ARCHS:
        interval = 4
    if interval:
        main = blocks - (header.count(f"{arch}.nextn_predict_layers") or 0)
        return tuple(il < main and (il + 1) % interval != 0 for il in range(blocks))
    # Other hybrids mark their recurrent layers with 0 KV heads; a pure Mamba has none.
    return tuple(heads == 0 for heads in kv_heads)


def _recurrent_state_bytes(header: GgufHeader, arch: str) -> int:
    """Conv + SSM state per sequence per recurrent layer (llama_hparams::n_embd_r/n_embd_s)."""
    conv, inner = header.count(f"{arch}.ssm.conv_kernel"), header.count(f"{arch}.ssm.inner_size")
    state, groups = header.count(f"{arch}.ssm.state_size"), header.count(f"{arch}.ssm.group_count")
    if not inner or not state:
        return 0
    conv_state = max((conv or 0) - 1, 0) * (inner + 2 * (groups or 0) * state)
    return (conv_state + state * inner) * F32_BYTES


def _file_type_name(value: int | None) -> str | None:
    if value is None:
        return None
    from gguf.constants import LlamaFileType

    try:
        name = LlamaFileType(value).name
    except ValueError:
        return f"file type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")

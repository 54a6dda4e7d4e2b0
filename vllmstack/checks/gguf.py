"""What a GGUF file's header says, read with the `gguf` package (llama.cpp's own gguf-py, pinned
to the version the pinned llama.cpp source carries), and the sums the llama.cpp checks need.

Nothing here judges a profile: `read_gguf` returns the facts (architecture, trained context,
file type, layers, heads, tensor bytes per layer), and the methods answer "how many bytes does
llama.cpp put on the GPU for these layers" and "how many bytes of KV cache per token" the way
the pinned llama.cpp's loader and KV cache do (src/llama-model.cpp, src/llama-kv-cache.cpp,
src/llama-hparams.cpp). The rules that use them are in llamacpp.py.
"""

from __future__ import annotations

import re
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

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
# The fixed header: magic, version, tensor count, key/value count (gguf.md).
GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24
# The least bytes one entry takes: a tensor's name length, one dimension, type and offset; a
# pair's key length and value type plus the smallest value.
MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8
MIN_KV_PAIR = 8 + 4 + 1


class GgufError(ValueError):
    """The file is missing, unreadable or not GGUF; `kind` says which."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "missing", "unreadable" or "invalid"


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
    """The header facts of a GGUF file (and its sibling split files). Raises GgufError."""
    reader = _open(path)
    arch = _str(reader, "general.architecture")
    if not arch:
        raise GgufError("invalid", f"{path} has no general.architecture: not a llama.cpp model GGUF")
    tensors = [(t.name, t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors]
    split = SPLIT_NAME.match(path.name)
    if split and int(_int(reader, "split.count") or 1) > 1:
        for index in range(2, int(split.group("count")) + 1):
            part = path.with_name(f"{split.group('stem')}-{index:05d}-of-{split.group('count')}.gguf")
            tensors += [(t.name, t.tensor_type.name, int(t.n_bytes)) for t in _open(part).tensors]
    blocks = _int(reader, f"{arch}.block_count") or 0
    if not 0 <= blocks <= len(tensors):
        # Every layer holds tensors of its own: a count beyond them is a header that lies, and
        # the per-layer tables below would be that long (10^12 layers: MemoryError).
        raise GgufError("invalid", f"{path} claims {blocks} layers but holds {len(tensors)} "
                        "tensors: not a GGUF file llama.cpp can load")
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
    n_embd, n_head = _int(reader, f"{arch}.embedding_length"), _int(reader, f"{arch}.attention.head_count")
    default_dim = n_embd // n_head if n_embd and n_head else None
    kv_heads = _per_layer(_value(reader, f"{arch}.attention.head_count_kv"), blocks, n_head or 0)
    recurrent = _recurrent_layers(reader, arch, blocks, kv_heads)
    file_type = _int(reader, "general.file_type")
    return GgufInfo(
        path=path, arch=arch, name=_str(reader, "general.name") or path.stem,
        file_type=_file_type_name(file_type), context_length=_int(reader, f"{arch}.context_length"),
        block_count=blocks, embedding_length=n_embd, head_count=n_head, head_count_kv=kv_heads,
        key_length=_int(reader, f"{arch}.attention.key_length") or default_dim,
        value_length=_int(reader, f"{arch}.attention.value_length") or default_dim,
        expert_count=_int(reader, f"{arch}.expert_count") or 0,
        sliding_window=_int(reader, f"{arch}.attention.sliding_window"),
        recurrent=recurrent, recurrent_state_bytes=_recurrent_state_bytes(reader, arch),
        tensor_bytes=sum(size for _, _, size in tensors), layer_bytes=layer_bytes,
        expert_bytes=expert_bytes, output_bytes=output, token_embd_bytes=token_embd,
        tied_output=not any(name == "output.weight" for name, _, _ in tensors),
        dominant_type=max(by_type, key=lambda k: by_type[k]) if by_type else None,
    )


def _open(path: Path) -> Any:
    _check_header(path)
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except FileNotFoundError as exc:
        raise GgufError("missing", f"{path} does not exist") from exc
    except PermissionError as exc:
        raise GgufError("unreadable", f"{path} cannot be read ({exc.strerror})") from exc
    except OSError as exc:
        raise GgufError("unreadable", f"{path} cannot be read ({exc})") from exc
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        # gguf-py raises ValueError("GGUF magic invalid") for another format, and index or
        # key errors on a header cut short (a download that stopped).
        raise GgufError("invalid", f"{path} is not a GGUF file llama.cpp can read ({exc})") from exc


def _check_header(path: Path) -> None:
    """Refuse before the reader maps the file: what is not a regular file (a FIFO blocks the
    open for ever), and counts of tensors or key/value pairs that the file is too small to hold
    (each takes bytes of its own); the reader would otherwise trust them."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise GgufError("missing", f"{path} does not exist") from None
    except OSError as exc:
        raise GgufError("unreadable", f"{path} cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(info.st_mode):
        raise GgufError("invalid", f"{path} is a folder, not a .gguf file")
    if not stat.S_ISREG(info.st_mode):
        raise GgufError("invalid", f"{path} is not a regular file (a pipe, socket or device): "
                        "a model is read from a file")
    try:
        with path.open("rb") as handle:
            head = handle.read(HEADER_BYTES)
    except OSError as exc:
        raise GgufError("unreadable", f"{path} cannot be read ({exc.strerror or exc})") from None
    if len(head) < HEADER_BYTES or head[:4] != GGUF_MAGIC:
        return  # not GGUF, or cut short: the reader says so in its words
    # A file written big-endian reads as version 0x0N000000 here (the reader's own test).
    order = ">" if struct.unpack("<I", head[4:8])[0] & 0xFFFF == 0 else "<"
    tensors, pairs = struct.unpack(order + "QQ", head[8:24])
    room = info.st_size - HEADER_BYTES
    for what, count, least in (("tensors", tensors, MIN_TENSOR_INFO), ("key/value pairs", pairs,
                                                                        MIN_KV_PAIR)):
        if count * least > room:
            raise GgufError("invalid", f"{path} claims {count} {what} in a {info.st_size}-byte "
                            "file: not a GGUF file llama.cpp can read")


def _value(reader: Any, key: str) -> Any:
    found = reader.fields.get(key)
    return None if found is None else found.contents()


def _int(reader: Any, key: str) -> int | None:
    value = _value(reader, key)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _str(reader: Any, key: str) -> str:
    value = _value(reader, key)
    return value if isinstance(value, str) else ""


def _per_layer(value: Any, blocks: int, fallback: int) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(int(v) for v in value[:blocks]) + (fallback,) * max(0, blocks - len(value))
    number = int(value) if isinstance(value, int | float) else fallback
    return (number,) * blocks


def _recurrent_layers(reader: Any, arch: str, blocks: int, kv_heads: tuple[int, ...]) -> tuple[bool, ...]:
    """Which layers are Mamba/GDN layers (src/llama-hparams, the arch's load_arch_hparams)."""
    listed = _value(reader, f"{arch}.attention.recurrent_layers")
    if isinstance(listed, list):
        return tuple(bool(v) for v in listed[:blocks]) + (False,) * max(0, blocks - len(listed))
    if _int(reader, f"{arch}.ssm.inner_size") is None:
        return (False,) * blocks
    interval = _int(reader, f"{arch}.full_attention_interval")
    if interval is None and arch in INTERVAL_4_ARCHS:
        interval = 4
    if interval:
        main = blocks - (_int(reader, f"{arch}.nextn_predict_layers") or 0)
        return tuple(il < main and (il + 1) % interval != 0 for il in range(blocks))
    # Other hybrids mark their recurrent layers with 0 KV heads; a pure Mamba has none.
    return tuple(heads == 0 for heads in kv_heads)


def _recurrent_state_bytes(reader: Any, arch: str) -> int:
    """Conv + SSM state per sequence per recurrent layer (llama_hparams::n_embd_r/n_embd_s)."""
    conv, inner = _int(reader, f"{arch}.ssm.conv_kernel"), _int(reader, f"{arch}.ssm.inner_size")
    state, groups = _int(reader, f"{arch}.ssm.state_size"), _int(reader, f"{arch}.ssm.group_count")
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

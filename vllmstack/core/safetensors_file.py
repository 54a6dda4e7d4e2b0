"""The safetensors files the stack writes: the made model's weights (`models/tiny.py`), the
trained model's (`models/train_runner.py`) and the KV scales beside a checkpoint
(`tune/kv_copy.py`), one writer for all three.

The format: an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and
byte range in the data, and `__metadata__`), spaces to align the data to 8 bytes, then the tensors'
bytes back to back. Plain Python, no imports of the package: train_runner runs in the engine's
interpreter, and the made model is written without torch or numpy.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

# The metadata every file gets: transformers' loader reads `format` and refuses a checkpoint that
# names another framework (and, in older versions, one without it).
PT_FORMAT: Mapping[str, str] = {"format": "pt"}


class Tensor(NamedTuple):
    name: str
    dtype: str  # safetensors' dtype name: "BF16", "F32", ...
    shape: tuple[int, ...]
    data: bytes  # row-major, little-endian


def encode_header(tensors: Iterable[Tensor], metadata: Mapping[str, str] | None = PT_FORMAT) -> bytes:
    """The length and the header of a file holding `tensors` in the order given.

    safetensors' own writer sorts by descending dtype, then by name; a caller whose file should be
    byte for byte the one it would write passes them in that order (train_runner sorts by name:
    all its tensors are BF16). Compact JSON, ASCII, as serde_json writes it for ASCII names.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata is not None else {}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + len(tensor.data)]}
        offset += len(tensor.data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return struct.pack("<Q", len(text)) + text


def encode_safetensors(tensors: list[Tensor], metadata: Mapping[str, str] | None = PT_FORMAT) -> bytes:
    """A whole file in memory: for small ones (the KV scales)."""
    return encode_header(tensors, metadata) + b"".join(t.data for t in tensors)


def write_safetensors(path: Path, tensors: list[Tensor],
                      metadata: Mapping[str, str] | None = PT_FORMAT) -> int:
    """The file at `path`, the tensors written one by one (a model's weights are not joined in
    memory first); returns the bytes written."""
    head = encode_header(tensors, metadata)
    with path.open("wb") as f:
        f.write(head)
        for tensor in tensors:
            f.write(tensor.data)
    return len(head) + sum(len(t.data) for t in tensors)

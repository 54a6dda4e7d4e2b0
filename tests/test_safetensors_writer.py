"""The one safetensors writer (core/safetensors_file.py): the bytes it writes are the ones the two
writers it replaced wrote, the real `safetensors` package reads them back, and its order is the
one safetensors' own writer uses, so the trained model's file is byte for byte what
safetensors.torch.save_file wrote before."""

from __future__ import annotations

import ctypes
import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from vllmstack.core.safetensors_file import Tensor, encode_safetensors, write_safetensors
from vllmstack.models import train_runner
from vllmstack.tune.kv_copy import f32_safetensors

# safetensors' reader of a whole file in memory (untyped): [(name, {dtype, shape, data})].
DESERIALIZE: Callable[[bytes], list[tuple[str, dict[str, Any]]]] = safetensors.deserialize
BF16_ONE, BF16_TWO = b"\x80\x3f", b"\x00\x40"
MODEL = [Tensor("model.embed_tokens.weight", "BF16", (2, 3), bytes(range(12))),
         Tensor("lm_head.weight", "BF16", (1, 2), BF16_ONE + BF16_TWO),
         Tensor("a.norm.weight", "BF16", (3,), BF16_ONE * 3)]


def test_the_bytes_are_the_ones_the_replaced_writers_wrote(tmp_path: Path) -> None:
    # Pinned from models/tiny.py's and tune/kv_copy.py's own writers before they were merged:
    # the tensors in the order given, compact JSON, spaces to an 8-byte boundary.
    header = (b'{"__metadata__":{"format":"pt"},'
              b'"model.embed_tokens.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},'
              b'"lm_head.weight":{"dtype":"BF16","shape":[1,2],"data_offsets":[12,16]},'
              b'"a.norm.weight":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}}    ')
    expected = struct.pack("<Q", 256) + header + bytes(range(12)) + BF16_ONE + BF16_TWO + BF16_ONE * 3
    assert len(header) == 256
    path = tmp_path / "model.safetensors"
    assert write_safetensors(path, MODEL) == len(expected) == 286
    assert path.read_bytes() == expected == encode_safetensors(MODEL)
    scales = f32_safetensors({"l.k_scale": 0.5, "l.v_scale": 0.25})
    header = (b'{"__metadata__":{"format":"pt"},"l.k_scale":{"dtype":"F32","shape":[1],'
              b'"data_offsets":[0,4]},"l.v_scale":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}')
    header += b" " * (-len(header) % 8)
    assert scales == struct.pack("<Q", len(header)) + header + struct.pack("<ff", 0.5, 0.25)


def test_the_real_safetensors_reads_back_every_tensor(tmp_path: Path) -> None:
    tensors = [*MODEL, Tensor("scale", "F32", (1,), struct.pack("<f", 0.5)),
               Tensor("empty", "F32", (0, 4), b"")]
    loaded = {name: (info["dtype"], info["shape"], bytes(info["data"]))
              for name, info in DESERIALIZE(encode_safetensors(tensors))}
    assert loaded == {t.name: (t.dtype, list(t.shape), t.data) for t in tensors}
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors)
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [2, 3]
        assert f.get_tensor("scale").tolist() == [0.5]
    reread = f32_safetensors({"k": 0.125, "v": 2.0})
    assert {n: struct.unpack("<f", bytes(i["data"]))[0] for n, i in DESERIALIZE(reread)} == {
        "k": 0.125, "v": 2.0}


def test_sorted_by_name_it_is_the_file_safetensors_writes() -> None:
    # safetensors orders tensors by dtype, then by name: one dtype sorted by name is its order.
    arrays = {"zeta": np.arange(3, dtype="<f4"), "alpha": np.ones((2, 2), dtype="<f4"),
              "mid.weight": np.array([0.5], dtype="<f4")}
    theirs = safetensors.numpy.save(arrays, metadata={"format": "pt"})
    ours = encode_safetensors([Tensor(n, "F32", a.shape, a.tobytes()) for n, a in sorted(arrays.items())])
    assert ours == theirs
    assert ours != encode_safetensors([Tensor(n, "F32", a.shape, a.tobytes()) for n, a in arrays.items()])


class FakeTensor:
    """What train_runner.tensor_bytes asks of a contiguous CPU torch tensor."""

    def __init__(self, raw: bytes, item: int) -> None:
        self.buffer = ctypes.create_string_buffer(raw, len(raw) or 1)
        self.size, self.item = len(raw), item

    def numel(self) -> int:
        return self.size // self.item

    def element_size(self) -> int:
        return self.item

    def data_ptr(self) -> int:
        return ctypes.addressof(self.buffer)


def test_the_trainer_writes_a_tensors_memory_as_it_is() -> None:
    raw = BF16_ONE + BF16_TWO + b"\x12\x34"
    assert train_runner.tensor_bytes(FakeTensor(raw, 2)) == raw  # little-endian, as safetensors stores
    assert train_runner.tensor_bytes(FakeTensor(b"", 2)) == b""


def test_the_trainer_and_the_writer_import_only_the_stdlib() -> None:
    # train_runner runs in the engine's interpreter: torch and transformers, not the stack's deps.
    code = ("import json, sys; before = set(sys.modules); import vllmstack.models.train_runner; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    loaded = json.loads(done.stdout)
    assert "vllmstack.core.safetensors_file" in loaded and "safetensors" not in loaded
    assert [m for m in loaded if m.split(".")[0] not in (*sys.stdlib_module_names, "vllmstack")] == []

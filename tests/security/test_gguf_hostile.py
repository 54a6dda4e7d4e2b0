"""A hostile pass over the GGUF header reader (issue 36, rows 2, 3, 11 and 12, and the property).

`invoke check` reads an ENGINE=llamacpp profile's LLAMACPP_MODEL header (checks/gguf.py through
checks/gguf_header.py). Each case is a file crafted byte by byte with struct -- an array that
claims 2^62 items, a NaN layer count, an architecture holding terminal escapes, a string
block_count, a string that claims 2^40 bytes -- and asserts what a user depends on: a GgufError
naming the file (or a finding with it), in bounded time and memory, never a traceback, never
"0 layers", and nothing the file says reaching the terminal unquoted. A property test feeds
random, cut and mutated headers and accepts only a successful read or a GgufError.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFWriter
from helpers import finishes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_llamacpp_checks import small_gguf

from vllmstack.checks.gguf import GgufError, GgufInfo, read_gguf
from vllmstack.checks.registry import check_profile, render_report
from vllmstack.config.profiles import resolve
from vllmstack.core.paths import Project
from vllmstack.core.runner import RecordingRunner

ENVIRON = {"HOME": "/nonexistent"}
U8, I32, U32, F32, BOOL, STRING, ARRAY, U64 = 0, 5, 4, 6, 7, 8, 9, 10
GGML_F32 = 0


# --- GGUF bytes, by hand (GGUF v3, little-endian) ----------------------------------------------

def text(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return struct.pack("<Q", len(data)) + data


def pair(key: str, vtype: int, payload: bytes) -> bytes:
    return text(key) + struct.pack("<I", vtype) + payload


def u32(key: str, value: int) -> bytes:
    return pair(key, U32, struct.pack("<I", value))


def string(key: str, value: str | bytes) -> bytes:
    return pair(key, STRING, text(value))


def array(key: str, itype: int, count: int, items: bytes = b"") -> bytes:
    return pair(key, ARRAY, struct.pack("<IQ", itype, count) + items)


def tensor_info(name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return (text(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", ggml_type, offset))


def gguf_bytes(pairs: Sequence[bytes], tensors: Sequence[bytes] = (), data: bytes = b"",
               pad_to: int = 0) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(pairs)) + b"".join(pairs)
    head += b"".join(tensors)
    if tensors:
        head += b"\0" * (-len(head) % 32) + data
    return head + b"\0" * max(0, pad_to - len(head))


def valid_llama(arch: str = "llama", *, name: str = "tiny", extra: Sequence[bytes] = ()) -> bytes:
    """A small llama.cpp-shaped GGUF: 2 layers, per-layer KV heads, a vocabulary, 3 F32 tensors."""
    pairs = [string("general.architecture", arch), string("general.name", name),
             u32(f"{arch}.block_count", 2), u32(f"{arch}.context_length", 4096),
             u32(f"{arch}.embedding_length", 64), u32(f"{arch}.attention.head_count", 4),
             array(f"{arch}.attention.head_count_kv", U32, 2, struct.pack("<2I", 2, 2)),
             array("tokenizer.ggml.tokens", STRING, 3, text("a") + text("bc") + text("")),
             array("tokenizer.ggml.scores", F32, 3, struct.pack("<3f", 0, 1, 2)),
             u32("general.file_type", 0), *extra]
    names = ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.attn_q.weight")
    tensors = [tensor_info(name, (4,), GGML_F32, 32 * i) for i, name in enumerate(names)]
    data = b"".join(struct.pack("<4f", 1, 2, 3, 4) + b"\0" * 16 for _ in names)
    return gguf_bytes(pairs, tensors, data)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def refused(path: Path, *said: str) -> GgufError:
    """read_gguf(path) ends, in bounded time, with a GgufError "invalid" naming the file."""
    with pytest.raises(GgufError) as caught:
        finishes(lambda: read_gguf(path))
    error = caught.value
    assert error.kind == "invalid" and str(path) in str(error), str(error)
    assert error.fix and "gguf-convert" in error.fix
    for words in said:
        assert words in str(error), str(error)
    return error


def check_text(project: Project, path: Path) -> tuple[list[Any], str]:
    resolved = resolve(project, model="tiny-gguf", platform="cpu", environ=ENVIRON,
                       overrides=[f"LLAMACPP_MODEL={path}"])
    findings = check_profile(project, resolved, ENVIRON, RecordingRunner())
    return findings, render_report(resolved, findings, verbose=True)


# --- row 2: an array count of 2^62 in a 158-byte file ---------------------------------------------

CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from pathlib import Path
from vllmstack.checks.gguf import GgufError, read_gguf
try:
    read_gguf(Path(sys.argv[1]))
    print(json.dumps({"read": True}))
except GgufError as exc:
    print(json.dumps({"error": type(exc).__name__, "kind": exc.kind, "message": str(exc)}))
except MemoryError:
    print(json.dumps({"error": "MemoryError"}))
"""


def test_row2_an_array_of_2_to_the_62_items_is_refused_under_a_1_gib_cap(tmp_path: Path) -> None:
    # u8 items: gguf-py's reader takes each past the end as an empty array, 2^62 times.
    data = gguf_bytes([string("general.architecture", "llama"),
                       array("tokenizer.ggml.token_type", U8, 2**62)], pad_to=158)
    path = write(tmp_path / "huge-array.gguf", data)
    assert len(data) == 158
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                              text=True, timeout=120, check=False, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the read of a 158-byte file ran past 120 s")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["error"] == "GgufError" and said["kind"] == "invalid", said
    assert str(path) in said["message"] and "'tokenizer.ggml.token_type'" in said["message"]


@pytest.mark.parametrize("itype", [U8, U64, STRING])
def test_huge_array_counts_of_every_item_kind_end_at_once(tmp_path: Path, itype: int) -> None:
    path = write(tmp_path / "a.gguf", gguf_bytes(
        [string("general.architecture", "llama"), array("x.y", itype, 2**40)], pad_to=4096))
    refused(path, "'x.y'")


# --- row 3: a NaN block count (138 bytes) ----------------------------------------------------------

def test_row3_a_nan_block_count_is_a_named_error_not_a_traceback(project: Project,
                                                                   tmp_path: Path) -> None:
    data = gguf_bytes([string("general.architecture", "llama"),
                       pair("llama.block_count", F32, struct.pack("<f", math.nan))], pad_to=138)
    assert len(data) == 138
    path = write(tmp_path / "nan.gguf", data)
    refused(path, "'llama.block_count'", "float32", "nan")
    findings, report = check_text(project, path)
    [bad] = [f for f in findings if f.code == "gguf-invalid"]
    assert bad.severity == "error" and str(path) in bad.message and "Traceback" not in report


@pytest.mark.parametrize(("payload", "said"), [
    (pair("llama.block_count", F32, struct.pack("<f", math.inf)), "float32"),
    (pair("llama.block_count", F32, struct.pack("<f", 2.0)), "float32"),
    (pair("llama.block_count", I32, struct.pack("<i", -3)), "-3"),
    (pair("llama.block_count", BOOL, b"\x01"), "bool"),
    (array("llama.block_count", U32, 1, struct.pack("<I", 2)), "array"),
    (pair("llama.context_length", F32, struct.pack("<f", math.nan)), "'llama.context_length'"),
    (pair("llama.attention.head_count", I32, struct.pack("<i", -1)), "'llama.attention.head_count'"),
    (array("llama.attention.head_count_kv", STRING, 1, text("8")), "array of string"),
    (array("llama.attention.head_count_kv", I32, 2, struct.pack("<2i", 8, -8)), "-8"),
    (u32("general.alignment", 3), "general.alignment"),
    (string("general.file_type", "Q8_0"), "'general.file_type'"),
])
def test_a_value_of_the_wrong_type_or_range_is_a_named_error(tmp_path: Path, payload: bytes,
                                                             said: str) -> None:
    pairs = [string("general.architecture", "llama"), payload]
    if b"llama.block_count" not in payload:
        pairs.append(u32("llama.block_count", 0))
    refused(write(tmp_path / "t.gguf", gguf_bytes(pairs, pad_to=512)), said)


# --- row 11: what the file says reaches the terminal quoted ------------------------------------------

HOSTILE_ARCH = "llama\n\x1b[31mOK all good\x1b[0m\u202egnp.exe"


def test_row11_an_architecture_with_escapes_is_quoted_in_what_check_prints(
        project: Project, tmp_path: Path) -> None:
    path = write(tmp_path / "escape.gguf", valid_llama(HOSTILE_ARCH, name="x\x1b]0;pwned\x07"))
    info = finishes(lambda: read_gguf(path))
    assert isinstance(info, GgufInfo) and info.arch == HOSTILE_ARCH  # read exactly, shown quoted
    findings, report = check_text(project, path)
    for raw in ("\x1b", "\u202e", "\x07", "\nOK all good"):
        assert raw not in report, f"{raw!r} reached the terminal raw:\n{report}"
    assert repr(HOSTILE_ARCH) in report  # quoted, so the user sees what the file says
    assert any(f.code == "gguf-unknown-arch" and f.severity == "error" for f in findings)
    for finding in findings:
        assert "\x1b" not in json.dumps(finding.to_json(), ensure_ascii=False)


def test_a_key_or_tensor_name_with_escapes_is_quoted_in_the_error(tmp_path: Path) -> None:
    bad_key = gguf_bytes([string("general.architecture", "llama"),
                          pair("evil\x1b[2J", 99, b"")], pad_to=256)
    error = refused(write(tmp_path / "k.gguf", bad_key), "unknown type 99")
    assert "\x1b" not in str(error) and "\\x1b[2J" in str(error)
    twice = valid_llama().replace(text("blk.1.attn_q.weight"), text("blk.0.attn_q.weight"))
    error = refused(write(tmp_path / "t.gguf", twice), "'blk.0.attn_q.weight' is there twice")


# --- row 12: a wrong type or an absurd length is an error, not "0 layers" ------------------------------

def test_row12_a_string_block_count_is_an_error_not_zero_layers(project: Project,
                                                              tmp_path: Path) -> None:
    path = write(tmp_path / "str.gguf", gguf_bytes(
        [string("general.architecture", "llama"), string("llama.block_count", "32")], pad_to=256))
    refused(path, "'llama.block_count'", "a string ('32')")
    findings, report = check_text(project, path)
    assert any(f.code == "gguf-invalid" and f.severity == "error" for f in findings)
    assert "0 layers" not in report and not any(f.code == "gguf-header" for f in findings)


def test_row12_an_architecture_claiming_2_to_the_40_bytes_is_an_error(project: Project,
                                                                     tmp_path: Path) -> None:
    # The last pair: gguf-py's reader cut the string at the file's end and read on.
    claim = pair("general.architecture", STRING, struct.pack("<Q", 2**40) + b"llama")
    path = write(tmp_path / "long.gguf", gguf_bytes([string("general.name", "x"), claim],
                                                    pad_to=256))
    refused(path, "needs 1099511627776 bytes", "256")
    findings, report = check_text(project, path)
    assert any(f.code == "gguf-invalid" and f.severity == "error" for f in findings)
    assert "0 layers" not in report


def test_a_known_architecture_without_block_count_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "n.gguf", gguf_bytes([string("general.architecture", "llama")]))
    refused(path, "'llama.block_count'")


# --- what is not a regular file is refused before a byte is read ------------------------------------

@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null", "fifo", "link-to-zero", "folder"])
def test_devices_fifos_and_folders_are_refused_before_reading(tmp_path: Path, target: str) -> None:
    path = tmp_path / "model.gguf"
    if target == "fifo":
        os.mkfifo(path)
    elif target == "link-to-zero":
        path.symlink_to("/dev/zero")
    elif target == "folder":
        path.mkdir()
    else:
        path = Path(target)
    with pytest.raises(GgufError) as caught:
        finishes(lambda: read_gguf(path))
    assert caught.value.kind == "invalid" and str(path) in str(caught.value)
    assert ("not a regular file" if target != "folder" else "is a folder") in str(caught.value)


# --- a valid file reads as the gguf package reads it --------------------------------------------------

def test_a_valid_file_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    path = small_gguf(tmp_path / "m.gguf", layers=3, kv_heads=[2, 4, 0], tied=False,
                      extra={"qwen3.attention.sliding_window": 128})
    info = read_gguf(path)
    reader = GGUFReader(path)
    assert info.tensor_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert info.dominant_type == "Q8_0" and not info.tied_output
    assert (info.arch, info.name, info.block_count) == ("qwen3", "m", 3)
    assert info.head_count_kv == (2, 4, 0) and info.sliding_window == 128
    assert info.context_length == reader.fields["qwen3.context_length"].contents()
    assert info.layer_bytes == {il: int(reader.tensors[2 + il].n_bytes) for il in range(3)}


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_a_file_written_by_gguf_py_in_either_byte_order_reads_the_same(tmp_path: Path,
                                                                       endian: GGUFEndian) -> None:
    path = tmp_path / f"{endian.name}.gguf"
    writer = GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_name("both")
    writer.add_block_count(2)
    writer.add_context_length(2048)
    writer.add_head_count(4)
    writer.add_array("llama.attention.head_count_kv", [1, 2])
    writer.add_token_list(["a", "b", "c"])
    for name in ("blk.0.attn_q.weight", "blk.1.attn_q.weight", "output.weight"):
        writer.add_tensor(name, np.ones((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = read_gguf(path)
    assert (info.name, info.block_count, info.context_length, info.head_count_kv) == (
        "both", 2, 2048, (1, 2))
    assert info.layer_bytes == {0: 64, 1: 64} and info.output_bytes == 64 and not info.tied_output


def test_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        with pytest.raises(GgufError, match="not a regular file"):
            finishes(lambda: read_gguf(path))


def test_a_hand_built_file_and_a_real_sized_vocabulary_read_quickly(tmp_path: Path) -> None:
    vocab = b"".join(text(f"tok{i}") for i in range(300_000))
    data = valid_llama(extra=[array("tokenizer.ggml.merges", STRING, 300_000, vocab)])
    info = finishes(lambda: read_gguf(write(tmp_path / "v.gguf", data)))
    assert (info.arch, info.block_count, info.head_count_kv, info.tensor_bytes) == (
        "llama", 2, (2, 2), 48)
    assert info.layer_bytes == {0: 16, 1: 16} and info.quant == "F32"


def test_tensor_data_cut_short_is_invalid(tmp_path: Path) -> None:
    data = valid_llama()
    refused(write(tmp_path / "cut.gguf", data[:-20]), "'blk.1.attn_q.weight'", "past the file's end")


# --- the property: random, cut and mutated bytes never raise anything but GgufError --------------------

BASE = valid_llama()


def read_or_refuse(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "p.gguf"
        path.write_bytes(data)
        try:
            info = finishes(lambda: read_gguf(path))
        except GgufError as exc:
            assert exc.kind == "invalid" and str(path) in str(exc) and exc.fix
            assert not any(c in str(exc) for c in "\x1b\u202e\x00"), str(exc)
            return
        assert isinstance(info, GgufInfo)


cuts = st.integers(min_value=0, max_value=len(BASE))
edits = st.lists(st.tuples(st.integers(min_value=0, max_value=len(BASE) - 1),
                           st.integers(min_value=0, max_value=255)), max_size=6)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=300).map(lambda tail: b"GGUF\x03\x00\x00\x00" + tail),
    cuts.map(lambda n: BASE[:n]),
    st.tuples(edits, cuts).map(lambda e: bytes(_edit(BASE, e[0]))[:e[1]]),
    st.tuples(st.integers(0, len(BASE) - 8), st.sampled_from(
        [2**64 - 1, 2**63, 2**40, 2**32, 0, 1])).map(
        lambda e: BASE[:e[0]] + struct.pack("<Q", e[1]) + BASE[e[0] + 8:]),
))
def test_any_bytes_read_or_are_refused_never_a_traceback(data: bytes) -> None:
    read_or_refuse(data)


def _edit(data: bytes, changes: list[tuple[int, int]]) -> bytearray:
    out = bytearray(data)
    for at, value in changes:
        out[at] = value
    return out


def test_the_base_of_the_property_reads() -> None:
    with tempfile.TemporaryDirectory() as folder:
        info = read_gguf(write(Path(folder) / "b.gguf", BASE))
    assert (info.arch, info.name, info.block_count, info.context_length) == ("llama", "tiny", 2, 4096)


def test_bench_vs_reads_the_gguf_through_the_same_bounds(tmp_path: Path) -> None:
    # bench-vs names each llama.cpp row's checkpoint from LLAMACPP_MODEL's header: the hostile
    # file is a note on that row (quoted), the good one's source and file type are read.
    from vllmstack.bench.fleet.vs_report import read_gguf_source

    hostile = write(tmp_path / "huge\x1b[31m.gguf", gguf_bytes(
        [string("general.architecture", "llama"), array("tokenizer.ggml.token_type", U8, 2**62)],
        pad_to=158))
    file_type, sources, notes = finishes(lambda: read_gguf_source(hostile), 30)
    assert (file_type, sources) == (None, [])
    assert len(notes) == 1 and "header not readable" in notes[0] and "\x1b" not in notes[0]
    good = write(tmp_path / "good.gguf", valid_llama(extra=[
        string("general.source.url", "https://huggingface.co/Qwen/Qwen3-0.6B")]))
    assert read_gguf_source(good) == ("ALL_F32", ["https://huggingface.co/Qwen/Qwen3-0.6B"], [])

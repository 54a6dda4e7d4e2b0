"""A bounded reader of a GGUF file's header: the key/value pairs and the tensor infos, never the
tensor data, in bounded time and memory whatever the file says.

Why not `gguf.GGUFReader`: it memory-maps the whole file and parses every field, trusting each
count and length (an array that claims 2^62 items builds a list until MemoryError; a string
that claims 2^40 bytes is silently cut at the end of the file), and has no limit to give it.
Here every count and length is checked against the file's size and against the limits below
before anything is read or allocated, values are read only for the keys asked for, and every
way a file can be wrong is a GgufError naming the file (never a traceback). The `gguf` package
is kept for what is safe in it: the tables of tensor types and their block sizes.

The layout (GGUF v2 and v3, llama.cpp's ggml/src/gguf.cpp): magic 'GGUF', version u32,
tensor count u64, key/value count u64; each pair a key (u64 length + bytes), a value type u32
and the value (an array: item type u32, count u64, the items); each tensor info a name, a
dimension count u32, the dimensions u64, a type u32 and an offset u64 into the data section,
which starts at the next multiple of general.alignment. A file written big-endian is read too.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmstack.core.errors import StackError

GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 24
VERSIONS = (2, 3)  # what gguf-py and llama.cpp read (v1 is refused by llama.cpp)
# The least bytes one entry takes: a tensor's name length, one dimension, type and offset; a
# pair's key length and value type plus the smallest value.
MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8
MIN_KV_PAIR = 8 + 4 + 1
# Limits. Real model files hold ~50 pairs, a few thousand tensors, vocabularies of up to ~262k
# tokens and ~500k merges (a few tens of MB of header): each limit is far above that, and each
# keeps the worst a hostile file can make the reader do to seconds and tens of MB.
MAX_KV_PAIRS = 65536
MAX_TENSORS = 65536
MAX_HEADER_BYTES = 256 * 2**20   # the pairs and tensor infos together
MAX_KEY_BYTES = 1024
MAX_ARRAY_ITEMS = 2**22          # one array
MAX_WALKED_ITEMS = 2**22         # the strings in all arrays together (each is visited in turn)
MAX_KEPT_STRING = 4096           # a string value that is read (architecture, name)
MAX_KEPT_ITEMS = 512             # an array that is read: per-layer values (LLAMA_MAX_LAYERS)
MAX_NAME_BYTES = 63              # a tensor name (GGML_MAX_NAME 64, with its NUL)
MAX_DIMS = 4                     # GGML_MAX_DIMS
INT64_MAX = 2**63 - 1
CHUNK = 2**20
DEFAULT_ALIGNMENT = 32

T_UINT32, T_BOOL, T_STRING, T_ARRAY = 4, 7, 8, 9
# GGUF value types with a fixed size: struct format and name.
FIXED: dict[int, tuple[str, str]] = {
    0: ("B", "uint8"), 1: ("b", "int8"), 2: ("H", "uint16"), 3: ("h", "int16"),
    4: ("I", "uint32"), 5: ("i", "int32"), 6: ("f", "float32"), 7: ("?", "bool"),
    10: ("Q", "uint64"), 11: ("q", "int64"), 12: ("d", "float64"),
}
INTEGER_TYPES = frozenset((0, 1, 2, 3, 4, 5, 10, 11))
FIXES = {
    "missing": "check the path, or make the file: invoke gguf-convert MODEL_DIR",
    "unreadable": "make the file readable by this user (chmod a+r), or fix the path",
    "invalid": "re-download the file (a partial download is not GGUF) or convert the model "
               "again: invoke gguf-convert MODEL_DIR",
}


class GgufError(StackError, ValueError):
    """The file is missing, unreadable or not GGUF; `kind` says which ("missing",
    "unreadable" or "invalid"). The message names the file; what the file says is quoted."""

    def __init__(self, kind: str, message: str, fix: str | None = None) -> None:
        super().__init__(message, fix or FIXES.get(kind))
        self.kind = kind


def shown(value: Any, limit: int = 60) -> str:
    """`value` as it may reach a terminal or a log: repr (control characters, ANSI escapes and
    bidi overrides escaped), and cut to about `limit` characters."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} in all)"
    return repr(value)


def type_name(vtype: int) -> str:
    if vtype in FIXED:
        return FIXED[vtype][1]
    return {T_STRING: "string", T_ARRAY: "array"}.get(vtype, f"type {vtype}")


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str  # the ggml type (Q8_0, F16, ...)
    n_bytes: int
    end: int        # where its data ends in the file


class _Cursor:
    """Reads a header forward from an open file in chunks; never past the file's end or
    MAX_HEADER_BYTES, and never holds more than a chunk plus the value being read."""

    def __init__(self, fd: int, path: Path, size: int, order: str) -> None:
        self.fd, self.path, self.size, self.order = fd, path, size, order
        self.buf, self.start, self.at = b"", 0, 0
        self.walked = 0
        self._u64 = struct.Struct(order + "Q")

    def invalid(self, reason: str) -> GgufError:
        return GgufError("invalid", f"{self.path} is not a GGUF file llama.cpp can read: {reason}")

    def tell(self) -> int:
        return self.start + self.at

    def seek(self, pos: int) -> None:
        self.buf, self.start, self.at = b"", pos, 0

    def _room(self, pos: int, n: int, what: str) -> None:
        if pos + n > self.size:
            raise self.invalid(f"{what} at byte {pos} needs {n} bytes, and the file ends at byte "
                               f"{self.size} (cut short, or a count that lies)")
        if pos + n > MAX_HEADER_BYTES:
            raise self.invalid(f"{what} at byte {pos} runs past {MAX_HEADER_BYTES} bytes, "
                               "more header than any model has")

    def take(self, n: int, what: str) -> bytes:
        if len(self.buf) - self.at < n:
            pos = self.tell()
            self._room(pos, n, what)
            try:
                data = os.pread(self.fd, min(max(n, CHUNK), MAX_HEADER_BYTES - pos), pos)
            except OSError as exc:
                raise GgufError("unreadable", f"{self.path} cannot be read "
                                f"({exc.strerror or exc})") from None
            if len(data) < n:  # the file shrank while it was read
                raise self.invalid(f"{what} at byte {pos}: the file ends early")
            self.buf, self.start, self.at = data, pos, 0
        out = self.buf[self.at:self.at + n]
        self.at += n
        return out

    def skip(self, n: int, what: str) -> None:
        if n <= len(self.buf) - self.at:
            self.at += n
            return
        self._room(self.tell(), n, what)
        self.seek(self.tell() + n)

    def unpack(self, fmt: str, what: str) -> Any:
        code = struct.Struct(self.order + fmt)
        return code.unpack(self.take(code.size, what))[0]

    def skip_strings(self, count: int, what: str) -> None:
        """Past `count` strings (each a u64 length and its bytes), in bounded time."""
        self.walked += count
        if self.walked > MAX_WALKED_ITEMS:
            raise self.invalid(f"{what} brings the strings in arrays to more than "
                               f"{MAX_WALKED_ITEMS}, more than any model has")
        unpack = self._u64.unpack_from
        while count:
            buf, at = self.buf, self.at
            limit = len(buf) - 8
            while count and at <= limit:
                nxt = at + 8 + unpack(buf, at)[0]
                if nxt > len(buf):
                    break
                at, count = nxt, count - 1
            self.at = at
            if count:  # a string across the chunk's end (or one that lies): the checked path
                self.skip(self.unpack("Q", what), what)
                count -= 1


class GgufHeader:
    """An open GGUF file's header: its keys (values read on demand, each checked) and tensors."""

    def __init__(self, cursor: _Cursor, fields: dict[str, tuple[int, int]],
                 tensors: list[Tensor], data_start: int) -> None:
        self.path, self._cursor, self.fields = cursor.path, cursor, fields
        self.tensors, self.data_start = tensors, data_start

    def _wrong(self, key: str, what: str, expected: str) -> GgufError:
        return self._cursor.invalid(f"{shown(key)} is {what}, not {expected}")

    def raw(self, key: str) -> tuple[int, Any] | None:
        """(value type, value) of `key`, None when the file has no such key. A string longer
        than MAX_KEPT_STRING is refused; an array is read only when it holds numbers (at most
        MAX_KEPT_ITEMS of them), else its value is its item type."""
        found = self.fields.get(key)
        if found is None:
            return None
        vtype, offset = found
        cur = self._cursor
        cur.seek(offset)
        what = f"the value of {shown(key)}"
        if vtype in FIXED:
            return vtype, cur.unpack(FIXED[vtype][0], what)
        if vtype == T_STRING:
            length = cur.unpack("Q", what)
            if length > MAX_KEPT_STRING:
                raise self._wrong(key, f"a string of {length} bytes",
                                  f"one of at most {MAX_KEPT_STRING}")
            data = cur.take(length, what)
            try:
                return vtype, data.decode("utf-8")
            except UnicodeDecodeError:
                raise self._wrong(key, f"{shown(data)}", "UTF-8 text") from None
        itype, count = cur.unpack("I", what), cur.unpack("Q", what)
        if itype not in FIXED:
            return vtype, (itype, None)
        if count > MAX_KEPT_ITEMS:
            raise self._wrong(key, f"an array of {count} items",
                              f"one of at most {MAX_KEPT_ITEMS} (one per layer)")
        fmt, _ = FIXED[itype]
        code = struct.Struct(f"{cur.order}{count}{fmt}")
        return vtype, (itype, list(code.unpack(cur.take(code.size, what))))

    def string(self, key: str) -> str | None:
        found = self.raw(key)
        if found is None:
            return None
        vtype, value = found
        if vtype != T_STRING:
            raise self._wrong(key, self._describe(vtype, value), "a string")
        assert isinstance(value, str)
        return value

    def count(self, key: str, *, most: int = 2**32 - 1) -> int | None:
        """A whole number 0..`most` (llama.cpp's hyperparameters are u32), None when absent."""
        found = self.raw(key)
        if found is None:
            return None
        vtype, value = found
        if vtype not in INTEGER_TYPES:
            raise self._wrong(key, self._describe(vtype, value), "a whole number")
        return self._checked(key, value, most)

    def counts(self, key: str) -> int | list[int] | None:
        """A whole number or an array of them (a per-layer value), None when absent."""
        found = self.raw(key)
        if found is None or found[0] != T_ARRAY:
            return None if found is None else self.count(key)
        itype, items = found[1]
        if itype not in INTEGER_TYPES or items is None:
            raise self._wrong(key, f"an array of {type_name(itype)}", "of whole numbers")
        return [self._checked(key, item, 2**32 - 1) for item in items]

    def flags(self, key: str) -> list[bool] | None:
        """An array of booleans (or 0/1 numbers), None when absent."""
        found = self.raw(key)
        if found is None:
            return None
        vtype, value = found
        if vtype != T_ARRAY or (value[0] not in INTEGER_TYPES and value[0] != T_BOOL):
            raise self._wrong(key, self._describe(vtype, value), "an array of booleans")
        return [bool(item) for item in value[1]]

    def _checked(self, key: str, value: int, most: int) -> int:
        if not 0 <= value <= most:
            raise self._wrong(key, f"{value}", f"a count from 0 to {most}")
        return value

    @staticmethod
    def _describe(vtype: int, value: Any) -> str:
        if vtype == T_ARRAY:
            return f"an array of {type_name(value[0])}"
        return f"a {type_name(vtype)} ({shown(value)})"


@contextmanager
def open_header(path: Path) -> Iterator[GgufHeader]:
    """The header of the GGUF at `path`, open while the block runs. Raises GgufError.

    What is not a regular file (a FIFO, /dev/zero, a device, a socket) is refused before a
    byte is read: stat first (a device is never even opened), then, as core/files.py's
    read_json_file does, opened non-blocking (a FIFO swapped in meanwhile would block the open
    for ever) and checked again on the descriptor, which is what is read."""
    try:
        _regular(path, os.stat(path))
    except OSError as exc:
        raise _unopenable(path, exc) from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _unopenable(path, exc) from None
    try:
        info = os.fstat(fd)
        _regular(path, info)
        yield _parse(fd, path, info.st_size)
    finally:
        os.close(fd)


def _unopenable(path: Path, exc: OSError) -> GgufError:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return GgufError("missing", f"{path} does not exist")
    if exc.errno == errno.ENXIO:  # a socket
        return GgufError("invalid", f"{path} is not a regular file (a pipe, socket or device): "
                         "a model is read from a file")
    return GgufError("unreadable", f"{path} cannot be read ({exc.strerror or exc})")


def _regular(path: Path, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise GgufError("invalid", f"{path} is a folder, not a .gguf file")
    if not stat.S_ISREG(info.st_mode):
        raise GgufError("invalid", f"{path} is not a regular file (a pipe, socket or device): "
                        "a model is read from a file")


def _parse(fd: int, path: Path, size: int) -> GgufHeader:
    try:
        head = os.pread(fd, HEADER_BYTES, 0)
    except OSError as exc:
        raise GgufError("unreadable", f"{path} cannot be read ({exc.strerror or exc})") from None
    if head[:4] != GGUF_MAGIC:
        raise GgufError("invalid", f"{path} is not a GGUF file (it starts with {shown(head[:4])}, "
                        f"not {GGUF_MAGIC!r})")
    if len(head) < HEADER_BYTES:
        raise GgufError("invalid", f"{path} is not a GGUF file llama.cpp can read: cut short at "
                        f"{len(head)} bytes (the fixed header alone takes {HEADER_BYTES})")
    # A file written big-endian reads as version 0x0N000000 here (gguf-py's own test).
    order = ">" if struct.unpack("<I", head[4:8])[0] & 0xFFFF == 0 else "<"
    version, tensors, pairs = struct.unpack(order + "IQQ", head[4:24])
    cur = _Cursor(fd, path, size, order)
    if version not in VERSIONS:
        raise cur.invalid(f"GGUF version {version} (readable: {', '.join(map(str, VERSIONS))})")
    room = size - HEADER_BYTES
    for what, count, least, most in (("tensors", tensors, MIN_TENSOR_INFO, MAX_TENSORS),
                                     ("key/value pairs", pairs, MIN_KV_PAIR, MAX_KV_PAIRS)):
        if count * least > room:
            raise GgufError("invalid", f"{path} claims {count} {what} in a {size}-byte "
                            "file: not a GGUF file llama.cpp can read")
        if count > most:
            raise cur.invalid(f"it claims {count} {what}, more than {most}")
    cur.seek(HEADER_BYTES)
    fields = _read_pairs(cur, pairs)
    infos = _read_tensor_infos(cur, tensors)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        header = GgufHeader(cur, fields, [], 0)
        kind, value = header.raw("general.alignment") or (T_UINT32, DEFAULT_ALIGNMENT)
        if kind != T_UINT32 or value == 0 or value & (value - 1):
            raise cur.invalid(f"general.alignment is {header._describe(kind, value)}, not a "
                              "uint32 power of two")
        alignment = value
    end = cur.tell()
    data_start = end + (-end % alignment)
    out = []
    for name, kind_name, n_bytes, offset in infos:
        stop = data_start + offset + n_bytes
        if stop > size:
            raise cur.invalid(f"the data of tensor {shown(name)} ends at byte {stop}, past the "
                              f"file's end at byte {size} (a download that stopped?)")
        out.append(Tensor(name, kind_name, n_bytes, stop))
    return GgufHeader(cur, fields, out, data_start)


def _read_pairs(cur: _Cursor, pairs: int) -> dict[str, tuple[int, int]]:
    """Every key, its value type and where its value starts; each value is walked past."""
    fields: dict[str, tuple[int, int]] = {}
    for index in range(pairs):
        what = f"key {index}"
        key = _read_name(cur, what, what, 1, MAX_KEY_BYTES)
        if key in fields:
            raise cur.invalid(f"the key {shown(key)} is there twice")
        what = f"the value of {shown(key)}"
        vtype = cur.unpack("I", what)
        fields[key] = (vtype, cur.tell())
        _walk_value(cur, vtype, what)
    return fields


def _read_name(cur: _Cursor, what: str, called: str, shortest: int, longest: int) -> str:
    """A length-prefixed UTF-8 name (a key, a tensor's name), its length bounded before it is read."""
    length = cur.unpack("Q", what)
    if not shortest <= length <= longest:
        raise cur.invalid(f"{called} is {length} bytes long ({shortest} to {longest})")
    data = cur.take(length, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise cur.invalid(f"{called} ({shown(data)}) is not UTF-8") from None


def _walk_value(cur: _Cursor, vtype: int, what: str) -> None:
    if vtype in FIXED:
        cur.skip(struct.calcsize(FIXED[vtype][0]), what)
    elif vtype == T_STRING:
        cur.skip(cur.unpack("Q", what), what)
    elif vtype == T_ARRAY:
        itype, count = cur.unpack("I", what), cur.unpack("Q", what)
        if itype == T_ARRAY:
            raise cur.invalid(f"{what} is an array of arrays, which llama.cpp does not read")
        if itype not in FIXED and itype != T_STRING:
            raise cur.invalid(f"{what} is an array of unknown type {itype}")
        if count > MAX_ARRAY_ITEMS:
            raise cur.invalid(f"{what} is an array of {count} items, more than {MAX_ARRAY_ITEMS}")
        if itype == T_STRING:
            cur._room(cur.tell(), 8 * count, what)  # each string takes 8 bytes at least
            cur.skip_strings(count, what)
        else:
            cur.skip(count * struct.calcsize(FIXED[itype][0]), what)
    else:
        raise cur.invalid(f"{what} has unknown type {vtype}")


def _read_tensor_infos(cur: _Cursor, count: int) -> list[tuple[str, str, int, int]]:
    """(name, ggml type name, bytes, data offset) of each tensor, checked as llama.cpp does."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    out: list[tuple[str, str, int, int]] = []
    names: set[str] = set()
    for index in range(count):
        what = f"tensor {index}"
        name = _read_name(cur, what, f"the name of {what}", 0, MAX_NAME_BYTES)
        if name in names:
            raise cur.invalid(f"the tensor {shown(name)} is there twice")
        names.add(name)
        what = f"tensor {shown(name)}"
        n_dims = cur.unpack("I", what)
        if n_dims > MAX_DIMS:
            raise cur.invalid(f"{what} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = [cur.unpack("Q", what) for _ in range(n_dims)]
        elements = 1
        for dim in dims:
            elements *= dim
        if any(dim > INT64_MAX for dim in dims) or elements > INT64_MAX:
            raise cur.invalid(f"{what} has the shape {dims}, more elements than llama.cpp can count")
        raw_type = cur.unpack("I", what)
        try:
            kind = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise cur.invalid(f"{what} has the unknown tensor type {raw_type}") from None
        if (dims[0] if dims else 1) % block:
            raise cur.invalid(f"{what} of type {kind.name} has rows of {dims[0] if dims else 1} "
                              f"elements, not a multiple of its block of {block}")
        offset = cur.unpack("Q", what)
        out.append((name, kind.name, elements * type_size // block, offset))
    return out

"""The symbol versions an ELF shared library needs (its .gnu.version_r section), as the dynamic
loader checks them when it loads the library: `GLIBC_2.38` from libc.so.6 means the library does
not load where the C library is older ("version `GLIBC_2.38' not found").

A wheel compiled in an image is tagged linux_x86_64, not manylinux_X_Y, so nothing else in it says
which glibc it was linked against. Reading the section, not searching the bytes for "GLIBC_",
counts only what the loader will ask for: a library may mention any version in its strings.
"""

from __future__ import annotations

import re
import struct

MAGIC = b"\x7fELF"
SHT_GNU_VERNEED = 0x6FFFFFFE
GLIBC = re.compile(r"^GLIBC_(\d+)\.(\d+)(?:\.\d+)?$")


def needed_versions(data: bytes) -> list[tuple[str, str]] | None:
    """(library, version) for each version `data` needs, e.g. ("libc.so.6", "GLIBC_2.38"); None
    when `data` is not an ELF file, or has no section headers to find the needs by."""
    if len(data) < 64 or data[:4] != MAGIC or data[4] not in (1, 2) or data[5] not in (1, 2):
        return None
    order = "<" if data[5] == 1 else ">"
    wide = data[4] == 2  # ELFCLASS64
    try:
        if wide:
            (table,) = struct.unpack_from(order + "Q", data, 0x28)
            size, count = struct.unpack_from(order + "HH", data, 0x3A)
        else:
            (table,) = struct.unpack_from(order + "I", data, 0x20)
            size, count = struct.unpack_from(order + "HH", data, 0x2E)
        if table == 0 or count == 0:
            return None
        # (name, type, flags, addr, offset, size, link, info, ...): the same order in both classes.
        layout = order + ("IIQQQQIIQQ" if wide else "IIIIIIIIII")
        sections = [struct.unpack_from(layout, data, table + i * size) for i in range(count)]
        needed: list[tuple[str, str]] = []
        for section in sections:
            if section[1] != SHT_GNU_VERNEED:
                continue
            strings = sections[section[6]][4]  # sh_link: the string table (.dynstr)
            entry = section[4]
            for _ in range(section[7]):  # sh_info: how many Verneed entries
                _, auxes, library, aux, following = struct.unpack_from(order + "HHIII", data, entry)
                at = entry + aux
                for _ in range(auxes):
                    _, _, _, name, step = struct.unpack_from(order + "IHHII", data, at)
                    needed.append((read_string(data, strings + library),
                                   read_string(data, strings + name)))
                    at += step
                entry += following
        return needed
    except (struct.error, IndexError, ValueError):
        return None  # truncated or inconsistent: not a library the loader would load either


def read_string(data: bytes, at: int) -> str:
    return data[at:data.index(b"\0", at)].decode("ascii", "replace")


def needed_glibc(data: bytes) -> tuple[int, int] | None:
    """The newest GLIBC_x.y the library needs (from libc.so.6, libm.so.6, ...), or None."""
    versions = [(int(m[1]), int(m[2])) for _, name in needed_versions(data) or ()
                if (m := GLIBC.match(name))]
    return max(versions, default=None)

"""Small file helpers every layer shares: atomic JSON writes and reading a file's tail."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any, mode: int = 0o644) -> None:
    """Write `data` as JSON atomically, so a reader in another process never sees half a file.

    The temporary file is created with `mode` (never chmod-ed afterwards), so a file that can
    hold a token is never readable by others, not even for a moment.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # an old temp file would keep its own (possibly wider) mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines of a file, reading only its end."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            pos = handle.tell()
            data = b""
            while pos > 0 and data.count(b"\n") <= count:
                step = min(65536, pos)
                pos -= step
                handle.seek(pos)
                data = handle.read(step) + data
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-count:] if count > 0 else []

"""Small file helpers every layer shares: atomic writes created with their mode, reading the
stack's own JSON files safely, the one env-file encoding, and reading a file's tail."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import unicodedata
from pathlib import Path
from typing import Any

from vllmstack.core.errors import StackError
from vllmstack.core.findings import Finding

# Files that can hold a token (rendered env files, the override, state records) are created
# readable by their owner only.
PRIVATE = 0o600


class FileWriteError(StackError, OSError):
    """A file the stack writes could not be written (disk full, no permission, read-only file
    system); names the file and the fix. Still an OSError, so callers that handle one go on
    doing so."""

    def __init__(self, path: Path, exc: OSError) -> None:
        reason = exc.strerror or str(exc)
        super().__init__(f"cannot write {path}: {reason}", write_fix(exc.errno, path))
        self.errno, self.strerror, self.filename = exc.errno, exc.strerror, str(path)

    def __str__(self) -> str:  # OSError's "[Errno N] ..." would hide the fix's context
        return self.cause


def write_fix(code: int | None, path: Path) -> str:
    """What to do about a failed write of `path`, by its errno."""
    if code in (errno.ENOSPC, errno.EDQUOT):
        return (f"free space on the file system that holds {path.parent} (df -h {path.parent}), "
                "then run this again")
    if code in (errno.EACCES, errno.EPERM):
        return (f"make {path.parent} writable for this user (ls -ld {path.parent}; a folder made "
                "by `sudo` or a container belongs to root), then run this again")
    if code == errno.EROFS:
        return f"{path.parent} is on a read-only file system: remount it read-write or move the checkout"
    return f"check {path.parent} (df -h, ls -ld), then run this again"


def write_text(path: Path, text: str, mode: int = PRIVATE) -> None:
    """Write `text` (UTF-8) atomically, so a reader in another process never sees half a file.

    The temporary file is created with `mode` (never chmod-ed afterwards), so a file that can
    hold a token is never readable by others, not even for a moment. A failed write (a full
    disk) raises FileWriteError naming `path` and leaves neither a temporary file nor a changed
    `path` behind.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)  # an old temp file would keep its own (possibly wider) mode
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
                handle.write(text)
            tmp.replace(path)
        except BaseException:
            # A half-written temp file on a full disk holds space it cannot use: give it back.
            tmp.unlink(missing_ok=True)
            raise
    except FileWriteError:
        raise
    except OSError as exc:
        raise FileWriteError(path, exc) from exc


def remove_file(path: Path) -> None:
    """Delete a file the stack wrote, if it is there. A folder in its place is left alone (it is
    not one the stack made, and what is in it is not the stack's to delete); a deletion that
    fails otherwise (read-only file system) is a FileWriteError naming the file."""
    try:
        path.unlink(missing_ok=True)
    except IsADirectoryError:
        pass
    except OSError as exc:
        raise FileWriteError(path, exc) from exc


def write_json(path: Path, data: Any, mode: int = 0o644) -> None:
    """Write `data` as JSON atomically, created with `mode` (see write_text)."""
    write_text(path, json.dumps(data, indent=2) + "\n", mode)


# --- paths a user names: a folder to write into, a file to replace
#
# `--out` and the like are the user's text: a file where a folder belongs (or the reverse), a
# folder under a file, a device, /proc. Each is refused by what it is, before anything is
# written, instead of surfacing as mkdir's FileExistsError or rmtree's NotADirectoryError.
# The kernel's own trees: nothing a command writes belongs there (/dev holds devices, and a
# file written there as root is lost at the next boot).
PSEUDO_TREES = {"/proc": "the kernel's process tree", "/sys": "the kernel's sysfs",
                "/dev": "the device tree"}


class PathKindError(StackError):
    """A path a user named exists as the wrong kind (a file where a folder belongs, a device),
    lies under a file, or lies in a tree of the kernel's; says which and what to name instead."""


def path_kind(mode: int) -> str:
    """What an inode is, as a user reads it: "a file", "a folder", "a device", ..."""
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file or folder"


def writable_folder(path: Path, option: str, *, shown: str | None = None) -> Path:
    """`path` (absolute) when it is a folder this user may write into, or one that can be made
    there; PathKindError otherwise, named after `option` (e.g. "--out"): an existing file, device
    or FIFO; a path under a file; a path under /proc, /sys or /dev; a nearest existing folder the
    user cannot write. Links are followed, as a write would follow them."""
    path = path.expanduser().absolute()
    own = shown is None  # False: the folder of a file `shown` names (writable_file)
    shown = shown or f"{option} {path}"
    existing = path
    while True:  # the nearest part of the path that exists (/ always does)
        try:
            info = existing.stat()
            break
        except (FileNotFoundError, NotADirectoryError):
            existing = existing.parent
        except OSError as exc:  # a link loop, a name too long, no permission to look
            raise PathKindError(f"{shown} cannot be used ({exc.strerror or exc})",
                                f"name another folder for {option}") from None
    kind = path_kind(info.st_mode)
    if not stat.S_ISDIR(info.st_mode):
        if existing == path and own:
            aside = "" if kind == "a device" else f", or move {path} aside"
            raise PathKindError(f"{shown} is {kind}, not a folder",
                                f"name a folder for {option} (it is made when missing){aside}")
        raise PathKindError(f"{shown} is under {existing}, which is {kind}, not a folder",
                            f"name a folder for {option} whose parents are folders")
    real = Path(os.path.realpath(existing))
    for tree, what in PSEUDO_TREES.items():
        if real.is_relative_to(tree):
            raise PathKindError(f"{shown} is in {tree}, {what}, where no files of the stack belong",
                                f"name a folder on a disk for {option}, e.g. {option} ./out")
    if not os.access(existing, os.W_OK | os.X_OK):
        # write_fix speaks of the parent of the path it is given: the folder that must be writable.
        raise PathKindError(f"{shown}: {existing} is not writable for this user",
                            write_fix(errno.EACCES, existing / "x"))
    return path


def writable_file(path: Path, option: str) -> Path:
    """`path` (absolute) when a file may be written there: its folder passes writable_folder
    (not under a file, not in /proc, /sys or /dev, writable), and nothing is there but a regular
    file (a folder, a device or a FIFO is refused). PathKindError otherwise, named after `option`."""
    path = path.expanduser().absolute()
    writable_folder(path.parent, option, shown=f"{option} {path}")
    try:
        info = path.stat()
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise PathKindError(f"{option} {path} cannot be used ({exc.strerror or exc})",
                            f"name another file for {option}") from None
    if not stat.S_ISREG(info.st_mode):
        raise PathKindError(f"{option} {path} is {path_kind(info.st_mode)}, not a file",
                            f"name a file for {option} (it is made when missing)")
    return path


def file_head(path: Path, size: int) -> bytes | None:
    """The first `size` bytes of the file at `path`, None when there is none; PathKindError when
    something else is there (a folder, a FIFO: opened without blocking, never read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise PathKindError(f"{path} is a folder, where a file belongs",
                            f"move {path} aside, or name another folder") from None
    except OSError as exc:
        raise PathKindError(f"{path} cannot be read ({exc.strerror or exc})",
                            f"check {path} (ls -l), or name another folder") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PathKindError(f"{path} is {path_kind(mode)}, where a file belongs",
                                f"move {path} aside, or name another folder")
        return os.read(fd, size)
    except OSError as exc:
        raise PathKindError(f"{path} cannot be read ({exc.strerror or exc})",
                            f"check {path} (ls -l), or name another folder") from None
    finally:
        os.close(fd)


# --- reading the stack's own JSON files
#
# Files the stack wrote (state, records, history lines, run records) can still be cut short by a
# full disk, edited by hand, or replaced by anything: each reader turns whatever it finds into a
# value or a named error, never a traceback. json.loads alone raises RecursionError (not a
# ValueError) on deep nesting, accepts NaN, and a structure a few hundred levels deep can still
# blow the stack of whatever walks it next; the stack writes nothing deeper than a handful.
MAX_JSON_DEPTH = 64
MAX_JSON_BYTES = 16 * 1024 * 1024  # far above any file the stack writes; reading is bounded


class JsonFileError(StackError):
    """One of the stack's own JSON files cannot be used; says which file and why."""

    def __init__(self, cause: str, fix: str | None = None, *, path: Path | None = None,
                 reason: str = "") -> None:
        super().__init__(cause, fix)
        self.path, self.reason = path, reason


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def json_depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed value (0 for a scalar), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (item.values() if isinstance(item, dict) else item
                    if isinstance(item, list) else None)
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json(data: str | bytes, *, max_depth: int = MAX_JSON_DEPTH,
               allow_nan: bool = False) -> Any:
    """json.loads for text that may be anything: every way it fails is a ValueError whose
    message says why in a few words (not JSON, not UTF-8, nested too deeply, NaN)."""
    try:
        value = json.loads(data, parse_constant=None if allow_nan else _refuse_constant)
    except RecursionError as exc:
        raise ValueError(f"nested too deeply to read (more than {max_depth} levels)") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                         f"{exc.start})") from exc
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from exc
    if json_depth(value) > max_depth:
        raise ValueError(f"nested too deeply to read (more than {max_depth} levels)")
    return value


def json_syntax_error(exc: BaseException) -> json.JSONDecodeError | None:
    """The JSON syntax error (with its line) behind a refusal of parse_json or read_json_file,
    which raise from it, or None when the text was refused for another reason."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, json.JSONDecodeError):
        seen = seen.__cause__
    return seen


def read_json_file(path: Path, what: str | None = None, *, fix: str | None = None,
                   max_bytes: int = MAX_JSON_BYTES, allow_nan: bool = False,
                   expect_object: bool = True,
                   too_large: str = "more than the stack ever writes there") -> Any:
    """The JSON value in `path`, or None when there is no such file.

    Anything else that keeps it from being used (unreadable, not a regular file, larger than
    `max_bytes` (`too_large` says why that is too much), not UTF-8, not JSON, nested too deeply,
    NaN unless `allow_nan`, not an object when `expect_object`) raises JsonFileError "WHAT
    REASON" (`what` names the file, default its path; the reason alone is in `.reason`;
    `json_syntax_error` finds the line of a syntax error), with `fix` (default: move it aside)."""
    shown = what or str(path)

    def damaged(reason: str) -> JsonFileError:
        return JsonFileError(f"{shown} {reason}",
                             fix or f"move it aside (mv {path} {path}.bad) and run this again",
                             path=path, reason=reason)

    try:
        # Non-blocking: a FIFO put where a record belongs must not hang the command that reads it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise damaged(f"cannot be read ({exc.strerror or exc})") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise damaged(f"is not a regular file (it is {path_kind(mode)})")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise damaged(f"cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise damaged(f"is larger than {max_bytes} bytes, {too_large}")
    try:
        value = parse_json(data, allow_nan=allow_nan)
    except ValueError as exc:
        raise damaged(f"is {exc}") from exc
    if expect_object and not isinstance(value, dict):
        raise damaged(f"holds a JSON {type(value).__name__}, not an object")
    return value


# --- env files: one encoding that Compose v1, Compose v2 and podman-compose all read back exactly
#
# Compose v1 and podman-compose read env files with python-dotenv, Compose v2 with compose-go's
# dotenv. They agree on a single-quoted value as long as it holds no ' (python-dotenv and
# compose-go end the value there, and disagree on \'), no \ (python-dotenv turns \\ into \,
# compose-go keeps both), no $ (python-dotenv interpolates ${X} even in single quotes, and some
# compose v2 releases double a literal $) and no control character (python-dotenv reads with
# universal newlines, so \r becomes \n; a newline would start a line of its own), and it must be
# text (a lone surrogate is how Python carries bytes of argv or the environment that are not
# UTF-8). Such a value is refused, never escaped: no escape means the same thing to all three.
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BARE = re.compile(r"[A-Za-z0-9._/:,+@-]+")  # no quotes needed in any of the three parsers


class EnvValueError(ValueError):
    """A value an env file cannot carry exactly; the message says which character and why."""


def env_value_problem(value: str) -> str | None:
    """Why `value` cannot be written into an env file exactly, or None when it can."""
    for char in value:
        if char == "'":
            return "contains a single quote (')"
        if char == "\\":
            return "contains a backslash (\\)"
        if char == "$":
            return "contains a $, which Compose would interpolate"
        if unicodedata.category(char) == "Cs":  # how Python keeps undecodable bytes of argv/env
            return "contains bytes that are not UTF-8"
        if unicodedata.category(char) == "Cc":
            what = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab"}.get(
                char, f"the control character U+{ord(char):04X}")
            return f"contains {what}"
    return None


def env_line(key: str, value: str) -> str:
    """`KEY=value` for an env file: bare when only safe characters, else in single quotes.

    Raises EnvValueError for a key that is not a variable name or a value env_value_problem
    refuses."""
    if not ENV_KEY.fullmatch(key):
        raise EnvValueError(f"{key!r} is not a variable name (letters, digits, _)")
    problem = env_value_problem(value)
    if problem:
        raise EnvValueError(f"{key}: its value {problem}")
    return f"{key}={value}" if _BARE.fullmatch(value) else f"{key}='{value}'"


def decode_env_bytes(data: bytes, display: str) -> tuple[str, list[Finding]]:
    """The text of an env file; each line with bytes that are not UTF-8 becomes a finding and an
    empty line (so the line numbers of the rest stay right)."""
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM, as editors on Windows write it
    try:
        return data.decode("utf-8"), []
    except UnicodeDecodeError:
        pass
    out: list[str] = []
    problems: list[Finding] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            out.append("")
            problems.append(Finding(
                "error", "not-utf8",
                f"line {lineno} of {display} has a byte that is not UTF-8 (0x{raw[exc.start]:02x} "
                f"at column {exc.start + 1}); the line is ignored",
                source=f"{display}:{lineno}",
                fix="save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or retype the line"))
    return "\n".join(out), problems


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

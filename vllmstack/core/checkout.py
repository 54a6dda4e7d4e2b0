"""One checkout of the stack: an id derived from its path, and the lock its commands hold.

Two clones on one host are two stacks. `checkout_id` tells them apart wherever a name is shared
by the whole host: the default Compose project name and the marker in the native engine's
environment. `stack_lock` serialises the commands that start, stop or replace a stack's engine
(`up`, `down`, `install-engine`): without it two `up`s at once both started an engine, the
second died on the port and overwrote the record, and `down` then left the first one running.

The lock is flock(2) on generated/stack.lock. The kernel drops it when its holder exits, however
it exits, so a killed command never leaves a stale lock behind; the file's content (pid, command,
since when, whether `down` may stop it) is only there to say who holds it, and is believed only
when /proc/locks names the same pid (`lock_holder`).

The id is derived from the checkout's path, so a copy (`cp -a A B`) has its own id from its first
command on: nothing stored is copied with it. What A recorded (engine and dashboard records,
state.json) names A's id, and B treats it as another checkout's (runtime.native.records,
serve.state).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from vllmstack.core.errors import StackError
from vllmstack.core.files import FileWriteError, JsonFileError, read_json_file
from vllmstack.core.paths import Project
from vllmstack.core.runner import Runner

LOCK_FILE = "stack.lock"
# The checkout's named engines (the router runs one per profile) keep their files here, one
# folder each: generated/engines/NAME/ holds what generated/ holds for the default engine of
# `invoke up` (state.json, stack.lock, native/). The default engine's name is "".
ENGINES_DIR = "engines"
# Short, so a unix socket under generated/engines/NAME/native/ipc stays within 107 bytes.
ENGINE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,23}")
# The source `invoke config --explain` shows for a default derived from the checkout.
DERIVED_FROM_CHECKOUT = "derived from the checkout path"
# How long a second command waits for the first one. Long enough for a `down` or an `up` that
# finds the engine already running; short enough that nobody stares at a silent terminal while
# another `up` boots a model for twenty minutes (the message names that command instead).
LOCK_WAIT_S = 10.0
POLL_S = 0.2

P = ParamSpec("P")
R = TypeVar("R")

# Locks held, by path and thread: a nested `with stack_lock(...)` must not wait for itself (flock
# on a second descriptor of the same file conflicts with the first); another thread must.
_held: dict[tuple[Path, int], int] = {}


class LockBusyError(StackError):
    """Another command holds this stack's lock; the message names it."""


@dataclass(frozen=True)
class LockHolder:
    """The command that holds the stack lock now, as its lock file says and the kernel confirms."""

    pid: int
    command: str
    since: float
    stoppable: bool  # an `invoke up` in the foreground that ends cleanly on SIGTERM


def _lock_info(path: Path) -> tuple[int, str, float, bool] | None:
    try:
        data = read_json_file(path, max_bytes=4096)
        if data is None:
            return None
        pid, command, since = data["pid"], data["command"], data["since"]
        if not (isinstance(pid, int) and isinstance(command, str)
                and isinstance(since, (int, float))) or isinstance(pid, bool):
            return None
        return pid, command, float(since), data.get("stoppable") is True
    except (JsonFileError, KeyError):
        return None


def lock_holder(generated: Path) -> LockHolder | None:
    """Who holds the stack lock, when the lock file and /proc/locks agree on the pid (a lock
    file left by a command that was killed names a pid that holds nothing: None)."""
    path = (generated / LOCK_FILE).resolve()
    info = _lock_info(path)
    if info is None or _kernel_holder(path) != info[0]:
        return None
    return LockHolder(*info)


def checkout_id(root: Path) -> str:
    """8 hex digits of the sha256 of the checkout's absolute path: stable, and unique per clone."""
    return hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:8]


def engine_dir(generated: Path, name: str) -> Path:
    """The folder of one of the checkout's engines: `generated` itself for the default engine
    (""), generated/engines/NAME for a named one. ValueError for a name `engine_name` did not make."""
    if not name:
        return generated
    if not ENGINE_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an engine name")
    return generated / ENGINES_DIR / name


def engine_name(profile: str) -> str:
    """The engine name a profile runs under when several engines run (its own name, or for a
    long one a short prefix and a hash of the whole, so two long names never share one)."""
    if ENGINE_NAME.fullmatch(profile):
        return profile
    head = re.sub(r"[^A-Za-z0-9._-]", "-", profile)[:14].lstrip("._-") or "p"
    return f"{head}-{hashlib.sha256(profile.encode()).hexdigest()[:8]}"


def engine_names(generated: Path) -> list[str]:
    """The named engines whose folders exist (whether they run or not), sorted."""
    try:
        found = [p.name for p in (generated / ENGINES_DIR).iterdir() if p.is_dir()]
    except OSError:
        return []
    return sorted(name for name in found if ENGINE_NAME.fullmatch(name))


def default_compose_project(root: Path) -> str:
    """The Compose project name of a checkout that does not set COMPOSE_PROJECT.

    Lowercase letters, digits and `-` only, starting with a letter: valid for Compose v1, v2
    and Podman alike."""
    return f"vllmstack-{checkout_id(root)}"


def derived_compose_project(root: Path) -> tuple[str, str]:
    """(the default COMPOSE_PROJECT, its source as `invoke config --explain` shows it): two
    clones on one host never stop each other's containers."""
    return default_compose_project(root), f"{DERIVED_FROM_CHECKOUT} {root}"


def _holder_text(path: Path) -> str:
    """Who holds the lock: what it wrote into the file, else the pid the kernel lists for it."""
    for _ in range(10):  # the holder writes its details a moment after it got the lock
        info = _lock_info(path)
        if info is None:
            time.sleep(0.05)
            continue
        pid, command, since, _ = info
        age = max(0, int(time.time() - since))
        line = _cmdline(pid)
        return (f"`invoke {command}` (pid {pid}, for {age} s" + (f": {line}" if line else "") + ")")
    kernel_pid = _kernel_holder(path)
    return f"another command (pid {kernel_pid})" if kernel_pid else "another command"


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    line = " ".join(shlex.join(part.decode(errors="replace") for part in raw.split(b"\0")
                               if part).split())  # one line, however the arguments break
    return line if len(line) <= 200 else line[:199] + "…"


def _kernel_holder(path: Path) -> int | None:
    """The pid /proc/locks gives for a FLOCK on `path`'s inode."""
    try:
        inode = path.stat().st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            return int(fields[4]) if fields[4].isdigit() else None
    return None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def stack_lock(generated: Path, command: str, *, say: Callable[[str], None] | None = None,
               wait: float | None = None, stoppable: bool = False) -> Iterator[None]:
    """Hold the stack's lock for `command` (up, down, install-engine).

    A busy lock is waited for up to `wait` seconds (LOCK_WAIT_S), saying so through `say`; then
    LockBusyError names the holder (its command and pid) and how to proceed. `stoppable`: the
    holder ends cleanly on SIGTERM (what `down` sends a booting `up`). A lock file that cannot be
    made or written (a full disk, a read-only checkout) is a FileWriteError naming it.
    """
    path = (generated / LOCK_FILE).resolve()
    key = (path, threading.get_ident())
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    limit = LOCK_WAIT_S if wait is None else wait
    try:
        generated.mkdir(parents=True, exist_ok=True)
        # Never replaced or deleted: a new inode would let a second command lock "the same" file.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise FileWriteError(path, exc) from exc
    try:
        if not _try_lock(fd):
            holder = _holder_text(path)
            (say or _stderr)(f"waiting up to {limit:g} s for {holder}, which holds the stack "
                             f"lock {path}")
            deadline = time.monotonic() + limit
            while not _try_lock(fd):
                if time.monotonic() >= deadline:
                    raise LockBusyError(
                        f"{_holder_text(path)} is still working on this stack (it holds {path}); "
                        f"`invoke {command}` did nothing",
                        "wait for it to finish, then run this again (or end it first: Ctrl-C in "
                        "its terminal, or kill the pid named above)")
                time.sleep(POLL_S)
            (say or _stderr)(f"the stack lock is free; `invoke {command}` goes ahead")
        try:
            os.ftruncate(fd, 0)
            text = json.dumps({"pid": os.getpid(), "command": command, "since": time.time(),
                               "stoppable": stoppable}).encode()
            if os.pwrite(fd, text, 0) != len(text):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            raise FileWriteError(path, exc) from exc
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
    finally:
        os.close(fd)  # releases the flock


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def holds_stack_lock(command: str) -> Callable[[Callable[Concatenate[Project, Runner, P], R]],
                                               Callable[Concatenate[Project, Runner, P], R]]:
    """Decorate `fn(project, runner, ...)` to run under the stack lock (none under --dry-run,
    which changes nothing and must not create generated/)."""

    def wrap(fn: Callable[Concatenate[Project, Runner, P], R],
             ) -> Callable[Concatenate[Project, Runner, P], R]:
        @functools.wraps(fn)
        def locked(project: Project, runner: Runner, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if runner.dry_run:
                return fn(project, runner, *args, **kwargs)
            with stack_lock(project.generated, command):
                return fn(project, runner, *args, **kwargs)

        return locked

    return wrap

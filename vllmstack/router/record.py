"""generated/router.json and generated/router.lock: which router serves this checkout.

One router per checkout: the router holds flock(2) on generated/router.lock for its whole life
(the kernel drops it however the router ends, so a killed router leaves no stale lock). A second
router is refused at start, naming the first; without the lock, two routers adopted each other's
engine and swapped under each other. (It is not `up`'s stack.lock: the router's loads take that
one from worker threads for every `up` and `down`.)

router.json says what the running router serves, for the dashboard and for people. The router
rewrites it at every state change and removes it when it stops (only its own: the pid and start
time in it must be this process's). A record is believed only while the process it names is
that router: same pid, same start time (clock ticks after boot) and same boot, so a pid that a
later program reused is not taken for the router. Between changes the live numbers (queue,
in-flight requests) come from the router itself: `router_state` asks its /v1/health.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import requests

from vllmstack.config.envfiles import read_env_file
from vllmstack.core.errors import StackError
from vllmstack.core.files import write_json
from vllmstack.core.paths import Project
from vllmstack.router.options import TOKEN_VAR
from vllmstack.runtime.native.procs import ProcTable
from vllmstack.serve.running import router_alive

ROUTER_FILE = "router.json"
LOCK_FILE = "router.lock"


class RouterLockError(StackError):
    """Another router serves this checkout."""


def identity(pid: int | None = None, procs: ProcTable | None = None) -> dict[str, Any]:
    """What tells this process from a later one with the same pid."""
    procs = procs or ProcTable()
    pid = os.getpid() if pid is None else pid
    proc = procs.get(pid)
    return {"pid": pid, "pid_start": proc.start_ticks if proc else None, "boot_id": procs.boot_id()}


def is_running(record: dict[str, Any], procs: ProcTable | None = None) -> bool:
    """Whether the router the record names still runs (not merely a process with its pid)."""
    return router_alive(record, procs)


def write_record(project: Project, data: dict[str, Any]) -> None:
    project.generated.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_json(project.generated / ROUTER_FILE, data)


def remove_record(project: Project, own: dict[str, Any]) -> None:
    """Remove router.json when it is this router's (`own`: its identity)."""
    record = read_record(project)
    if record is not None and all(record.get(k) == v for k, v in own.items()):
        (project.generated / ROUTER_FILE).unlink(missing_ok=True)


def read_record(project: Project) -> dict[str, Any] | None:
    try:
        with (project.generated / ROUTER_FILE).open("rb") as handle:
            data = json.loads(handle.read(1 << 20))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def router_lock(project: Project) -> Iterator[None]:
    """Hold this checkout's router lock; RouterLockError when another router holds it."""
    project.generated.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = project.generated / LOCK_FILE
    # Never replaced or deleted: a new inode would let a second router lock "the same" file.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = read_record(project) or {}
            who = (f"pid {record.get('pid')}, {record.get('url')}"
                   if is_running(record) else "its record is not written yet")
            raise RouterLockError(
                f"another router already serves this checkout ({who}; it holds {path})",
                "use that router, or stop it first (Ctrl-C in its terminal, or kill its pid); "
                "a second one would swap engines under the first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(identity()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def known_token(project: Project, environ: Mapping[str, str] | None = None) -> str:
    """The router token this process knows, as the router looks for it: ROUTER_TOKEN in the
    environment, else in the checkout's .env ("" when neither sets it; a --token-file's token
    is known only to whoever passes it)."""
    environ = os.environ if environ is None else environ
    if environ.get(TOKEN_VAR):
        return environ[TOKEN_VAR]
    try:
        lines, _ = read_env_file(project.dotenv, ".env")
    except (OSError, ValueError):
        return ""
    return next((line.value for line in reversed(lines) if line.key == TOKEN_VAR), "")


def router_state(project: Project, *, timeout: float = 1.0,
                 token: str | None = None) -> dict[str, Any] | None:
    """The router's state for the dashboard: None when no router runs for this checkout, else
    router.json (url, pid, resident model, every model's state, recent swaps with their stop and
    start seconds), with `live` True and the current queue and in-flight counts when its
    /v1/health answered within `timeout`. The request carries `token` (default: known_token),
    since the router refuses reads without it too."""
    record = read_record(project)
    if record is None or not is_running(record):
        return None
    state = dict(record)
    state["live"] = False
    token = known_token(project) if token is None else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        answer = requests.get(f"{record.get('url')}/v1/health", headers=headers, timeout=timeout)
        if answer.status_code == 200:
            state.update(answer.json())
            state["live"] = True
    except (requests.RequestException, ValueError):
        pass
    return state

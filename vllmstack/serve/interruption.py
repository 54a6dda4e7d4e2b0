"""Stopping an `up` that is still booting: SIGTERM ends it cleanly, and `down` sends it.

An `invoke up` holds the stack lock for the whole boot (minutes for a large model). A `down`
issued meanwhile used to wait 10 s for the lock and give up, leaving the engine booting. Now
`up` (in the foreground, in the main thread: the router loads profiles from other threads and
has its own signal handling) turns SIGTERM into `UpInterruptedError`, stops the engine it started and
releases the lock; `down` finds such an `up` through the lock (core.checkout.lock_holder, which
believes the lock file only when /proc/locks names the same pid), sends it SIGTERM, and waits
for the lock long enough for that engine to be stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TextIO

from vllmstack.core.checkout import lock_holder
from vllmstack.core.paths import Project
from vllmstack.serve.stack import LifecycleError

# How long `down` waits for an interrupted `up` to stop its engine and release the lock: the
# engine's stop grace (NATIVE_STOP_GRACE, compose's stop_grace_period: 30 s) and the KILL wait.
UP_STOP_WAIT_S = 90.0


class UpInterruptedError(LifecycleError):
    """`up` was stopped by SIGTERM (`invoke down`, or a kill) before its engine was ready."""


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    # A second SIGTERM while the engine is being stopped ends the process the default way.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise UpInterruptedError(
        "`invoke up` was stopped by SIGTERM (an `invoke down`, or a kill) before the engine was "
        "ready; whatever it had started is stopped",
        "run `invoke up` again when you want the engine")


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[bool]:
    """Within: SIGTERM raises UpInterruptedError. Yields whether it does (only in the main thread,
    and only where nothing else handles SIGTERM already)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        yield False
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield True
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def stop_booting_up(project: Project, out: TextIO) -> bool:
    """Send SIGTERM to an `invoke up` of this checkout that holds the stack lock and can be
    stopped that way; returns whether one was. Another command (a `down`, `install-engine`, a
    router's load) is never signalled: `down` waits for it as for any holder."""
    holder = lock_holder(project.generated)
    if holder is None or holder.command != "up" or not holder.stoppable \
            or holder.pid == os.getpid():
        return False
    print(f"`invoke up` (pid {holder.pid}) is still starting the engine: stopping it (SIGTERM); "
          f"it stops the engine it started, then `down` goes on (waiting up to "
          f"{UP_STOP_WAIT_S:.0f} s for it)", file=out)
    try:
        os.kill(holder.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    return True

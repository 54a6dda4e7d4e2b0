"""The commands that look into the engine or clean up after it: logs, exec, clear-caches."""

from __future__ import annotations

from collections.abc import Sequence

from vllmstack.core.store import clear_store
from vllmstack.runtime import engine_env
from vllmstack.serve.stack import LifecycleError, Stack


def logs(stack: Stack, *, follow: bool = True, tail: int = 200, service: str = "vllm") -> int:
    """Stream the engine log (follow) to the terminal."""
    argv = stack.engine.log_command(tail=tail, follow=follow, service=service)
    if argv is not None:
        return stack.runner.run(argv, capture=False, mutates=False).returncode
    for line in stack.engine.log_lines(tail):
        print(line, file=stack.out)
    return 0


def exec_in_engine(stack: Stack, command: Sequence[str], *, tty: bool) -> int:
    if not command:
        raise LifecycleError("nothing to run", "give a command after --, e.g. invoke exec -- python3 -V")
    argv = stack.engine.exec_command(command, tty=tty)
    return stack.runner.run(argv, capture=False).returncode


def clear_caches(stack: Stack, *, dry_run: bool = False, store: bool = False) -> list[str]:
    """Delete compile/JIT caches (after an image or driver change); the HF cache stays. `store`:
    the build store too (core/store.py), which says what it frees and keeps what is in use."""
    if store:
        print("\n".join(clear_store(stack.environ, dry_run=dry_run)), file=stack.out)
    if stack.engine.state().running:
        raise LifecycleError("the engine is running and uses these caches", "invoke down first")
    done = engine_env.clear_engine_caches(engine_env.stack_paths(stack.resolved, stack.environ),
                                          dry_run=dry_run)
    for line in done or ["nothing to delete"]:
        print(("(dry run) " if dry_run else "") + line, file=stack.out)
    return done

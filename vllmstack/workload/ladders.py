"""Depth and concurrency ladders that follow the live profile.

Depth: powers of two (from `first`) up to `max_model_len - pp - tg - margin`, plus that top rung,
so the deepest test always fills the window the server really has. Concurrency: powers of two up
to `max_num_seqs`, plus `max_num_seqs` itself.
"""

from __future__ import annotations

from vllmstack.core.errors import StackError

DEFAULT_MARGIN = 256
DEFAULT_FIRST_DEPTH = 1024


class LadderError(StackError, ValueError):
    """The window or limits leave no room for a ladder; the message says which number to change."""


def depth_cap(max_model_len: int, pp: int, tg: int, margin: int = DEFAULT_MARGIN) -> int:
    """The deepest context that still fits pp + tg + margin inside the window."""
    return max_model_len - pp - tg - margin


def depth_ladder(
    max_model_len: int,
    pp: int,
    tg: int,
    *,
    margin: int = DEFAULT_MARGIN,
    first: int = DEFAULT_FIRST_DEPTH,
    include_zero: bool = True,
) -> list[int]:
    """[0, first, 2*first, ... <= cap] plus cap itself (when it is not already the last rung)."""
    if max_model_len <= 0 or pp <= 0 or tg <= 0:
        raise LadderError("max_model_len, pp and tg must be positive")
    if first <= 0 or first & (first - 1):
        raise LadderError(f"the first depth rung must be a power of two, got {first}")
    cap = depth_cap(max_model_len, pp, tg, margin)
    if cap < 0:
        raise LadderError(
            f"pp {pp} + tg {tg} + margin {margin} = {pp + tg + margin} tokens do not fit in "
            f"max_model_len {max_model_len}; lower --pp/--tg or raise VLLM_MAX_MODEL_LEN"
        )
    rungs = [0] if include_zero else []
    depth = first
    while depth <= cap:
        rungs.append(depth)
        depth *= 2
    if cap > 0 and (not rungs or rungs[-1] != cap):
        rungs.append(cap)
    return rungs


def conc_ladder(max_num_seqs: int) -> list[int]:
    """[1, 2, 4, ... < max] plus max; [1] when the server runs one sequence at a time."""
    if max_num_seqs < 1:
        raise LadderError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    rungs = []
    level = 1
    while level < max_num_seqs:
        rungs.append(level)
        level *= 2
    rungs.append(max_num_seqs)
    return rungs

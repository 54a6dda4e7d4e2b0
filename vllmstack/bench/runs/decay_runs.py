"""The depth-decay probe's measurement: bench-depth's own run over the depths the probe picks.

probes/ sits below runs/ and never imports it, so `bench/cli.py` builds this here and hands it to
the probe as `ProbeContext.depth_rows`: the probe measures exactly what `invoke bench-depth
--depth ...` measures (two-phase with the prefix cache on, the overhead correction, the burst
check), and only its verdict is new.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from vllmstack.bench.client.client import ChatClient
from vllmstack.bench.client.row import BenchRow
from vllmstack.bench.runs.depth_runs import run_depth
from vllmstack.bench.runs.session import Progress, RunOptions, Session, measure_overhead
from vllmstack.bench.target import Target
from vllmstack.workload.prompts import PromptBuilder

DepthMeasure = Callable[[list[int], int, int, int], Awaitable[tuple[list[BenchRow], list[str]]]]


def make_depth_rows(client: ChatClient, builder: PromptBuilder, target: Target,
                   progress: Progress) -> DepthMeasure:
    """A function running bench-depth over (depths, pp, tg, runs) on `client`: rows, warnings."""

    async def measure(depths: list[int], pp: int, tg: int,
                      runs: int) -> tuple[list[BenchRow], list[str]]:
        options = RunOptions(pp=[pp], tg=[tg], runs=runs, depths=list(depths))
        options.check()
        session = Session(client, builder, target, options, progress)
        session.overhead = await measure_overhead(session)
        # The depths are explicit, so the window is not needed to build a ladder.
        rows = await run_depth(session, None)
        return rows, list(session.warnings)

    return measure

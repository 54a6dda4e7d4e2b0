"""One benchmark session: the options, the client and prompts it uses, the per-request overhead and
the summary row every run kind produces.

pp t/s is overhead-corrected with a two-point estimate: tiny requests (a few prompt tokens, one
output token) measure the fixed cost of a request -- HTTP, tokenisation, scheduling, the first
decode step -- and pp = (P - P0) / median(TTFT - TTFT0) over the runs. Dividing the whole TTFT
instead leaves that fixed cost inside and understates pp badly for short prompts; subtracting only
a network round trip leaves most of it in as well.

Where the prefill is fast, that marginal time (TTFT - TTFT0) is a few milliseconds left after
subtracting a 20-30 ms overhead, and noise in either term moves pp by multiples (one H200 showed
147k t/s in one command and 450k in the next on the same server). So pp comes with its
uncertainty: u = sqrt(spread of the marginal times over the runs^2 + spread of the overhead
samples^2), reported as the interval (P - P0) / (marginal +- u); and when the marginal time is
not at least RESOLUTION times u, the row says "below resolution" instead of a number. The ratio of
medians is used, not the mean of per-run ratios, which one small denominator would blow up, and
spreads are robust (`robust_spread`): one run stalled by something else on the client machine
moves neither the number nor its resolution. What no spread within one command can show is the
server drifting between commands (the H200's overhead read 22.4 ms in one and 30.3 ms in the
next): compare commands run back to back.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllmstack.bench.client.client import ChatClient, EndpointError, RequestResult, chat_body
from vllmstack.bench.client.row import BenchRow, Stat, mean_of
from vllmstack.bench.options import MAX_TOKENS
from vllmstack.bench.target import Target
from vllmstack.core.errors import StackError
from vllmstack.observe.metrics import MetricsError, MetricsSnapshot, parse_metrics
from vllmstack.workload.ladders import DEFAULT_MARGIN
from vllmstack.workload.prompts import PromptBuilder

Progress = Callable[[str], None]

OVERHEAD_PROMPT_TOKENS = 16
OVERHEAD_SAMPLES = 8
# pp is a number only when the marginal prefill time is this many uncertainties above zero.
RESOLUTION = 2.0
BELOW_RESOLUTION = "below resolution"


# What every measured request sends itself; --extra-body may add fields, not replace these.
MEASURED_FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens",
                   "min_tokens", "ignore_eos", "stream", "stream_options", "n", "best_of")
MIN_DURATION_S = 0.1


class RunError(StackError, RuntimeError):
    """The run could not start or produced nothing; the message says what to check."""


@dataclass
class RunOptions:
    pp: list[int] = field(default_factory=lambda: [2048])
    tg: list[int] = field(default_factory=lambda: [128])
    runs: int = 3
    depths: list[int] | None = None  # depth: explicit rungs instead of the live ladder
    concurrency: list[int] | None = None  # conc: explicit levels instead of the ladder
    duration_s: float = 30.0  # conc: closed-loop time per level
    margin: int = DEFAULT_MARGIN
    prefix_caching: str = "auto"  # depth: auto | on | off
    warmup: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    timeout_s: float = 600.0

    def check(self) -> None:
        """Refuse values no run can use (the parser refuses them first; other callers too)."""
        if not self.pp or min(self.pp) < 1 or max(self.pp) > MAX_TOKENS:
            raise RunError(f"--pp needs token counts from 1 to {MAX_TOKENS}")
        if not self.tg or min(self.tg) < 1 or max(self.tg) > MAX_TOKENS:
            raise RunError(f"--tg needs token counts from 1 to {MAX_TOKENS}")
        if self.runs < 1:
            raise RunError("--runs must be at least 1")
        if not math.isfinite(self.duration_s) or self.duration_s < MIN_DURATION_S:
            # --duration 1e-300 sent no request at all and passed.
            raise RunError(f"--duration must be a finite number of seconds, at least "
                           f"{MIN_DURATION_S:g}")
        clash = sorted(set(self.extra_body) & set(MEASURED_FIELDS))
        if clash:
            raise RunError(
                f"--extra-body sets {', '.join(clash)}, which every measured request sends itself: "
                "replaced, the record would say one thing and the server get another",
                "leave them out of --extra-body (--pp and --tg set the lengths, --model the model)")
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise RunError("--timeout must be a positive, finite number of seconds")
        if self.margin < 0:
            raise RunError("--margin must be 0 or more tokens")
        if self.depths is not None and (not self.depths or min(self.depths) < 0):
            raise RunError("--depth needs token counts of 0 or more")
        if self.concurrency is not None and (not self.concurrency or min(self.concurrency) < 1):
            raise RunError("--concurrency needs levels of at least 1")
        if self.prefix_caching not in ("auto", "on", "off"):
            raise RunError("--prefix-caching must be auto, on or off")

    def check_window(self, kind: str, window: int | None) -> None:
        """Refuse a shape the server's window cannot hold, before any prompt of it is built
        (`--pp 100000000` against an 8k server built 21.8 GB of prompt first). The chat template
        adds a few tokens on top; the server still answers for those."""
        if window is None:
            return
        tg = max(self.tg)
        longest = max(self.pp) + tg + (max(self.depths or [0]) if kind == "depth" else 0)
        if longest <= window:
            return
        what = "--depth + --pp + --tg" if kind == "depth" and self.depths else "--pp + --tg"
        room = window - tg - (max(self.depths or [0]) if kind == "depth" else 0)
        raise RunError(f"{what} is {longest} tokens, more than the server's max_model_len of "
                       f"{window}; no prompt was built",
                       f"pass --pp {room} or less" if room >= 1 else
                       f"lower --tg (or --depth) below {window}, or serve a longer window")


@dataclass
class Overhead:
    """Fixed cost of one request: median TTFT and prompt size of tiny one-token requests, and the
    spread of those TTFTs (`robust_spread`), which bounds how finely pp resolves."""

    ttft_s: float
    prompt_tokens: int
    spread_s: float = 0.0


def robust_spread(values: Sequence[float]) -> float:
    """A standard deviation that one disturbed sample cannot inflate: 1.4826 x the median
    absolute deviation (equal to the standard deviation for normally spread samples)."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values)


@dataclass(frozen=True)
class PpEstimate:
    """pp with its uncertainty, or why not: `pp_tps` (None, or mean = the estimate, std = its
    uncertainty, min/max = the interval, n = runs), `pp_marginal_ms` (the marginal prefill times),
    `pp_uncertainty_ms` and `pp_note` ("below resolution" when the marginal time does not clear
    RESOLUTION x the uncertainty). The names are BenchRow's, where they are copied to."""

    pp_tps: Stat | None = None
    pp_marginal_ms: Stat | None = None
    pp_uncertainty_ms: float | None = None
    pp_note: str | None = None


def pp_estimate(overhead: Overhead | None, pairs: Sequence[tuple[int | None, float | None]]
                ) -> PpEstimate:
    """pp from (prompt tokens, TTFT s) pairs: the estimate with its uncertainty, or why not."""
    usable = [(p, t) for p, t in pairs if p and t and p > 0 and t > 0]
    if overhead is None or not usable:
        return PpEstimate()
    tokens = [p - overhead.prompt_tokens for p, _ in usable]
    marginal = [t - overhead.ttft_s for _, t in usable]
    # Medians: one request delayed by something else on the machine must not move pp.
    mean_m = statistics.median(marginal)
    mean_p = statistics.median(tokens)
    spread_m = robust_spread(marginal)
    u = math.hypot(spread_m, overhead.spread_s)
    marginal_ms = Stat.of(m * 1000 for m in marginal)
    if mean_p <= 0 or mean_m <= 0 or mean_m <= RESOLUTION * u:
        return PpEstimate(None, marginal_ms, u * 1000, BELOW_RESOLUTION)
    estimate = mean_p / mean_m
    stat = Stat(mean=estimate, std=estimate * u / mean_m, min=mean_p / (mean_m + u),
                max=mean_p / (mean_m - u), n=float(len(usable)))
    return PpEstimate(stat, marginal_ms, u * 1000, None)


class PpFields(Protocol):
    """What `pp_text` reads: a BenchRow, or the PpEstimate it was made from."""

    @property
    def pp_tps(self) -> Stat | None: ...
    @property
    def pp_marginal_ms(self) -> Stat | None: ...
    @property
    def pp_uncertainty_ms(self) -> float | None: ...
    @property
    def pp_note(self) -> str | None: ...


def pp_text(row: PpFields) -> str:
    """`147k ± 48k t/s`, or why there is no number."""
    mean = mean_of(row.pp_tps)
    if row.pp_tps is not None and mean is not None:
        return f"{_short(mean)} ± {_short(row.pp_tps.std or 0.0)} t/s"
    marginal = row.pp_marginal_ms
    if row.pp_note == BELOW_RESOLUTION and marginal is not None:
        return (f"{BELOW_RESOLUTION} (marginal prefill {marginal.mean:.1f} ms, "
                f"uncertainty {row.pp_uncertainty_ms or 0:.1f} ms)")
    return "-"


def _short(value: float) -> str:
    if abs(value) >= 10000:
        return f"{value / 1000:.0f}k"
    return f"{value / 1000:.1f}k" if abs(value) >= 1000 else f"{value:.0f}"


@dataclass
class Session:
    client: ChatClient
    builder: PromptBuilder
    target: Target
    options: RunOptions
    progress: Progress
    overhead: Overhead | None = None
    warnings: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)
            self.progress(f"warning: {text}")

    def body(self, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
        return chat_body(self.target.model, messages, max_tokens, extra=self.options.extra_body)

    async def send(self, messages: list[dict[str, Any]], max_tokens: int) -> RequestResult:
        result = await self.client.stream_chat(self.body(messages, max_tokens))
        if result.ok and result.t_first_token is None and not result.stopped:
            result.error = result.why  # a measured request that gave no token measured nothing
        if not result.ok:
            self.failures.append(result.why)
        elif result.completion_tokens is not None and result.completion_tokens != max_tokens:
            self.warn(f"asked for {max_tokens} tokens, the server produced "
                      f"{result.completion_tokens} (ignore_eos/min_tokens unsupported?)")
        if result.ok and result.token_source in ("usage-final", "tokenizer"):
            self.warn(f"tokens per chunk estimated from {result.token_source}: the server sends "
                      "neither token_ids nor per-chunk usage")
        if result.ok and result.token_source == "none":
            self.warn("the server reports no usage and no tokenizer was loaded: decode t/s "
                      "and ITL cannot be measured")
        return result

    async def metrics(self) -> MetricsSnapshot | None:
        try:
            return parse_metrics(await self.client.get_text("/metrics"))
        except (EndpointError, MetricsError):
            return None


@contextlib.contextmanager
def steady_heap() -> Iterator[None]:
    """Measure with the heap as it is now moved out of the collector's way.

    A full collection walks every object the process holds (tokenizer tables, prompt pools,
    earlier results); one landing inside a stream is a pause the server never made. Collecting
    once and freezing what exists (as `vllm bench serve` does) leaves only the young objects of
    each chunk to the collector.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _ms(values: Sequence[float | None]) -> Stat | None:
    return Stat.of(v * 1000 for v in values if v is not None)


async def measure_overhead(session: Session) -> Overhead:
    """Median TTFT of tiny one-token requests (fixed per-request cost, see the module doc)."""
    ttfts: list[float] = []
    sizes: list[int] = []
    missing: list[str] = []
    for _ in range(OVERHEAD_SAMPLES):
        prompt = await session.builder.build_async(OVERHEAD_PROMPT_TOKENS)
        result = await session.client.stream_chat(session.body(user(prompt.text), 1))
        if not result.ok:
            raise RunError(f"the endpoint failed a one-token request: {result.why}")
        if result.ttft_s is not None:
            ttfts.append(result.ttft_s)
        else:
            missing.append(result.why)
        if result.prompt_tokens:
            sizes.append(result.prompt_tokens)
    if not ttfts:
        raise RunError(f"a one-token request gave no token time: {missing[0]}")
    overhead = Overhead(statistics.median(ttfts), int(statistics.median(sizes)) if sizes else 0,
                        robust_spread(ttfts))
    session.progress(f"request overhead: {overhead.ttft_s * 1000:.1f} ± "
                     f"{overhead.spread_s * 1000:.1f} ms for {overhead.prompt_tokens} prompt "
                     "tokens (subtracted from pp)")
    return overhead


def summarize_results(
    session: Session,
    results: Sequence[RequestResult],
    *,
    pp: int,
    tg: int,
    depth: int,
    concurrency: int,
    pp_pairs: Sequence[tuple[int | None, float | None]] | None = None,
) -> BenchRow:
    """One result row: distributions over the successful requests plus counts.

    `pp_pairs` are the (prompt tokens, TTFT) that pp is estimated from; by default every
    successful request's whole prompt.
    """
    good = [r for r in results if r.ok]
    if pp_pairs is None:
        pp_pairs = [(r.prompt_tokens, r.ttft_s) for r in good]
    # A stream released in one burst has no decode rate (it would read as 100,000s of t/s);
    # its TTFT stays in: that wait is what a user of the server saw.
    paced = [r for r in good if not r.burst]
    if len(paced) < len(good):
        session.warn(
            f"{len(good) - len(paced)} of {len(good)} requests (pp {pp}, tg {tg}, c={concurrency}) "
            "got their tokens in one burst at the end: the server held the stream back (on a CPU "
            "host, its API server starved of CPU by the engine's busy-waiting processes); their "
            "decode rate and ITL are left out")
    itl: list[float] = []
    for r in paced:
        itl.extend(r.itl_samples_s())
    sources = sorted({r.token_source for r in good})
    estimate = pp_estimate(session.overhead, pp_pairs)
    return BenchRow(
        pp=pp,
        tg=tg,
        depth=depth,
        concurrency=concurrency,
        requests=len(results),
        errors=len(results) - len(good),
        ttft_ms=_ms([r.ttft_s for r in good]),
        ttfr_ms=_ms([r.ttfr_s for r in good]),
        pp_tps=estimate.pp_tps,
        pp_marginal_ms=estimate.pp_marginal_ms,
        pp_uncertainty_ms=estimate.pp_uncertainty_ms,
        pp_note=estimate.pp_note,
        tg_tps=Stat.of(v for v in (r.decode_tps for r in paced) if v is not None),
        itl_ms=_ms(itl),
        e2e_ms=_ms([r.t_end - r.t_sent for r in good]),
        prompt_tokens=Stat.of(float(r.prompt_tokens) for r in good if r.prompt_tokens),
        completion_tokens=Stat.of(float(r.tokens) for r in good),
        token_source=sources[0] if len(sources) == 1 else tuple(sources),
    )


def progress_line(row: BenchRow, label: str) -> str:
    def mean(stat: Stat | None, fmt: str) -> str:
        value = mean_of(stat)
        return "-" if value is None else format(value, fmt)

    itl = row.itl_ms
    return (f"{label}: ttft {mean(row.ttft_ms, '.1f')} ms, pp {pp_text(row)}, "
            f"tg {mean(row.tg_tps, '.2f')} t/s, itl p50/p99 "
            f"{(itl.p50 or 0) if itl else 0:.2f}/{(itl.p99 or 0) if itl else 0:.2f} ms"
            + (f", {row.errors} failed" if row.errors else ""))

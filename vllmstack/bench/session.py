"""One benchmark session: the options, the client and prompts it uses, the per-request overhead and
the summary row every run kind produces.

pp t/s is overhead-corrected with a two-point estimate: a tiny request (a few prompt tokens, one
output token) measures the fixed cost of a request -- HTTP, tokenisation, scheduling, the first
decode step -- and pp = (P - P0) / (TTFT - TTFT0). Dividing the whole TTFT instead leaves that
fixed cost inside and understates pp badly for short prompts; subtracting only a network round
trip leaves most of it in as well.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllmstack.bench.client import ChatClient, EndpointError, RequestResult, chat_body
from vllmstack.bench.ladders import DEFAULT_MARGIN
from vllmstack.bench.prompts import PromptBuilder
from vllmstack.bench.stats import summarize
from vllmstack.bench.target import Target
from vllmstack.core.errors import StackError
from vllmstack.observe.metrics import MetricsError, MetricsSnapshot, parse_metrics

Progress = Callable[[str], None]

OVERHEAD_PROMPT_TOKENS = 16
OVERHEAD_SAMPLES = 3


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
        if not self.pp or min(self.pp) < 1:
            raise RunError("--pp needs positive token counts")
        if not self.tg or min(self.tg) < 1:
            raise RunError("--tg needs positive token counts")
        if self.runs < 1:
            raise RunError("--runs must be at least 1")
        if self.duration_s <= 0:
            raise RunError("--duration must be positive seconds")
        if self.prefix_caching not in ("auto", "on", "off"):
            raise RunError("--prefix-caching must be auto, on or off")


@dataclass
class Overhead:
    """Fixed cost of one request: median TTFT and prompt size of tiny one-token requests."""

    ttft_s: float
    prompt_tokens: int

    def pp_rate(self, prompt_tokens: int | None, ttft_s: float | None) -> float | None:
        if not prompt_tokens or prompt_tokens <= 0 or not ttft_s or ttft_s <= 0:
            return None
        if prompt_tokens > self.prompt_tokens and ttft_s > self.ttft_s:
            return (prompt_tokens - self.prompt_tokens) / (ttft_s - self.ttft_s)
        return prompt_tokens / ttft_s


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
        if not result.ok:
            self.failures.append(result.error or "failed")
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


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _ms(values: Sequence[float | None]) -> dict[str, float] | None:
    return summarize([v * 1000 for v in values if v is not None])


async def measure_overhead(session: Session) -> Overhead:
    """Median TTFT of tiny one-token requests (fixed per-request cost, see the module doc)."""
    ttfts: list[float] = []
    sizes: list[int] = []
    for _ in range(OVERHEAD_SAMPLES):
        prompt = session.builder.build(OVERHEAD_PROMPT_TOKENS)
        result = await session.client.stream_chat(session.body(user(prompt.text), 1))
        if not result.ok:
            raise RunError(f"the endpoint failed a one-token request: {result.error}")
        if result.ttft_s is not None:
            ttfts.append(result.ttft_s)
        if result.prompt_tokens:
            sizes.append(result.prompt_tokens)
    if not ttfts:
        raise RunError("no token arrived for a one-token request; is this a chat model endpoint?")
    overhead = Overhead(statistics.median(ttfts), int(statistics.median(sizes)) if sizes else 0)
    session.progress(f"request overhead: {overhead.ttft_s * 1000:.1f} ms for "
                     f"{overhead.prompt_tokens} prompt tokens (subtracted from pp)")
    return overhead


def summarize_results(
    session: Session,
    results: Sequence[RequestResult],
    *,
    pp: int,
    tg: int,
    depth: int,
    concurrency: int,
    pp_values: Sequence[float | None] | None = None,
) -> dict[str, Any]:
    """One result row: distributions over the successful requests plus counts."""
    good = [r for r in results if r.ok]
    overhead = session.overhead
    if pp_values is None:
        pp_values = [overhead.pp_rate(r.prompt_tokens, r.ttft_s) if overhead else None
                     for r in good]
    itl: list[float] = []
    for r in good:
        itl.extend(r.itl_samples_s())
    sources = sorted({r.token_source for r in good})
    return {
        "pp": pp,
        "tg": tg,
        "depth": depth,
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(good),
        "ttft_ms": _ms([r.ttft_s for r in good]),
        "ttfr_ms": _ms([r.ttfr_s for r in good]),
        "pp_tps": summarize([v for v in pp_values if v is not None]),
        "tg_tps": summarize([v for v in (r.decode_tps for r in good) if v is not None]),
        "itl_ms": _ms(itl),
        "e2e_ms": _ms([r.t_end - r.t_sent for r in good]),
        "prompt_tokens": summarize([float(r.prompt_tokens) for r in good if r.prompt_tokens]),
        "completion_tokens": summarize([float(r.tokens) for r in good]),
        "token_source": sources[0] if len(sources) == 1 else sources,
    }


def progress_line(row: dict[str, Any], label: str) -> str:
    def mean(key: str, fmt: str) -> str:
        s = row.get(key)
        return format(s["mean"], fmt) if s else "-"

    return (f"{label}: ttft {mean('ttft_ms', '.1f')} ms, pp {mean('pp_tps', '.0f')} t/s, "
            f"tg {mean('tg_tps', '.2f')} t/s, itl p50/p99 "
            f"{row['itl_ms']['p50'] if row.get('itl_ms') else 0:.2f}/"
            f"{row['itl_ms']['p99'] if row.get('itl_ms') else 0:.2f} ms"
            + (f", {row['errors']} failed" if row.get("errors") else ""))


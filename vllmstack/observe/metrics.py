"""vLLM's Prometheus `/metrics`: parse it, fetch it, and turn counters into rates.

Parsing uses prometheus_client's text parser. Lookups go by *sample* name, which
keeps the suffixes vLLM exposes (`..._total` for counters, `..._sum`/`..._count`/
`..._bucket` for histograms); a counter may also be asked for by its family name
without `_total`. The metric names come from vLLM's V1 `PrometheusStatLogger`
(see the reference notes); the older names removed around 0.12 are read as a
fallback so an old engine still shows its KV usage and prefix-cache counters.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# Metric names (exposed sample names) the stack reads.
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES_OLD = "vllm:gpu_prefix_cache_queries_total"
PREFIX_HITS_OLD = "vllm:gpu_prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
ITL_OLD = "vllm:time_per_output_token_seconds"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
CACHE_CONFIG = "vllm:cache_config_info"
REQUEST_SUCCESS = "vllm:request_success_total"
PREEMPTIONS = "vllm:num_preemptions_total"

# The families the dashboard and `invoke status` need; parsing only these (and no
# histogram buckets) is ~7x faster than parsing vLLM's whole exposition.
LIVE_FAMILIES: frozenset[str] = frozenset({
    KV_USAGE, KV_USAGE_OLD, RUNNING, WAITING, PREFIX_QUERIES, PREFIX_HITS,
    PREFIX_QUERIES_OLD, PREFIX_HITS_OLD, PROMPT_TOKENS, PROMPT_BY_SOURCE, GENERATION_TOKENS,
    TTFT, ITL, ITL_OLD, SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED, CACHE_CONFIG,
    REQUEST_SUCCESS, PREEMPTIONS,
})

_SUFFIXES = ("_total", "_sum", "_count", "_bucket")


class MetricsError(RuntimeError):
    """The engine's /metrics could not be read or parsed; the message says which and why."""


Sample = tuple[dict[str, str], float]


@dataclass(frozen=True)
class CacheLayout:
    """The prefix-cache geometry `vllm:cache_config_info` reports (labels, as vLLM 0.27 names
    them: `block_size`, `mamba_cache_mode`, `enable_prefix_caching`), plus whether speculative
    decoding counters are exposed. None where the engine does not say."""

    block_size: int | None
    mamba_cache_mode: str | None  # "none" for attention-only models, "align" for hybrids
    prefix_caching: bool | None
    spec_decode: bool

    @property
    def hybrid(self) -> bool:
        """A model with Mamba-style (linear-attention) layers caching its state per block."""
        return self.mamba_cache_mode not in (None, "none")


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape: sample name -> [(labels, value), ...] in exposition order."""

    samples: Mapping[str, list[Sample]] = field(default_factory=dict)

    def _find(self, name: str) -> list[Sample] | None:
        found = self.samples.get(name)
        if found is None and not name.endswith("_total"):
            # Counters are often named by family (`vllm:prompt_tokens`); samples keep `_total`.
            found = self.samples.get(name + "_total")
        return found

    def has(self, name: str) -> bool:
        return self._find(name) is not None

    def value(self, name: str, **labels: str) -> float | None:
        """Sum of the samples of `name` whose labels include `labels`.

        None when the metric is absent or no sample carries those labels, so a
        caller can tell "not exposed by this vLLM" from a real zero.
        """
        found = self._find(name)
        if found is None:
            return None
        total = 0.0
        matched = False
        for sample_labels, val in found:
            if all(sample_labels.get(k) == v for k, v in labels.items()):
                total += val
                matched = True
        return total if matched else None

    def mean(self, name: str) -> float | None:
        """Mean over samples: right for per-engine fractions (KV usage with data parallel)."""
        found = self._find(name)
        if not found:
            return None
        return sum(v for _, v in found) / len(found)

    def labels_of(self, name: str) -> dict[str, str] | None:
        """Labels of the first sample (for info gauges such as `vllm:cache_config_info`)."""
        found = self._find(name)
        if not found:
            return None
        return dict(found[0][0])

    # Convenient views -----------------------------------------------------------

    @property
    def kv_cache_usage(self) -> float | None:
        """Fraction 0–1 of the KV cache in use (mean over engines)."""
        usage = self.mean(KV_USAGE)
        return usage if usage is not None else self.mean(KV_USAGE_OLD)

    @property
    def requests_running(self) -> float | None:
        return self.value(RUNNING)

    @property
    def requests_waiting(self) -> float | None:
        return self.value(WAITING)

    @property
    def prefix_cache_queries(self) -> float | None:
        found = self.value(PREFIX_QUERIES)
        return found if found is not None else self.value(PREFIX_QUERIES_OLD)

    @property
    def prefix_cache_hits(self) -> float | None:
        found = self.value(PREFIX_HITS)
        return found if found is not None else self.value(PREFIX_HITS_OLD)

    @property
    def prompt_tokens(self) -> float | None:
        """All prompt tokens, including those served from the prefix cache."""
        return self.value(PROMPT_TOKENS)

    @property
    def prompt_tokens_local_compute(self) -> float | None:
        """Prompt tokens the GPU prefilled (None on a vLLM without the by-source family)."""
        return self.value(PROMPT_BY_SOURCE, source="local_compute")

    @property
    def generation_tokens(self) -> float | None:
        return self.value(GENERATION_TOKENS)

    @property
    def ttft_sum(self) -> float | None:
        return self.value(TTFT + "_sum")

    @property
    def ttft_count(self) -> float | None:
        return self.value(TTFT + "_count")

    @property
    def itl_sum(self) -> float | None:
        found = self.value(ITL + "_sum")
        return found if found is not None else self.value(ITL_OLD + "_sum")

    @property
    def itl_count(self) -> float | None:
        found = self.value(ITL + "_count")
        return found if found is not None else self.value(ITL_OLD + "_count")

    @property
    def spec_decode_drafts(self) -> float | None:
        return self.value(SPEC_DRAFTS)

    @property
    def spec_decode_draft_tokens(self) -> float | None:
        return self.value(SPEC_DRAFT_TOKENS)

    @property
    def spec_decode_accepted_tokens(self) -> float | None:
        return self.value(SPEC_ACCEPTED)

    @property
    def cache_config(self) -> dict[str, str]:
        return self.labels_of(CACHE_CONFIG) or {}

    @property
    def cache_layout(self) -> CacheLayout:
        """How the engine's prefix cache is laid out (see `CacheLayout`)."""
        labels = self.cache_config
        raw_block = labels.get("block_size", "")
        mode = labels.get("mamba_cache_mode")
        prefix = labels.get("enable_prefix_caching")
        return CacheLayout(
            block_size=int(raw_block) if raw_block.isdigit() and int(raw_block) > 0 else None,
            mamba_cache_mode=None if mode in (None, "", "None") else mode.lower(),
            prefix_caching=None if prefix in (None, "", "None") else prefix.lower() == "true",
            spec_decode=self.has(SPEC_DRAFTS),
        )

    @property
    def model_name(self) -> str | None:
        for name in (RUNNING, KV_USAGE, GENERATION_TOKENS):
            labels = self.labels_of(name)
            if labels and labels.get("model_name"):
                return labels["model_name"]
        return None


def _wanted(only: Iterable[str]) -> frozenset[str]:
    names: set[str] = set()
    for name in only:
        names.add(name)
        if name.endswith("_total"):
            names.add(name[: -len("_total")])
    return frozenset(names)


def _keep_line(line: str, wanted: frozenset[str]) -> bool:
    """Whether a line of the exposition belongs to a wanted family (buckets and stamps dropped)."""
    if line.startswith("#"):
        parts = line.split(" ", 3)
        # The parser needs TYPE lines to group samples; HELP text is not used.
        return len(parts) >= 3 and parts[1] == "TYPE" and parts[2] in wanted
    cut = len(line)
    for stop in ("{", " "):
        pos = line.find(stop)
        if 0 <= pos < cut:
            cut = pos
    name = line[:cut]
    if name in wanted:
        return True
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            if suffix == "_bucket":
                return False
            return name[: -len(suffix)] in wanted
    return False


def parse_metrics(text: str, only: Iterable[str] | None = None) -> MetricsSnapshot:
    """Parse Prometheus exposition text.

    `only` limits parsing to those families (sample or family names, e.g.
    `LIVE_FAMILIES`) and skips histogram buckets and `_created` stamps — the
    polling path uses that to stay within its time budget. Raises MetricsError
    with the parser's complaint on malformed text.
    """
    from prometheus_client.parser import text_string_to_metric_families

    if only is not None:
        wanted = _wanted(only)
        text = "\n".join(ln for ln in text.splitlines() if ln and _keep_line(ln, wanted)) + "\n"
    samples: dict[str, list[Sample]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value = float(sample.value)
                if math.isnan(value):
                    continue
                samples.setdefault(sample.name, []).append((dict(sample.labels), value))
    except ValueError as exc:
        raise MetricsError(f"cannot parse /metrics text: {exc}") from exc
    return MetricsSnapshot(samples)


def metrics_url(url: str) -> str:
    """The /metrics URL for an engine base URL (a URL already ending in /metrics is kept)."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch_metrics(
    url: str, timeout: float = 2.0, only: Iterable[str] | None = None
) -> MetricsSnapshot:
    """GET the engine's /metrics (base URL or full URL) and parse it.

    Raises MetricsError naming the URL and the cause (refused, timeout, HTTP status).
    """
    import requests

    target = metrics_url(url)
    try:
        response = requests.get(target, timeout=timeout)
    except requests.RequestException as exc:
        raise MetricsError(f"cannot reach {target}: {exc.__class__.__name__}: {exc}") from exc
    if response.status_code != 200:
        raise MetricsError(f"{target} answered HTTP {response.status_code}")
    return parse_metrics(response.text, only=only)


# --- rates ------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    """The cumulative counters the rates are derived from (None = not exposed)."""

    prompt: float | None  # locally computed prompt tokens, or all of them as a fallback
    generation: float | None
    prefix_queries: float | None
    prefix_hits: float | None
    ttft_sum: float | None
    ttft_count: float | None
    itl_sum: float | None
    itl_count: float | None
    spec_drafts: float | None
    spec_draft_tokens: float | None
    spec_accepted: float | None

    @classmethod
    def of(cls, snap: MetricsSnapshot) -> tuple[Counters, str]:
        local = snap.prompt_tokens_local_compute
        prompt, source = (local, "local_compute") if local is not None else (
            snap.prompt_tokens, "total")
        return cls(
            prompt=prompt,
            generation=snap.generation_tokens,
            prefix_queries=snap.prefix_cache_queries,
            prefix_hits=snap.prefix_cache_hits,
            ttft_sum=snap.ttft_sum,
            ttft_count=snap.ttft_count,
            itl_sum=snap.itl_sum,
            itl_count=snap.itl_count,
            spec_drafts=snap.spec_decode_drafts,
            spec_draft_tokens=snap.spec_decode_draft_tokens,
            spec_accepted=snap.spec_decode_accepted_tokens,
        ), source


def _delta(new: float | None, old: float | None) -> float | None:
    if new is None or old is None:
        return None
    return new - old


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


@dataclass(frozen=True)
class Rates:
    """What one poll adds to the picture. Fractions are 0–1; times are seconds."""

    prompt_tps: float | None  # EMA of locally computed prompt tokens per second
    generation_tps: float | None  # EMA of generated tokens per second
    prompt_tps_raw: float | None  # this interval alone, before smoothing
    generation_tps_raw: float | None
    prompt_source: str  # "local_compute", or "total" on a vLLM without by-source counters
    prefix_hit_window: float | None  # hits/queries over the window
    prefix_hit_total: float | None  # hits/queries since the engine started
    ttft_window: float | None  # mean TTFT of requests that got their first token in the window
    itl_window: float | None  # mean inter-token latency in the window
    spec_acceptance_window: float | None  # accepted/draft tokens in the window
    spec_acceptance_total: float | None
    spec_acceptance_length_window: float | None  # 1 + accepted/drafts: tokens per step
    spec_acceptance_length_total: float | None
    spike_held: bool  # a sample was held back by the spike guard
    reset: bool  # counters went backwards (engine restarted): the window started over

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Ema:
    alpha: float
    spike_factor: float
    spike_floor: float
    value: float | None = None
    held: int = 0

    def update(self, raw: float, idle: bool) -> bool:
        """Fold `raw` in; returns True when the spike guard held it back."""
        if self.value is None:
            self.value = raw
            return False
        if idle and raw == 0:
            # An idle engine produces nothing: a slowly decaying tail would be a lie.
            self.value = 0.0
            self.held = 0
            return False
        limit = max(self.spike_factor * self.value, self.spike_floor)
        if raw > limit and self.held == 0:
            # A single outlier (a long chunked prefill counted when it completes) would
            # dominate the average for many polls; hold once, accept if it repeats.
            self.held += 1
            return True
        self.held = 0
        self.value = self.alpha * raw + (1 - self.alpha) * self.value
        return False


@dataclass
class RateDeriver:
    """Turns successive snapshots into rates. Pure: the caller passes the time.

    Throughput uses an EMA (`alpha`) with a spike guard: a sample above
    max(spike_factor × EMA, spike_floor) is held back once. Ratios and latency
    means come from counter deltas over the last `window_s` seconds. Counters
    that go backwards mean the engine restarted: the baseline starts over and
    the EMAs keep their last value.
    """

    alpha: float = 0.35
    spike_factor: float = 3.0
    spike_floor: float = 50_000.0
    window_s: float = 30.0
    _prev: tuple[float, Counters] | None = None
    _window: deque[tuple[float, Counters]] = field(default_factory=deque)
    _source: str | None = None
    _prompt: _Ema | None = None
    _gen: _Ema | None = None

    def __post_init__(self) -> None:
        self._prompt = _Ema(self.alpha, self.spike_factor, self.spike_floor)
        self._gen = _Ema(self.alpha, self.spike_factor, self.spike_floor)

    def reset(self) -> None:
        """Forget the baseline (e.g. after the engine was unreachable for a while)."""
        self._prev = None
        self._window.clear()

    def update(self, snap: MetricsSnapshot, now: float) -> Rates:
        assert self._prompt is not None and self._gen is not None
        cur, source = Counters.of(snap)
        reset = False
        prompt_raw = gen_raw = None
        spike = False
        if self._prev is not None and (source != self._source or _went_back(self._prev[1], cur)):
            reset = True
            self.reset()
        if self._prev is not None:
            then, old = self._prev
            dt = now - then
            if dt > 0:
                idle = not (snap.requests_running or snap.requests_waiting)
                d_prompt = _delta(cur.prompt, old.prompt)
                d_gen = _delta(cur.generation, old.generation)
                if d_prompt is not None:
                    prompt_raw = d_prompt / dt
                    spike |= self._prompt.update(prompt_raw, idle)
                if d_gen is not None:
                    gen_raw = d_gen / dt
                    spike |= self._gen.update(gen_raw, idle)
        self._prev = (now, cur)
        self._source = source
        self._window.append((now, cur))
        # Keep exactly one point at or before the window start as the baseline.
        while len(self._window) >= 2 and self._window[1][0] <= now - self.window_s:
            self._window.popleft()
        base = self._window[0][1]

        def window(num: str, den: str) -> float | None:
            return _ratio(_delta(getattr(cur, num), getattr(base, num)),
                          _delta(getattr(cur, den), getattr(base, den)))

        length_window = window("spec_accepted", "spec_drafts")
        length_total = _ratio(cur.spec_accepted, cur.spec_drafts)
        return Rates(
            prompt_tps=self._prompt.value,
            generation_tps=self._gen.value,
            prompt_tps_raw=prompt_raw,
            generation_tps_raw=gen_raw,
            prompt_source=source,
            prefix_hit_window=window("prefix_hits", "prefix_queries"),
            prefix_hit_total=_ratio(cur.prefix_hits, cur.prefix_queries),
            ttft_window=window("ttft_sum", "ttft_count"),
            itl_window=window("itl_sum", "itl_count"),
            spec_acceptance_window=window("spec_accepted", "spec_draft_tokens"),
            spec_acceptance_total=_ratio(cur.spec_accepted, cur.spec_draft_tokens),
            spec_acceptance_length_window=None if length_window is None else 1 + length_window,
            spec_acceptance_length_total=None if length_total is None else 1 + length_total,
            spike_held=spike,
            reset=reset,
        )


def _went_back(old: Counters, new: Counters) -> bool:
    for name in Counters.__dataclass_fields__:
        before, after = getattr(old, name), getattr(new, name)
        if before is not None and after is not None and after < before:
            return True
    return False

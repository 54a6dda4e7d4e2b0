"""Live engine metrics: one poll's text becomes a JSON payload and a point in a ring.

The server polls, not the page: rates then do not depend on how many tabs are
open, and the ring (15 minutes at one poll a second) is there when a page is
reloaded or opened after a run. `LiveMetrics.record` is pure (text and time in,
payload out) so tests and the benchmark script drive it without a network.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllmstack.observe.metrics import (
    LIVE_FAMILIES,
    SPEC_DRAFT_TOKENS,
    MetricsError,
    MetricsSnapshot,
    RateDeriver,
    Rates,
    parse_metrics,
)

# The ring point keys and the payload fields they come from (short keys keep the history small).
POINT_FIELDS = {
    "kv": "kv_cache_usage",
    "running": "requests_running",
    "waiting": "requests_waiting",
    "hit": "prefix_hit_window",
    "pp": "prompt_tps",
    "tg": "generation_tps",
    "ttft": "ttft_window",
    "itl": "itl_window",
    "accept": "spec_acceptance_window",
}

_RATE_FIELDS = tuple(Rates.__dataclass_fields__)


def _int_label(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    try:
        return int(float(raw)) if raw not in (None, "None", "") else None
    except (TypeError, ValueError):
        return None


def _float_label(labels: dict[str, str], key: str) -> float | None:
    raw = labels.get(key)
    try:
        value = float(raw) if raw not in (None, "None", "") else None
    except (TypeError, ValueError):
        return None
    return value if value is None or math.isfinite(value) else None


def _kv_capacity(snap: MetricsSnapshot, usage: float | None) -> dict[str, Any]:
    info = snap.cache_config
    tokens = _int_label(info, "kv_cache_size_tokens")
    return {
        "block_size": _int_label(info, "block_size"),
        "num_gpu_blocks": _int_label(info, "num_gpu_blocks"),
        "kv_cache_tokens": tokens,
        "kv_tokens_used": round(usage * tokens) if usage is not None and tokens else None,
        "cache_dtype": info.get("cache_dtype"),
        "gpu_memory_utilization": _float_label(info, "gpu_memory_utilization"),
        "prefix_caching": info.get("enable_prefix_caching"),
        "mamba_cache_mode": info.get("mamba_cache_mode"),
    }


@dataclass
class LiveMetrics:
    """Polling state: the rate deriver, the ring, the latest payload and the backoff."""

    engine_url: str
    interval: float = 1.0
    max_backoff: float = 8.0
    ring_size: int = 900
    deriver: RateDeriver = field(default_factory=RateDeriver)
    latest: dict[str, Any] | None = None
    failures: int = 0
    ring: deque[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.ring = deque(maxlen=self.ring_size)

    def next_delay(self) -> float:
        """One interval while the engine answers; doubling up to max_backoff while it does not."""
        if self.failures == 0:
            return self.interval
        backoff = self.interval * 2.0 ** min(self.failures, 16)
        return float(min(backoff, max(self.max_backoff, self.interval)))

    def record(self, text: str | None, now: float, error: str | None = None) -> dict[str, Any]:
        """Fold one poll in: `text` is the /metrics body, or None with `error` when it failed."""
        if text is not None:
            try:
                snap = parse_metrics(text, only=LIVE_FAMILIES)
            except MetricsError as exc:
                text, error = None, str(exc)
        if text is None:
            return self._record_down(now, error or "no answer")
        if self.failures:
            # Rates across an outage would average over the gap; start from this poll instead.
            self.deriver.reset()
        self.failures = 0
        rates = self.deriver.update(snap, now)
        usage = snap.kv_cache_usage
        payload: dict[str, Any] = {
            "ts": now,
            "engine_up": True,
            "engine_url": self.engine_url,
            "error": None,
            "model": snap.model_name,
            "kv_cache_usage": usage,
            "requests_running": snap.requests_running,
            "requests_waiting": snap.requests_waiting,
            "prefix_cache_queries": snap.prefix_cache_queries,
            "prefix_cache_hits": snap.prefix_cache_hits,
            "spec_decode": snap.has(SPEC_DRAFT_TOKENS),
            **_kv_capacity(snap, usage),
            **rates.as_dict(),
        }
        self.latest = payload
        self._push(payload)
        return payload

    def _record_down(self, now: float, error: str) -> dict[str, Any]:
        self.failures += 1
        previous = self.latest or {}
        down_since = previous.get("down_since") if not previous.get("engine_up", False) else None
        payload: dict[str, Any] = {
            "ts": now,
            "engine_up": False,
            "engine_url": self.engine_url,
            "error": error,
            "down_since": down_since or now,
            "model": previous.get("model"),
            "kv_cache_usage": None,
            "requests_running": None,
            "requests_waiting": None,
            "spec_decode": False,
            "retry_in": self.next_delay(),
        }
        payload.update({name: None for name in _RATE_FIELDS})
        payload["reset"] = False
        payload["spike_held"] = False
        payload["prompt_source"] = None
        self.latest = payload
        self._push(payload)
        return payload

    def _push(self, payload: dict[str, Any]) -> None:
        point = {"ts": payload["ts"], "up": payload["engine_up"]}
        for short, name in POINT_FIELDS.items():
            point[short] = payload.get(name)
        self.ring.append(point)

    def history(self, limit: int | None = None) -> list[dict[str, Any]]:
        points = list(self.ring)
        if limit is not None and limit >= 0:
            points = points[-limit:] if limit else []
        return points

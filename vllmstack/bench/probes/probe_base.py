"""What every probe and stability run is handed: the client, the model, the live limits, the
checked settings, and a way to read the engine's /metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from vllmstack.bench.client.client import ChatClient, EndpointError
from vllmstack.bench.client.row import BenchRow
from vllmstack.observe.metrics import MetricsError, MetricsSnapshot, parse_metrics
from vllmstack.workload.prompts import PromptBuilder

Progress = Callable[[str], None]
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
# bench-depth's run over (depths, pp, tg, runs): its rows and warnings. runs/ sits above probes/,
# so the caller hands it in (bench/runs/decay_runs.py); depth-decay measures with it.
DepthRows = Callable[[list[int], int, int, int], Awaitable[tuple[list[BenchRow], list[str]]]]


@dataclass
class ProbeContext:
    client: ChatClient
    model: str
    builder: PromptBuilder | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    params: dict[str, Any] = field(default_factory=dict)  # checked by `params.check_params`
    progress: Progress = print
    # The profile values a verdict names (bench/target.PROBE_KEYS: the attention backend, the KV
    # dtype, the GPU); empty against a bare --url.
    settings: dict[str, str] = field(default_factory=dict)
    depth_rows: DepthRows | None = None
    # The roofline's inputs for the profile (bench/report/roofline.inputs_from_profile); None on a
    # CPU platform or against a bare --url. depth-decay judges its curve against them.
    roofline: dict[str, Any] | None = None

    def param(self, key: str, default: Any) -> Any:
        value = self.params.get(key)
        return default if value is None else value

    async def metrics(self) -> MetricsSnapshot | None:
        try:
            return parse_metrics(await self.client.get_text("/metrics"))
        except (EndpointError, MetricsError):
            return None


def message_text(data: dict[str, Any] | None) -> tuple[str, str, list[tuple[str, str]], str]:
    """content, reasoning, [(tool name, arguments)], finish_reason of a non-streamed answer
    (one the client has checked the shape of)."""
    if not data or not data.get("choices"):
        return "", "", [], ""
    choice = data["choices"][0]
    message = choice.get("message") or {}
    calls = [((c.get("function") or {}).get("name") or "",
              (c.get("function") or {}).get("arguments") or "")
             for c in message.get("tool_calls") or []]
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    return message.get("content") or "", reasoning, calls, choice.get("finish_reason") or ""

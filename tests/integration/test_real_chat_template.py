"""The prefix cache on a real engine with chat-templates/qwen3.jinja and with a variant that drops
the empty think block from history (Qwen's own habit), issue 24.

vLLM's CPU build serves the made tiny model twice, once per template; each time the prefix-cache
probe plays 6 thinking-off turns, and /metrics' prefix-cache counters are read around it. With
the shipped template every earlier turn re-renders byte for byte, so a turn reuses the whole
history, the previous reply included; the variant's history parts from the cached prompt where
the empty think block was, so each turn recomputes from there. The numbers go to
test-artifacts/chat-template-prefix-cache.json (benchmarks/2026-12-01-chat-template-prefix-cache.md
records a run). Run alone, under the heavy lock:

    flock /tmp/vllmstack-heavy.lock \
      python3 -m pytest -m real_engine tests/integration/test_real_chat_template.py
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import ROOT, copy_project, free_port, write_dotenv
from template_variants import variant
from test_real_cpu_engine import BOOT_TIMEOUT_S, Stack, provision_engine

from vllmstack.observe.metrics import parse_metrics

pytestmark = [pytest.mark.slow, pytest.mark.real_engine]
TURNS = 6
TEMPLATES = {"qwen3.jinja": "qwen3.jinja", "drops-empty-think": "qwen3-drops-empty-think.jinja"}
ARTIFACT = ROOT / "test-artifacts" / "chat-template-prefix-cache.json"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    engine = provision_engine()
    base = tmp_path_factory.mktemp("real-template")
    root = copy_project(base / "stack")
    (root / ".cache" / "engines").mkdir(parents=True)
    (root / ".cache" / "engines" / engine.name).symlink_to(engine)
    (root / "chat-templates" / TEMPLATES["drops-empty-think"]).write_text(
        variant("drops-empty-think"), encoding="utf-8")
    home = base / "home"
    home.mkdir()
    port = free_port()
    # A short path: the engine's ZeroMQ sockets live under it, and a socket path has at most
    # 107 bytes (the checkout's .cache/real-engine-tests/... went over). Removed at the end: the
    # engine's compile cache in it is 150 MB a run.
    host_cache = tempfile.mkdtemp(prefix="v24-")
    write_dotenv(root, {
        "PLATFORM": "cpu", "MODEL_PROFILE": "tiny", "RUNTIME": "native", "VLLM_PORT": str(port),
        "OTHER_ENGINE_PORTS": "", "DASHBOARD_PORT": str(free_port()),
        "HOST_CACHE_DIR": host_cache, "UP_TIMEOUT": str(BOOT_TIMEOUT_S),
        "HF_CACHE_DIR": str(home / ".cache" / "huggingface")})
    made = Stack(root, home, port, engine)
    made.must("make-model")
    try:
        yield made
    finally:
        made.invoke("down", timeout=180)
        shutil.rmtree(host_cache, ignore_errors=True)


def counters(stack: Stack) -> tuple[float, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.port}/metrics", timeout=30) as answer:
        snap = parse_metrics(answer.read().decode())
    assert snap.prefix_cache_hits is not None and snap.prefix_cache_queries is not None
    return snap.prefix_cache_hits, snap.prefix_cache_queries


def turns_of(record: dict[str, Any]) -> list[dict[str, int]]:
    """Per turn 2..6: the probe's hits, the earlier prompt, what the cache could reach of it and
    the prompt tokens queried (from its check rows)."""
    rows = []
    for check in record["checks"]:
        found = re.match(r"turn (\d+)$", check["name"])
        hits = re.match(r"(\d+)/(\d+) earlier tokens reused", check["value"])
        note = re.match(r"(\d+) reachable, queries (\d+)", check["note"])
        if found and hits and note:
            rows.append({"turn": int(found.group(1)), "hits": int(hits.group(1)),
                         "earlier_prompt": int(hits.group(2)), "reachable": int(note.group(1)),
                         "queries": int(note.group(2))})
    return rows


def measure(stack: Stack, template: str) -> dict[str, Any]:
    setting = f"VLLM_CHAT_TEMPLATE={template}"
    started = time.monotonic()
    stack.must("up", "--no-dashboard", "--set", setting, timeout=BOOT_TIMEOUT_S + 60)
    try:
        before = counters(stack)
        probe = stack.invoke("probe", "prefix-cache", "-p", f"turns={TURNS}", "--json", "--set", setting,
                             timeout=900)
        after = counters(stack)
    finally:
        stack.must("down", timeout=180)
    assert probe.returncode in (0, 1), probe.stdout[-2000:] + probe.stderr[-2000:]
    record = json.loads(probe.stdout)
    hits, queries = after[0] - before[0], after[1] - before[1]
    rows = turns_of(record)
    assert len(rows) == TURNS - 1, record
    later_hits = sum(r["hits"] for r in rows)
    later_queries = sum(r["queries"] for r in rows)
    return {"template": template, "probe_verdict": record.get("verdict"),
            "block_size": (record.get("details") or {}).get("block_size"),
            "hits": hits, "queries": queries, "hit_rate": hits / queries,
            "turns_2_to_6": {"hits": later_hits, "queries": later_queries,
                             "hit_rate": later_hits / later_queries,
                             "recomputed_tokens": later_queries - later_hits},
            "turns": rows, "seconds": round(time.monotonic() - started)}


def test_the_shipped_template_keeps_more_of_each_turn_in_the_prefix_cache(stack: Stack) -> None:
    results = {name: measure(stack, template) for name, template in TEMPLATES.items()}
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.write_text(json.dumps(results, indent=2) + "\n")
    shipped, broken = results["qwen3.jinja"], results["drops-empty-think"]
    print(json.dumps({n: r["turns_2_to_6"] for n, r in results.items()}, indent=2))
    # The same probe conversation (the replies are sampled, so turn lengths differ a little):
    # with the variant, turns 2-6 recompute what the shipped template serves from the cache.
    assert shipped["turns_2_to_6"]["hit_rate"] > broken["turns_2_to_6"]["hit_rate"]
    assert shipped["turns_2_to_6"]["recomputed_tokens"] < broken["turns_2_to_6"]["recomputed_tokens"]

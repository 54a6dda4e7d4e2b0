"""Swap times through a running `invoke router` (issue 21's evidence), standard library only.

For each cycle it asks for the next model in turn (a streamed chat completion through the
router), takes the time from sending the request to its first content token, then sends the
same request straight to that model's engine (awake now: the router's /v1/health names its URL)
for the engine's own time to first token. The swap's cost is the difference. It also keeps the
router's record of the swap (sleep, stop, wake or start seconds, first answer), the card's used
memory before and after (nvidia-smi), and, from a sampling thread, the most engines the router
ever had awake and the most memory the card ever had in use. With --load it first loads each
model through /v1/load (a sleep-mode engine pays its first sleep there, with no client waiting).

  python3 benchmarks/gpu/router_swap_probe.py --router http://127.0.0.1:8090 \
      --models qwen3-0.6b,qwen3-8b --cycles 12 --load --out /tmp/out/sleep.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


def get(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read())


def post(url: str, body: dict[str, Any], timeout: float = 900) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def first_token(url: str, model: str, max_tokens: int = 16) -> tuple[float, float, int]:
    """(seconds to the first content token, seconds to the end, HTTP status) of one stream."""
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "stream": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    began = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=900) as answer:
        status = answer.status
        for raw in answer:
            line = raw.decode(errors="replace").strip()
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0].get("delta", {})
                if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
                    first = time.perf_counter() - began
    end = time.perf_counter() - began
    return (first if first is not None else end), end, status


def card_used() -> int | None:
    """MiB in use on the first card, as nvidia-smi reads it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


class Sampler(threading.Thread):
    """The router's awake engines and the card's memory, sampled while the probe runs."""

    def __init__(self, router: str) -> None:
        super().__init__(daemon=True)
        self.router, self.done = router, threading.Event()
        self.awake: list[int] = []
        self.used: list[int] = []

    def run(self) -> None:
        last = 0.0
        while not self.done.is_set():
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.awake.append(len(get(self.router + "/v1/health", timeout=5)["awake"]))
            if time.monotonic() - last > 0.5:
                used = card_used()
                if used is not None:
                    self.used.append(used)
                last = time.monotonic()
            time.sleep(0.05)


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True)
    parser.add_argument("--models", required=True, help="comma-separated, asked for in turn")
    parser.add_argument("--cycles", type=int, default=12)
    parser.add_argument("--load", action="store_true", help="/v1/load each model first")
    parser.add_argument("--out", required=True, help="the JSON report")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    report: dict[str, Any] = {"models": models, "loads": [], "cycles": [], "card_mib": {}}
    report["card_mib"]["before"] = card_used()
    if args.load:
        for model in models:
            began = time.perf_counter()
            post(args.router + "/v1/load", {"model": model})
            health = get(args.router + "/v1/health")
            report["loads"].append({"model": model, "seconds": round(time.perf_counter() - began, 2),
                                    "card_mib": card_used(), "engines": health["engines"],
                                    "swap": health["swaps"][-1] if health["swaps"] else None})
    sampler = Sampler(args.router)
    sampler.start()
    known = get(args.router + "/v1/health")["swaps"]
    last_at = known[-1]["at"] if known else None
    for cycle in range(args.cycles):
        model = models[cycle % len(models)]
        before = card_used()
        routed, routed_end, status = first_token(args.router, model)
        health = get(args.router + "/v1/health")
        # The swap this request caused, if any (the router keeps the last 20).
        fresh = [s for s in health["swaps"] if last_at is None or s["at"] > last_at]
        swap = next((s for s in reversed(fresh) if s["reason"] == "request"), None)
        last_at = health["swaps"][-1]["at"] if health["swaps"] else last_at
        url = health["engines"][model]["url"]
        direct, _, _ = first_token(url, model) if url else (None, None, None)
        report["cycles"].append({
            "model": model, "status": status, "routed_ttft_s": round(routed, 4),
            "routed_total_s": round(routed_end, 4),
            "direct_ttft_s": round(direct, 4) if direct is not None else None,
            "swap_overhead_s": round(routed - direct, 4) if direct is not None else None,
            "swap": swap, "card_mib_before": before, "card_mib_after": card_used(),
            "awake": health["awake"], "asleep": health["asleep"],
            "engines": {k: {f: v.get(f) for f in ("state", "swap", "util", "gpu_gib", "host_gib",
                                                   "residue_gib", "residue_measured")}
                        for k, v in health["engines"].items()}})
    sampler.done.set()
    sampler.join()
    report["card_mib"]["after"] = card_used()
    report["max_awake"] = max(sampler.awake, default=None)
    report["max_card_mib"] = max(sampler.used, default=None)
    report["plan"] = get(args.router + "/v1/health").get("plan")
    swapped = [c for c in report["cycles"] if c["swap"] and c["swap"]["loaded"] == c["model"]]
    summary: dict[str, Any] = {}
    for model in models:
        mine = [c for c in swapped if c["model"] == model]
        summary[model] = {
            "swaps": len(mine),
            "swap_overhead_s_median": median([c["swap_overhead_s"] for c in mine
                                              if c["swap_overhead_s"] is not None]),
            "swap_overhead_s_max": max((c["swap_overhead_s"] for c in mine
                                        if c["swap_overhead_s"] is not None), default=None),
            "direct_ttft_s_median": median([c["direct_ttft_s"] for c in mine
                                            if c["direct_ttft_s"] is not None]),
            "sleep_s_median": median([c["swap"]["sleep_s"] for c in mine]),
            "wake_s_median": median([c["swap"]["wake_s"] for c in mine]),
            "stop_s_median": median([c["swap"]["stop_s"] for c in mine]),
            "start_s_median": median([c["swap"]["start_s"] for c in mine]),
        }
    report["summary"] = summary
    report["failures"] = [c for c in report["cycles"] if c["status"] != 200]
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print(json.dumps({"summary": summary, "max_awake": report["max_awake"],
                      "max_card_mib": report["max_card_mib"], "card_mib": report["card_mib"],
                      "failures": len(report["failures"])}, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env bash
# The router's overhead on the lent H200 (issue 22), beside the 2026-11-30 measurement of the old
# router (8B resident: +2.09 ms TTFT). From the carried tree root, after device.sh stage p1/p2:
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-router-overhead-run.sh
# 1. vLLM 0.27.1 serves the Qwen3-8B geometry (dummy weights, /tmp/models/qwen3-8b-dummy) on
#    127.0.0.1:8000, started by hand: the router is measured, not `up`.
# 2. bench_router_overhead.py --engine-url: the router (run_router: its aiohttp server, pooled
#    client and scheduler) in front of that engine; 30 alternating pairs of streamed one-token
#    completions (TTFT) and 30 of 200-token streams (pace, router CPU per chunk).
# 3. bench_router_overhead.py (default mode) on the same host: the simulator and the stamping
#    engine, loaded by the router through `up`: the stamped per-chunk latency.
# Results: $OUT/router-overhead-8b.md, $OUT/router-overhead-sim.md, $OUT/vllm.log.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"; M=/tmp/models
python3 -m vllm.entrypoints.cli.main serve "$M/qwen3-8b-dummy" --served-model-name qwen3-8b \
  --host 127.0.0.1 --port 8000 --load-format dummy --attention-backend TRITON_ATTN \
  --max-model-len 4096 > "$O/vllm.log" 2>&1 &
V=$!
trap 'kill $V 2>/dev/null; wait $V 2>/dev/null' EXIT
for _ in $(seq 480); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)" \
    2>/dev/null && break
  kill -0 $V 2>/dev/null || { echo "vLLM exited; see $O/vllm.log"; exit 1; }
  sleep 1
done
timeout 300 python3 benchmarks/bench_router_overhead.py --engine-url http://127.0.0.1:8000 \
  --pairs 30 --tokens 200 > "$O/router-overhead-8b.md" 2>&1
echo "engine-url rc=$?" >> "$O/router-overhead-8b.md"
kill $V; wait $V 2>/dev/null
timeout 240 python3 benchmarks/bench_router_overhead.py --pairs 30 --tokens 200 \
  > "$O/router-overhead-sim.md" 2>&1
echo "default rc=$?" >> "$O/router-overhead-sim.md"

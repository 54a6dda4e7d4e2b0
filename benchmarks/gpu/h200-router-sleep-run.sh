#!/usr/bin/env bash
# Issue 21's evidence on the lent H200 (see ../shared/gpu/README.md): `invoke router` swapping by
# sleep against swapping by restart, with real vLLM 0.27.1 (CUDA graphs on, native runtime, dummy
# weights at the real geometries in /tmp/models). From the carried tree root, after device.sh
# stage p1/p2, one mode per call (each fits the 10-minute limit; run all three in one session so
# they share the machine and its warm compile cache):
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-router-sleep-run.sh sleep
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-router-sleep-run.sh restart
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-router-sleep-run.sh hybrid
#   (2026-12-02: kv and hybrid-kv, the same runs with ROUTER_SLEEP_FREES=auto, which picks kv;
#   CYCLES=200 ... kv: 200 alternating requests instead of 12)
# sleep:   the router (--swap sleep) over the 0.6B and the 8B geometry at gpu_memory_utilization
#          0.6 each (they do not fit together, so every swap sleeps one and wakes the other);
#          both loaded through /v1/load (each pays its first sleep there), then 12 alternating
#          streamed requests: swap = time to first token through the router minus the engine's
#          own, straight after (router_swap_probe.py), with the router's split (sleep, wake,
#          first answer), the card's memory before and after each swap, the most engines awake.
# restart: the same two profiles and requests with --swap restart (3 requests: 2 swaps).
# kv, hybrid-kv: sleep and hybrid with ROUTER_SLEEP_FREES=auto (the others run with =all, vLLM's
#          own level 1): the plan keeps the weights on the card (both fit beside one budget), so a
#          sleep releases only the KV cache (engine-plugins/vllmstack_sleep) and nothing is copied.
# hybrid:  the Qwen3.6-27B-like hybrid with MTP-1 at TP=1 (util 0.85, --gdn-prefill-backend
#          triton) beside the 0.6B (eager, util 0.3): load both, then 6 alternating requests.
# Done when (issue 21): a swap back to a loaded model <= 0.5 s up to 8B and <= 1.5 s for the 27B
# hybrid (swap_overhead_s); no failure; max_awake 1 (the plan's); nothing left after SIGTERM.
# Everything lands in $OUT/<mode>.tgz (also when a step runs past the call's limit): probe.json,
# router output and per-profile logs, the plan, memory.json, nvidia-smi before/after, ps after stop.
set -u
MODE=$1; O=/tmp/ev-$MODE; rm -rf "$O"; mkdir -p "$O"; M=/tmp/models
pack() { mkdir -p "${OUT:-/tmp/out}"
         cp -r generated/router "$O/router-dir" 2>/dev/null
         tar -C /tmp -czf "${OUT:-/tmp/out}/$MODE.tgz" "ev-$MODE"; }
trap pack EXIT TERM
INV="python3 -m invoke"
t0=$(date +%s.%N); el() { python3 -c "print(round($(date +%s.%N)-$t0,1))"; }
step() { echo "=== +$(el)s $*" | tee -a "$O/steps.log"; }
smi() { nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader >> "$O/nvidia-smi.txt"
        echo "-- $1" >> "$O/nvidia-smi.txt"; }
cat > .env <<E
PLATFORM=nvidia
RUNTIME=native
VLLM_PORT=8180
VLLM_VERSION=0.31.0
VLLM_REF=v0.31.0
NATIVE_ENGINE_VERSION=0.27.1
NATIVE_ENGINE_COMMAND=python3 -m vllm.entrypoints.cli.main
GPU_VRAM_GIB=139.8
GPU_DEVICE_NAME=NVIDIA_H200
MODELS_DIR=$M
ATTENTION_BACKEND=TRITON_ATTN
OTHER_ENGINE_PORTS=
VLLM_MAX_MODEL_LEN=16384
ROUTER_SWAP_GRACE=0
ROUTER_SLEEP_FREES=$([ "${MODE%kv}" != "$MODE" ] && echo auto || echo all)
E
# Profiles of their own (the keys that differ live in the profile: .env would win over them).
# Beside the hybrid the small one starts quickly (eager) and takes little: the swap measured
# there is the hybrid's wake.
SMALL="VLLM_GPU_MEM_UTIL=0.6"; [ "${MODE%-kv}" = hybrid ] && SMALL=$'VLLM_GPU_MEM_UTIL=0.3\nVLLM_ENFORCE_EAGER=1'
cat > env/models/h200-small.env <<E
PROFILE_DESCRIPTION=the Qwen3-0.6B geometry, dummy weights (issue 21's evidence run)
EXTENDS=models/qwen3-0.6b
PROFILE_PLATFORMS=nvidia
VLLM_SERVED_NAME=small
VLLM_MODEL=$M/qwen3-0.6b-dummy
VLLM_TOKENIZER=$M/qwen3-0.6b-dummy
$SMALL
VLLM_EXTRA_ARGS=--load-format dummy
E
cat > env/models/h200-8b.env <<E
PROFILE_DESCRIPTION=the Qwen3-8B geometry, dummy weights (issue 21's evidence run)
EXTENDS=models/qwen3-0.6b
PROFILE_PLATFORMS=nvidia
VLLM_SERVED_NAME=big
VLLM_MODEL=$M/qwen3-8b-dummy
VLLM_TOKENIZER=$M/qwen3-8b-dummy
VLLM_GPU_MEM_UTIL=0.6
VLLM_EXTRA_ARGS=--load-format dummy
MODEL_NUM_LAYERS=36
MODEL_FULL_ATTENTION_LAYERS=36
MODEL_NUM_ATTENTION_HEADS=32
MODEL_HIDDEN_SIZE=4096
MODEL_INTERMEDIATE_SIZE=12288
MODEL_WEIGHT_GIB=15.3
E
cat > env/models/h200-27b.env <<E
PROFILE_DESCRIPTION=the Qwen3.6-27B-like hybrid with MTP-1 at TP=1, dummy weights (issue 21)
EXTENDS=models/qwen3.6-27b
PROFILE_PLATFORMS=nvidia
VLLM_SERVED_NAME=hybrid
VLLM_MODEL=$M/qwen3.6-27b-dummy
VLLM_TOKENIZER=$M/qwen3.6-27b-dummy
VLLM_TP=1
VLLM_GPU_MEM_UTIL=0.85
VLLM_SPEC_DECODE='{"method": "mtp", "num_speculative_tokens": 1}'
VLLM_LIMIT_MM_PER_PROMPT=
VLLM_MAX_NUM_SEQS=2
MODEL_QUANT=
MODEL_WEIGHT_GIB=50
VLLM_EXTRA_ARGS=--load-format dummy --gdn-prefill-backend triton
E
cp .env "$O/dotenv.txt"; cp env/models/h200-*.env "$O/"
rm -f generated/router/memory.json  # each mode measures its residues afresh
case $MODE in
sleep|kv) PROFILES=h200-small,h200-8b; SWAP=sleep;   ARGS="--models small,big --cycles ${CYCLES:-12} --load"; LIMIT=560 ;;
restart) PROFILES=h200-small,h200-8b; SWAP=restart; ARGS="--models small,big,small --cycles 3"; LIMIT=560 ;;
hybrid|hybrid-kv) PROFILES=h200-27b,h200-small; SWAP=sleep;  ARGS="--models hybrid,small --cycles 6 --load"; LIMIT=560 ;;
*) echo "usage: $0 sleep|restart|hybrid|kv|hybrid-kv"; exit 2 ;;
esac
smi "before"
step "plan ($PROFILES, --swap $SWAP)"
timeout 60 $INV router --plan --profiles $PROFILES --swap $SWAP > "$O/plan.txt" 2>&1
step "check"; for p in ${PROFILES//,/ }; do timeout 90 $INV check --model "$p" > "$O/check-$p.txt" 2>&1; done
step "router start"
$INV router --port 8090 --profiles $PROFILES --swap $SWAP > "$O/router.txt" 2>&1 &
R=$!
for _ in $(seq 60); do curl -sf 127.0.0.1:8090/v1/health > /dev/null && break; sleep 1; done
curl -s 127.0.0.1:8090/v1/models > "$O/models-before.json"
step "probe $ARGS"
# What is left of the call, less a minute for the stop and the packing.
timeout $(( LIMIT - $(python3 -c "print(int($(date +%s.%N)-$t0))") - 60 )) \
  python3 benchmarks/gpu/router_swap_probe.py --router http://127.0.0.1:8090 $ARGS \
  --out "$O/probe.json" > "$O/probe.txt" 2>&1
echo "probe rc=$?" >> "$O/steps.log"
curl -s 127.0.0.1:8090/v1/models > "$O/models-after.json"
curl -s 127.0.0.1:8090/v1/health > "$O/health-after.json"
smi "after the probe"
$INV status > "$O/status.txt" 2>&1
cp generated/router.json "$O/" 2>/dev/null
step "router stop (SIGTERM)"; kill -TERM $R; wait $R; echo "router rc=$?" >> "$O/steps.log"
smi "after SIGTERM"
ps aux | grep -E "vllm|VLLMSTACK" | grep -v grep > "$O/ps-after-stop.txt"
grep -h "vllmstack_sleep\|Sleep mode freed\|sleep-mode backend" generated/router/*.log > "$O/sleeps.txt" 2>/dev/null
step end

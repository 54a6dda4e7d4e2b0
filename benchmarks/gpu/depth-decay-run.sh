#!/usr/bin/env bash
# Issue 39, item 3: `invoke probe depth-decay` on the H200, so there is a measured baseline of what
# a healthy backend's decode-vs-depth curve looks like (decode t/s at 8K, 32K and 64K, each as a
# share of 8K; the probe now judges that share against the roofline's). One geometry per call
# (boot plus the probe fits one 10-minute call), dummy weights (`--load-format dummy`), real
# vLLM 0.27.1 on the native runtime, TRITON_ATTN (its FlashAttention extensions do not load on that machine). From the
# carried tree root, after device.sh stage p1/p2 (see ../shared/gpu/README.md):
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/depth-decay-run.sh 8b
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/depth-decay-run.sh 27b
# 8b:  the Qwen3-8B geometry, bf16, TP=1. Its dummy config says max_position_embeddings 40960, so
#      a copy of it says 131072 (random weights: only the window matters), and the window is
#      67584 tokens: 64K of context plus the probe's question, answer and margin.
# 27b: the Qwen3.6-27B-like hybrid with MTP-1 (dummy weights: the draft is rarely accepted, so
#      decode is the MTP path's cost, not its gain), bf16, TP=${TP:-1} (TP=2 where two GPUs are
#      lent: `TP=2 bash ...`), --gdn-prefill-backend triton.
# BUDGET (seconds, default 560) bounds the whole run. Results: $OUT/depth-decay-<mode>.tgz
# (dotenv, profile, up, the probe's JSON record and its progress, the engine log, down).
set -u
MODE=${1:-}; case $MODE in 8b|27b) ;; *) echo "usage: $0 8b|27b"; exit 2 ;; esac
DEADLINE=$(( $(date +%s) + ${BUDGET:-560} ))
tmo() { local left=$(( DEADLINE - $(date +%s) - 20 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
O=/tmp/ev-decay-$MODE; rm -rf "$O"; mkdir -p "$O"; M=/tmp/models
pack() { mkdir -p "${OUT:-/tmp/out}"; cp generated/native/engine.log "$O/engine.log" 2>/dev/null
         tar -C /tmp -czf "${OUT:-/tmp/out}/depth-decay-$MODE.tgz" "ev-decay-$MODE"; }
trap pack EXIT TERM
INV="python3 -m invoke"
step() { echo "=== $(date +%T) $*" | tee -a "$O/steps.log"; }
TP=${TP:-1}
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
MODEL_PROFILE=h200-decay-$MODE
E
if [ "$MODE" = 8b ]; then
  rm -rf "$M/qwen3-8b-dummy-long"; cp -r "$M/qwen3-8b-dummy" "$M/qwen3-8b-dummy-long"
  python3 - "$M/qwen3-8b-dummy-long/config.json" <<'P'
import json, sys
path = sys.argv[1]
config = json.load(open(path))
config["max_position_embeddings"] = 131072
json.dump(config, open(path, "w"), indent=2)
P
  cat > env/models/h200-decay-8b.env <<E
PROFILE_DESCRIPTION=the Qwen3-8B geometry with a 131072-token position table, dummy weights (issue 39)
EXTENDS=models/qwen3-0.6b
PROFILE_PLATFORMS=nvidia
VLLM_SERVED_NAME=qwen3-8b
VLLM_MODEL=$M/qwen3-8b-dummy-long
VLLM_TOKENIZER=$M/qwen3-8b-dummy-long
VLLM_EXTRA_ARGS=--load-format dummy
VLLM_MAX_MODEL_LEN=67584
MODEL_MAX_POSITION_EMBEDDINGS=131072
MODEL_NUM_LAYERS=36
MODEL_FULL_ATTENTION_LAYERS=36
MODEL_NUM_ATTENTION_HEADS=32
MODEL_HIDDEN_SIZE=4096
MODEL_INTERMEDIATE_SIZE=12288
MODEL_WEIGHT_GIB=15.3
E
else
  VISIBLE=$(seq -s, 0 $(( TP - 1 )))
  cat > env/models/h200-decay-27b.env <<E
PROFILE_DESCRIPTION=the Qwen3.6-27B-like hybrid with MTP-1 at TP=$TP, dummy weights (issue 39)
EXTENDS=models/qwen3.6-27b
PROFILE_PLATFORMS=nvidia
VLLM_SERVED_NAME=hybrid
VLLM_MODEL=$M/qwen3.6-27b-dummy
VLLM_TOKENIZER=$M/qwen3.6-27b-dummy
VLLM_TP=$TP
GPU_COUNT=$TP
CUDA_VISIBLE_DEVICES=$VISIBLE
VLLM_GPU_MEM_UTIL=0.85
VLLM_SPEC_DECODE='{"method": "mtp", "num_speculative_tokens": 1}'
VLLM_LIMIT_MM_PER_PROMPT=
VLLM_MAX_NUM_SEQS=2
VLLM_MAX_MODEL_LEN=67584
MODEL_QUANT=
MODEL_WEIGHT_GIB=50
VLLM_EXTRA_ARGS=--load-format dummy --gdn-prefill-backend triton
E
fi
cp .env "$O/dotenv.txt"; cp "env/models/h200-decay-$MODE.env" "$O/"
step up; timeout $(tmo 330) $INV up --no-dashboard --timeout $(tmo 310) > "$O/up.txt" 2>&1
rc=$?; echo "rc=$rc" >> "$O/steps.log"
if [ $rc -eq 0 ]; then
  step "probe depth-decay"
  # Exit 1 (fail) is a result here, not an error: the table is the point.
  timeout $(tmo 180) $INV probe depth-decay --json > "$O/probe.json" 2> "$O/probe-progress.txt"
  echo "rc=$?" >> "$O/steps.log"
  cp -r results "$O/results" 2>/dev/null
fi
step down; DEADLINE=$(( DEADLINE + 15 )); timeout $(tmo 40) $INV down > "$O/down.txt" 2>&1
echo "rc=$?" >> "$O/steps.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader >> "$O/down.txt" 2>&1

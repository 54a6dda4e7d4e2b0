#!/usr/bin/env bash
# Issue 25's "invoke bench on the H200 prints % of the roofline": the Qwen3-8B geometry (dummy
# weights, bf16, TP=1) served by `invoke up` (native runtime, real vLLM 0.27.1, CUDA graphs on),
# then `invoke bench` as a user runs it (tg32 and tg128 at a short prompt, pp2048), its text output
# kept as printed (the "roofline:" line under each row). From the carried tree root, after
# device.sh stage p1/p2 (see ../shared/gpu/README.md):
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-roofline-run.sh
# BUDGET (seconds, default 330) bounds the whole run so it can follow another script in one call.
# Results: $OUT/roofline.tgz (dotenv, up, the bench outputs, the engine log, down).
set -u
DEADLINE=$(( $(date +%s) + ${BUDGET:-330} ))
tmo() { local left=$(( DEADLINE - $(date +%s) - 20 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
O=/tmp/ev-roofline; rm -rf "$O"; mkdir -p "$O"; M=/tmp/models
pack() { mkdir -p "${OUT:-/tmp/out}"; cp generated/native/engine.log "$O/engine.log" 2>/dev/null
         tar -C /tmp -czf "${OUT:-/tmp/out}/roofline.tgz" ev-roofline; }
trap pack EXIT TERM
INV="python3 -m invoke"
step() { echo "=== $(date +%T) $*" | tee -a "$O/steps.log"; }
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
MODEL_PROFILE=h200-8b
E
cat > env/models/h200-8b.env <<E
PROFILE_DESCRIPTION=the Qwen3-8B geometry, dummy weights (issue 25's roofline run)
EXTENDS=models/qwen3-0.6b
PROFILE_PLATFORMS=nvidia
VLLM_SERVED_NAME=qwen3-8b
VLLM_MODEL=$M/qwen3-8b-dummy
VLLM_TOKENIZER=$M/qwen3-8b-dummy
VLLM_EXTRA_ARGS=--load-format dummy
VLLM_MAX_MODEL_LEN=8192
MODEL_NUM_LAYERS=36
MODEL_FULL_ATTENTION_LAYERS=36
MODEL_NUM_ATTENTION_HEADS=32
MODEL_HIDDEN_SIZE=4096
MODEL_INTERMEDIATE_SIZE=12288
MODEL_WEIGHT_GIB=15.3
E
cp .env "$O/dotenv.txt"; cp env/models/h200-8b.env "$O/"
step up; timeout $(tmo 240) $INV up --no-dashboard --timeout $(tmo 220) > "$O/up.txt" 2>&1
rc=$?; echo "rc=$rc" >> "$O/steps.log"
if [ $rc -eq 0 ]; then
  for spec in "128 32" "128 128" "2048 32"; do
    set -- $spec
    step "bench --pp $1 --tg $2"
    timeout $(tmo 60) $INV bench --pp "$1" --tg "$2" --runs 3 > "$O/bench-pp$1-tg$2.txt" 2>&1
    echo "rc=$?" >> "$O/steps.log"
  done
  cp -r results "$O/results" 2>/dev/null
fi
step down; DEADLINE=$(( DEADLINE + 15 )); timeout $(tmo 40) $INV down > "$O/down.txt" 2>&1
echo "rc=$?" >> "$O/steps.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader >> "$O/down.txt" 2>&1

#!/usr/bin/env bash
# Issue 25 on the lent H200 (see ../shared/gpu/README.md): tuned Triton configs measured with the
# stack's own `invoke tune`, then a same-boot end-to-end A/B with `invoke bench` (stock configs,
# then tuned ones, one machine, one session). From the carried tree root, after device.sh stage
# p1/p2 and with .gpu/p3 carrying the models (make_dummy_models.py + make_moe_dummy.py):
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-tuned-configs-run.sh tune
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-tuned-configs-run.sh ab
# `tune` leaves the configs in /tmp/tuned (the machine stays warm between the two calls); each
# mode packs what it measured into $OUT/<mode>.tgz.
set -u
DEADLINE=$(( $(date +%s) + ${BUDGET:-520} ))
tmo() { local left=$(( DEADLINE - $(date +%s) - 20 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
MODE=$1; O=/tmp/ev-$MODE; rm -rf "$O"; mkdir -p "$O" /tmp/tuned; M=/tmp/models
pack() { mkdir -p "${OUT:-/tmp/out}"; cp generated/native/engine.log "$O/engine.log" 2>/dev/null
         cp -r fused_moe_configs fp8_configs "$O/" 2>/dev/null
         tar -C /tmp -czf "${OUT:-/tmp/out}/$MODE.tgz" "ev-$MODE"; }
trap pack EXIT TERM
INV="python3 -m invoke"
t0=$(date +%s.%N); el() { python3 -c "print(round($(date +%s.%N)-$t0,1))"; }
step() { echo "=== +$(el)s $*" | tee -a "$O/steps.log"; }
cat > .env <<E
RUNTIME=native
PLATFORM=nvidia
GPU_DEVICE_NAME=NVIDIA_H200
VLLM_PORT=8180
VLLM_VERSION=0.31.0
VLLM_REF=v0.31.0
NATIVE_ENGINE_VERSION=0.27.1
NATIVE_ENGINE_COMMAND=python3 -m vllm.entrypoints.cli.main
MODELS_DIR=$M
ATTENTION_BACKEND=TRITON_ATTN
E
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv > "$O/nvidia-smi.csv" 2>&1
case $MODE in
tune)
  # Decode sizes (1-8: one to a few streams, MTP drafts), then the prefill chunks the profiles use.
  step "tune moe"; timeout $(tmo 280) $INV tune moe --model qwen3.6-35b-a3b --tp 1 \
    --batch-sizes 1,2,4,8,16,32,64,128,256,512,1024,2048,4096 --budget-min ${MOE_MIN:-3.2} \
    > "$O/tune-moe.txt" 2>&1; echo "rc=$?" | tee -a "$O/steps.log"; tail -30 "$O/tune-moe.txt"
  step "tune fp8-dense"; timeout $(tmo 290) $INV tune fp8-dense --model qwen3.8-27b --tp 1 \
    --batch-sizes 1,2,4,8,16,32,64,256,1024,2048 --budget-min ${DENSE_MIN:-3.3} \
    > "$O/tune-dense.txt" 2>&1; echo "rc=$?" | tee -a "$O/steps.log"; tail -30 "$O/tune-dense.txt"
  cp fused_moe_configs/*.json /tmp/tuned/ 2>/dev/null; ls -la /tmp/tuned | tee -a "$O/steps.log"
  cp -r generated/tune "$O/raw" 2>/dev/null ;;
moe-ab)
  # The second call of the day: MoE re-tuned with graph-only timing (the first call's eager
  # timings measured fused_experts' Python, not the kernel), then the A/B below, whose tuned arm
  # runs only when a config was written and time is left.
  step "tune moe"; timeout $(tmo 200) $INV tune moe --model qwen3.6-35b-a3b --tp 1 \
    --batch-sizes 1,2,4,8,16,32,64,128,256,512,1024,2048 --budget-min ${MOE_MIN:-2.2} --force \
    > "$O/tune-moe.txt" 2>&1; echo "rc=$?" | tee -a "$O/steps.log"; grep -v "WARNING\|^\[" "$O/tune-moe.txt" | tail -22
  cp fused_moe_configs/*.json /tmp/tuned/ 2>/dev/null; cp -r generated/tune "$O/raw" 2>/dev/null
  python3 -c "from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel as K; print('CUTLASS block-FP8 dense supported here:', K.is_supported())" 2>&1 | grep -v WARNING | tail -1 | tee -a "$O/steps.log"
  ;&
ab)
  # Qwen3.6-35B-A3B geometry, FP8, TP=1, dummy weights; one sequence at a time (bench rows are
  # single-stream), no MTP (the dummy has no trained draft head). DeepGEMM off in both arms: its
  # JIT would compile at boot, and vLLM runs this model's N=512 experts on Triton either way.
  cat >> .env <<E
MODEL_PROFILE=qwen3.6-35b-a3b
VLLM_MODEL=$M/qwen3.6-35b-a3b-dummy
VLLM_TOKENIZER=$M/qwen3.6-35b-a3b-dummy
VLLM_EXTRA_ARGS=--load-format dummy --gdn-prefill-backend triton
VLLM_LIMIT_MM_PER_PROMPT=
VLLM_SPEC_DECODE=
VLLM_MAX_MODEL_LEN=8192
ENGINE_ENV=VLLM_USE_DEEP_GEMM=0
E
  cp .env "$O/dotenv.txt"
  mkdir -p fused_moe_configs /tmp/aside; mv fused_moe_configs/*.json /tmp/aside/ 2>/dev/null
  arm() {  # name
    step "up ($1)"; timeout $(tmo 330) $INV up --no-dashboard --timeout $(tmo 310) > "$O/up-$1.txt" 2>&1
    local rc=$?; echo "rc=$rc" >> "$O/steps.log"; cp generated/native/engine.log "$O/engine-$1.log" 2>/dev/null
    if [ $rc -eq 0 ]; then
      step "bench ($1)"; timeout $(tmo 150) $INV bench --pp 2048 --tg 32 --tg 128 --runs 5 --json \
        > "$O/bench-$1.json" 2> "$O/bench-$1.err"; echo "rc=$?" >> "$O/steps.log"; tail -8 "$O/bench-$1.err"
    else tail -20 "$O/up-$1.txt"; fi
    grep -h "Using configuration from\|Using default MoE config" "$O/engine-$1.log" | sort -u | head -3
    step "down ($1)"; timeout $(tmo 60) $INV down > "$O/down-$1.txt" 2>&1
  }
  arm stock
  cp /tmp/tuned/E=*.json fused_moe_configs/ 2>/dev/null; ls fused_moe_configs | tee -a "$O/steps.log"
  if ls fused_moe_configs/E=*.json >/dev/null 2>&1 && [ $(( DEADLINE - $(date +%s) )) -gt 200 ]; then
    arm tuned
  else step "tuned arm skipped: no config won, or too little time left"; fi ;;
esac
step end

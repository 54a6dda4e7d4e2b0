#!/usr/bin/env bash
# The real-engine evidence run on the lent 2x H200 machine (see ../shared/gpu/README.md): the stack's own
# commands (native runtime) against real vLLM 0.27.1 with dummy weights, side by side with
# `vllm bench serve` from the same install. From the carried tree root, after device.sh stage p1/p2:
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-real-engine-run.sh small|big
# Everything it measures lands in $OUT/<mode>.tgz (logs, JSON, check output, the engine log).
set -u
# The lent machine kills a call at 600 s without a signal the trap could catch: every step's
# timeout is cut to what is left of BUDGET seconds, so the pack below always runs.
DEADLINE=$(( $(date +%s) + ${BUDGET:-550} ))
tmo() { local left=$(( DEADLINE - $(date +%s) - 25 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
MODE=$1; O=/tmp/ev-$MODE; rm -rf "$O"; mkdir -p "$O"; M=/tmp/models
# Whatever happens (a step past the call's limit included), what was measured so far comes back.
pack() { mkdir -p "${OUT:-/tmp/out}"; cp generated/native/engine.log "$O/engine.log" 2>/dev/null
         tar -C /tmp -czf "${OUT:-/tmp/out}/$MODE.tgz" "ev-$MODE"; }
trap pack EXIT TERM
INV="python3 -m invoke"
t0=$(date +%s.%N); el() { python3 -c "print(round($(date +%s.%N)-$t0,1))"; }
step() { echo "=== +$(el)s $*" | tee -a "$O/steps.log"; }
vbench() {  # served-name tokenizer-dir input output prompts concurrency file
  step "vllm bench serve c=$6"
  timeout $(tmo 200) python3 -m vllm.entrypoints.cli.main bench serve --backend openai-chat \
    --base-url http://127.0.0.1:8180 --endpoint /v1/chat/completions --model "$1" --tokenizer "$M/$2" \
    --dataset-name random --random-input-len "$3" --random-output-len "$4" --num-prompts "$5" \
    --max-concurrency "$6" --ignore-eos --temperature 0 --save-result --result-dir "$O" \
    --result-filename "$7" > "$O/${7%.json}.txt" 2>&1; echo "rc=$?" >> "$O/steps.log"
}
common_env() {
  cat > .env <<E
RUNTIME=native
VLLM_PORT=8180
VLLM_VERSION=0.31.0
VLLM_REF=v0.31.0
NATIVE_ENGINE_VERSION=0.27.1
NATIVE_ENGINE_COMMAND=python3 -m vllm.entrypoints.cli.main
MODELS_DIR=$M
ATTENTION_BACKEND=TRITON_ATTN
E
}
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv > "$O/nvidia-smi.csv" 2>&1
common_env
case $MODE in
small)
  cat >> .env <<E
PLATFORM=nvidia
MODEL_PROFILE=qwen3-0.6b
VLLM_MODEL=$M/qwen3-0.6b-dummy
VLLM_TOKENIZER=$M/qwen3-0.6b-dummy
VLLM_EXTRA_ARGS=--load-format dummy
E
  NAME=qwen3-0.6b; TOK=qwen3-0.6b-dummy; TG=128; PROMPTS8=48 ;;
big)
  cat >> .env <<E
PLATFORM=2xnvidia
MODEL_PROFILE=qwen3.6-27b
VLLM_MODEL=$M/qwen3.6-27b-dummy
VLLM_TOKENIZER=$M/qwen3.6-27b-dummy
VLLM_EXTRA_ARGS=--load-format dummy --gdn-prefill-backend triton
VLLM_LIMIT_MM_PER_PROMPT=
VLLM_MAX_MODEL_LEN=32768
VLLM_MAX_NUM_SEQS=3
E
  # CUDA graphs on: eager mode made every request take ~40 s (the first attempt timed out).
  NAME=qwen3.6-27b; TOK=qwen3.6-27b-dummy; TG=128; PROMPTS8=16 ;;
esac
cp .env "$O/dotenv.txt"
step check; timeout $(tmo 90) $INV check -v > "$O/check.txt" 2>&1; echo "rc=$?" >> "$O/steps.log"
step up; timeout $(tmo 420) $INV up --no-dashboard --timeout $(tmo 400) > "$O/up.txt" 2>&1; rc=$?; echo "rc=$rc" >> "$O/steps.log"
cp generated/native/engine.log "$O/engine.log" 2>/dev/null
if [ $rc -eq 0 ]; then
  curl -s 127.0.0.1:8180/metrics > "$O/metrics-idle.txt"
  step "bench c=1"; timeout $(tmo 200) $INV bench --pp 2048 --tg $TG --runs 3 --json > "$O/bench_c1.json" 2> "$O/bench_c1.err"; echo "rc=$?" >> "$O/steps.log"
  vbench $NAME $TOK 2048 $TG 4 1 vllm_c1.json
  step "bench-conc c=1,8"; timeout $(tmo 200) $INV bench-conc --concurrency 1 --concurrency 8 --pp 2048 --tg $TG --duration 20 --json > "$O/conc.json" 2> "$O/conc.err"; echo "rc=$?" >> "$O/steps.log"
  vbench $NAME $TOK 2048 $TG $PROMPTS8 8 vllm_c8.json
  step "probe prefix-cache"; timeout $(tmo 120) $INV probe prefix-cache > "$O/probe-prefix.txt" 2>&1; echo "rc=$?" >> "$O/steps.log"
  curl -s 127.0.0.1:8180/metrics > "$O/metrics-after.txt"
fi
step down; DEADLINE=$(( DEADLINE + 20 )); timeout $(tmo 60) $INV down > "$O/down.txt" 2>&1; echo "rc=$?" >> "$O/steps.log"
nvidia-smi --query-gpu=index,memory.used --format=csv >> "$O/down.txt" 2>&1
step end

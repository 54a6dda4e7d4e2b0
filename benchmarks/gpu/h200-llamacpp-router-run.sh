#!/usr/bin/env bash
# The llama.cpp and router evidence run on the lent H200 machine (see ../shared/gpu/README.md): the stack's
# own commands (native runtime) with real vLLM 0.27.1 and llama.cpp b9993 built for CUDA from the
# pinned sdist (carried in .cache/sdist: the machine has no network). From the carried tree root,
# after device.sh stage p1/p2:
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-llamacpp-router-run.sh router
#   then (next call):  source .gpu/p3/tools/device.sh setup && bash .../h200-llamacpp-router-run.sh vs
# router: start the llama-server CUDA build (background, niced), make one random-weight
#         Qwen3-0.6B-geometry checkpoint and convert it to GGUF (bf16: the same weights); meanwhile
#         `invoke router` over two vLLM profiles (a load, a swap, a stream, the lifecycle API),
#         then `burn` over two (one starved of KV memory: its FAIL row).
# vs:     wait for the build, `invoke gpu-check`, `invoke bench-vs` vLLM vs llama.cpp.
# Everything measured lands in $OUT/<mode>.tgz, also when a step runs past the call's limit.
set -u
MODE=$1; O=/tmp/ev-$MODE; rm -rf "$O"; mkdir -p "$O"; M=/tmp/models
pack() { mkdir -p "${OUT:-/tmp/out}"; cp generated/native/engine.log "$O/engine.log" 2>/dev/null
         cp benchmarks/bench-vs-results.md benchmarks/burn-latest.md "$O/" 2>/dev/null
         tar -C /tmp -czf "${OUT:-/tmp/out}/$MODE.tgz" "ev-$MODE"; }
trap pack EXIT TERM
INV="python3 -m invoke"
t0=$(date +%s.%N); el() { python3 -c "print(round($(date +%s.%N)-$t0,1))"; }
step() { echo "=== +$(el)s $*" | tee -a "$O/steps.log"; }
rc() { echo "rc=$?" >> "$O/steps.log"; }
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
E
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv > "$O/nvidia-smi.csv" 2>&1
case $MODE in
router)
  step "install-engine --engine llamacpp --backend cuda (background)"
  # From a copy of the tree: install-engine holds this checkout's stack lock, which the router's
  # loads need meanwhile. vs mode points LLAMACPP_SERVER at the result.
  rm -rf /tmp/bt && mkdir /tmp/bt && cp -a . /tmp/bt/ && rm -rf /tmp/bt/generated
  (cd /tmp/bt && nohup setsid nice -n 10 $INV install-engine --engine llamacpp --backend cuda --cuda-arch 90 > /tmp/install-llamacpp.txt 2>&1 &)
  step "random checkpoint"; timeout 120 python3 benchmarks/gpu/make_random_checkpoint.py $M/qwen3-0.6b-dummy $M/qwen3-0.6b-rand > "$O/checkpoint.txt" 2>&1; rc
  step "gguf-convert"; timeout 180 $INV gguf-convert $M/qwen3-0.6b-rand --outtype bf16 --out $M/qwen3-0.6b-rand-bf16.gguf --pre-tokenizer gpt-2 > "$O/convert.txt" 2>&1; rc
  # Two vLLM profiles on the dummy 0.6B geometry; eager mode keeps each boot short.
  sed 's/^VLLM_SERVED_NAME=.*/VLLM_SERVED_NAME=qwen3-0.6b-b/' env/models/qwen3-0.6b.env > env/models/qwen3-0.6b-b.env
  # For burn's FAIL row: a KV cache that cannot fit, diagnosed from vLLM's own error.
  sed 's/^VLLM_SERVED_NAME=.*/VLLM_SERVED_NAME=qwen3-0.6b-starved/' env/models/qwen3-0.6b.env > env/models/qwen3-0.6b-starved.env
  echo "VLLM_GPU_MEM_UTIL=0.005" >> env/models/qwen3-0.6b-starved.env
  cat >> .env <<E
VLLM_MODEL=$M/qwen3-0.6b-dummy
VLLM_TOKENIZER=$M/qwen3-0.6b-dummy
VLLM_EXTRA_ARGS=--load-format dummy
VLLM_ENFORCE_EAGER=1
E
  cp .env "$O/dotenv.txt"
  step "router start"; $INV router --port 8090 --profiles qwen3-0.6b,qwen3-0.6b-b > "$O/router.txt" 2>&1 &
  R=$!; sleep 5
  curl -s 127.0.0.1:8090/v1/models > "$O/models-before.json"
  for name in qwen3-0.6b qwen3-0.6b-b; do
    step "request $name"
    curl -s -o "$O/chat-$name.json" -w "%{http_code} %{time_starttransfer} %{time_total}\n" 127.0.0.1:8090/v1/chat/completions \
      -H 'content-type: application/json' -d "{\"model\":\"$name\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":64}" >> "$O/requests.txt"
    curl -s 127.0.0.1:8090/v1/health >> "$O/health.txt"; echo >> "$O/health.txt"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader >> "$O/gpu-procs.txt"; echo "--" >> "$O/gpu-procs.txt"
  done
  step "stream through the router"; curl -sN 127.0.0.1:8090/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"qwen3-0.6b-b","stream":true,"messages":[{"role":"user","content":"hi"}],"max_tokens":32}' | head -c 2000 > "$O/stream.txt"
  curl -s 127.0.0.1:8090/v1/models > "$O/models-after.json"
  cp generated/router.json "$O/" 2>/dev/null; cp -r generated/router "$O/router-dir" 2>/dev/null
  step "router stop"; kill -TERM $R; wait $R; echo "router rc=$?" >> "$O/steps.log"
  ps aux | grep -E "vllm|llama-server" | grep -v grep > "$O/ps-after-stop.txt"
  nvidia-smi --query-gpu=memory.used --format=csv >> "$O/ps-after-stop.txt"
  step "burn"; timeout 330 $INV burn --profiles qwen3-0.6b,qwen3-0.6b-starved --runs 3 --warmup 1 --max-tokens 200 > "$O/burn.txt" 2>&1; rc ;;
vs)
  cat >> .env <<E
VLLM_MODEL=$M/qwen3-0.6b-rand
VLLM_TOKENIZER=$M/qwen3-0.6b-rand
LLAMACPP_MODEL=$M/qwen3-0.6b-rand-bf16.gguf
LLAMACPP_CTX=16384
LLAMACPP_PARALLEL=4
LLAMACPP_GPU_LAYERS=all
LLAMACPP_SERVER=/tmp/bt/.cache/engines/llamacpp-9993-cuda/bin/llama-server
E
  cp .env "$O/dotenv.txt"
  step "wait for the llama.cpp build"
  while pgrep -f "install-engine --engine llamacpp" > /dev/null; do sleep 5; done
  cp /tmp/install-llamacpp.txt "$O/"; tail -3 /tmp/install-llamacpp.txt >> "$O/steps.log"
  step "gpu-check"; timeout 60 $INV gpu-check --python python3 > "$O/gpu-check.txt" 2>&1; rc
  timeout 60 $INV gpu-check --model qwen3-0.6b-gguf > "$O/gpu-check-llamacpp.txt" 2>&1; rc
  step "check both"; timeout 60 $INV check --model qwen3-0.6b > "$O/check-vllm.txt" 2>&1; rc
  timeout 60 $INV check --model qwen3-0.6b-gguf > "$O/check-llamacpp.txt" 2>&1; rc
  step "bench-vs"; timeout 480 $INV bench-vs -t vllm:qwen3-0.6b -t llamacpp:qwen3-0.6b-gguf --ctx 8000 --concurrency 4 > "$O/bench-vs.txt" 2>&1; rc
  cp generated/native/engine.log.1 "$O/engine-prev.log" 2>/dev/null ;;
esac
step end

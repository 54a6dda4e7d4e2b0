#!/usr/bin/env bash
# Device run for issue 12 items 1, 2, 10, 12: real flashinfer failure, progress lines, native
# dashboard, nvidia-smi detection. From the carried tree root, after device.sh stage p1/p2.
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
source .gpu/p3/tools/device.sh setup > $O/setup.log 2>&1 || { echo setup failed; tail $O/setup.log; exit 1; }
t0=$(date +%s.%N); el() { python3 -c "print(round($(date +%s.%N)-$t0,1))"; }
nvidia-smi --query-gpu=index,name,memory.total,memory.reserved --format=csv,noheader,nounits > $O/nvidia-smi-detect.csv 2>&1
nvidia-smi --query-gpu=index,name,memory.total,memory.reserved,memory.used,memory.free --format=csv > $O/nvidia-smi-full.csv 2>&1
nvidia-smi --query-gpu=index,memory.total,memory.used --format=csv,noheader,nounits > $O/nvidia-smi-probe.csv 2>&1
nvidia-smi -L > $O/nvidia-smi-L.txt 2>&1
python3 -c "
import torch
for i in range(torch.cuda.device_count()):
    f, t = torch.cuda.mem_get_info(i); print(i, repr(torch.cuda.get_device_name(i)), f, t, round(t/2**30, 3))
" > $O/torch-mem.txt 2>&1
cat > .env <<E
PLATFORM=2xnvidia
RUNTIME=native
MODEL_PROFILE=qwen3.6-27b
VLLM_PORT=8180
VLLM_VERSION=0.31.0
VLLM_REF=v0.31.0
NATIVE_ENGINE_VERSION=0.27.1
NATIVE_ENGINE_COMMAND=python3 -m vllm.entrypoints.cli.main
MODELS_DIR=/tmp/models
VLLM_MODEL=/tmp/models/qwen3.6-27b-dummy
VLLM_TOKENIZER=/tmp/models/qwen3.6-27b-dummy
VLLM_EXTRA_ARGS=--load-format dummy
ATTENTION_BACKEND=TRITON_ATTN
VLLM_LIMIT_MM_PER_PROMPT=
VLLM_ENFORCE_EAGER=1
VLLM_MAX_MODEL_LEN=32768
E
echo "=== +$(el)s check" > $O/stack.log; timeout 60 python3 -m invoke check >> $O/stack.log 2>&1; echo rc=$? >> $O/stack.log
echo "=== +$(el)s up (no gdn flag)" >> $O/stack.log; timeout 300 python3 -m invoke up --timeout 280 >> $O/stack.log 2>&1; echo rc=$? >> $O/stack.log
cp generated/native/engine.log $O/engine-flashinfer.log 2>/dev/null
sed -i 's/^VLLM_EXTRA_ARGS=.*/VLLM_EXTRA_ARGS=--load-format dummy --gdn-prefill-backend triton/' .env
echo "=== +$(el)s up (triton gdn)" >> $O/stack.log; timeout 280 python3 -m invoke up --timeout 260 >> $O/stack.log 2>&1; echo rc=$? >> $O/stack.log
echo "=== +$(el)s status" >> $O/stack.log; timeout 30 python3 -m invoke status >> $O/stack.log 2>&1
curl -s -m 5 127.0.0.1:8083/api/health >> $O/stack.log; echo >> $O/stack.log
echo "=== +$(el)s up again" >> $O/stack.log; timeout 60 python3 -m invoke up >> $O/stack.log 2>&1; echo rc=$? >> $O/stack.log
echo "=== +$(el)s down" >> $O/stack.log; timeout 120 python3 -m invoke down >> $O/stack.log 2>&1; echo rc=$? >> $O/stack.log
ps aux | grep -c "[v]llmstack.dashboard" >> $O/stack.log
cp generated/native/engine.log $O/engine-ok.log 2>/dev/null; cp generated/native/dashboard.log* $O/ 2>/dev/null
echo "=== +$(el)s end" >> $O/stack.log

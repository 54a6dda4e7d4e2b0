#!/usr/bin/env bash
# Issue 25 on the lent H200 (see ../shared/gpu/README.md): `invoke calibrate-kv` at GPU speed.
#  1. `invoke make-model --trained` there (the training runs on the GPU: seconds per hundred
#     steps, where the 2-core CPU needs minutes), then `invoke calibrate-kv --gate` on it: fp8 KV
#     against bf16 KV in vLLM 0.27.1, perplexity, needle recall by depth, the scales vLLM used.
#  2. The Qwen3-8B geometry (qwen3-8b-dummy, 36 layers): random bf16 weights written on the GPU
#     (calibration runs the checkpoint through transformers, so it needs weight files, not
#     --load-format dummy), calibrated, and the calibrated copy served once with fp8 KV to see vLLM
#     load and report the scales. Random weights make its perplexity and recall meaningless: only
#     the scale gate and the loading count.
# From the carried tree root, after device.sh stage p1/p2 and with .gpu/p3 carrying the models
# (make_dummy_models.py), one 10-minute call:
#   source .gpu/p3/tools/device.sh setup && bash benchmarks/gpu/h200-kv-calibration-run.sh
# What it measured is packed into $OUT/kv.tgz.
set -u
DEADLINE=$(( $(date +%s) + ${BUDGET:-540} ))
tmo() { local left=$(( DEADLINE - $(date +%s) - 15 )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
O=/tmp/ev-kv; rm -rf "$O"; mkdir -p "$O"; M=/tmp/models
pack() { mkdir -p "${OUT:-/tmp/out}"
         for f in "$M"/calibrated/*/vllmstack-kv-calibration.json; do
           [ -f "$f" ] && cp "$f" "$O/$(basename "$(dirname "$f")").sidecar.json"; done
         tar -C /tmp -czf "${OUT:-/tmp/out}/kv.tgz" ev-kv; }
trap pack EXIT TERM
INV="python3 -m invoke"
t0=$(date +%s.%N); el() { python3 -c "print(round($(date +%s.%N)-$t0,1))"; }
step() { echo "=== +$(el)s $*" | tee -a "$O/steps.log"; }
cat > .env <<E
RUNTIME=native
PLATFORM=nvidia
GPU_DEVICE_NAME=NVIDIA_H200
VLLM_VERSION=0.31.0
NATIVE_ENGINE_VERSION=0.27.1
NATIVE_ENGINE_COMMAND=python3 -m vllm.entrypoints.cli.main
MODELS_DIR=$M
HF_CACHE_DIR=/tmp/hf
ATTENTION_BACKEND=TRITON_ATTN
E
cp .env "$O/dotenv.txt"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv > "$O/nvidia-smi.csv" 2>&1

step "make-model --trained (tiny, on the GPU)"
timeout $(tmo 200) $INV make-model --trained --minutes 2.5 --json > "$O/trained.json" 2> "$O/trained.err"
echo "rc=$?" | tee -a "$O/steps.log"; tail -4 "$O/trained.err"; head -c 600 "$O/trained.json"; echo
step "calibrate-kv --gate (tiny trained)"
timeout $(tmo 200) $INV calibrate-kv --model tiny --platform nvidia --gate \
  --set VLLM_MODEL=vllmstack/tiny-qwen3-trained --set ATTENTION_BACKEND=TRITON_ATTN \
  > "$O/gate-tiny.txt" 2>&1
echo "rc=$?" | tee -a "$O/steps.log"; grep -v "WARNING\|^INFO\|^\[" "$O/gate-tiny.txt" | tail -12

step "random Qwen3-8B checkpoint"
timeout $(tmo 150) python3 - "$M/qwen3-8b-dummy" "$M/qwen3-8b-random" > "$O/random-8b.txt" 2>&1 <<'PY'
import shutil, sys, time
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, out = Path(sys.argv[1]), Path(sys.argv[2])
started = time.monotonic()
torch.manual_seed(0)
with torch.device("cuda"):  # initializing 8 B parameters on 16 CPU cores takes minutes
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    if (src / name).exists():
        shutil.copy(src / name, out / name)
print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters "
      f"in {time.monotonic() - started:.0f} s")
PY
echo "rc=$?" | tee -a "$O/steps.log"; tail -2 "$O/random-8b.txt"
step "calibrate-kv (8B geometry: scale gate)"
timeout $(tmo 150) $INV calibrate-kv --model tiny --platform nvidia --tokens 16384 \
  --set VLLM_MODEL=$M/qwen3-8b-random > "$O/calibrate-8b.txt" 2>&1
echo "rc=$?" | tee -a "$O/steps.log"; grep -v "WARNING\|^INFO\|^\[" "$O/calibrate-8b.txt" | head -4
C8=$M/calibrated/qwen3-8b-random-kv-fp8
step "vLLM serves the calibrated 8B with fp8 KV and reports its scales"
python3 -c "from vllmstack.workload.corpus import split_corpus as s; from vllmstack.tune.kv_copy import DEFAULT_CORPUS as c; open('/tmp/heldout.txt','w').write(s(c.read_text())[1])"
timeout $(tmo 200) python3 -m vllmstack.models.kv_quality_runner "$C8" /tmp/heldout.txt "$O/fp8-8b.json" \
  --kv-cache-dtype fp8 --ppl-tokens 256 --context 512 --trials 1 --attention-backend TRITON_ATTN \
  > "$O/fp8-8b.txt" 2>&1
echo "rc=$?" | tee -a "$O/steps.log"; tail -3 "$O/fp8-8b.txt"
python3 - "$C8" "$O/fp8-8b.json" <<'PY' 2>&1 | tee -a "$O/steps.log"
import json, math, sys
from pathlib import Path
scales = json.loads((Path(sys.argv[1]) / "vllmstack-kv-calibration.json").read_text())["scales"]
used = json.loads(Path(sys.argv[2]).read_text())["scales"]
same = [layer for layer, pair in scales.items() if math.isclose(used.get(layer + ".attn", [0, 0])[0], pair["k_scale"], rel_tol=1e-3)
        and math.isclose(used.get(layer + ".attn", [0, 0])[1], pair["v_scale"], rel_tol=1e-3)]
print(f"8B: {len(scales)} calibrated layers, vLLM reports {len(used)}; the same k and v scales in {len(same)}")
PY
step "done"

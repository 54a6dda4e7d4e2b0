#!/usr/bin/env bash
# vLLM's CPU target compiled outside Docker, to time the compile step on a machine where the image
# build cannot run: the 16-core GPU machine reaches no package index, so it gets no base image,
# apt or pip there. This step is the same as Dockerfile.fullbuild's vllm-build for the cpu target:
# the pinned sdist, patches/vllm/ applied by scripts/apply-patches.py, oneDNN from the pinned
# commit (FETCHCONTENT_SOURCE_DIR_ONEDNN, CMake disconnected), ccache, VLLM_TARGET_DEVICE=cpu.
#
# It needs there: a Python with torch 2.13 (any build: only its headers and libraries are
# used), gcc/g++ >= 12.3, cmake >= 3.26, ninja, ccache, git, and in the working tree
# .cache/build-inputs/vllm-0.31.0.tar.gz and upstream/onednn (a mirror of the pinned commit).
# Prints three times: cold (ccache empty), no change (same tree again), and one Python-only patch.
#
#   bash benchmarks/cpu_source_build_native.sh [MAX_JOBS]     # default: every core
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.31.0
SDIST_SHA256=dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380  # sources.VLLM_SDIST_SHA256
ONEDNN_REF=0e2a5bfeef1bfbffc3137464606540233086ce9b  # the schema's ONEDNN_REF
JOBS=${1:-$(nproc)}
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/cpu-source-build.XXXXXX)
export CCACHE_DIR=$WORK/ccache

need() { command -v "$1" > /dev/null || { echo "missing: $1" >&2; exit 1; }; }
for tool in gcc g++ cmake ninja ccache git "$PY"; do need "$tool"; done
"$PY" -c "import torch, sys; print('torch', torch.__version__); sys.exit(not torch.__version__.startswith('2.13'))"
g++ -dumpfullversion | awk -F. '{ if ($1 < 12 || ($1 == 12 && $2 < 3)) { print "g++ " $0 " < 12.3"; exit 1 } }'
echo "${SDIST_SHA256}  .cache/build-inputs/vllm-${VERSION}.tar.gz" | sha256sum -c -

# The source as the image build makes it: the sdist, one commit, the patch series applied.
mkdir -p "$WORK/vllm"
tar -xzf ".cache/build-inputs/vllm-${VERSION}.tar.gz" -C "$WORK/vllm" --strip-components=1
git -C "$WORK/vllm" init -q && git -C "$WORK/vllm" add -A -f \
  && git -C "$WORK/vllm" -c user.name=sdist -c user.email=sdist@localhost commit -qm "vllm ${VERSION} (sdist)" \
  && git -C "$WORK/vllm" tag "v${VERSION}"
"$PY" scripts/apply-patches.py apply --source "$WORK/vllm" --patches patches/vllm
git init -q "$WORK/onednn" && git -C "$WORK/onednn" fetch -q --depth=1 "$PWD/upstream/onednn" "$ONEDNN_REF" \
  && git -C "$WORK/onednn" checkout -q --detach FETCH_HEAD

build() {  # one `setup.py bdist_wheel` as vllm-build runs it; prints its seconds and ccache's counts
  rm -rf "$WORK/vllm/build" "$WORK/wheels"
  ccache --zero-stats > /dev/null
  local start=$SECONDS
  (cd "$WORK/vllm" && "$PY" tools/use_existing_torch.py --prefix > /dev/null \
    && VLLM_TARGET_DEVICE=cpu MAX_JOBS=$JOBS CMAKE_ARGS=-DFETCHCONTENT_FULLY_DISCONNECTED=ON \
       FETCHCONTENT_SOURCE_DIR_ONEDNN="$WORK/onednn" VLLM_VERSION_OVERRIDE="${VERSION}+cpu" \
       "$PY" setup.py bdist_wheel --dist-dir="$WORK/wheels" > "$WORK/$1.log" 2>&1)
  echo "$1: $((SECONDS - start)) s, MAX_JOBS=$JOBS, ccache $(ccache --print-stats | awk -F'\t' '$1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" {h += $2} $1 == "cache_miss" {m = $2} END {print h " hits, " m " misses"}')"
}
build cold
build no-change
# One Python-only patch: a comment in the OpenAI chat protocol module (what the test patch touches).
echo "# one-patch rebuild" >> "$WORK/vllm/vllm/entrypoints/openai/chat_completion/protocol.py"
build one-python-patch
ls -l "$WORK/wheels"
echo "work folder (delete it when done): $WORK"

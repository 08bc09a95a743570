#!/usr/bin/env bash
# One device-machine call: every op's canary for every runnable backend on cuda:0, with
# cold Triton and TileLang caches, then again warm (bench_verify.py); results in $OUT.
# Carry .whl-indexer (tilelang 0.1.12, apache-tvm-ffi 0.1.11, z3-solver,
# torch-c-dlpack-ext, sgl-deep-gemm) and .whl-fm (sgl-flash-mla 1.0.0) so that their
# backends are candidates; a library that does not load there is reported by its canary.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/log.txt"
SITE=$(mktemp -d)
whls=$(ls .whl-indexer/*.whl .whl-fm/*.whl 2>/dev/null)
if [ -n "$whls" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
     --target "$SITE" $whls; then
  export PYTHONPATH=$SITE:$PWD
else
  export PYTHONPATH=$PWD
fi
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" | tee -a "$LOG"; timeout "$t" "$@" 2>&1 | tee -a "$LOG" | tail -${TAIL:-40}; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
step 30 python3 -m capdispatch explain --device cuda:0
TAIL=60 step 540 python3 benchmarks/bench_verify.py --device cuda:0 --out "$OUT" ${COLD:+--cold "$COLD"} ${JOBS:+--jobs "$JOBS"}

#!/usr/bin/env bash
# One device-machine call for the model ops: GPU tests, then the MoE, attention and
# indexer benchmarks, each under its own time limit. Carry .whl-indexer (tilelang
# 0.1.12, apache-tvm-ffi 0.1.11, sgl-deep-gemm 0.2.3.post2) for the indexer's
# TileLang and DeepGEMM backends.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/log.txt"
if ls .whl-indexer/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
     --no-cache-dir --upgrade --target /tmp/site .whl-indexer/*.whl; then
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" | tee -a "$LOG"; timeout "$t" "$@" 2>&1 | tee -a "$LOG" | tail -${TAIL:-25}; }
TAIL=30 step 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_moe.py tests/test_sparse_prefill.py \
  tests/test_decode_mla.py tests/test_indexer.py tests/test_gpu_probe.py
step 100 python3 benchmarks/bench_moe.py --backends triton_w4a16 torch --out "$OUT"
step 130 python3 benchmarks/bench_attention.py --out "$OUT"
step 110 python3 benchmarks/bench_indexer.py --out "$OUT"

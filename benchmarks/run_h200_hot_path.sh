#!/usr/bin/env bash
# One device-machine call for the hot path (issue 14): the custom-op GPU matrix (eager,
# CUDA graph, compile fullgraph, reduce-overhead) for every backend that runs on the
# card, then bench_overhead.py. Carry .whl-fm (sgl-flash-mla) / .whl-indexer as for
# run_h200_flashmla.sh / run_h200_ops.sh to include those backends.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/log.txt"
export PYTHONPATH=$PWD
for d in .whl-fm .whl-indexer; do
  if ls "$d"/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
       --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl; then
    export PYTHONPATH=/tmp/site:$PWD
  fi
done
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" | tee -a "$LOG"; timeout "$t" "$@" 2>&1 | tee -a "$LOG" | tail -${TAIL:-25}; }
TAIL=40 step 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_custom_ops.py
step 150 python3 benchmarks/bench_overhead.py --device cuda:0 --out "$OUT"

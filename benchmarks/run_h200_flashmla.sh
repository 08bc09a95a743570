#!/usr/bin/env bash
# One device-machine call: FlashMLA (sgl-flash-mla 1.0.0) beside the Triton attention
# kernels -- the GPU tests of sparse_prefill, decode_mla and the SGLang route wrappers,
# then the attention benchmark with CUDA-graph timings (small decode batches are
# launch-bound in eager mode, which is how SGLang never runs them).
# Extra arguments go to bench_attention.py (e.g. --tune: time the Triton launch configurations).
# Before the call, here:  pip download --no-deps sgl-flash-mla==1.0.0 -d .whl-fm
# and carry .whl-fm (9.9 MB; it loads against the device's torch 2.11 despite its
# torch>=2.14.1 metadata).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl-fm/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
     --no-cache-dir --target /tmp/fm .whl-fm/*.whl; then
  export PYTHONPATH=/tmp/fm:$PWD
else
  export PYTHONPATH=$PWD
fi
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_sparse_prefill.py \
  tests/test_decode_mla.py tests/test_routes_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -8
LIMIT=240; case " $* " in *" --tune "*) LIMIT=480;; esac     # --tune times 15 configurations per shape (with --quick: 4 shapes)
timeout $LIMIT python3 benchmarks/bench_attention.py --graphs "$@" --out "$OUT" 2>&1 | tee "$OUT/bench_attention.txt" | tail -40

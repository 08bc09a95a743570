#!/usr/bin/env bash
# One device-machine call: every gpu-marked test (pytest-xdist across the card: the
# tests check values, not times), then the timed steps named as arguments:
#   verify    bench_verify.py (every canary, cold then warm JIT caches; issue 12)
#   overhead  bench_overhead.py (custom-op call overhead, eager and CUDA graph; issue 14)
#   route     bench_sglang_moe_route.py (SGLang's FusedMoE routed per rank; issue 11)
#   probe     every module SGLang's MoE import chain lacks here (probe_imports.py)
#   kernels   the kernel benchmarks (bench_attention.py --graphs, bench_moe.py, bench_indexer.py,
#             bench_kv_cache.py), each run twice: with this card's own launch tables, then with
#             --tiles 99kb (the entries and shared-memory limit of SM86/SM89/SM120)
#   kernels-99kb  only the --tiles 99kb pass of the kernels step
# Wheel folders carried with the call (.whl-indexer, .whl-fm, .whl-sg) are installed into
# one site folder, once per machine; TESTS narrows the test selection (default: tests/);
# VERIFY_ARGS, OVERHEAD_ARGS, ROUTE_ARGS, ATTENTION_ARGS, MOE_ARGS, INDEXER_ARGS and KV_ARGS go
# to the benchmarks, *_LIMIT bound each step (each pass of the kernels step).
# tests/test_sglang_call_sites_gpu.py needs SGLang and sgl-flash-mla installed in the same run
# (it compares the routed call sites with SGLang's own FlashMLA); without either it skips.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/log.txt"
SITE=/tmp/site; mkdir -p $SITE
for d in .whl-indexer .whl-fm .whl-sg; do
  ls $d/*.whl >/dev/null 2>&1 || continue
  [ -f $SITE/.installed$d ] && continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $SITE $d/*.whl 2>&1 | grep -v "Target directory" | tail -3
  [ -d $d/extra ] && cp -r $d/extra/* $SITE/
  touch $SITE/.installed$d
done
# capdispatch itself, so that its SGLang plugin (an entry point) is registered.
[ -f $SITE/.installed-capdispatch ] || { python3 -m pip install -q --no-deps --no-build-isolation --no-index \
  --no-cache-dir --upgrade --target $SITE . 2>&1 | grep -v "Target directory" | tail -3; touch $SITE/.installed-capdispatch; }
export PYTHONPATH=$SITE:$PWD
step() { local t=$1; shift; echo "=== $* (limit ${t}s) $(date -u +%T)" | tee -a "$LOG"; timeout "$t" "$@" 2>&1 | tee -a "$LOG" | tail -${TAIL:-30}; }
# One pass of the kernel benchmarks; $1: the --tiles value (card or 99kb).
kernel_pass() {
  step ${ATTENTION_LIMIT:-400} python3 benchmarks/bench_attention.py --graphs --tiles "$1" --out "$OUT" ${ATTENTION_ARGS:-}
  step ${MOE_LIMIT:-200} python3 benchmarks/bench_moe.py --tiles "$1" --out "$OUT" ${MOE_ARGS:-}
  step ${INDEXER_LIMIT:-200} python3 benchmarks/bench_indexer.py --tiles "$1" --out "$OUT" ${INDEXER_ARGS:-}
  step ${KV_LIMIT:-120} python3 benchmarks/bench_kv_cache.py --tiles "$1" --out "$OUT" ${KV_ARGS:-}
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
step 60 python3 -m capdispatch explain --device cuda:0 --brief
TAIL=${TEST_TAIL:-60} step ${TEST_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs \
  -n ${JOBS:-8} --timeout 240 ${TESTS:-tests/}
for s in "$@"; do
  case $s in
    verify)   step ${VERIFY_LIMIT:-200} python3 benchmarks/bench_verify.py --device cuda:0 --out "$OUT" ${VERIFY_ARGS:-} ;;
    overhead) step ${OVERHEAD_LIMIT:-120} python3 benchmarks/bench_overhead.py --device cuda:0 --out "$OUT" ${OVERHEAD_ARGS:-} ;;
    route)    step ${ROUTE_LIMIT:-150} python3 benchmarks/bench_sglang_moe_route.py --out "$OUT" ${ROUTE_ARGS:-} ;;
    probe)    step 60 python3 benchmarks/probe_imports.py sglang.srt.layers.moe.fused_moe_triton.layer \
                sglang.srt.layers.quantization.fp8 sglang.srt.server_args ;;
    kernels)  kernel_pass card; kernel_pass 99kb ;;
    kernels-99kb) kernel_pass 99kb ;;
    *) echo "unknown step $s" ;;
  esac
done

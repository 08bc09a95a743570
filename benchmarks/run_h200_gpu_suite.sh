#!/usr/bin/env bash
# One device-machine call: every gpu-marked test (pytest-xdist across the card: the
# tests check values, not times), then the timed steps named as arguments (the step
# `tests` puts the tests at its place in the list instead):
#   verify    bench_verify.py (every canary, cold then warm JIT caches; issue 12)
#   overhead  bench_overhead.py (custom-op call overhead, eager and CUDA graph; issue 14)
#   route     bench_sglang_moe_route.py (SGLang's FusedMoE routed per rank; issue 11)
#   probe     every module SGLang's MoE import chain lacks here (probe_imports.py)
#   calibrate `dispatch bench --write-policy` op by op (CALIBRATE_OPS; issue 14), policy into $OUT
#   measure   `dispatch bench --check` of that policy and the default, on fresh inputs (the regret check)
#   kernels   the kernel benchmarks (bench_attention.py, bench_moe.py, bench_indexer.py with --graphs,
#             bench_kv_cache.py), each run twice: with this card's own launch tables, then with
#             --tiles 99kb (the entries and shared-memory limit of SM86/SM89/SM120)
#   kernels-99kb  only the --tiles 99kb pass of the kernels step
# The packed site folders (.site/*.tar.xz, from pack_site_bundle.sh) or the wheel folders
# carried with the call (.whl-indexer, .whl-z3, .whl-fm, .whl-sg) are installed into one
# site folder, once per machine; TESTS narrows the test selection (default: tests/);
# VERIFY_ARGS, OVERHEAD_ARGS, ROUTE_ARGS, CALIBRATE_ARGS, MEASURE_ARGS, ATTENTION_ARGS,
# MOE_ARGS, INDEXER_ARGS and KV_ARGS go to the benchmarks, *_LIMIT bound each step (each
# pass of the kernels step).
# tests/test_sglang_call_sites_gpu.py needs SGLang and sgl-flash-mla installed in the same run
# (it compares the routed call sites with SGLang's own FlashMLA); without either it skips.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/log.txt"
SITE=/tmp/site; mkdir -p $SITE
for b in .site/*.tar.xz; do
  [ -f "$b" ] || continue
  m=$SITE/.installed-$(basename "$b" .tar.xz)
  [ -f "$m" ] || { tar -xJf "$b" -C $SITE && touch "$m"; }
done
for d in .whl-indexer .whl-z3 .whl-fm .whl-sg; do
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
# The tree first: a later call's working tree wins over the copy installed for its entry point.
export PYTHONPATH=$PWD:$SITE
step() { local t=$1; shift; echo "=== $* (limit ${t}s) $(date -u +%T)" | tee -a "$LOG"; timeout "$t" "$@" 2>&1 | tee -a "$LOG" | tail -${TAIL:-30}; }
# One pass of the kernel benchmarks; $1: the --tiles value (card or 99kb).
kernel_pass() {
  step ${ATTENTION_LIMIT:-400} python3 benchmarks/bench_attention.py --graphs --tiles "$1" --out "$OUT" ${ATTENTION_ARGS:-}
  step ${MOE_LIMIT:-200} python3 benchmarks/bench_moe.py --graphs --tiles "$1" --out "$OUT" ${MOE_ARGS:-}
  step ${INDEXER_LIMIT:-200} python3 benchmarks/bench_indexer.py --graphs --tiles "$1" --out "$OUT" ${INDEXER_ARGS:-}
  step ${KV_LIMIT:-120} python3 benchmarks/bench_kv_cache.py --tiles "$1" --out "$OUT" ${KV_ARGS:-}
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
step 60 python3 -m capdispatch explain --device cuda:0 --brief
run_tests() { TAIL=${TEST_TAIL:-60} step ${TEST_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs \
  -n ${JOBS:-8} --timeout ${TEST_TIMEOUT:-240} ${TEST_ARGS:-} ${TESTS:-tests/}; }
# The tests run first, or where the step list names `tests`.
case " $* " in *" tests "*) ;; *) run_tests ;; esac
for s in "$@"; do
  case $s in
    tests)    run_tests ;;
    verify)   step ${VERIFY_LIMIT:-200} python3 benchmarks/bench_verify.py --device cuda:0 --out "$OUT" ${VERIFY_ARGS:-} ;;
    overhead) step ${OVERHEAD_LIMIT:-120} python3 benchmarks/bench_overhead.py --device cuda:0 --out "$OUT" ${OVERHEAD_ARGS:-} ;;
    route)    step ${ROUTE_LIMIT:-150} python3 benchmarks/bench_sglang_moe_route.py --out "$OUT" ${ROUTE_ARGS:-} ;;
    probe)    step 60 python3 benchmarks/probe_imports.py sglang.srt.layers.moe.fused_moe_triton.layer \
                sglang.srt.layers.quantization.fp8 sglang.srt.server_args ;;
    # One `dispatch bench` per op, each updating the same policy (a run keeps the ops it does
    # not measure): a step cut off by its limit loses that op only, and each op's time shows.
    # CALIBRATE_FROM: a policy to start from (e.g. the committed example), kept for the ops not run.
    calibrate) [ -n "${CALIBRATE_FROM:-}" ] && [ ! -f "$OUT/h200.yaml" ] && cp "$CALIBRATE_FROM" "$OUT/h200.yaml"
               for op in ${CALIBRATE_OPS:-kv_quant kv_dequant moe indexer decode_mla sparse_prefill}; do
                 step ${CALIBRATE_LIMIT:-150} python3 -m capdispatch bench --device cuda:0 --op "$op" \
                   --write-policy "$OUT/h200.yaml" ${CALIBRATE_ARGS:-}
               done
               step 30 python3 -m capdispatch explain --device cuda:0 --policy "$OUT/h200.yaml" --brief ;;
    measure)  for op in ${CALIBRATE_OPS:-kv_quant kv_dequant moe indexer decode_mla sparse_prefill}; do
                step ${MEASURE_LIMIT:-150} python3 -m capdispatch bench --device cuda:0 --op "$op" --seed 1 \
                  --check "$OUT/h200.yaml" --check default ${CALIBRATE_ARGS:-}
              done ;;
    kernels)  kernel_pass card; kernel_pass 99kb ;;
    kernels-99kb) kernel_pass 99kb ;;
    *) echo "unknown step $s" ;;
  esac
done

#!/usr/bin/env bash
# Device-machine calls (NOT RUN YET): calibrate capdispatch on the lent H200 and measure
# the effect. Phases, one call each (a call may run 10 minutes; the machine keeps /tmp
# while held):
#   bash benchmarks/run_h200_calibrate.sh calibrate decode_mla sparse_prefill
#   bash benchmarks/run_h200_calibrate.sh calibrate indexer moe kv_quant kv_dequant
#   bash benchmarks/run_h200_calibrate.sh measure
# `calibrate` runs `dispatch bench --device cuda:0 --write-policy` for the ops named (each
# run keeps the ops it does not measure, comments included), writing
# capdispatch/policies/examples/h200.yaml under $OUT; `measure` runs bench_calibrated.py:
# bind under that policy and under the built-in default against the fastest backend at
# every decode size 1-4096 and every prefill size (target: within 1.10x everywhere).
# FlashMLA: carry .whl-fm as for run_h200_flashmla.sh (pip download --no-deps
# sgl-flash-mla==1.0.0 -d .whl-fm). Copy $OUT/h200.yaml into
# capdispatch/policies/examples/ only from a real run.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
POLICY=${POLICY:-/tmp/calibrate/h200.yaml}; mkdir -p "$(dirname "$POLICY")"
if ls .whl-fm/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
     --no-cache-dir --target /tmp/fm .whl-fm/*.whl; then
  export PYTHONPATH=/tmp/fm:$PWD
else
  export PYTHONPATH=$PWD
fi
phase=${1:-}; shift || true
stamp=$(date -u +%Y%m%dT%H%M%S)
case "$phase" in
  calibrate)
    ops=(); for op in "$@"; do ops+=(--op "$op"); done
    python3 -m capdispatch explain --device cuda:0 --probe torch --format json > "$OUT/explain_$stamp.json"
    timeout 560 python3 -m capdispatch bench --device cuda:0 "${ops[@]}" --write-policy "$POLICY" \
      --format json > "$OUT/calibrate_$stamp.json" 2> "$OUT/calibrate_$stamp.err"
    echo "dispatch bench exit $?"; tail -20 "$OUT/calibrate_$stamp.err"
    cp "$POLICY" "$OUT/h200.yaml" && cat "$POLICY"
    python3 -m capdispatch explain --device cuda:0 --probe torch --policy "$POLICY" > "$OUT/explain_calibrated_$stamp.txt"
    ;;
  measure)
    timeout 560 python3 benchmarks/bench_calibrated.py --policy "$POLICY" --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/bench_calibrated_$stamp.txt" | tail -40
    ;;
  *)
    echo "usage: $0 calibrate OP... | measure [bench_calibrated.py args]" >&2; exit 2;;
esac

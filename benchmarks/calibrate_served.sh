#!/usr/bin/env bash
# Calibrate capdispatch on one CUDA card in the served form, and check policies' regret.
#
#   bash benchmarks/calibrate_served.sh OUT_DIR [PACKAGES...]
#
# PACKAGES: wheel folders, or site bundles packed by pack_site_bundle.sh (.tar.xz), installed
# first into a site folder (for machines without a package index; FlashMLA, TileLang).
# Environment (all optional):
#   OPS="decode_mla indexer"     the ops to calibrate (default: every op)
#   START=FILE                   a calibrated policy to update: ops not run keep their lines
#   CHECK="default FILE"         policies whose regret the calibration run also reports, from
#                                the same measurements (default: "default", the built-in one)
#   RECHECK="default"            then measure again and check the written policy and these
#                                (the honest check of a fresh calibration); unset: no second run
#   BENCH_ARGS="--model deepseek-v4-flash --tp 1"   more `dispatch bench` arguments
#   LIMIT=540                    seconds for each `dispatch bench` run (one per op)
# Writes OUT_DIR/calibrated.yaml, calibrate_OP.json per op, calibrate.log, and with RECHECK
# recheck.json and .log.
set -u
OUT_DIR=${1:?usage: $0 OUT_DIR [WHEEL_FOLDER|BUNDLE.tar.xz ...]}; shift
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SITE=${SITE:-$(mktemp -d)}
for p in "$@"; do
  case "$p" in
    *.tar.xz) tar -xJf "$p" -C "$SITE" ;;
    *) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
         --target "$SITE" "$p"/*.whl 2>&1 | grep -v "Target directory" | tail -3 ;;
  esac
done
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
LIMIT=${LIMIT:-540}
checks=(); for c in ${CHECK:-default}; do checks+=(--check "$c"); done
POLICY=$OUT_DIR/calibrated.yaml
[ -n "${START:-}" ] && [ "$START" != "$POLICY" ] && cp "$START" "$POLICY"
python3 -m capdispatch devices 2>&1 | head -5
all_ops=$(python3 -c "import capdispatch as cd; print(' '.join(cd.registry().ops))")
# One `dispatch bench` per op: each updates the policy (keeping the other ops' lines), so a
# run cut short by LIMIT loses only its own op.
for op in ${OPS:-$all_ops}; do
  # shellcheck disable=SC2086
  timeout "$LIMIT" python3 -m capdispatch bench --op "$op" --write-policy "$POLICY" "${checks[@]}" \
    --format json ${BENCH_ARGS:-} > "$OUT_DIR/calibrate_$op.json" 2>> "$OUT_DIR/calibrate.log"
  echo "calibration of $op: exit $? (0: every backend passed and no checked policy is above the threshold)"
done
tail -5 "$OUT_DIR/calibrate.log"
if [ -n "${RECHECK:-}" ]; then
  rechecks=(--check "$POLICY"); for c in $RECHECK; do rechecks+=(--check "$c"); done
  ops=(); for op in ${OPS:-$all_ops}; do ops+=(--op "$op"); done
  # shellcheck disable=SC2086
  timeout "$LIMIT" python3 -m capdispatch bench "${ops[@]}" "${rechecks[@]}" --seed 1 --format json \
    ${BENCH_ARGS:-} > "$OUT_DIR/recheck.json" 2> "$OUT_DIR/recheck.log"
  echo "re-check: exit $?"
  tail -5 "$OUT_DIR/recheck.log"
fi

#!/usr/bin/env bash
# Device-machine calls for the MoE backends beyond Triton, on an H200 (SM90):
#   flashinfer_cutlass_w4a16  FlashInfer 0.6.14's CUTLASS mixed-input MoE, JIT-built on first
#                             use: about 190 nvcc translation units (fused_moe_90), many
#                             minutes, so it is built detached and waited for across calls;
#   marlin_w4a16              SGLang 0.5.23's MXFP4 Marlin MoE, JIT-built from the sglang wheel.
# A machine keeps /tmp between calls while it is held, so each phase list is one call:
#   bash benchmarks/run_h200_moe_external.sh install build attention until:555  (call 1: .whl-moe .whl-deps .whl-sk .whl-fm)
#   bash benchmarks/run_h200_moe_external.sh install probe marlin until:560     (call 2: .whl-sg .whl-sk)
#   bash benchmarks/run_h200_moe_external.sh until:300 bench                    (call 3)
# ("attention" is run_h200_flashmla.sh, issue 4's measurement, beside the build: its
# timings are CUDA-graph replays and device events, and the build runs at nice 19.)
# Measured 2026-11-29 on the two-GPU kind's 32 cores: the FlashInfer build needs 30-35
# minutes, more than one session's device time (results/archive/h200-2026-11-29-moe-external/).
# Carried wheel folders (all ignored by git; fetched here with pip download --no-deps):
#   .whl-moe   flashinfer-python 0.6.14, apache-tvm-ffi 0.1.11
#   .whl-deps  the light packages SGLang's import chain needs (README's list, plus
#              compressed-tensors 0.18.0 and loguru, which its CUDA path imports)
#   .whl-sg    sglang 0.5.23
#   .whl-sk    the Python files of sglang-kernel 0.4.10, without its compiled libraries:
#              those are built against torch 2.14.1 and cannot load on the device's torch
#              2.11 (undefined c10/torch::Library symbols, checked with nm). SGLang 0.5.23's
#              MXFP4 Marlin path uses only sgl_kernel's pure-Python ScalarType; its GEMMs,
#              align, activation and top-k sum are JIT kernels of the sglang wheel. An empty
#              `common_ops` module stands in for the library, so any call into a compiled
#              sgl_kernel op fails loudly ("no such operator sgl_kernel::...").
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=/tmp/site
export PYTHONPATH=$SITE:$PWD
FI_LOG=/tmp/fijit.log; FI_RC=/tmp/fijit.rc; FI_T0=/tmp/fijit.start

fi_ninja() { find "$HOME/.cache/flashinfer" -path '*fused_moe_90*' -name build.ninja 2>/dev/null | head -1; }

progress() {
  local nf; nf=$(fi_ninja)
  [ -n "$nf" ] || { echo "fused_moe_90: no build.ninja yet"; return; }
  local total built
  total=$(grep -c '^build .*\.o:' "$nf")
  built=$(find "$(dirname "$nf")" -name '*.o' | wc -l)
  echo "fused_moe_90: $built / $total objects after $(( $(date +%s) - $(cat $FI_T0) )) s" \
       "(load $(cut -d' ' -f1 /proc/loadavg), free $(free -g | awk '/Mem/{print $7}') GiB)"
}

for phase in "$@"; do
  echo "=== $phase $(date -u +%H:%M:%S)"
  case $phase in
    install)
      mkdir -p $SITE
      for d in .whl-moe .whl-deps .whl-sg; do
        ls $d/*.whl >/dev/null 2>&1 || continue
        # Once per machine: reinstalling flashinfer under a running build deletes the
        # CUTLASS headers its nvcc jobs read (that ended the build of 2026-11-29 at 80/182).
        [ -f $SITE/.installed$d ] && { echo "$d already installed"; continue; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target $SITE $d/*.whl 2>&1 | grep -v "WARNING: Target directory" | tail -3
        touch $SITE/.installed$d
      done
      if [ -d .whl-sk/sgl_kernel ]; then
        cp -r .whl-sk/* $SITE/
        printf '"""Stands in for sgl_kernel'"'"'s compiled library (see run_h200_moe_external.sh)."""\n' \
          > $SITE/common_ops.py
      fi
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
      python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
      nvcc --version | tail -2 | head -1; nproc; free -g | head -2 ;;
    build)
      [ -f $FI_T0 ] || date +%s > $FI_T0
      # Its own session (setsid) so it outlives this call; nice'd so timings beside it keep a core.
      setsid nohup nice -n 19 env MAX_JOBS=$(( $(nproc) - 2 )) bash -c \
        "python3 benchmarks/bench_moe.py --build-flashinfer-jit --out /tmp/fijit_out > $FI_LOG 2>&1; echo \$? > $FI_RC" \
        < /dev/null > /dev/null 2>&1 &
      sleep 45; progress ;;
    attention)
      bash benchmarks/run_h200_flashmla.sh ;;
    probe)
      # Everything SGLang's CUDA import chain of the Marlin MoE lacks here, in one go.
      python3 benchmarks/probe_imports.py sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe \
        sglang.kernels.ops.moe.moe_wna16_marlin 2>&1 | grep -v Warning | tail -8 ;;
    marlin)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu -rs -k marlin tests/test_moe.py 2>&1 \
        | tee "$OUT/moe_marlin_tests.txt" | tail -25 ;;
    wait:*|until:*)
      # wait:S waits at most S seconds; until:S until this script has run S seconds.
      case $phase in wait:*) limit=${phase#wait:};; *) limit=$(( ${phase#until:} - SECONDS ));; esac
      t0=$(date +%s)
      while [ ! -f $FI_RC ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
        sleep 20; [ $(( ($(date +%s) - t0) % 120 )) -lt 20 ] && progress
      done
      progress
      if [ -f $FI_RC ]; then
        echo "build exit status $(cat $FI_RC)"; tail -5 $FI_LOG; cp $FI_LOG "$OUT/fijit.log"
        cp /tmp/fijit_out/*.json "$OUT/" 2>/dev/null
      fi ;;
    bench)
      MOE_FLASHINFER_JIT=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_moe.py \
        2>&1 | tee "$OUT/moe_gpu_tests.txt" | tail -30
      timeout 280 python3 benchmarks/bench_moe.py --backends triton_w4a16 flashinfer_cutlass_w4a16 marlin_w4a16 \
        torch --out "$OUT" 2>&1 | tee "$OUT/bench_moe.txt" | tail -40 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done

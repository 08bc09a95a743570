#!/usr/bin/env bash
# One device-machine call: probes, explain, GPU tests, KV benchmark.
# Carry .whl (sglang 0.5.23 --no-deps and the light packages its dequant import needs)
# to time SGLang's own kernel side by side; without it the benchmark says why.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -m capdispatch devices --probe nvml | tee "$OUT/devices_nvml.txt"
python3 -m capdispatch devices --probe torch | tee "$OUT/devices_torch.txt"
python3 -m capdispatch explain --device cuda:0 | tee "$OUT/explain_cuda0.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_probe.py tests/test_kv_cache_kernels.py \
  tests/test_api.py tests/test_cli.py tests/test_capabilities.py 2>&1 | tee "$OUT/pytest.txt" | tail -15
python3 benchmarks/bench_kv_cache.py --out "$OUT" 2>&1 | tee "$OUT/bench.txt" | tail -40

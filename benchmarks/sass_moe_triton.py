"""Instruction counts of the Triton W4A16 MoE GEMM kernels, compiled offline (no GPU).

    python benchmarks/sass_moe_triton.py [--cc 90] [--avg-rows 1]

Compiles ``_gemm1_swiglu_kernel`` and ``_gemm2_kernel`` with the tiles the op would
choose for the given mean routes per expert at DSv4 shapes (H 4096, I 2048), with
the argument specialisation a launch gets (16-byte aligned pointers and sizes), then
disassembles the cubin with the nvdisasm Triton ships and prints the size of the
main loop (the largest backward branch) and its instruction mix. At decode sizes the
kernels decode every MXFP4 weight in registers, so the loop's integer and float work
per weight is what bounds them; this is a proxy to compare decoders without a GPU, not
a timing (bench_moe.py / sweep_moe_triton.py time them on a card).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from sass_tools import compile_kernel, main_loop  # noqa: E402


def sass(fn, sig, consts, warps, stages, cc):
    return compile_kernel(fn, sig, consts, warps, stages, cc).sass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", type=int, default=90)
    ap.add_argument("--avg-rows", type=float, default=1.0)
    a = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    from capdispatch.backends.moe import triton_kernels as tk
    t = tk.tiles_for(a.avg_rows, 4096, 2048, False)
    sigs = tk.COMPILE_SIGNATURES
    jobs = [("gemm1_swiglu", tk._gemm1_swiglu_kernel, sigs["_gemm1_swiglu_kernel"],
             dict(TOPK=6, HAS_LIMIT=True, F32=False, BM=t.BM, BN=t.BN1, BK=t.BK1, SPLIT=t.SK1, PREFETCH=t.PF),
             t.W1, t.S1),
            ("gemm2", tk._gemm2_kernel, sigs["_gemm2_kernel"],
             dict(F32=False, BM=t.BM, BN=t.BN2, BK=t.BK2, SPLIT=t.SK2, PREFETCH=t.PF), t.W2, t.S2)]
    print(f"sm_{a.cc}, {t}")
    for name, fn, sig, consts, warps, stages in jobs:
        n, mix = main_loop(sass(fn, sig, consts, warps, stages, a.cc))
        print(f"{name}: main loop {n} instructions; " + ", ".join(f"{k} {v}" for k, v in mix.most_common(8)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

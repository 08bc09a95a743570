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
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

INSN = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def sass(fn, sig, consts, warps, stages, cc):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    # What a launch specialises: every pointer and every int argument that is a multiple of 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t != "fp32"}
    full = dict(sig, **{k: "constexpr" for k in consts})
    ck = triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                        target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "num_stages": stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        return subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True).stdout


def main_loop(text):
    """(instructions in the largest backward-branch loop, Counter of its opcodes)."""
    insns = [(int(m.group(1), 16), m.group(2)) for m in map(INSN.match, text.split("\n")) if m]
    labels = {m.group(1): int(m.group(2), 16)
              for m in re.finditer(r"^(\.L_x_\d+):\s*\n\s+/\*([0-9a-f]+)\*/", text, re.M)}
    best = (0, collections.Counter())
    for m in re.finditer(r"/\*([0-9a-f]+)\*/[^\n]*BRA[^\n]*`\((\.L_x_\d+)\)", text):
        end, start = int(m.group(1), 16), labels.get(m.group(2))
        if start is not None and start < end:
            body = [op for a, op in insns if start <= a <= end]
            if len(body) > best[0]:
                best = (len(body), collections.Counter(body))
    return best


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
             dict(TOPK=6, HAS_LIMIT=True, F32=False, BM=t.BM, BN=t.BN1, BK=t.BK1), t.W1, t.S1),
            ("gemm2", tk._gemm2_kernel, sigs["_gemm2_kernel"],
             dict(F32=False, BM=t.BM, BN=t.BN2, BK=t.BK2), t.W2, t.S2)]
    print(f"sm_{a.cc}, {t}")
    for name, fn, sig, consts, warps, stages in jobs:
        n, mix = main_loop(sass(fn, sig, consts, warps, stages, a.cc))
        print(f"{name}: main loop {n} instructions; " + ", ".join(f"{k} {v}" for k, v in mix.most_common(8)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

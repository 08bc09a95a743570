"""Sweep the Triton W4A16 MoE tiles on a CUDA GPU at DeepSeek-V4 expert shapes.

    python benchmarks/sweep_moe_triton.py [--tokens 1 8 64 4096] [--out DIR]

For each token count: fresh random inputs (seed printed), the torch reference
once, then two coordinate passes over the tile space of
``capdispatch.backends.moe.triton_kernels.Tiles``: GEMM1 (N tile, K tile, warps,
stages) with GEMM2 at the current choice, then GEMM2 with the best GEMM1. Every
candidate's output is checked against the reference (norm-relative error within
the tests' Triton bound, 2e-3, and finite) before it is timed replayed from a CUDA
graph, as serving replays decode (do_bench_cudagraph median after eager warm-up: an
eager time at a few tokens is the host's launch, not the kernels); a candidate that fails to compile or to check is
recorded with the reason, never timed. The roofline is bench_moe.py's (weight
bytes over the measured copy bandwidth, FLOPs over the measured bf16 rate).
Writes moe_tiles_<gpu>_<utc>.json and .md into --out.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import os
import sys

from bench_moe import E, H, I, SWIGLU_LIMIT, TOPK, roofline  # noqa: E402 (the script's own folder)
from ceilings import bench_graph, copy_bandwidth, describe, matmul_rate, run_facts  # noqa: E402
from results_dir import add_out, archive_previous  # noqa: E402 (the script's own folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CHECK_NORM = 2e-3


def space(avg_rows):
    """(BM values, GEMM1 candidates (BN, BK, W, S), GEMM2 candidates)."""
    if avg_rows <= 16:
        bms = (16,)
        g = [(bn, bk, w, s) for bn, bk, s in itertools.product((16, 32, 64, 128), (128, 256), (2, 3, 4))
             for w in ((2, 4) if bn <= 32 else (4,))]
    else:
        bms = (64, 128)
        g = list(itertools.product((64, 128), (64, 128), (4, 8), (3, 4)))
    return bms, g, g


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 4096])
    add_out(ap)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("sweep_moe_triton.py needs a CUDA device", file=sys.stderr)
        return 2
    from capdispatch.backends.moe import reference as R
    from capdispatch.backends.moe import launch_table
    from capdispatch.backends.moe import triton_kernels as tk

    facts = run_facts(a.seed)
    gen = torch.Generator().manual_seed(facts["seed"])
    bw, _ = copy_bandwidth()
    rate, _ = matmul_rate()
    w = R.random_weights(E, H, I, gen=gen, device="cuda", swiglu_limit=SWIGLU_LIMIT)
    per_expert = w.packed_bytes_per_expert()
    print(f"[tiles] {facts['device']}: copy {bw:.0f} GB/s, bf16 {rate:.0f} TFLOP/s, seed {facts['seed']}", flush=True)
    rows = []
    for T in a.tokens:
        x = torch.randn(T, H, generator=gen).bfloat16().cuda()
        tw, ids = R.random_routing(T, TOPK, E, gen=gen, device="cuda")
        ref = R.moe(x, w, tw, ids).float()
        experts = int(torch.unique(ids[ids >= 0]).numel())
        R_ = T * TOPK
        avg = launch_table.mean_rows(R_, E)
        roof = max(roofline(T, experts, per_expert, bw, rate)[2:])
        cur = tk.tiles_for(avg, H, I, False)
        tried = {}

        def run(t):
            key = tuple(t)
            if key in tried:
                return tried[key]
            try:
                out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
                tk.moe_w4a16(x, w, tw, ids, out=out, tiles=t)
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not bool(torch.isfinite(out).all()) or not err <= CHECK_NORM:
                    res = {"tiles": key, "error": f"check failed: norm-rel {err:.2e}"}
                else:
                    res = {"tiles": key, "ms": bench_graph(lambda: tk.moe_w4a16(x, w, tw, ids, out=out, tiles=t), rep=100),
                           "err": err}
            except Exception as exc:          # out of resources, compile errors: recorded, not timed
                res = {"tiles": key, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            tried[key] = res
            return res

        base = run(cur)
        best = base if "ms" in base else None
        bms, g1, g2 = space(avg)
        for bm in bms:
            start = cur._replace(BM=bm)
            cand1 = [run(start._replace(BN1=bn, BK1=bk, W1=wp, S1=st)) for bn, bk, wp, st in g1]
            ok1 = [c for c in cand1 if "ms" in c] or [run(start)]
            b1 = tk.Tiles(*min(ok1, key=lambda c: c.get("ms", 1e9))["tiles"])
            cand2 = [run(b1._replace(BN2=bn, BK2=bk, W2=wp, S2=st)) for bn, bk, wp, st in g2]
            for c in cand2 + cand1:
                if "ms" in c and (best is None or c["ms"] < best["ms"]):
                    best = c
        row = {"tokens": T, "routes": R_, "experts_touched": experts, "avg_rows": avg, "roofline_ms": roof,
               "current": base, "best": best, "candidates": list(tried.values())}
        rows.append(row)
        print(f"[tiles] T={T:5d} current {cur} {base.get('ms', float('nan')) * 1e3:8.1f} us "
              f"({100 * roof / base.get('ms', float('inf')):.1f}% roofline)", flush=True)
        if best:
            print(f"[tiles] T={T:5d} best    {tk.Tiles(*best['tiles'])} {best['ms'] * 1e3:8.1f} us "
                  f"({100 * roof / best['ms']:.1f}% roofline); {len(tried)} tried, "
                  f"{sum('error' in c for c in tried.values())} failed", flush=True)
    res = {"meta": dict(facts, copy_GBps=bw, bf16_TFLOPs=rate, shape={"E": E, "H": H, "I": I, "topk": TOPK}),
           "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    series = f"moe_tiles_{facts['device'].lower().replace(' ', '_')}"
    archive_previous(a.out, series)
    base_name = os.path.join(a.out, f"{series}_{stamp}")
    with open(base_name + ".json", "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Triton W4A16 MoE tile sweep on {facts['device']}", "", describe(facts), "",
             "| tokens | avg rows/expert | roofline us | current tiles | us (% roofline) | best tiles | us (% roofline) |",
             "| ---: | ---: | ---: | --- | ---: | --- | ---: |"]
    for r in rows:
        c, b = r["current"], r["best"] or {}
        fmt = lambda d: f"{d['ms'] * 1e3:.1f} ({100 * r['roofline_ms'] / d['ms']:.1f}%)" if "ms" in d else d.get("error", "—")
        lines.append(f"| {r['tokens']} | {r['avg_rows']:.1f} | {r['roofline_ms'] * 1e3:.1f} | {tuple(c['tiles'])} | "
                     f"{fmt(c)} | {tuple(b.get('tiles', ()))} | {fmt(b) if b else '—'} |")
    lines += ["", "Tiles: (BM, BN1, BK1, W1, S1, BN2, BK2, W2, S2). Times are replays from a CUDA graph; "
              f"every timed candidate matched the torch reference within norm-relative {CHECK_NORM}."]
    with open(base_name + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

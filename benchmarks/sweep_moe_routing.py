"""Sweep the Triton MoE's one-program routing kernel: scan chunk and warps per route count.

    python benchmarks/sweep_moe_routing.py --out DIR [--tokens 1 8 64 256] [--seed N]

At 64 experts and top-6 (DeepSeek-V4's local experts at EP 4), with the routing skew
calibration serves (bench.SERVED_ROUTE_SKEW): for each token count and each block size the MoE
uses there (BM 16 and 32), every (CH, num_warps) of CHUNKS x WARPS. Each candidate's tables are
first compared with the torch path's (routing_tables(force_torch=True)): the sorted routes of
every unmasked route and the three block columns, element for element; a candidate that
differs is reported and not timed. Timed replayed from a CUDA graph (bench.cuda_timer's graph
mode: the routing kernel is one launch of a decode step's graph). The launch table's choice
(launch_table.routing_launch) is marked in the output, which is what its rows are read from.

Writes moe_routing_<card>_<utc>.json and .md into --out (report.write: card, versions, date).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import report  # noqa: E402 (the script's own folder)
from results_dir import add_out  # noqa: E402 (the script's own folder)
from ceilings import bench_graph  # noqa: E402

E, TOPK = 64, 6
CHUNKS = (16, 32, 64, 128)
WARPS = (1, 2, 4)


def sweep(tokens, seed, rep_ms=50):
    import torch
    import triton

    from capdispatch import bench
    from capdispatch.backends.moe import reference as R
    from capdispatch.backends.moe import triton_kernels as tk
    from capdispatch.backends.moe.launch_table import routing_launch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for T in tokens:
        _, ids = R.random_routing(T, TOPK, E, gen=gen, device="cuda", skew=bench.SERVED_ROUTE_SKEW)
        ids = ids.contiguous()
        routes = T * TOPK
        live = int((ids >= 0).sum())
        for BM in (16, 32):
            maxb = tk.max_blocks(routes, E, BM)
            bp = max(16, triton.next_power_of_2(maxb))
            want = tk.routing_tables(ids, E, BM, force_torch=True)
            for ch in CHUNKS:
                for warps in WARPS:
                    srt = torch.full((max(routes, 1),), -7, dtype=torch.int32, device="cuda")
                    blk = torch.full((3, maxb), -7, dtype=torch.int32, device="cuda")

                    def call(ch=ch, warps=warps, srt=srt, blk=blk, maxb=maxb, bp=bp, BM=BM):
                        tk._routing_kernel[(1,)](ids, srt, blk[0], blk[1], blk[2], routes, E, maxb,
                                                 CH=ch, EP=64, BP=bp, BM=BM, num_warps=warps)
                    call()
                    ok = torch.equal(srt[:live], want[0][:live]) and all(
                        torch.equal(blk[i], want[i + 1]) for i in range(3))
                    row = dict(tokens=T, routes=routes, BM=BM, CH=ch, warps=warps, ok=ok,
                               chosen=(ch, warps) == routing_launch(routes))
                    if ok:
                        row["us"] = bench_graph(call, rep=rep_ms) * 1e3
                    rows.append(row)
                    print(f"[routing] T={T:5d} BM={BM} CH={ch:3d} w{warps} "
                          + (f"{row['us']:7.2f} us" if ok else "TABLES DIFFER") + (" (table)" if row["chosen"] else ""),
                          flush=True)
    return rows


def to_markdown(rows) -> list:
    out = ["Routing kernel alone, one launch replayed from a CUDA graph; 64 experts, top-6, served routing skew. "
           "`table`: the launch table's choice (launch_table.ROUTING_LAUNCHES); `best`: the fastest candidate "
           "whose tables equal the torch path's.", "",
           "| tokens | routes | BM | table (CH, warps) | table us | best (CH, warps) | best us |",
           "| ---: | ---: | ---: | --- | ---: | --- | ---: |"]
    for key in sorted({(r["tokens"], r["BM"]) for r in rows}):
        group = [r for r in rows if (r["tokens"], r["BM"]) == key]
        timed = [r for r in group if r["ok"]]
        table = next((r for r in group if r["chosen"]), None)
        best = min(timed, key=lambda r: r["us"]) if timed else None
        cell = lambda r: (f"({r['CH']}, {r['warps']})", f"{r['us']:.2f}" if r.get("us") is not None else "differs")
        t, b = cell(table) if table else ("—", "—"), cell(best) if best else ("—", "—")
        out.append(f"| {key[0]} | {group[0]['routes']} | {key[1]} | {t[0]} | {t[1]} | {b[0]} | {b[1]} |")
    bad = [r for r in rows if not r["ok"]]
    out += ["", f"Candidates whose tables differ from the torch path's: {len(bad)}."]
    out += ["", "## Every candidate", "", "| tokens | BM | CH | warps | us |", "| ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {r['tokens']} | {r['BM']} | {r['CH']} | {r['warps']} | "
            + (f"{r['us']:.2f}" if r["ok"] else "tables differ") + " |" for r in rows]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out(ap, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    if any(t < 1 for t in a.tokens):
        ap.error(f"--tokens must be positive, got {a.tokens}")
    import torch
    if not torch.cuda.is_available():
        print("sweep_moe_routing.py needs a CUDA device", file=sys.stderr)
        return 2
    from ceilings import run_facts
    facts = run_facts(a.seed)
    rows = sweep(a.tokens, facts["seed"])
    env = report.environment(torch.cuda.current_device())
    paths = report.write(a.out, "moe_routing", env, dict(seed=facts["seed"], experts=E, topk=TOPK, rows=rows),
                         to_markdown(rows), title=f"MoE routing kernel: chunk and warps on {env.get('card')}")
    print("\n".join(paths))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

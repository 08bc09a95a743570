"""Memory plan vs a real allocation: allocate a small config's DeepSeek-V4 KV pools, compress-state
rings and one MoE layer's routed experts on a CUDA card the way SGLang 0.5.23 lays them out
(one uint8 [pages, page_bytes] tensor per layer and pool, paged as SGLang pages them; fp32 state
rings per request slot; MXFP4 experts as packed bytes plus E8M0 scales), and compare the bytes
`dispatch plan` estimates (bench.memory) with what the allocation holds and with
what torch.cuda.memory_allocated and cudaMemGetInfo report. Also the CUDA context's own memory
against the plan's fixed allowance for it.

    python benchmarks/measure_memory.py [--model deepseek-v4-flash] [--tp 8] [--context 32768]
                                        [--batch 4] [--page-size 256] [--out benchmarks/results]

Writes memory_<card>_<stamp>.json and .md to --out (older runs of the series go to archive/
when --out is benchmarks/results). Needs torch with CUDA; runs in a few seconds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from results_dir import add_out, archive_previous  # noqa: E402 (the script's own folder)
from report import card_slug  # noqa: E402 (the script's own folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import capdispatch as cd  # noqa: E402 (after the path insertion)
from capdispatch import bench  # noqa: E402

bytes_per_page, load_model, mem = bench.v4_layout.bytes_per_page, cd.load_model, bench.memory

MIB = 1 << 20


def measure(args) -> dict:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("measure_memory: needs a CUDA device (torch.cuda.is_available() is False)")
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    torch.empty(1, device=dev)                       # the CUDA context exists from here
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info(dev)
    context_used = total - free0 - torch.cuda.memory_reserved(dev)
    model = load_model(args.model)
    rank = model.for_rank(args.tp, args.ep)
    est_kv = {p.name: p.bytes for p in mem.kv_parts(model, rank, args.context, args.batch,
                                                   page_size=args.page_size)}
    pools = mem.kv_pools(model, rank, args.context, args.batch, page_size=args.page_size)
    # The plan's page layout is capdispatch's kv_cache layout (what SGLang allocates).
    assert pools[0].shape[1] == bytes_per_page(args.page_size), "page layout drifted from backends/v4_layout.py"
    E, H, I = rank.experts, model.hidden, rank.moe_intermediate
    experts = [mem.Pool("routed experts, one layer: w13", 1, (E, 2 * I, H // 2), "uint8"),
               mem.Pool("routed experts, one layer: w13 E8M0 scales", 1, (E, 2 * I, H // 32), "uint8"),
               mem.Pool("routed experts, one layer: w2", 1, (E, H, I // 2), "uint8"),
               mem.Pool("routed experts, one layer: w2 E8M0 scales", 1, (E, H, I // 32), "uint8")]
    rows, held = [], []
    for pool in tuple(pools) + tuple(experts):
        before_alloc = torch.cuda.memory_allocated(dev)
        before_free = torch.cuda.mem_get_info(dev)[0]
        for _ in range(pool.count):           # one tensor per layer, as SGLang allocates them
            held.append(torch.empty(pool.shape, dtype=getattr(torch, pool.dtype), device=dev))
        torch.cuda.synchronize()
        rows.append({"pool": pool.name, "tensors": pool.count, "shape": list(pool.shape), "dtype": pool.dtype,
                     "estimate": pool.bytes,
                     "allocated_delta": torch.cuda.memory_allocated(dev) - before_alloc,
                     "device_delta": before_free - torch.cuda.mem_get_info(dev)[0]})
    kv_rows = [r for r in rows if "states" not in r["pool"] and not r["pool"].startswith("routed")]
    state_rows = [r for r in rows if "states" in r["pool"]]
    expert_rows = [r for r in rows if r["pool"].startswith("routed")]
    est_expert = next(p.bytes for p in mem.weight_parts(model, rank) if p.name == "routed experts")
    est_expert_layer = est_expert // (model.layers + (model.mtp if rank.next_n > 1 else 0))
    compare = [
        _cmp("KV pools (window, c4, c128, indexer)", est_kv["KV pools"], kv_rows),
        _cmp("compress-state rings", est_kv["compress-state rings"], state_rows),
        _cmp("routed experts, one layer", est_expert_layer, expert_rows),
        {"what": "CUDA context and handles", "estimate": 640 * MIB, "layout": None,
         "allocated": None, "device": context_used,
         "error_vs_device": (640 * MIB - context_used) / context_used if context_used else None},
    ]
    del held
    return {"meta": {"device": torch.cuda.get_device_name(dev), "total_bytes": total,
                     "torch": torch.__version__, "cuda": torch.version.cuda,
                     "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                     "model": model.name, "tp": args.tp, "ep": args.ep, "context": args.context,
                     "batch": args.batch, "page_size": args.page_size, "next_n": rank.next_n,
                     "margin": mem.MARGIN_TEXT},
            "pools": rows, "compare": compare}


def _cmp(what, estimate, rows) -> dict:
    layout = sum(r["estimate"] for r in rows)
    alloc = sum(r["allocated_delta"] for r in rows)
    device = sum(r["device_delta"] for r in rows)
    return {"what": what, "estimate": estimate, "layout": layout, "allocated": alloc, "device": device,
            "error_vs_allocated": (estimate - alloc) / alloc if alloc else None,
            "error_vs_device": (estimate - device) / device if device else None}


def series(device: str) -> str:
    return f"memory_{card_slug(device)}"


def write(out_dir: str, result: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    meta = result["meta"]
    name = series(meta["device"])
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    archive_previous(out_dir, name)
    base = os.path.join(out_dir, f"{name}_{stamp}")
    with open(base + ".json", "w") as fh:
        json.dump(result, fh, indent=2)
    lines = [f"# Memory plan vs allocation on {meta['device']}", "",
             f"{meta['model']} at tp {meta['tp']} ep {meta['ep']}, context {meta['context']} x batch "
             f"{meta['batch']}, page {meta['page_size']}, next_n {meta['next_n']}; torch {meta['torch']}, "
             f"CUDA {meta['cuda']}; {meta['date']}.", "",
             "| what | estimate MiB | allocated as MiB | memory_allocated delta MiB | mem_get_info delta MiB "
             "| error vs allocated | error vs device |",
             "|---|---|---|---|---|---|---|"]
    for c in result["compare"]:
        def f(v):
            return "" if v is None else f"{v / MIB:.1f}"

        def pct(v):
            return "" if v is None else f"{100 * v:+.1f}%"
        lines.append(f"| {c['what']} | {f(c['estimate'])} | {f(c['layout'])} | {f(c['allocated'])} | "
                     f"{f(c['device'])} | {pct(c.get('error_vs_allocated'))} | {pct(c.get('error_vs_device'))} |")
    lines += ["", f"Stated margin: {meta['margin']}.", "",
              "Per pool (tensors, bytes of SGLang's layout, allocator and device deltas):", ""]
    for r in result["pools"]:
        lines.append(f"- {r['pool']}: {r['tensors']} x {r['shape']} {r['dtype']}, "
                     f"{r['estimate'] / MIB:.1f} MiB planned, "
                     f"{r['allocated_delta'] / MIB:.1f} MiB allocated, {r['device_delta'] / MIB:.1f} MiB on the device")
    with open(base + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return base


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v4-flash")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    add_out(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    result = measure(args)
    base = write(args.out, result)
    for c in result["compare"]:
        e = c.get("error_vs_allocated", c.get("error_vs_device"))
        print(f"{c['what']}: estimate {c['estimate'] / MIB:.1f} MiB, device {c['device'] / MIB:.1f} MiB"
              + (f", error {100 * e:+.1f}%" if e is not None else ""))
    print(f"wrote {base}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

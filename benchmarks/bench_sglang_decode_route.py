"""SGLang's DeepSeek-V4 decode call site routed to capdispatch's `flashmla` adapter, against
SGLang's own FlashMLA call, as a model serves them: LAYERS layers of one batch replayed from a
CUDA graph, each layer its own pools, queries and indices, the batch's valid counts and one
FlashMLA schedule (`tile_scheduler_metadata`) shared by the layers. The routed side goes
through the route wrapper (capdispatch/adapters/sglang/routes.py `mla_decode`), which hands
SGLang's schedule on to the adapter bound in served form (`bind(..., checks=False)`); a third
row times the adapter outside any batch, making its own schedule on every call.

    python benchmarks/bench_sglang_decode_route.py [--tokens 1 8 32 64 128 512] [--layers 8]
                                                   [--out DIR]

Each size: outputs compared bit for bit with SGLang's call first, then times (median of
do_bench_cudagraph, per layer). Target: routed / SGLang <= 1.05. Needs CUDA, sglang (installed
with --no-deps) and sgl-flash-mla; writes sglang_decode_route_<card>_<stamp>.md/.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys

from results_dir import add_out, archive_previous  # the script's own folder
from report import card_slug  # noqa: E402 (the script's own folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TARGET = 1.05


def run(args) -> int:
    import torch
    if not torch.cuda.is_available():
        print("bench_sglang_decode_route: needs a CUDA device", file=sys.stderr)
        return 2
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import sglang_prelude  # noqa: F401  (before SGLang: offline; a torchvision stand-in where it is absent)
    import capdispatch as cd
    from capdispatch import bench
    from capdispatch.adapters.sglang import routes
    from capdispatch.backends.decode_mla.library_args import pool_view
    from ceilings import bench_graph
    CI = bench.inputs
    fmi = importlib.import_module("sglang.kernels.ops.attention.flash_mla_interface")
    own = fmi.flash_mla_with_kvcache
    fn = cd.bind("decode_mla", "cuda:0", backend="flashmla", checks=False)
    key = ("cuda", 0)
    routes._KERNELS.setdefault("decode_mla", {})[key] = fn
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = []
    for T in args.tokens:
        layers = []
        for i in range(args.layers):
            (q, pool, idx, page, scale, tl, sink, cpool, cidx, cpage, ctl) = CI.decode_args(T, gen, "cuda", 256, 64, 65536)
            if layers:              # one batch: the layers share its valid counts
                tl, ctl = layers[0]["topk_length"], layers[0]["extra_topk_length"]
            layers.append(dict(q=q, k_cache=pool_view(pool, page), indices=idx, attn_sink=sink,
                               extra_k_cache=pool_view(cpool, cpage), extra_indices_in_kvcache=cidx,
                               topk_length=tl, extra_topk_length=ctl, softmax_scale=scale))

        def sglang_forward():
            sched = fmi.get_mla_metadata()[0]       # SGLang: one schedule per batch
            return [own(**x, block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=sched,
                        is_fp8_kvcache=True, use_legacy=True) for x in layers]

        def routed_forward():
            sched = fmi.get_mla_metadata()[0]
            return [routes.mla_decode(own, **x, block_table=None, cache_seqlens=None, head_dim_v=512,
                                      tile_scheduler_metadata=sched, is_fp8_kvcache=True, use_legacy=True)
                    for x in layers]

        def per_call_forward():         # no schedule handed on: the adapter makes one per call
            return [routes.mla_decode(own, **x, block_table=None, cache_seqlens=None, head_dim_v=512,
                                      tile_scheduler_metadata=None, is_fp8_kvcache=True, use_legacy=True)
                    for x in layers]
        want, got = sglang_forward(), routed_forward()
        same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got))
        t_own = bench_graph(sglang_forward, args.warmup, args.rep) / args.layers
        t_route = bench_graph(routed_forward, args.warmup, args.rep) / args.layers
        try:
            t_call = bench_graph(per_call_forward, args.warmup, args.rep) / args.layers
        except Exception as exc:        # a schedule per call inside a capture may not be capturable
            t_call, call_err = None, f"{type(exc).__name__}: {str(exc)[:200]}"
        else:
            call_err = None
        rows.append(dict(tokens=T, same=same, sglang_us=t_own * 1e3, routed_us=t_route * 1e3,
                         ratio=t_route / t_own, per_call_us=None if t_call is None else t_call * 1e3,
                         per_call_error=call_err))
        print(f"tokens {T}: same={same} sglang {t_own * 1e3:.1f} us, routed {t_route * 1e3:.1f} us "
              f"({t_route / t_own:.3f}x), per call {'-' if t_call is None else f'{t_call * 1e3:.1f} us'}", flush=True)
        del layers
        torch.cuda.empty_cache()
    _write(args, rows)
    return 0 if all(r["same"] and r["ratio"] <= TARGET for r in rows) else 1


def _write(args, rows):
    import torch
    import triton
    name = torch.cuda.get_device_name(0)
    slug = card_slug(name)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    os.makedirs(args.out, exist_ok=True)
    series = f"sglang_decode_route_{slug}"
    archive_previous(args.out, series)
    base = os.path.join(args.out, f"{series}_{stamp}")
    meta = dict(device=name, torch=torch.__version__, triton=triton.__version__, layers=args.layers,
                date=stamp, target=TARGET)
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    lines = [f"# SGLang's decode site routed to capdispatch flashmla vs SGLang's own call, {name}", "",
             f"torch {meta['torch']}, Triton {meta['triton']}, {stamp} UTC; {args.layers} layers of one batch per "
             f"CUDA graph, one FlashMLA schedule per batch; times per layer (do_bench_cudagraph median).", "",
             "| tokens | bit-equal | SGLang us | routed us | routed / SGLang | adapter outside batch us |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        per = f"{r['per_call_us']:.1f}" if r["per_call_us"] is not None else f"not capturable ({r['per_call_error']})"
        lines.append(f"| {r['tokens']} | {'yes' if r['same'] else 'NO'} | {r['sglang_us']:.1f} | {r['routed_us']:.1f} | "
                     f"{r['ratio']:.3f} | {per} |")
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    print(base + ".md")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float, default=25)
    p.add_argument("--rep", type=float, default=100)
    add_out(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

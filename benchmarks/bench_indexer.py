"""Benchmark the sparse-indexer backends (fp8 paged MQA logits) at DeepSeek-V4 shapes.

    python benchmarks/bench_indexer.py [--out DIR] [--backends ...] [--quick] [--no-memory]
    python benchmarks/bench_indexer.py --cpu-memory        # no GPU: the accounting only

On a CUDA GPU:
  1. ceilings: device-to-device copy bandwidth (bytes read + written) and the matmul
     rate the op's tensor-core work can reach (fp8 torch._scaled_mm from cc 8.9, bf16
     torch.matmul below), each the median of triton.testing.do_bench;
  2. for each shape (decode: B requests x next_n rows over C4-compressed contexts;
     prefill: one request's causal rows, row i seeing (start + i + 1) // 4 index-K
     tokens), fresh random inputs (seed printed), every runnable backend
     (torch, triton [native fp8 where cc >= 8.9], triton_u8, tilelang, deepgemm) is
     checked against the float32 absolute-sum bound (|err| <= 2**-10 * A at valid
     positions, -inf past each row for capdispatch kernels), then timed (median;
     with --graphs also replayed from a CUDA graph, and that time is the one compared);
     roofline time = max(bytes / copy bandwidth, FLOPs / matmul rate) with bytes =
     q + weights + index-K pages the rows reach (each once) + logits written, FLOPs =
     2 * 64 heads * 128 * scored positions; fraction of roofline = roofline / measured;
     the default pick (deepgemm > tilelang > triton > torch, cc < 8.9: triton first)
     is compared with the fastest backend;
  3. the torch reference's peak memory at 8k and 32k tokens of prefill (rows =
     tokens, C4 context = tokens / 4) with torch.cuda.max_memory_allocated, beside the
     accounted bound of one step (reference.plan_steps) and what gathering a whole
     1024-row chunk's index-K in float32 would take (what ran out of memory before the step plan);
  4. writes indexer_<device>_<stamp>.json and .md into --out.

With --tiles 99kb only the Triton backends are timed (the torch reference still checks
them), with the launch-table entries and the shared-memory limit of the 99 KB cards
(SM86, SM89, SM120; tile_modes.py); no memory measurement; the results are the series
indexer_<device>_99kb.

Without a GPU (or with --cpu-memory) it prints and writes item 3's accounting alone:
the reference's step plan (query chunk, pages per step, accounted bytes) at 8k, 32k
and 128k tokens, which is what bounds its peak memory on any device.

TileLang and DeepGEMM: install them beside capdispatch (docs/ops/indexer.md, "Running on a GPU").
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys

from ceilings import bench as _bench, bench_graph as _bench_graph, copy_bandwidth, describe, matmul_rate, run_facts  # noqa: E402 (the script's own folder)
from results_dir import add_out, archive_previous  # noqa: E402 (the script's own folder)
from report import card_slug  # noqa: E402 (the script's own folder)
import tile_modes  # noqa: E402 (the script's own folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from capdispatch import bench  # noqa: E402

CI = bench.inputs

H, D, PAGE = CI.INDEXER_HEADS, CI.INDEXER_DIM, CI.INDEXER_PAGE
REL_TOL = CI.INDEXER_REL_TOL
BACKENDS = ("torch", "triton", "triton_u8", "tilelang", "deepgemm")
TRITON_BACKENDS = ("triton", "triton_u8")   # capdispatch's Triton kernels: what --tiles changes
DECODE = [(64, 1, 16384), (128, 1, 4096), (8, 1, 65536), (64, 2, 16384)]       # (B, next_n, context)
PREFILL = [(8192, 0), (4096, 28672)]                                            # (rows, start)
MEMORY_TOKENS = (8192, 32768)


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #
def make_inputs(kind, shape, gen, dev="cuda"):
    """Device tensors for one shape. Distinct pages per decode request; prefill rows of
    one request share its page list (each row its own block-table row, as SGLang passes)."""
    import torch
    from capdispatch.backends.indexer import reference as R
    if kind == "decode":
        B, N, ctx = shape
        (q, kv, w, lens, bt, _, S, _), E = CI.indexer_decode_args(B, N, ctx, gen, dev)
        P = kv.shape[0]
        return dict(q=q, kv=kv, w=w, ctx=lens, bt=bt, S=S, rows=B * N, B=B, N=N, E=E,
                    unique_pages=P, scored=int(E.sum()))
    rows, start = shape
    N, B = 1, rows
    S = (start + rows) // 4
    NB = -(-S // PAGE)
    P = NB
    perm = torch.randperm(P, generator=gen, device=dev).int()
    bt = perm[None, :].expand(rows, NB).contiguous()
    ctx_arg = ((torch.arange(rows, device=dev) + start + 1) // 4).int()
    E = R.row_lengths(ctx_arg, 1, S)
    x = torch.randn(P, PAGE, D, generator=gen, device=dev)
    codes, scales = R.quantize_index_k(x)
    kv = R.pack_index_k(codes, scales)
    q = torch.randn(B, N, H, D, generator=gen, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(B * N, H, generator=gen, device=dev)
    return dict(q=q, kv=kv, w=w, ctx=ctx_arg, bt=bt, S=S, rows=rows, B=B, N=N, E=E,
                unique_pages=P, scored=int(E.sum()))


def traffic(c):
    """(bytes, flops) the op must move / do at least."""
    rows, S = c["rows"], c["S"]
    nbytes = (rows * H * D            # q fp8
              + rows * H * 4          # weights
              + c["unique_pages"] * PAGE * (D + 4)   # index-K pages, each once
              + rows * S * 4)         # logits written
    return nbytes, 2 * H * D * c["scored"]


def abs_sum(c):
    """A = s * sum_h |w| * sum_d |q k| per position: the reference on magnitudes."""
    return CI.indexer_abs_sum((c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, c["S"], False))


def check(got, want, A, E, S, clean):
    return CI.indexer_errors(got, want, A, E, S, clean)


# --------------------------------------------------------------------------- #
# Backends
# --------------------------------------------------------------------------- #
def load_backends(names):
    """name -> (callable, None) or (None, why not)."""
    import torch
    out = {}
    cc = torch.cuda.get_device_capability()
    for name in names:
        try:
            if name == "torch":
                from capdispatch.backends.indexer.reference import fp8_paged_mqa_logits as fn
            elif name == "triton":
                from capdispatch.backends.indexer.triton_kernels import fp8_paged_mqa_logits as fn
            elif name == "triton_u8":
                from capdispatch.backends.indexer.triton_kernels import fp8_paged_mqa_logits_u8 as fn
            elif name == "tilelang":
                from capdispatch.backends.indexer.tilelang_kernel import fp8_paged_mqa_logits as fn
            elif name == "deepgemm":
                if cc[0] not in (9, 10):
                    raise RuntimeError(f"the deepgemm backend needs wgmma or tcgen05 (cc {cc[0]}.{cc[1]})")
                from capdispatch.backends.indexer.deepgemm import fp8_paged_mqa_logits as fn
            else:
                raise ValueError(name)
            out[name] = (fn, None)
        except Exception as exc:
            out[name] = (None, f"{type(exc).__name__}: {str(exc)[:300]}")
    return out


def default_pick(available, cc):
    order = ["triton", "tilelang", "torch"] if cc < (8, 9) else ["deepgemm", "tilelang", "triton", "torch"]
    return next((b for b in order if b in available), None)


# --------------------------------------------------------------------------- #
# Memory of the torch reference
# --------------------------------------------------------------------------- #
def accounting(tokens_list=(8192, 32768, 131072)):
    from capdispatch.backends.indexer import layout as L
    from capdispatch.backends.indexer import reference as R
    rows = []
    for tokens in tokens_list:
        S = tokens // 4
        pages = -(-S // PAGE)
        plan = R.plan_steps(tokens, 1, H, pages)
        rows.append(dict(tokens=tokens, context=S, query_chunk=plan.batch_chunk, pages_per_step=plan.pages,
                         step_bytes=plan.bytes, logits_bytes=tokens * S * 4,
                         seed_chunk_fp32_gather_bytes=L.QUERY_CHUNK * pages * PAGE * D * 4))
    return rows


def gpu_memory(warmup, rep, tokens_list, gen, with_time=True):
    import torch
    from capdispatch.backends.indexer import reference as R
    out = []
    for tokens in tokens_list:
        c = make_inputs("prefill", (tokens, 0), gen)
        S = c["S"]
        pages = -(-S // PAGE)
        plan = R.plan_steps(tokens, 1, H, pages)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logits = R.fp8_paged_mqa_logits(c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, S)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        extra = peak - logits.numel() * 4
        ms = _bench(lambda: R.fp8_paged_mqa_logits(c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, S),
                    warmup, rep) if with_time else None
        row = dict(tokens=tokens, context=S, peak_bytes=peak, logits_bytes=logits.numel() * 4, extra_bytes=extra,
                   plan_step_bytes=plan.bytes, query_chunk=plan.batch_chunk, pages_per_step=plan.pages,
                   within_plan=extra <= plan.bytes * 1.25 + (8 << 20), ms=ms,
                   seed_chunk_fp32_gather_bytes=1024 * pages * PAGE * D * 4)
        print(f"  torch reference, {tokens} tokens (context {S}): peak {peak / 2**20:.0f} MiB = logits "
              f"{logits.numel() * 4 / 2**20:.0f} MiB + {extra / 2**20:.0f} MiB working set "
              f"(step plan {plan.bytes / 2**20:.0f} MiB: {plan.batch_chunk} rows x {plan.pages} pages)"
              + (f", {ms:.1f} ms" if ms else ""))
        out.append(row)
        del logits, c
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #
def run(args):
    import torch
    if args.cpu_memory or not torch.cuda.is_available():
        acc = accounting()
        for r in acc:
            print(f"  {r['tokens']:>7} tokens (C4 context {r['context']}): {r['query_chunk']} rows x "
                  f"{r['pages_per_step']} pages per step, {r['step_bytes'] / 2**20:.0f} MiB accounted; "
                  f"logits {r['logits_bytes'] / 2**20:.0f} MiB; a whole chunk's index-K in fp32: "
                  f"{r['seed_chunk_fp32_gather_bytes'] / 2**20:.0f} MiB")
        meta = dict(device="cpu", python=platform.python_version(), torch=torch.__version__,
                    date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        _write(args.out, meta, [], [], acc)
        return 0

    facts = run_facts(args.seed)
    seed, cc = facts["seed"], torch.cuda.get_device_capability()
    print(describe(facts))
    gbps, _ = copy_bandwidth(args.copy_bytes, args.warmup, args.rep)
    tflops, mm_dtype = matmul_rate(8192, args.warmup, args.rep, fp8=True)
    print(f"ceilings: copy {gbps:.0f} GB/s (read+write), {mm_dtype} matmul {tflops:.0f} TFLOP/s")

    backends = load_backends(args.backends)
    for name, (fn, why) in backends.items():
        if fn is None:
            print(f"  {name}: not run ({why})")
    available = [n for n, (fn, _) in backends.items() if fn is not None]
    timed = [n for n in available if args.tiles == "card" or n in TRITON_BACKENDS]
    limit = tile_modes.target(args.tiles).shared_bytes if args.tiles != "card" else None
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [("decode", s) for s in (DECODE[:2] if args.quick else DECODE)] + \
             [("prefill", s) for s in (PREFILL[:1] if args.quick else PREFILL)]
    rows = []
    picks = []
    for kind, shape in shapes:
        c = make_inputs(kind, shape, gen)
        nbytes, flops = traffic(c)
        t_roof = max(nbytes / (gbps * 1e6), flops / (tflops * 1e9))        # ms
        bound = "memory" if nbytes / (gbps * 1e6) >= flops / (tflops * 1e9) else "compute"
        want = backends["torch"][0](c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, c["S"]) \
            if "torch" in available else None
        A = abs_sum(c) if want is not None else None
        times = {}
        for name in timed:
            fn = backends[name][0]
            call = lambda: fn(c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, c["S"], False)  # noqa: E731
            launches = []
            try:
                got, launches, err = tile_modes.checked(args.tiles, call)
                launches = tile_modes.launch_rows(launches)
                if launches:
                    print(f"  {kind} {shape} {name} {tile_modes.label(args.tiles)}: "
                          f"{tile_modes.describe(launches, limit)}")
                if err is not None:
                    raise err
                torch.cuda.synchronize()
                ok, err, ratio = (check(got, want, A, c["E"], c["S"], clean=name != "deepgemm")
                                  if want is not None else (None, None, None))
                del got
                if name == "torch" and kind == "prefill" and shape[0] * c["S"] > (1 << 26) and args.quick:
                    ms = None
                else:
                    with tile_modes.timing(args.tiles):
                        eager = ms = _bench(call, args.warmup, args.rep)
                        if args.graphs and name != "torch":
                            ms = _bench_graph(call, args.warmup, args.rep)
            except Exception as exc:
                print(f"  {kind} {shape} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                rows.append(dict(kind=kind, shape=list(shape), backend=name, error=f"{type(exc).__name__}: {exc}"[:500],
                                 launches=launches))
                continue
            times[name] = ms
            rows.append(dict(kind=kind, shape=list(shape), backend=name, ms=ms,
                             eager_ms=eager if ms is not None else None, correct=ok, max_abs_err=err,
                             max_err_over_abs_sum=ratio, bytes=nbytes, flops=flops, roofline_ms=t_roof,
                             bound=bound, frac_roofline=(t_roof / ms) if ms else None, launches=launches))
            tag = f" [{tile_modes.label(args.tiles)}]" if args.tiles != "card" else ""
            how = f" (eager {eager:.4f})" if ms is not None and ms != eager else ""
            print(f"  {kind:>7} {str(shape):>18} {name:>9}{tag}: {ms if ms is None else round(ms, 4)} ms{how}, "
                  f"{100 * t_roof / ms if ms else float('nan'):5.1f}% of {bound} roofline, correct={ok} "
                  f"(max|err| {err}, /A {ratio})")
        if times and args.tiles == "card":     # default vs fastest needs every backend
            fastest = min((t, n) for n, t in times.items() if t is not None)
            pick = default_pick([n for n in times if times[n] is not None], cc)
            ratio_pick = times[pick] / fastest[0] if pick else None
            picks.append(dict(kind=kind, shape=list(shape), fastest=fastest[1], fastest_ms=fastest[0], default=pick,
                              default_ms=times.get(pick), default_over_fastest=ratio_pick,
                              within_10pct=ratio_pick is not None and ratio_pick <= 1.10))
            print(f"  {kind:>7} {str(shape):>18} fastest {fastest[1]} ({fastest[0]:.4f} ms); default {pick} "
                  f"x{ratio_pick:.2f}")
        del c, want, A
        torch.cuda.empty_cache()

    mem = gpu_memory(args.warmup, args.rep, MEMORY_TOKENS, gen, with_time=not args.quick) \
        if not args.no_memory and args.tiles == "card" else []
    meta = dict(facts, copy_gbps=gbps, matmul_tflops=tflops, matmul_dtype=mm_dtype,
                not_run={n: why for n, (fn, why) in backends.items() if fn is None},
                versions=_versions(), tolerance=f"|err| <= 2^-10 * A (abs-sum) at valid positions",
                do_bench=dict(warmup_ms=args.warmup, rep_ms=args.rep, return_mode="median"),
                tiles=args.tiles, tiles_label=tile_modes.label(args.tiles), shared_limit=limit, graphs=args.graphs)
    _write(args.out, meta, rows, picks, accounting(), mem)
    bad = [r for r in rows if r.get("correct") is False or "error" in r]
    return 1 if bad else 0


def _versions():
    from importlib import metadata
    out = {}
    for d in ("tilelang", "sgl-deep-gemm", "apache-tvm-ffi", "sglang"):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out


def series(device: str, tiles: str = "card") -> str:
    """The results series of a run on DEVICE with --tiles TILES."""
    return f"indexer_{card_slug(device)}{tile_modes.suffix(tiles)}"


def _write(out_dir, meta, rows, picks, acc, mem=()):
    os.makedirs(out_dir, exist_ok=True)
    tiles = meta.get("tiles", "card")
    name = series(meta["device"], tiles)
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    archive_previous(out_dir, name)
    base = os.path.join(out_dir, f"{name}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, results=rows, default_vs_fastest=picks, reference_memory=list(mem),
                       reference_accounting=acc), f, indent=2)
    lines = [f"# Sparse indexer (fp8 paged MQA logits) on {meta['device']}"
             + (f": {meta['tiles_label']}" if tiles != "card" else ""), ""] + tile_modes.header_lines(tiles)
    if rows:
        lines += [
            f"- date {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, "
            f"cc {meta['compute_capability']}; seed {meta['seed']}; versions {meta['versions']}",
            f"- ceilings: copy {meta['copy_gbps']:.0f} GB/s (read+write), {meta['matmul_dtype']} matmul "
            f"{meta['matmul_tflops']:.0f} TFLOP/s; roofline = max(bytes / copy, FLOPs / matmul)",
            f"- not run: {meta['not_run'] or 'none'}",
            f"- correctness: {meta['tolerance']}; -inf past each row (capdispatch kernels)",
        ]
        if meta.get("graphs"):
            lines += ["- times: replays from a CUDA graph (do_bench_cudagraph median after eager warm-up) "
                      "for every backend but torch; the eager do_bench median beside them"]
        lines += ["", "| kind | shape | backend | ms | % of roofline | bound | correct | max err / A |"
                  + (" eager ms |" if meta.get("graphs") else ""),
                  "| --- | --- | --- | ---: | ---: | --- | --- | ---: |" + (" ---: |" if meta.get("graphs") else "")]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['kind']} | {r['shape']} | {_backend_cell(r['backend'], meta)} | error | | | "
                             f"{r['error'][:80]} | |")
                continue
            frac = f"{100 * r['frac_roofline']:.1f}" if r["frac_roofline"] else ""
            ms = f"{r['ms']:.4f}" if r["ms"] else ""
            ratio = f"{r['max_err_over_abs_sum']:.2g}" if r["max_err_over_abs_sum"] is not None else ""
            lines.append(f"| {r['kind']} | {r['shape']} | {_backend_cell(r['backend'], meta)} | {ms} | {frac} | "
                         f"{r['bound']} | "
                         f"{r['correct']} | {ratio} |"
                         + (f" {r['eager_ms']:.4f} |" if meta.get("graphs") and r.get("eager_ms") else
                            (" |" if meta.get("graphs") else "")))
        if picks:
            lines += ["", "| kind | shape | fastest | default pick | default / fastest |",
                      "| --- | --- | --- | --- | ---: |"]
        for p in picks:
            lines.append(f"| {p['kind']} | {p['shape']} | {p['fastest']} | {p['default']} | "
                         f"{p['default_over_fastest']:.2f} |")
    ent = [r for r in rows if r.get("launches")]
    if ent and tiles != "card":
        lines += tile_modes.entries_table(
            meta["tiles_label"], meta["shared_limit"], (("kind", "---"), ("shape", "---"), ("backend", "---")),
            [((r["kind"], r["shape"], r["backend"]), e) for r in ent for e in r["launches"]])
    if mem:
        lines += ["", "Torch reference memory (prefill, rows = tokens, context = tokens / 4):", "",
                  "| tokens | peak MiB | logits MiB | working set MiB | step plan MiB | within plan | ms |",
                  "| ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
        for m in mem:
            lines.append(f"| {m['tokens']} | {m['peak_bytes'] / 2**20:.0f} | {m['logits_bytes'] / 2**20:.0f} | "
                         f"{m['extra_bytes'] / 2**20:.0f} | {m['plan_step_bytes'] / 2**20:.0f} | {m['within_plan']} | "
                         f"{m['ms'] if m['ms'] is None else round(m['ms'], 1)} |")
    lines += ["", "Reference step plan (accounting; the same on any device):", "",
              "| tokens | context | rows/chunk | pages/step | step MiB | logits MiB | whole-chunk fp32 gather MiB |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a in acc:
        lines.append(f"| {a['tokens']} | {a['context']} | {a['query_chunk']} | {a['pages_per_step']} | "
                     f"{a['step_bytes'] / 2**20:.0f} | {a['logits_bytes'] / 2**20:.0f} | "
                     f"{a['seed_chunk_fp32_gather_bytes'] / 2**20:.0f} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {base}.json and {base}.md")


def _backend_cell(name, meta):
    return f"{name} ({meta['tiles_label']})" if meta.get("tiles", "card") != "card" else name


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--copy-bytes", type=int, default=2 << 30)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="fewer shapes, no reference timing at memory sizes")
    p.add_argument("--graphs", action="store_true",
                   help="time every backend but torch inside a CUDA graph too; the roofline fraction then "
                        "comes from the graph time (a decode call is shorter than its eager launch)")
    p.add_argument("--no-memory", action="store_true", help="skip the reference memory measurement")
    p.add_argument("--cpu-memory", action="store_true", help="only the reference's memory accounting")
    add_out(p)
    tile_modes.add_argument(p)
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    tile_modes.check_backends(p, a, TRITON_BACKENDS)
    if a.tiles != "card" and "torch" not in a.backends:
        a.backends = ["torch"] + list(a.backends)     # the reference that checks them
    return a


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the KV-cache quant/dequant backends (DeepSeek-V4 "V4" layout) on a CUDA GPU.

    python benchmarks/bench_kv_cache.py [--tokens 262144 1048576] [--page-size 256] [--out DIR]

What it does:
  1. measures device-to-device copy bandwidth (large torch copy, bytes read +
     written, median of triton.testing.do_bench) as the ceiling;
  2. for each token count, draws fresh random K rows (seed printed), a random slot
     permutation, and for each backend (torch, triton_u8, triton_fp8) checks the
     result against the torch reference (pool byte-identical, dequant bit-exact),
     then times kv_quant and kv_dequant (do_bench, warm-up, median);
  3. times SGLang's dequantize_k_cache_paged_dsv4 side by side when importable;
  4. writes results JSON + markdown into --out (default benchmarks/results).

With --tiles 99kb only the Triton backends run (the torch reference still checks them),
with the launch-table entries and shared-memory limit of the 99 KB cards (SM86, SM89,
SM120; tile_modes.py); the results are the series kv_cache_<device>_99kb.

Bytes counted per token: quant reads the bf16 K row (2 x v4_layout.DIM) and its int64
slot (8) and writes one pool row (v4_layout.TOKEN_BYTES); dequant reads the row and the
slot and writes the K row.

Importable without a GPU; it only needs CUDA when run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from ceilings import bench as _bench, copy_bandwidth, describe, run_facts  # noqa: E402 (the script's own folder)
from results_dir import add_out, archive_previous  # noqa: E402 (the script's own folder)
from report import card_slug  # noqa: E402 (the script's own folder)
import tile_modes  # noqa: E402 (the script's own folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import capdispatch as cd  # noqa: E402 (after the path insertion)
from capdispatch import bench  # noqa: E402

CI = bench.inputs
L = bench.v4_layout

K_ROW_BYTES = L.DIM * 2     # one bf16 K row: what kv_quant reads and kv_dequant writes
SLOT_BYTES = 8              # one int64 slot index per token
QUANT_BYTES_PER_TOKEN = K_ROW_BYTES + SLOT_BYTES + L.TOKEN_BYTES
DEQUANT_BYTES_PER_TOKEN = L.TOKEN_BYTES + SLOT_BYTES + K_ROW_BYTES
BACKENDS = ("torch", "triton_u8", "triton_fp8")
TRITON_BACKENDS = ("triton_u8", "triton_fp8")   # capdispatch's Triton kernels: what --tiles changes


def _ops(backend):
    """The kernels exactly as the hot path gets them: capdispatch.bind, explicit."""
    import capdispatch as cd
    return (cd.bind("kv_quant", "cuda:0", backend=backend),
            cd.bind("kv_dequant", "cuda:0", backend=backend))


def _sglang_dequant():
    """SGLang's dequant kernel, or (None, why)."""
    try:
        from sglang.kernels.ops.attention.dsv4.dequant_k_cache import dequantize_k_cache_paged_dsv4
    except Exception as exc:  # ImportError, or its own import-time failures
        return None, f"{type(exc).__name__}: {exc}"
    return dequantize_k_cache_paged_dsv4, None


def rand_k(n, gen):
    return CI.rand_k(n, gen, "cuda")


_same_bf16 = CI.same_bf16


def slots(pattern, n, num_pages, page_size, gen):
    """Token slots to write/read. 'random': any slot of the pool (the worst case).
    'paged': whole pages in random order, slots in order inside a page — how a
    paged allocator lays out a request's tokens."""
    import torch
    if pattern == "random":
        return torch.randperm(num_pages * page_size, generator=gen, device="cuda")[:n]
    pages = torch.randperm(num_pages, generator=gen, device="cuda")
    inner = torch.arange(page_size, device="cuda")
    return (pages[:, None] * page_size + inner[None, :]).reshape(-1)[:n]


def run(args):
    import torch

    if not torch.cuda.is_available():
        print("bench_kv_cache: needs a CUDA device", file=sys.stderr)
        return 2

    from capdispatch.backends.kv_cache import reference as R

    facts = run_facts(args.seed)
    seed, cc = facts["seed"], torch.cuda.get_device_capability()
    print(describe(facts))

    copy_gbps, copy_ms = copy_bandwidth(args.copy_bytes, args.warmup, args.rep)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s (read+write, {args.copy_bytes / 2**30:.1f} GiB, {copy_ms:.3f} ms)")

    backends = [b for b in args.backends if not (b == "triton_fp8" and cc < (8, 9))]
    limit = None
    if args.tiles != "card":
        backends = [b for b in backends if b in TRITON_BACKENDS]
        limit = tile_modes.target(args.tiles).shared_bytes
        print(f"tiles: {tile_modes.label(args.tiles)} (at most {limit} B of shared memory per block)")
    sglang_fn, sglang_why = _sglang_dequant() if args.tiles == "card" else (None, "not timed with --tiles")
    if sglang_fn is None:
        print(f"sglang dequant not timed: {sglang_why}")

    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    P = args.page_size
    for n, pattern in [(n, s) for n in args.tokens for s in args.slots]:
        num_pages = math.ceil(n / P)
        k = rand_k(n, gen)
        loc = slots(pattern, n, num_pages, P, gen)
        ref_pool = R.new_pool(num_pages, P, "cuda")
        R.kv_quant(k, ref_pool, loc, P)
        ref_out = R.kv_dequant(ref_pool, loc, P)
        pool = torch.empty_like(ref_pool)
        out = torch.empty_like(ref_out)
        times = {}
        for backend in backends:
            quant, dequant = _ops(backend)
            pool.zero_()
            _, lq, eq = tile_modes.checked(args.tiles, lambda: quant(k, pool, loc, P))
            ok_q = eq is None and bool(torch.equal(pool, ref_pool))
            out.fill_(float("nan"))
            _, ld, ed = tile_modes.checked(args.tiles, lambda: dequant(ref_pool, loc, P, out=out))
            ok_d = ed is None and _same_bf16(out, ref_out)
            launches = {"kv_quant": tile_modes.launch_rows(lq), "kv_dequant": tile_modes.launch_rows(ld)}
            errors = {"kv_quant": eq, "kv_dequant": ed}
            for op, ls in launches.items():
                if ls:
                    print(f"  {backend} {op} {tile_modes.label(args.tiles)}: {tile_modes.describe(ls, limit)}")
            if eq is not None or ed is not None:
                for op, e in errors.items():
                    if e is not None:
                        print(f"  n={n} {backend} {op}: FAILED {type(e).__name__}: {e}")
                        rows.append(dict(tokens=n, slots=pattern, page_size=P, backend=backend, op=op,
                                         error=f"{type(e).__name__}: {e}", correct=False, launches=launches[op]))
                continue
            if not (ok_q and ok_d):
                print(f"  {backend}: CORRECTNESS FAILURE n={n} quant_ok={ok_q} dequant_ok={ok_d}")
            with tile_modes.timing(args.tiles):
                tq = _bench(lambda: quant(k, pool, loc, P), args.warmup, args.rep)
                td = _bench(lambda: dequant(ref_pool, loc, P, out=out), args.warmup, args.rep)
            times[backend] = (tq, td)
            for op, ms, nbytes in (("kv_quant", tq, QUANT_BYTES_PER_TOKEN),
                                   ("kv_dequant", td, DEQUANT_BYTES_PER_TOKEN)):
                gbps = n * nbytes / ms / 1e6
                rows.append(dict(tokens=n, slots=pattern, page_size=P, backend=backend, op=op, ms=ms, gbps=gbps,
                                 frac_copy=gbps / copy_gbps, correct=ok_q if op == "kv_quant" else ok_d,
                                 launches=launches[op]))
                tag = f" [{tile_modes.label(args.tiles)}]" if args.tiles != "card" else ""
                print(f"  n={n:>8} {pattern:>6} {backend:>10}{tag} {op:>10}: {ms:8.4f} ms {gbps:7.0f} GB/s "
                      f"{100 * gbps / copy_gbps:5.1f}% of copy  correct={rows[-1]['correct']}")
        if sglang_fn is not None:
            try:
                out.fill_(float("nan"))
                sglang_fn(ref_pool, loc, P, out=out)
                ok = _same_bf16(out, ref_out)
                ms = _bench(lambda: sglang_fn(ref_pool, loc, P, out=out), args.warmup, args.rep)
                gbps = n * DEQUANT_BYTES_PER_TOKEN / ms / 1e6
                rows.append(dict(tokens=n, slots=pattern, page_size=P, backend="sglang", op="kv_dequant", ms=ms, gbps=gbps,
                                 frac_copy=gbps / copy_gbps, correct=ok))
                print(f"  n={n:>8} {pattern:>6} {'sglang':>10} {'kv_dequant':>10}: {ms:8.4f} ms {gbps:7.0f} GB/s "
                      f"{100 * gbps / copy_gbps:5.1f}% of copy  correct={ok}")
            except Exception as exc:  # report, keep the other results
                print(f"  sglang dequant failed: {type(exc).__name__}: {exc}")
        if "triton_u8" in times and "triton_fp8" in times:
            (uq, ud), (fq, fd) = times["triton_u8"], times["triton_fp8"]
            print(f"  n={n:>8} {pattern:>6} time ratio triton_u8/triton_fp8: quant {uq / fq:.3f}, dequant {ud / fd:.3f}")
            for op, r in (("kv_quant", uq / fq), ("kv_dequant", ud / fd)):
                rows.append(dict(tokens=n, slots=pattern, page_size=P, backend="triton_u8/triton_fp8", op=op, ratio=r))
        del k, loc, ref_pool, ref_out, pool, out
        torch.cuda.empty_cache()

    meta = dict(
        facts, page_size=P, copy_gbps=copy_gbps, copy_bytes=args.copy_bytes,
        bytes_per_token={"kv_quant": QUANT_BYTES_PER_TOKEN, "kv_dequant": DEQUANT_BYTES_PER_TOKEN},
        sglang=None if sglang_fn is not None else sglang_why,
        do_bench=dict(warmup_ms=args.warmup, rep_ms=args.rep, return_mode="median"),
        tiles=args.tiles, tiles_label=tile_modes.label(args.tiles), shared_limit=limit,
    )
    _write(args.out, meta, rows)
    return 0 if all(r.get("correct", True) for r in rows) else 1


def series(device: str, tiles: str = "card") -> str:
    """The results series of a run on DEVICE with --tiles TILES."""
    return f"kv_cache_{card_slug(device)}{tile_modes.suffix(tiles)}"


def _write(out_dir, meta, rows):
    os.makedirs(out_dir, exist_ok=True)
    tiles = meta.get("tiles", "card")
    name = series(meta["device"], tiles)
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    archive_previous(out_dir, name)
    base = os.path.join(out_dir, f"{name}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=2)
    lines = [
        f"# KV-cache kernels on {meta['device']}" + (f": {meta['tiles_label']}" if tiles != "card" else ""),
        "",
        f"- date: {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, "
        f"cc {meta['compute_capability']}; seed {meta['seed']}; page size {meta['page_size']}",
        f"- copy bandwidth (read+write): {meta['copy_gbps']:.0f} GB/s",
        f"- bytes/token: quant {QUANT_BYTES_PER_TOKEN}, dequant {DEQUANT_BYTES_PER_TOKEN}; "
        "timings: triton.testing.do_bench median",
        f"- sglang: {'timed' if meta['sglang'] is None else 'not timed (' + meta['sglang'] + ')'}",
    ] + tile_modes.header_lines(tiles) + [
        "",
        "| tokens | slots | op | backend | ms | GB/s | % of copy | correct |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "ratio" in r:
            continue
        if "error" in r:
            lines.append(f"| {r['tokens']} | {r['slots']} | {r['op']} | {_backend_cell(r['backend'], meta)} | error | | | "
                         f"{r['error']} |")
            continue
        lines.append(f"| {r['tokens']} | {r['slots']} | {r['op']} | {_backend_cell(r['backend'], meta)} | {r['ms']:.4f} | "
                     f"{r['gbps']:.0f} | "
                     f"{100 * r['frac_copy']:.1f} | {r['correct']} |")
    ratios = [r for r in rows if "ratio" in r]
    if ratios:
        lines += ["", "| tokens | slots | op | time triton_u8 / triton_fp8 |", "| ---: | --- | --- | ---: |"]
        lines += [f"| {r['tokens']} | {r['slots']} | {r['op']} | {r['ratio']:.3f} |" for r in ratios]
    ent = [r for r in rows if r.get("launches")]
    if ent and tiles != "card":
        lines += tile_modes.entries_table(
            meta["tiles_label"], meta["shared_limit"],
            (("tokens", "---:"), ("slots", "---"), ("op", "---"), ("backend", "---")),
            [((r["tokens"], r["slots"], r["op"], r["backend"]), e) for r in ent for e in r["launches"]])
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {base}.json and {base}.md")


def _backend_cell(name, meta):
    return f"{name} ({meta['tiles_label']})" if meta.get("tiles", "card") != "card" else name


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[262144, 1048576])
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--copy-bytes", type=int, default=2 << 30, help="bytes per copy for the bandwidth ceiling")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=200, help="do_bench measuring time, ms")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--slots", nargs="+", default=["random", "paged"], choices=("random", "paged"))
    add_out(p)
    tile_modes.add_argument(p)
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    tile_modes.check_backends(p, a, TRITON_BACKENDS)
    return a


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

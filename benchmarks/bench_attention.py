"""Benchmark the attention ops (sparse_prefill, decode_mla) on a CUDA GPU at DeepSeek-V4 shapes.

    python benchmarks/bench_attention.py [--out DIR] [--ops sparse_prefill decode_mla]
                                         [--quick] [--tune] [--graphs] [--tiles {card,99kb}]
                                         [--peer-max-tokens T]

What it does:
  1. measures the ceilings: device-to-device copy bandwidth (a large torch copy, bytes
     read + written) and the dense bf16 matmul rate (torch.matmul 8192^3);
  2. asks capdispatch which backends of each op can run on cuda:0 (a fresh registry with
     this op package, real import checks) and says why the others cannot;
  3. for each shape draws fresh random inputs (seed printed; DeepSeek-V4: 64 heads, head
     dim 512, top-k 512; decode pools written by kv_quant, page size 256 for the SWA pool
     with a 128-entry window list, page size 64 for the c4 compressed pool with top-k 512),
     checks every runnable backend against the torch reference (out relative error
     <= 1e-2, statistics within 1e-3: the tests' bounds), then times it
     (triton.testing.do_bench median; with --graphs also inside a CUDA graph);
  4. reports for each backend: time, fraction of the roofline
        roofline time = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate)
        bytes  = the distinct K/V rows the inputs reference, each read once (1024 B
                 bf16 for prefill, v4_layout.TOKEN_BYTES per pool token for decode) + q + out (1024 B
                 per token x head) + indices (4 B per entry) + statistics
        FLOPs  = 2 x 2 x tokens x heads x entries x 512 (Q.K^T and P.V)
     which term bounds it, and the Triton / torch speedup;
  5. with --tune, sweeps Triton launch configurations per shape and reports the best
     (with --tiles 99kb, among those that fit the 99 KB cards' shared memory);
  6. for decode, times two comparison rows beside the backends (outputs checked first,
     the lse conventions being the adapters'): FlashMLA as SGLang calls it, with the
     triton_fp8 / FlashMLA time ratio in CUDA graphs (the bar: within 1.2x), and SGLang
     0.5.23's own portable Triton decode for the V4 pool
     (sglang.kernels.ops.attention.flash_mla_sm120_triton, its opt-in SM120 path) up to
     --peer-max-tokens query tokens (default 512: it takes ~0.5 s a call at 4096); and
     the flashmla adapter as a serving model calls it (checks=False, inside one
     capdispatch.batch() whose first call builds the schedule before timing), against
     FlashMLA as SGLang calls it (the adapter bar: within 1.1x in CUDA graphs);
  7. writes JSON + markdown into --out (default benchmarks/results).

With --tiles 99kb only the Triton backends run, with the launch-table entries the 99 KB
cards (SM86, SM89, SM120) get and their shared-memory limit (tile_modes.py); each row
names the entry that ran with its shared memory, registers and spills; the results are
the series attention_<card>_99kb.

Importable without a GPU; it only needs CUDA when run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys

from ceilings import bench as _bench, copy_bandwidth, describe, matmul_rate, run_facts  # noqa: E402 (the script's own folder)
from results_dir import add_out, archive_previous  # noqa: E402 (the script's own folder)
from report import card_slug  # noqa: E402 (the script's own folder)
import tile_modes  # noqa: E402 (the script's own folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import capdispatch as cd  # noqa: E402 (after the path insertion)
from capdispatch import bench  # noqa: E402

CI = bench.inputs

SCALE = CI.SCALE
H = CI.HEADS
PREFILL_SHAPES = [  # (queries, s_kv, topk)
    dict(s=4096, s_kv=65536, topk=512),
    dict(s=16384, s_kv=65536, topk=512),
    dict(s=4096, s_kv=65536, topk=640),     # top-k 512 + SWA window 128, as SGLang combines them
]
DECODE_SHAPES = [   # tokens; SWA list 128 over page-256 pool + c4 list 512 over page-64 pool
    dict(tokens=1), dict(tokens=8), dict(tokens=32), dict(tokens=64), dict(tokens=128),
    dict(tokens=4096),   # an extend through the paged path (what SM120 does)
]
QUICK_PREFILL = PREFILL_SHAPES[:1]
QUICK_DECODE = [DECODE_SHAPES[0], DECODE_SHAPES[2], DECODE_SHAPES[5]]
SWA_TOPK, SWA_PAGE, C4_TOPK, C4_PAGE = CI.SWA_TOPK, 256, CI.C4_TOPK, 64
C4_TOKENS = 65536   # 256k context / 4

# Candidates for --tune: the measured winners and runners-up of the 2026-11-29 H200 sweeps
# (64-head tiles for prefill and one-pass decode, small tiles for split-K decode) and
# the portable tiles (kernels' PORTABLE_CONFIGS).
TUNE_CONFIGS = [dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=st) for bh, bn, w, st in (
    (64, 64, 8, 1), (64, 32, 8, 1), (32, 32, 4, 2), (32, 32, 4, 3), (32, 32, 8, 2), (32, 16, 8, 1),
    (16, 32, 4, 2), (16, 16, 4, 2), (16, 32, 2, 2), (16, 16, 4, 1),
)]


def registry():
    """The built-in ops and backends, no plugins."""
    return bench.registry.build(plugins=False)


def _bench_graph(fn, rep):
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def runnable(op, reg):
    """{backend: None if it can run on cuda:0 else the reasons}."""
    import capdispatch as cd
    res = cd.resolve(op, "cuda:0", registry=reg)
    out = {}
    for c in res.candidates:
        out[c.backend] = None if c.ok else "; ".join(ch.message or ch.code for ch in c.checks if not ch.ok)
    return out


# --------------------------------------------------------------------------- #
# Inputs and accounting
# --------------------------------------------------------------------------- #
def prefill_inputs(shape, gen):
    import torch
    s, topk = shape["s"], shape["topk"]
    args = CI.prefill_args(s, gen, "cuda", shape["s_kv"], topk)
    idx = args[2]
    rows = int(torch.unique(idx[idx >= 0]).numel())
    return args, dict(tokens=s, entries=topk, rows=rows)


def decode_inputs(shape, gen):
    import torch
    T = shape["tokens"]
    args = CI.decode_args(T, gen, "cuda", SWA_PAGE, C4_PAGE, C4_TOKENS)
    rows = int(torch.unique(args[2]).numel()) + int(torch.unique(args[8]).numel())
    return args, dict(tokens=T, entries=SWA_TOPK + C4_TOPK, rows=rows)


def flashmla_as_sglang(inputs):
    """FlashMLA's decode kernel called the way SGLang 0.5.23 serves with it, for comparison
    with the adapter: index lists already clean (-1 masked, 64-aligned; the benchmark's
    are), one ``FlashMLASchedMeta`` filled by the first call and reused (SGLang computes
    it once per batch, not per layer). Returns a callable, or None without flash_mla."""
    try:
        import flash_mla
    except ImportError:
        return None
    import torch
    from capdispatch.backends.decode_mla.library_args import pool_view as _pool_view
    q, pool, idx, ps, scale, lengths, sink, cpool, cidx, cps, clengths = inputs
    assert idx.shape[-1] % 64 == 0 and cidx.shape[-1] % 64 == 0 and idx.dtype == torch.int32
    sched = flash_mla.get_mla_metadata()[0]
    kv, ckv = _pool_view(pool, ps), _pool_view(cpool, cps)

    def call():
        return flash_mla.flash_mla_with_kvcache(
            q=q, k_cache=kv, block_table=None, cache_seqlens=None, head_dim_v=512,
            tile_scheduler_metadata=sched, softmax_scale=scale, is_fp8_kvcache=True, indices=idx,
            attn_sink=sink, topk_length=lengths, use_legacy=True, extra_k_cache=ckv,
            extra_indices_in_kvcache=cidx, extra_topk_length=clengths)
    call()
    return call


ADAPTER_IN_BATCH = "flashmla adapter (checks=False, one schedule per batch: capdispatch.batch())"
ADAPTER_BAR = 1.1   # the target: a library adapter within 1.1x of the library as SGLang calls it, in graphs


def adapter_in_one_batch(op, shape, inputs, want, reg, lib_ms, lib_gms, args):
    """The flashmla adapter as a serving model calls it: bound with checks=False, inside
    one ``capdispatch.batch()`` whose first call builds the schedule (SGLang's per-batch
    work, done before timing and counted apart); rows for the table and the 1.1x bar."""
    import capdispatch as cd
    fn = cd.bind(op, "cuda:0", backend="flashmla", checks=False, registry=reg)
    with cd.batch():
        got = fn(*inputs)
        ok = _check(op, got, want)[0]
        ms = _bench(lambda: fn(*inputs), args.warmup, args.rep)
        gms = _bench_graph(lambda: fn(*inputs), args.rep) if args.graphs else None
    print(f"  {op} {shape} {ADAPTER_IN_BATCH}: {ms:.4f} ms" + (f" (graph {gms:.4f})" if gms is not None else "")
          + f" correct={ok}")
    rows = [dict(op=op, shape=shape, backend=ADAPTER_IN_BATCH, ms=ms, graph_ms=gms, correct=ok, not_a_backend=True)]
    if ok and gms is not None and lib_gms:
        ratio = gms / lib_gms
        rows.append(dict(op=op, shape=shape, adapter_bar="flashmla adapter in one batch / flashmla as SGLang calls it",
                         adapter_graph_ms=gms, flashmla_graph_ms=lib_gms, ratio=ratio, target=ADAPTER_BAR,
                         met=ratio <= ADAPTER_BAR))
    return rows


SGLANG_PEER = "sglang.kernels.ops.attention.flash_mla_sm120_triton"
PEER_NAME = "sglang triton decode (flash_mla_sm120_triton, library call)"
FLASHMLA_BAR = 1.2      # the target: triton_fp8 within 1.2x of FlashMLA as SGLang calls it, in CUDA graphs
TRITON_BACKENDS = {"sparse_prefill": ("triton",), "decode_mla": ("triton", "triton_fp8")}


def sglang_peer(inputs):
    """SGLang's own portable Triton decode over the same pools (its SM120 opt-in path):
    (callable, None), or (None, why) when SGLang is not importable."""
    try:
        peer = importlib.import_module(SGLANG_PEER).flash_mla_sparse_decode_triton
    except Exception as exc:   # noqa: BLE001 - any import failure is a skip with its reason
        return None, f"{SGLANG_PEER} not importable: {type(exc).__name__}: {exc}"
    from capdispatch.backends.decode_mla.library_args import pool_view as _pool_view
    q, pool, idx, ps, scale, lengths, sink, cpool, cidx, cps, clengths = inputs
    kv, ckv = _pool_view(pool, ps), _pool_view(cpool, cps)

    def call():
        return peer(q, kv, idx, lengths, sink, 512, scale, extra_k_cache=ckv, extra_indices=cidx,
                    extra_topk_length=clengths)
    return call, None


def work(op, acc):
    T, n = acc["tokens"], acc["entries"]
    flops = 2 * 2 * T * H * n * 512
    row = 1024 if op == "sparse_prefill" else bench.v4_layout.TOKEN_BYTES
    nbytes = acc["rows"] * row + T * n * 4 + T * H * (1024 + 1024) + T * H * (8 if op == "sparse_prefill" else 4)
    return flops, nbytes


def _check(op, got, want):
    return CI.attention_errors(got, want)


# --------------------------------------------------------------------------- #
# Run
# --------------------------------------------------------------------------- #
def run(args):
    import torch

    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA device", file=sys.stderr)
        return 2
    import capdispatch as cd

    facts = run_facts(args.seed)
    seed = facts["seed"]
    print(describe(facts))
    bw, _ = copy_bandwidth(args.copy_bytes, args.warmup, args.rep)
    tflops, _ = matmul_rate(8192, args.warmup, args.rep)
    print(f"copy bandwidth {bw:.0f} GB/s (read+write); bf16 matmul {tflops:.0f} TFLOP/s")

    reg = registry()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows, tune_rows, availability = [], [], {}
    tiles_label = tile_modes.label(args.tiles)
    tag = f" [{tiles_label}]" if args.tiles != "card" else ""
    tgt = tile_modes.target(args.tiles)
    limit = tgt.shared_bytes if tgt is not None else None
    if tgt is not None:
        print(f"tiles: {tiles_label} (compute capability {tgt.capability[0]}.{tgt.capability[1]}, "
              f"at most {limit} B of shared memory per block; only the Triton backends run)")
    for op in args.ops:
        avail = runnable(op, reg)
        if args.tiles != "card":     # only capdispatch's Triton kernels have launch tables
            avail = {b: w for b, w in avail.items() if b in TRITON_BACKENDS[op]}
        availability[op] = avail
        for b, why in avail.items():
            print(f"[{op}] {b}: {'runnable' if why is None else 'not runnable: ' + why}")
        shapes = (QUICK_PREFILL if args.quick else PREFILL_SHAPES) if op == "sparse_prefill" else \
            (QUICK_DECODE if args.quick else DECODE_SHAPES)
        if op == "decode_mla" and args.decode_tokens:
            shapes = [dict(tokens=t) for t in args.decode_tokens]
        ref = cd.bind(op, "cuda:0", backend="torch", registry=reg)
        for shape in shapes:
            make = prefill_inputs if op == "sparse_prefill" else decode_inputs
            inputs, acc = make(shape, gen)
            flops, nbytes = work(op, acc)
            t_bw, t_fl = nbytes / bw / 1e6, flops / tflops / 1e9           # ms
            roof = max(t_bw, t_fl)
            bound = "memory" if t_bw >= t_fl else "compute"
            want = ref(*inputs)
            times, gtimes = {}, {}
            for backend, why in avail.items():
                if why is not None:
                    continue
                fn = cd.bind(op, "cuda:0", backend=backend, registry=reg)
                launches = []
                try:
                    got, launches, err = tile_modes.checked(args.tiles, lambda: fn(*inputs))
                    launches = tile_modes.launch_rows(launches)
                    if launches:
                        print(f"    {backend} {tile_modes.label(args.tiles)}: {tile_modes.describe(launches, limit)}")
                    if err is not None:
                        raise err
                    ok, rel, serr = _check(op, got, want)
                    with tile_modes.timing(args.tiles):
                        ms = _bench(lambda: fn(*inputs), args.warmup, args.rep)
                        gms = None
                        if args.graphs:
                            try:
                                gms = _bench_graph(lambda: fn(*inputs), args.rep)
                            except Exception as exc:   # noqa: BLE001 - report, keep going
                                print(f"    graph timing failed for {backend}: {type(exc).__name__}: {exc}")
                except Exception as exc:   # noqa: BLE001 - a backend failing must not hide the others
                    print(f"  {op} {shape} {backend}: FAILED {type(exc).__name__}: {exc}")
                    rows.append(dict(op=op, shape=shape, backend=backend, error=f"{type(exc).__name__}: {exc}",
                                     tiles=tiles_label, launches=launches))
                    continue
                times[backend] = ms
                if gms is not None:
                    gtimes[backend] = gms
                rows.append(dict(op=op, shape=shape, backend=backend, ms=ms, graph_ms=gms, correct=ok,
                                 out_rel_err=rel, stat_abs_err=serr, flops=flops, bytes=nbytes,
                                 roofline_ms=roof, bound=bound, frac_roofline=roof / ms,
                                 tiles=tiles_label, launches=launches))
                print(f"  {op} {shape} {backend:>22}{tag}: {ms:9.4f} ms"
                      + (f" (graph {gms:.4f})" if gms is not None else "")
                      + f"  {100 * roof / ms:5.1f}% of {bound} roofline  correct={ok} (rel {rel:.1e}, stat {serr:.1e})")
            served_g = None
            if op == "decode_mla" and "flashmla" in times:
                kfn = flashmla_as_sglang(inputs)
                if kfn is not None:
                    o = kfn()[0]   # the output only: the adapter owns the lse conventions
                    kok = _check(op, (o,), want[:1])[0]
                    kms = _bench(kfn, args.warmup, args.rep)
                    kgms = _bench_graph(kfn, args.rep) if args.graphs else None
                    rows.append(dict(op=op, shape=shape, backend="flashmla (kernel as SGLang calls it)",
                                     ms=kms, graph_ms=kgms, correct=kok, not_a_backend=True))
                    print(f"  {op} {shape} flashmla kernel as SGLang calls it: {kms:.4f} ms"
                          + (f" (graph {kgms:.4f})" if kgms is not None else "") + f" output correct={kok}")
                    served_g = kgms if kok else None
                    arow = adapter_in_one_batch(op, shape, inputs, want, reg, kms, kgms, args)
                    if arow:
                        rows += arow
                    if kok and kgms is not None and "triton_fp8" in gtimes:
                        ratio = gtimes["triton_fp8"] / kgms
                        rows.append(dict(op=op, shape=shape, bar="triton_fp8 / flashmla as SGLang calls it",
                                         triton_fp8_graph_ms=gtimes["triton_fp8"], flashmla_graph_ms=kgms,
                                         ratio=ratio, target=FLASHMLA_BAR, met=ratio <= FLASHMLA_BAR))
                        print(f"  {op} {shape}: FlashMLA bar in CUDA graphs: triton_fp8 / FlashMLA = {ratio:.2f}x "
                              f"(target <= {FLASHMLA_BAR}x: {'met' if ratio <= FLASHMLA_BAR else 'missed'})")
            if op == "decode_mla" and args.tiles == "card":
                rows += peer_rows(op, shape, inputs, want, times, gtimes, args)
            if "torch" in times:
                for b, ms in times.items():
                    if b != "torch":
                        rows.append(dict(op=op, shape=shape, backend=b, speedup_vs_torch=times["torch"] / ms))
                        print(f"  {op} {shape} {b:>22}: {times['torch'] / ms:7.1f}x torch")
            # Fastest-vs-default needs every backend: not asked in a --tiles run (Triton only).
            fastest = min(times, key=times.get) if times and args.tiles == "card" else None
            default = cd.resolve(op, "cuda:0", registry=reg).backend
            if fastest:
                rows.append(dict(op=op, shape=shape, fastest=fastest, default=default,
                                 default_over_fastest=times.get(default, math.inf) / times[fastest]))
                print(f"  {op} {shape}: fastest {fastest}, default {default} "
                      f"({times.get(default, math.inf) / times[fastest]:.2f}x the fastest)")
            # Inside CUDA graphs (how SGLang runs decode): the same question without launch overhead.
            gfast = min(gtimes, key=gtimes.get) if gtimes and args.tiles == "card" else None
            if gfast and default in gtimes:
                rows.append(dict(op=op, shape=shape, fastest_graph=gfast, default=default,
                                 default_over_fastest_graph=gtimes[default] / gtimes[gfast]))
                print(f"  {op} {shape}: in CUDA graphs fastest {gfast}, default {default} "
                      f"({gtimes[default] / gtimes[gfast]:.2f}x the fastest)")
            # On SM90 the SGLang adapter keeps SGLang's own FlashMLA decode call: that, not our
            # adapter, is how the flashmla default runs in serving.
            if gfast and default == "flashmla" and served_g is not None:
                rows.append(dict(op=op, shape=shape, served_default="flashmla as SGLang calls it",
                                 fastest_backend_graph=gfast, served_over_fastest_graph=served_g / gtimes[gfast]))
                print(f"  {op} {shape}: in CUDA graphs the default as served (SGLang's FlashMLA call) is "
                      f"{served_g / gtimes[gfast]:.2f}x the fastest backend ({gfast})")
            if args.tune:
                tune_rows += tune(op, inputs, shape, want, args)
            del inputs, want
            torch.cuda.empty_cache()

    meta = dict(facts, copy_gbps=bw, bf16_tflops=tflops, heads=H, availability=availability,
                do_bench=dict(warmup_ms=args.warmup, rep_ms=args.rep, return_mode="median"),
                tiles=args.tiles, tiles_label=tiles_label, shared_limit=limit,
                peer_max_tokens=args.peer_max_tokens)
    _write(args.out, meta, rows, tune_rows)
    return 0 if all(r.get("correct", True) and "error" not in r for r in rows) else 1


def peer_rows(op, shape, inputs, want, times, gtimes, args):
    """The SGLang peer's rows for one decode shape: timed (eager, and in CUDA graphs with
    --graphs) after its output is checked against the reference, or why not."""
    T = shape["tokens"]
    base = dict(op=op, shape=shape, backend=PEER_NAME, not_a_backend=True)
    if T > args.peer_max_tokens:
        why = (f"not timed above --peer-max-tokens {args.peer_max_tokens} "
               "(it took about 0.5 s a call at 4096 tokens on an H200)")
        print(f"  {op} {shape} {PEER_NAME}: {why}")
        return [dict(base, skipped=why)]
    call, why = sglang_peer(inputs)
    if call is None:
        print(f"  {op} {shape} {PEER_NAME}: skipped: {why}")
        return [dict(base, skipped=why)]
    try:
        o = call()[0]      # the output only: the lse conventions are the adapters'
        ok, rel, _ = _check(op, (o,), want[:1])
        ms = _bench(call, args.warmup, args.rep)
        gms = _bench_graph(call, args.rep) if args.graphs else None
    except Exception as exc:   # noqa: BLE001 - a failing peer is reported, the run goes on
        print(f"  {op} {shape} {PEER_NAME}: FAILED {type(exc).__name__}: {exc}")
        return [dict(base, peer_error=f"{type(exc).__name__}: {exc}")]
    row = dict(base, ms=ms, graph_ms=gms, correct=ok, out_rel_err=rel,
               tolerance="output relative error <= 1e-2 (Frobenius), the decode backends' bound; lse not compared")
    ref_t = gtimes.get("triton_fp8") if gms is not None else times.get("triton_fp8")
    if ref_t:
        row["over_triton_fp8"] = (gms if gms is not None else ms) / ref_t
    print(f"  {op} {shape} {PEER_NAME}: {ms:.4f} ms" + (f" (graph {gms:.4f})" if gms is not None else "")
          + f" output correct={ok} (rel {rel:.1e}, bound 1e-2)"
          + (f"; {row['over_triton_fp8']:.1f}x triton_fp8's time" if "over_triton_fp8" in row else ""))
    return [row]


def tune(op, inputs, shape, want, args):
    """Time the Triton backends with each launch configuration (others unchanged)."""
    from capdispatch.backends.decode_mla import triton_kernels as DK
    from capdispatch.backends.sparse_attention import kernels as K
    from capdispatch.backends.sparse_prefill import triton_kernels as PK
    out = []
    fns = [("triton", PK.sparse_prefill)] if op == "sparse_prefill" else \
        [("triton", DK.decode_mla_u8), ("triton_fp8", DK.decode_mla_fp8)]
    if args.tune_backends and op == "decode_mla":
        fns = [f for f in fns if f[0] in args.tune_backends]
    saved = K.device_configs
    try:
        for name, fn in fns:
            best = None
            for cfg in TUNE_CONFIGS:
                # Every call kind (prefill, decode, decode_split) gets this one configuration.
                K.device_configs = lambda device, kind, tokens=None, cfg=cfg: (cfg,)
                K.forget_plans()
                PK.forget_plans()
                DK.forget_plans()
                try:
                    # With --tiles 99kb a configuration over those cards' shared memory is
                    # rejected here, as OutOfResources would reject it there.
                    got, _, err = tile_modes.checked(args.tiles, lambda: fn(*inputs))
                    if err is not None:
                        raise err
                    ok = _check(op, got, want)[0]
                    with tile_modes.timing(args.tiles):
                        ms = _bench(lambda: fn(*inputs), args.warmup, args.rep)
                        # Small decode batches are launch-bound in eager mode: rank them as SGLang
                        # runs them, inside a CUDA graph, when --graphs is given.
                        gms = _bench_graph(lambda: fn(*inputs), args.rep) if args.graphs else None
                except Exception as exc:   # noqa: BLE001 - e.g. does not fit shared memory
                    print(f"    tune {name} {cfg}: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                out.append(dict(op=op, shape=shape, backend=name, config=cfg, ms=ms, graph_ms=gms, correct=ok,
                                tiles=tile_modes.label(args.tiles)))
                print(f"    tune {op} {shape} {name} {cfg}: {ms:.4f} ms"
                      + (f" (graph {gms:.4f})" if gms is not None else "") + f" correct={ok}")
                key = gms if gms is not None else ms
                if ok and (best is None or key < best[0]):
                    best = (key, cfg)
            if best:
                print(f"  tune {op} {shape} {name}: best {best[1]} {best[0]:.4f} ms"
                      + (" (in graphs)" if args.graphs else ""))
    finally:
        K.device_configs = saved
        K.forget_plans()
        PK.forget_plans()
        DK.forget_plans()
    return out


def _bar_table(rows, tag, name, ms_key, title) -> list:
    """Markdown lines of one ratio-to-FlashMLA table: the rows carrying TAG, NAME's graph
    time under MS_KEY against FlashMLA as SGLang calls it."""
    sel = [r for r in rows if tag in r]
    if not sel:
        return []
    return ["", title, "",
            f"| op | shape | {name} graph ms | FlashMLA graph ms | {name} / FlashMLA | target met |",
            "| --- | --- | ---: | ---: | ---: | --- |"] + [
        f"| {r['op']} | {_fmt_shape(r['shape'])} | {r[ms_key]:.4f} | {r['flashmla_graph_ms']:.4f} | "
        f"{r['ratio']:.2f}x | {'yes' if r['met'] else 'no'} |" for r in sel]


def _fmt_shape(s):
    return ", ".join(f"{k}={v}" for k, v in s.items())


def series(device: str, tiles: str) -> str:
    """The results series of a run on DEVICE with --tiles TILES."""
    return f"attention_{card_slug(device)}{tile_modes.suffix(tiles)}"


def _write(out_dir, meta, rows, tune_rows):
    os.makedirs(out_dir, exist_ok=True)
    name = series(meta["device"], meta.get("tiles", "card"))
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    archive_previous(out_dir, name)
    base = os.path.join(out_dir, f"{name}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, results=rows, tune=tune_rows), f, indent=2)
    lines = [
        f"# Attention ops on {meta['device']}" + (f": {meta['tiles_label']}" if meta.get("tiles", "card") != "card"
                                                  else ""),
        "",
        f"- date: {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, "
        f"cc {meta['compute_capability']}; seed {meta['seed']}; heads {meta['heads']}",
        f"- ceilings: copy {meta['copy_gbps']:.0f} GB/s (read+write), bf16 matmul {meta['bf16_tflops']:.0f} TFLOP/s",
        "- roofline time = max(bytes / copy bandwidth, FLOPs / matmul rate); timings: do_bench median",
    ] + tile_modes.header_lines(meta.get("tiles", "card")) + [""]
    for op, avail in meta["availability"].items():
        lines.append(f"- {op}: " + "; ".join(f"{b} {'runs' if w is None else 'not runnable (' + w + ')'}"
                                               for b, w in avail.items()))
    lines += ["", "| op | shape | backend | ms | graph ms | % roofline | bound | correct |",
              "| --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        if "ms" in r:
            g = f"{r['graph_ms']:.4f}" if r.get("graph_ms") is not None else "—"
            if r.get("not_a_backend"):   # a comparison row (output checked, lse not): no roofline
                rel = f" (rel err {r['out_rel_err']:.1e})" if r.get("out_rel_err") is not None else ""
                lines.append(f"| {r['op']} | {_fmt_shape(r['shape'])} | {r['backend']} | {r['ms']:.4f} | {g} "
                             f"| | | output {r['correct']}{rel} |")
                continue
            lines.append(f"| {r['op']} | {_fmt_shape(r['shape'])} | {_backend_cell(r)} | {r['ms']:.4f} | {g} | "
                         f"{100 * r['frac_roofline']:.1f} | {r['bound']} | {r['correct']} |")
        elif "error" in r or "peer_error" in r:
            lines.append(f"| {r['op']} | {_fmt_shape(r['shape'])} | {_backend_cell(r)} | error | | | | "
                         f"{r.get('error') or r.get('peer_error')} |")
        elif "skipped" in r:
            lines.append(f"| {r['op']} | {_fmt_shape(r['shape'])} | {r['backend']} | skipped | | | | {r['skipped']} |")
    sp = [r for r in rows if "speedup_vs_torch" in r]
    if sp:
        lines += ["", "| op | shape | backend | speedup vs torch |", "| --- | --- | --- | ---: |"]
        lines += [f"| {r['op']} | {_fmt_shape(r['shape'])} | {r['backend']} | {r['speedup_vs_torch']:.1f}x |"
                  for r in sp]
    fd = [r for r in rows if "fastest" in r]
    if fd:
        lines += ["", "| op | shape | fastest | default | default / fastest time |", "| --- | --- | --- | --- | ---: |"]
        lines += [f"| {r['op']} | {_fmt_shape(r['shape'])} | {r['fastest']} | {r['default']} | "
                  f"{r['default_over_fastest']:.2f} |" for r in fd]
    fg = [r for r in rows if "fastest_graph" in r]
    if fg:
        lines += ["", "In CUDA graphs:", "", "| op | shape | fastest | default | default / fastest time |",
                  "| --- | --- | --- | --- | ---: |"]
        lines += [f"| {r['op']} | {_fmt_shape(r['shape'])} | {r['fastest_graph']} | {r['default']} | "
                  f"{r['default_over_fastest_graph']:.2f} |" for r in fg]
    lines += _bar_table(rows, "bar", "triton_fp8", "triton_fp8_graph_ms",
                        f"The FlashMLA bar (target: triton_fp8 within {FLASHMLA_BAR}x of FlashMLA as SGLang "
                        "calls it), in CUDA graphs:")
    lines += _bar_table(rows, "adapter_bar", "adapter", "adapter_graph_ms",
                        "The FlashMLA adapter as a serving model calls it (`checks=False`, inside one "
                        "`capdispatch.batch()` whose first call builds the schedule, before timing) against "
                        f"FlashMLA as SGLang calls it (target within {ADAPTER_BAR}x), in CUDA graphs:")
    peer = [r for r in rows if r.get("backend") == PEER_NAME and "ms" in r]
    if peer:
        lines += ["", f"SGLang's own portable Triton decode ({SGLANG_PEER}, a library call; outputs checked "
                  "against the reference first: relative error <= 1e-2, lse not compared; not timed above "
                  f"--peer-max-tokens {meta.get('peer_max_tokens')}):", "",
                  "| op | shape | ms | graph ms | output correct (rel err) | peer / triton_fp8 time |",
                  "| --- | --- | ---: | ---: | --- | ---: |"]
        lines += [f"| {r['op']} | {_fmt_shape(r['shape'])} | {r['ms']:.4f} | "
                  + (f"{r['graph_ms']:.4f}" if r.get("graph_ms") is not None else "—")
                  + f" | {r['correct']} ({r['out_rel_err']:.1e}) | "
                  + (f"{r['over_triton_fp8']:.1f}x" if "over_triton_fp8" in r else "—") + " |" for r in peer]
    ent = [r for r in rows if r.get("launches")]
    if ent and meta.get("tiles", "card") != "card":
        lines += tile_modes.entries_table(
            meta["tiles_label"], meta["shared_limit"], (("op", "---"), ("shape", "---"), ("backend", "---")),
            [((r["op"], _fmt_shape(r["shape"]), r["backend"]), e) for r in ent for e in r["launches"]],
            ran_head="ran", skipped="no: over the limit, skipped")
    fs = [r for r in rows if "served_over_fastest_graph" in r]
    if fs:
        lines += ["", "The default as it runs in serving (on SM90 the SGLang adapter keeps SGLang's own "
                  "FlashMLA call: clean index lists, one schedule per batch), in CUDA graphs:", "",
                  "| op | shape | default as served | fastest backend | served / fastest backend time |",
                  "| --- | --- | --- | --- | ---: |"]
        lines += [f"| {r['op']} | {_fmt_shape(r['shape'])} | {r['served_default']} | {r['fastest_backend_graph']} | "
                  f"{r['served_over_fastest_graph']:.2f} |" for r in fs]
    if tune_rows:
        lines += ["", "## Triton launch configurations", "",
                  "| op | shape | backend | config | ms | graph ms | correct |",
                  "| --- | --- | --- | --- | ---: | ---: | --- |"]
        lines += [f"| {r['op']} | {_fmt_shape(r['shape'])} | {r['backend']} | "
                  f"{r['config']['BLOCK_H']}x{r['config']['BLOCK_N']} w{r['config']['num_warps']} "
                  f"s{r['config']['num_stages']} | {r['ms']:.4f} | "
                  + (f"{r['graph_ms']:.4f}" if r.get("graph_ms") is not None else "—")
                  + f" | {r['correct']} |" for r in tune_rows]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {base}.json and {base}.md")


def _backend_cell(r):
    t = r.get("tiles")
    return f"{r['backend']} ({t})" if t and t != tile_modes.label("card") else r["backend"]


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.peer_max_tokens < 0:
        p.error(f"--peer-max-tokens must be >= 0, got {args.peer_max_tokens}")
    return args


def main(argv=None):
    return run(parse_args(argv))


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=["sparse_prefill", "decode_mla"],
                   choices=("sparse_prefill", "decode_mla"))
    p.add_argument("--quick", action="store_true", help="one prefill shape, three decode shapes")
    p.add_argument("--decode-tokens", type=int, nargs="+", default=None, metavar="T",
                   help="decode shapes to run (query tokens), instead of the default or --quick list")
    p.add_argument("--tune", action="store_true", help="sweep Triton launch configurations per shape")
    p.add_argument("--tune-backends", nargs="+", default=None, choices=("triton", "triton_fp8"),
                   help="with --tune: only these Triton backends (prefill has only 'triton')")
    p.add_argument("--graphs", action="store_true", help="also time inside a CUDA graph (launch overhead removed)")
    p.add_argument("--copy-bytes", type=int, default=2 << 30)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    p.add_argument("--seed", type=int, default=None)
    add_out(p)
    tile_modes.add_argument(p)
    p.add_argument("--peer-max-tokens", type=int, default=512, metavar="T",
                   help="time SGLang's portable Triton decode only for decode shapes of at most T query tokens "
                        "(default 512; it took about 0.5 s a call at 4096 tokens on an H200)")
    return p


if __name__ == "__main__":
    sys.exit(main())

"""Where the Triton W4A16 MoE's time goes, its decode candidates, and SGLang's Triton peer.

    python benchmarks/bench_moe_breakdown.py --out DIR [--tokens 1 8 64 4096]
        [--tiles both|card|99kb] [--candidates none|all|NAME,...] [--peer] [--no-sass] [--seed N]

Shapes: E = 64 local experts, H = 4096, I = 2048, top-6, packed MXFP4 + E8M0 (13,369,344 B
per expert), clamped SwiGLU (limit 10); routing skewed as calibration serves it
(bench.SERVED_ROUTE_SKEW).

1. Ceilings measured in this run: device-to-device copy of fresh 2 GiB buffers (40x the
   H200's L2) COPY_REPEATS times, bytes read + written, median and spread; the bf16
   8192^3 matmul rate, MATMUL_REPEATS times.
Configurations: the launch table's tiles with this card's tables and with the 99 KB cards'
tables (``--tiles``; tile_modes.py: inside a 99 KB run every launch is compiled first and
checked against SM86/SM89/SM120's 101376 B of shared memory per block), and the decode
candidates named by ``--candidates`` (none by default; split-K and prefetch stay selectable).

2. Correctness first: every configuration (the launch table's and each candidate) against
   the torch reference at each token count and at tail sizes, on fresh inputs with a quarter
   of the routes masked to -1 (EP), output and scratch buffers poisoned with NaN; rows of
   all-masked tokens must be exactly 0. A configuration that fails is reported and not timed.
3. Served form: bound without checks, inside capdispatch.batch(), replayed from a CUDA
   graph; median of do_bench_cudagraph.
4. Per launch: torch.profiler over replays of that graph (eagerly-run calls when the
   profiler sees no kernel inside graphs, said in the output), each kernel's mean GPU time
   per call, launches per call, and the bytes and FLOPs each launch must move and do, as
   fractions of the copy and matmul ceilings.
5. --peer: SGLang's Triton fused MoE with int4 W4A16 weights and bf16 scales per 64
   weights (the same bytes per weight), same shapes and routing, checked against its own
   torch reference, timed the same way over its default tiles and a small sweep
   (moe_peer_sglang.py). If it cannot be imported or run, the output says what stops it.
6. SASS facts (offline compile, no GPU needed) of the sm_86 and sm_90a builds of every
   timed GEMM configuration: registers, spill bytes, shared memory, theoretical occupancy,
   main-loop instructions (sass_tools.py).

7. Targets (issue 29 item 3): per token count and table set, % of the roofline against the
   target (>= 60% of the weight-bytes roofline at 1-64 tokens, >= 55% of compute at 4096) and
   the ratio to the peer's best in the same run.

Writes moe_breakdown_<gpu>_<utc>.json and .md into --out, with card, versions and date.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from results_dir import add_out  # noqa: E402 (the script's own folder)
import tile_modes  # noqa: E402 (the script's own folder)

E, H, I, TOPK = 64, 4096, 2048, 6
SWIGLU_LIMIT = 10.0
DEFAULT_TOKENS = (1, 8, 64, 4096)
TAIL_TOKENS = (3, 37)              # odd sizes checked besides the timed ones
CANDIDATE_MAX_TOKENS = 64          # candidates target the decode regime
COPY_REPEATS, MATMUL_REPEATS = 5, 3
TRITON_NORM, TRITON_MAX = 2e-3, 1e-2       # the tests' tolerance for the Triton kernels
PEER_NORM = 1.5e-2                          # an external W4A16 kernel against its own reference
PROFILE_REPLAYS = 20

# Decode candidates: the launch table's tiles at 1-64 tokens with split-K parts (SK1, SK2) and
# the prefetching loop (PF). Name -> (SK1, SK2, PF). All are slower than the table on an H200
# (2026-12-03 breakdown: 75-87 against 67 us at 1 token), so none runs unless --candidates names it.
DEFAULT_CANDIDATES = "none"
CANDIDATES = {
    "split2": (2, 2, 0),
    "split4": (4, 4, 0),
    "split8": (8, 4, 0),
    "prefetch": (1, 1, 1),
    "split4+prefetch": (4, 4, 1),
}


TILE_SETS = ("both",) + tile_modes.TILES       # --tiles: both, card, 99kb
# Targets of issue 29 item 3: fraction of the roofline, by what bounds the size.
TARGET_BYTES, TARGET_FLOPS = 0.60, 0.55


def tile_modes_of(choice: str) -> list:
    """The tile_modes modes a --tiles choice runs, this card's first."""
    if choice == "both":
        return list(tile_modes.TILES)
    if choice not in tile_modes.TILES:
        raise SystemExit(f"--tiles: unknown {choice}; valid: {', '.join(TILE_SETS)}")
    return [choice]


def table_label(mode: str) -> str:
    return "table" if mode == "card" else f"table {mode}"


def parse_candidates(text: str) -> list:
    if text == "all":
        return list(CANDIDATES)
    if text == "none":
        return []
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in CANDIDATES]
    if bad:
        raise SystemExit(f"--candidates: unknown {', '.join(bad)}; valid: all, none or a comma list of "
                         f"{', '.join(CANDIDATES)}")
    return names


def ceilings():
    """Copy rate (fresh buffers each repeat) and bf16 matmul rate, with their spread."""
    from ceilings import copy_bandwidth, matmul_rate
    copies = [copy_bandwidth()[0] for _ in range(COPY_REPEATS)]
    mms = [matmul_rate()[0] for _ in range(MATMUL_REPEATS)]

    def summary(v):
        med = statistics.median(v)
        return dict(median=med, min=min(v), max=max(v), spread_pct=100 * (max(v) - min(v)) / med, runs=v)
    return dict(copy_GBps=summary(copies), bf16_TFLOPs=summary(mms), copy_bytes=2 << 30,
                copy_note="2 GiB fresh buffers per repeat, bytes read + written", matmul="bf16 8192^3 torch.matmul")


def traffic(part, T, experts, R, SK1, SK2):
    """(bytes, FLOPs) a launch must move and do: packed weights of the experts routed,
    activations and scratch in and out, at the sizes of this call (not of padded tiles)."""
    per_w = 0.5 + 1 / 32
    if part == "routing":
        return R * 4 + R * 4 + 3 * 4 * (R // 16 + min(E, R)), 0
    if part == "gemm1":
        out = R * 2 * I * 4 * SK1 if SK1 > 1 else R * I * 2
        return experts * 2 * I * H * per_w + T * H * 2 + out, 2 * R * H * 2 * I
    if part == "activation":
        return R * 2 * I * 4 * SK1 + R * I * 2, 0
    if part == "gemm2":
        return experts * H * I * per_w + R * I * 2 + R * H * 4 * SK2, 2 * R * I * H
    if part == "combine":
        return R * H * 4 * SK2 + T * H * 2 + R * 4, R * H * SK2
    return 0, 0


def roofline(T, experts, copy_gbps, tflops):
    nbytes = experts * (3 * H * I * (0.5 + 1 / 32)) + 2 * T * H * 2 + T * TOPK * 8
    flops = 6 * T * TOPK * H * I
    return nbytes, flops, nbytes / (copy_gbps * 1e9) * 1e3, flops / (tflops * 1e12) * 1e3


def profile_parts(fn, graph_fn, parts_of):
    """{kernel name: (mean us per call, launches per call)} from torch.profiler over
    PROFILE_REPLAYS replays of the CUDA graph (GRAPH_FN replays it), or eager calls of FN
    when the profiler sees no kernel in graph replays; and which it was."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def run(call, n):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                call()
            torch.cuda.synchronize()
        per = {}
        for ev in prof.events():
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            name = ev.name
            if name.startswith(("Memcpy", "Memset")) and "DtoD" not in name:
                continue
            us, cnt = per.get(name, (0.0, 0))
            per[name] = (us + ev.time_range.elapsed_us(), cnt + 1)
        return {k: (us / n, cnt / n) for k, (us, cnt) in per.items()}

    how = "graph replays"
    per = run(graph_fn, PROFILE_REPLAYS) if graph_fn is not None else {}
    if not per:
        how = "eager calls (the profiler saw no kernel inside graph replays)"
        fn()
        per = run(fn, PROFILE_REPLAYS)
    rows = []
    for name, (us, cnt) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        rows.append(dict(kernel=name, part=parts_of(name), us=us, launches=cnt))
    return rows, how


def capture(fn):
    """A CUDA graph of FN (after eager warm-up) and its replay."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def ours_parts(name: str) -> str:
    from capdispatch.backends.moe.triton_kernels import KERNEL_PARTS
    for k, part in KERNEL_PARTS.items():
        if k in name:
            return part
    return "routing"          # torch ops of the large-call routing path


def peer_parts(name: str) -> str:
    if "fused_moe_kernel" in name:
        return "gemm (gemm1 then gemm2)"
    return "torch ops (routing table, SwiGLU, sum)"


def check_ours(tk, R, w, tiles, T, gen, dev):
    """(ok, norm-rel, max-rel, what failed) of one configuration at T tokens on fresh inputs,
    a quarter of the routes masked, output and scratch poisoned with NaN."""
    import torch
    x = torch.randn(T, H, generator=gen).bfloat16().to(dev)
    tw, ids = R.random_routing(T, TOPK, E, gen=gen, device=dev, mask_frac=0.25, skew=0.5)
    if T > 1:
        ids[1] = -1                     # one token wholly masked
    ref = R.moe(x, w, tw, ids)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
    real = tk._alloc
    tk._alloc = lambda shape, dtype, d: torch.full(shape, float("nan"), dtype=dtype, device=d)
    try:
        tk.moe_w4a16(x, w, tw, ids, out=out, checks=True, tiles=tiles)
    finally:
        tk._alloc = real
    g, r = out.float(), ref.float()
    nrm = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
    mx = ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
    why = []
    if not bool(torch.isfinite(out).all()):
        why.append("non-finite output (poison leaked)")
    if nrm > TRITON_NORM or mx > TRITON_MAX:
        why.append(f"error norm {nrm:.2e} / max {mx:.2e} over {TRITON_NORM} / {TRITON_MAX}")
    dead = (ids < 0).all(dim=1)
    if bool(dead.any()) and not bool((out[dead].float() == 0).all()):
        why.append("an all-masked token is not 0")
    return not why, nrm, mx, "; ".join(why)


def _compile_one(job):
    """One offline compile (a worker process): the SASS facts of one GEMM configuration."""
    from sass_tools import H200, SMLimits, compile_kernel, main_loop, occupancy

    from capdispatch.backends.moe import triton_kernels as tk
    label, cc, name, consts, warps, stages = job
    # Per-SM limits of the build's card: cc 8.6 has 1536 threads, 16 blocks and 100 KB of
    # shared memory per SM (CUDA C++ Programming Guide, compute capabilities table).
    lim = SMLimits(smem=100 * 1024, warps=48, blocks=16) if cc == 86 else H200
    fn = tk._gemm1_swiglu_kernel if name == "gemm1" else tk._gemm2_kernel
    sig = tk.COMPILE_SIGNATURES["_gemm1_swiglu_kernel" if name == "gemm1" else "_gemm2_kernel"]
    row = dict(config=label, cc=cc, kernel=name, constexprs=consts, num_warps=warps, num_stages=stages)
    try:
        c = compile_kernel(fn, sig, consts, warps, stages, cc)
        occ = occupancy(c.regs or 0, c.smem, warps, lim)
        row.update(regs=c.regs, spill_stores=c.spill_stores, spill_loads=c.spill_loads, smem=c.smem,
                   blocks_per_sm=occ.blocks, warps_per_sm=occ.warps, occupancy_limiter=occ.limiter,
                   main_loop_instructions=main_loop(c.sass)[0])
    except Exception as exc:   # the row says why; the run goes on
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def sass_facts(configs, ccs=(86, 90), workers=1, fold=True):
    """Offline compiles of each GEMM configuration: regs, spills, smem, occupancy, loop size.
    FOLD: the decode the timed weights take (random_weights' scale bytes, 119-125, are at
    most FOLD_SCALE_MAX). WORKERS > 1 compiles in forked processes: call it before CUDA is
    initialised."""
    jobs, seen = [], set()
    for label, t in configs:
        for cc in ccs:
            for name, consts, warps, stages in (
                    ("gemm1", dict(TOPK=TOPK, HAS_LIMIT=True, F32=False, BM=t.BM, BN=t.BN1, BK=t.BK1, SPLIT=t.SK1,
                                   PREFETCH=t.PF, FOLD=int(fold)), t.W1, t.S1),
                    ("gemm2", dict(F32=False, BM=t.BM, BN=t.BN2, BK=t.BK2, SPLIT=t.SK2, PREFETCH=t.PF,
                                   FOLD=int(fold)), t.W2, t.S2)):
                key = (cc, name, tuple(sorted(consts.items())), warps, stages)
                if key not in seen:
                    seen.add(key)
                    jobs.append((label, cc, name, consts, warps, stages))
    if workers <= 1:
        return [_compile_one(j) for j in jobs]
    import multiprocessing as mp
    with mp.get_context("fork").Pool(min(workers, len(jobs))) as pool:
        return pool.map(_compile_one, jobs)


def sass_configs(tokens, cands):
    """(label, tiles) of every configuration the run times, each tiles once (the 99 KB
    tables' tiles are compiled once where they equal this card's)."""
    from capdispatch.backends.moe.launch_table import tiles_for
    out = []
    for T in tokens:
        for label, tiles, _ in configs_for(T, cands, tiles_for, ["card"]):
            if tiles not in [s[1] for s in out]:
                out.append((f"{label}@{T}", tiles))
    return out


def configs_for(T, cands, tiles_for, modes=("card",)):
    """(label, tiles, tile mode) at T tokens: the launch table's tiles in each tile mode, then
    each candidate's change of this card's tiles (decode sizes). The MoE launch table keys on
    the mean routes per expert, not the capability, so both table sets pick the same tiles;
    a 99 KB run differs in checking every launch against the 99 KB cards' shared memory."""
    from capdispatch.backends.moe.launch_table import mean_rows
    base = tiles_for(mean_rows(T * TOPK, E), H, I, False)
    out = [(table_label(m), base, m) for m in modes]
    if T <= CANDIDATE_MAX_TOKENS:
        out += [(n, base._replace(SK1=CANDIDATES[n][0], SK2=CANDIDATES[n][1], PF=CANDIDATES[n][2]), "card")
                for n in cands]
    return out


def targets(rows) -> list:
    """Per token count and configuration of the launch table: % of the roofline against the
    size's target, and the ratio of its time to the peer's best in the same run."""
    out = []
    for r in rows:
        flops_bound = r["bound_by"] == "flops"
        goal = TARGET_FLOPS if flops_bound else TARGET_BYTES
        best = [p for p in r["peer"] if p.get("best")]
        for c in r["configs"]:
            if not c["config"].startswith("table") or "us" not in c:
                continue
            peer_us = best[0]["us"] if best else None
            out.append(dict(tokens=r["tokens"], config=c["config"], us=c["us"], frac=c["frac_roofline"],
                            bound_by=r["bound_by"], goal=goal, met=c["frac_roofline"] >= goal,
                            peer_us=peer_us, vs_peer=c["us"] / peer_us if peer_us else None))
    return out


def run(a):
    import torch
    import triton

    import capdispatch as cd
    from capdispatch import bench
    from capdispatch.backends.moe import reference as R
    from capdispatch.backends.moe import triton_kernels as tk
    from capdispatch.backends.moe.launch_table import tiles_for
    SERVED_ROUTE_SKEW, forward = bench.SERVED_ROUTE_SKEW, bench.served.forward
    from ceilings import bench_graph, run_facts

    cands = parse_candidates(a.candidates)
    modes = tile_modes_of(a.tiles)
    sass = []
    if not a.no_sass:           # first: the compiles fork, before CUDA is initialised
        t1 = time.time()
        sass = sass_facts(sass_configs(a.tokens, cands), workers=max(1, min(16, (os.cpu_count() or 2) - 1)))
        print(f"[bd] SASS facts: {len(sass)} offline compiles in {time.time() - t1:.0f} s", flush=True)
    facts = run_facts(a.seed)
    gen = torch.Generator().manual_seed(facts["seed"])
    dev = "cuda"
    t0 = time.time()
    ceil = ceilings()
    bw, rate = ceil["copy_GBps"]["median"], ceil["bf16_TFLOPs"]["median"]
    print(f"[bd] {facts['device']}: copy {bw:.0f} GB/s (spread {ceil['copy_GBps']['spread_pct']:.1f}%), "
          f"bf16 {rate:.0f} TFLOP/s; seed {facts['seed']} ({time.time() - t0:.0f} s)", flush=True)

    w = R.random_weights(E, H, I, gen=gen, device=dev, swiglu_limit=SWIGLU_LIMIT)
    served = cd.bind("moe", "cuda:0", backend="triton_w4a16", checks=False)

    def configs_at(T):
        return configs_for(T, cands, tiles_for, modes)

    # Correctness of every configuration, timed sizes and tails; in a 99 KB mode every launch
    # is compiled and checked against those cards' shared memory first (tile_modes.checked).
    checks = []
    for T in sorted(set(a.tokens) | set(t for t in TAIL_TOKENS if t <= max(a.tokens))):
        for label, tiles, mode in configs_at(T if T in a.tokens else min(a.tokens, key=lambda s: abs(s - T))):
            launches = []
            try:
                got, launches, err = tile_modes.checked(
                    mode, lambda tiles=tiles, T=T: check_ours(tk, R, w, tiles, T, gen, dev))
                if err is not None:
                    raise err
                ok, nrm, mx, why = got
            except Exception as exc:
                ok, nrm, mx, why = False, None, None, f"{type(exc).__name__}: {str(exc)[:300]}"
            checks.append(dict(tokens=T, config=label, tiles=list(tiles), mode=mode, ok=ok, norm_rel=nrm, max_rel=mx,
                               why=why, launches=tile_modes.launch_rows(launches)))
            print(f"[bd] check T={T:5d} {label:16s} {'ok' if ok else 'FAILED: ' + why}"
                  + (f" (norm {nrm:.1e})" if nrm is not None else ""), flush=True)
    failed = {(c["tokens"], c["config"]) for c in checks if not c["ok"]}
    failed_cfg = {c["config"] for c in checks if not c["ok"]}

    peer = dict(status="not requested")
    invoke = None
    if a.peer:
        try:
            from moe_peer_sglang import load
            invoke, ver = load()
            peer = dict(status="ran", sglang=ver, module="sglang.kernels.ops.moe.fused_moe_triton_kernels")
            from moe_peer_sglang import random_int4_weights
            pw = random_int4_weights(E, H, I, gen, dev)
        except Exception as exc:
            peer = dict(status="cannot run", why=f"{type(exc).__name__}: {str(exc)[:500]}")
            print(f"[bd] peer: {peer['why']}", flush=True)

    rows = []
    for T in a.tokens:
        x = torch.randn(T, H, generator=gen).bfloat16().to(dev)
        tw, ids = R.random_routing(T, TOPK, E, gen=gen, device=dev, skew=SERVED_ROUTE_SKEW)
        experts = int(torch.unique(ids[ids >= 0]).numel())
        nbytes, flops, t_bw, t_fl = roofline(T, experts, bw, rate)
        row = dict(tokens=T, routes=T * TOPK, experts_touched=experts, roofline_bytes=nbytes, roofline_flops=flops,
                   roofline_us_bytes=t_bw * 1e3, roofline_us_flops=t_fl * 1e3,
                   bound_by="bytes" if t_bw >= t_fl else "flops", configs=[], peer=[])
        bound = max(t_bw, t_fl)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        for label, tiles, mode in configs_at(T):
            if label in failed_cfg:
                row["configs"].append(dict(config=label, tiles=list(tiles), skipped="failed its check"))
                continue
            if label.startswith("table"):          # the launch table: the served op
                call = forward([lambda: served(x, w, tw, ids, out)])
            else:
                call = forward([lambda tiles=tiles: tk.moe_w4a16(x, w, tw, ids, out=out, checks=False,
                                                                 tiles=tiles)])
            try:
                with tile_modes.timing(mode):
                    ms = bench_graph(call, rep=100)
                    replay = capture(call)
                    launches, how = profile_parts(call, replay, ours_parts)
            except Exception as exc:
                row["configs"].append(dict(config=label, tiles=list(tiles), error=f"{type(exc).__name__}: {exc}"))
                print(f"[bd] T={T:5d} {label}: {type(exc).__name__}: {exc}", flush=True)
                continue
            plan = tk._Plan(T, TOPK, E, H, I, True, tiles, False)
            SK1, SK2 = plan.SK1, plan.SK2
            for lr in launches:
                b, f = traffic(lr["part"], T, experts, T * TOPK, SK1, SK2)
                lr.update(bytes=b, flops=f, GBps=b / (lr["us"] * 1e3) if lr["us"] else None,
                          frac_copy=(b / (lr["us"] * 1e3)) / bw if lr["us"] else None,
                          frac_matmul=(f / (lr["us"] * 1e6)) / rate if lr["us"] else None)
            row["configs"].append(dict(config=label, tiles=list(tiles), mode=mode, split_used=[SK1, SK2], us=ms * 1e3,
                                       frac_roofline=bound / ms, launches=launches, profiled_from=how,
                                       launch_count=sum(lr["launches"] for lr in launches),
                                       kernels_us_sum=sum(lr["us"] for lr in launches)))
            print(f"[bd] T={T:5d} {label:16s} {ms * 1e3:8.1f} us  {100 * bound / ms:5.1f}% of roofline  "
                  + ", ".join(f"{lr['part']} {lr['us']:.1f}" for lr in launches[:6]), flush=True)
        if invoke is not None:
            row["peer"] = peer_row(invoke, pw, x, tw, ids, T, bound, bench_graph, capture)
        rows.append(row)
        with open(os.path.join(a.out, "moe_breakdown_partial.json"), "w") as f:     # what a cut-off run keeps
            json.dump(dict(facts=facts, ceilings=ceil, checks=checks, peer=peer, rows=rows, sass=sass), f,
                      indent=1, default=str)

    meta = dict(facts, shape=dict(E=E, H=H, I=I, topk=TOPK, swiglu_limit=SWIGLU_LIMIT, route_skew=SERVED_ROUTE_SKEW),
                packed_bytes_per_expert=w.packed_bytes_per_expert(), ceilings=ceil, candidates=cands,
                tile_modes={m: dict(label=tile_modes.label(m), shared_limit=(tile_modes.target(m).shared_bytes
                                                                            if m != "card" else None))
                            for m in modes},
                candidate_defs={n: dict(zip(("SK1", "SK2", "PF"), CANDIDATES[n])) for n in cands},
                triton_version=triton.__version__, seconds=round(time.time() - t0, 1),
                served="bound without checks, in capdispatch.batch(), replayed from a CUDA graph")
    return dict(meta=meta, checks=checks, failed=sorted(failed), peer=peer, rows=rows, sass=sass,
                targets=targets(rows))


def peer_row(invoke, pw, x, tw, ids, T, bound, bench_graph, capture):
    """The peer at T tokens: checked once against its reference, then each tile config timed."""
    import moe_peer_sglang as P
    w13, s13, w2, s2 = pw
    res = []
    ref = P.reference(x, w13, s13, w2, s2, tw, ids, SWIGLU_LIMIT)
    for label, cfg in P.configs(T, E):
        r = dict(config=label, tiles=cfg)
        try:
            call = P.make_call(invoke, x, w13, s13, w2, s2, tw, ids, SWIGLU_LIMIT, cfg, cfg)
            got = call().clone()
            nrm = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            r.update(norm_rel=nrm, ok=bool(got.isfinite().all()) and nrm <= PEER_NORM)
            if not r["ok"]:
                r["why"] = f"error norm {nrm:.2e} over {PEER_NORM}"
                res.append(r)
                continue
            try:
                ms = bench_graph(call, rep=60)
                r["timed"] = "graph"
            except Exception as exc:       # eager then, said in the row
                from ceilings import bench
                ms = bench(call, rep=60)
                r["timed"] = f"eager (graph capture failed: {type(exc).__name__}: {str(exc)[:160]})"
            r.update(us=ms * 1e3, frac_roofline=bound / ms)
        except Exception as exc:
            r.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        res.append(r)
        print(f"[bd] T={T:5d} peer {label:16s} " + (f"{r['us']:8.1f} us  {100 * r['frac_roofline']:5.1f}% of roofline"
                                                     if "us" in r else r.get("error") or r.get("why")), flush=True)
    timed = [r for r in res if "us" in r]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        call = P.make_call(invoke, x, w13, s13, w2, s2, tw, ids, SWIGLU_LIMIT, best["tiles"], best["tiles"])
        try:
            launches, how = profile_parts(call, capture(call), peer_parts)
            best.update(launches=launches, profiled_from=how)
        except Exception as exc:
            best["profile_error"] = f"{type(exc).__name__}: {exc}"
        best["best"] = True
    return res


def table_sets_lines(sets: dict) -> list:
    """Markdown lines naming the run's launch-table sets (meta's tile_modes)."""
    if not sets:
        return []
    parts = [f"`{table_label(k)}`: {v['label']}" + (
        f" (every launch compiled and checked against {v['shared_limit']} B of shared memory per block first; "
        "timed on this GPU)" if v.get("shared_limit") else "") for k, v in sets.items()]
    return ["Table sets: " + "; ".join(parts) + ".", ""]


def to_markdown(res) -> str:
    m = res["meta"]
    c = m["ceilings"]
    cp, mm = c["copy_GBps"], c["bf16_TFLOPs"]
    L = [f"# MoE triton_w4a16: per-launch breakdown, decode candidates, SGLang Triton peer — {m['device']}", "",
         f"{m['date']}; cc {m['compute_capability']}; torch {m['torch']}, Triton {m['triton']}, CUDA {m['cuda']}, "
         f"Python {m['python']}; seed {m['seed']}; {m['seconds']} s.", "",
         f"E={E}, H={H}, I={I}, top-{TOPK}, MXFP4 + E8M0 ({m['packed_bytes_per_expert']} B per expert), SwiGLU limit "
         f"{SWIGLU_LIMIT}, routing skew {m['shape']['route_skew']}. Served: {m['served']}.", "",
         f"Ceilings (this run): copy {cp['median']:.0f} GB/s median of {len(cp['runs'])} "
         f"(min {cp['min']:.0f}, max {cp['max']:.0f}, spread {cp['spread_pct']:.1f}%; {c['copy_note']}); "
         f"bf16 matmul {mm['median']:.0f} TFLOP/s (spread {mm['spread_pct']:.1f}%).", "",
         ] + table_sets_lines(m.get("tile_modes") or {}) + [
         "## Whole call", "",
         "| tokens | experts | roofline us (bound) | config | us | % roofline | launches | sum of kernels us |",
         "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in res["rows"]:
        rl = max(r["roofline_us_bytes"], r["roofline_us_flops"])
        for cfg in r["configs"]:
            if "us" not in cfg:
                L.append(f"| {r['tokens']} | {r['experts_touched']} | {rl:.1f} ({r['bound_by']}) | {cfg['config']} | "
                         f"{cfg.get('error') or cfg.get('skipped')} | | | |")
                continue
            L.append(f"| {r['tokens']} | {r['experts_touched']} | {rl:.1f} ({r['bound_by']}) | {cfg['config']} | "
                     f"{cfg['us']:.1f} | {100 * cfg['frac_roofline']:.1f}% | {cfg['launch_count']:.0f} | "
                     f"{cfg['kernels_us_sum']:.1f} |")
        for p in r["peer"]:
            if p.get("best"):
                L.append(f"| {r['tokens']} | {r['experts_touched']} | {rl:.1f} ({r['bound_by']}) | peer best "
                         f"`{p['config']}` | {p['us']:.1f} | {100 * p['frac_roofline']:.1f}% | | |")
            if p["config"] == "sglang_default" and "us" in p:
                L.append(f"| {r['tokens']} | {r['experts_touched']} | {rl:.1f} ({r['bound_by']}) | peer SGLang "
                         f"default | {p['us']:.1f} | {100 * p['frac_roofline']:.1f}% | | |")
    if res.get("targets"):
        L += ["", "## Targets (issue 29 item 3)", "",
              "| tokens | config | us | bound | % roofline | target | met | peer best us | ours / peer |",
              "| ---: | --- | ---: | --- | ---: | ---: | --- | ---: | ---: |"]
        for t in res["targets"]:
            L.append(f"| {t['tokens']} | {t['config']} | {t['us']:.1f} | {t['bound_by']} | {100 * t['frac']:.1f}% | "
                     f">= {100 * t['goal']:.0f}% | {'yes' if t['met'] else 'no'} | "
                     + (f"{t['peer_us']:.1f} | {t['vs_peer']:.2f}x |" if t["peer_us"] else "not run | |"))
    L += ["", "## Per launch (mean GPU time per call from torch.profiler)", "",
          "| tokens | config | part | kernel | us | launches/call | MB | GFLOP | GB/s | % copy | % matmul |",
          "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["rows"]:
        for cfg in r["configs"] + [p for p in r["peer"] if p.get("launches")]:
            for lr in cfg.get("launches") or ():
                name = lr["kernel"] if len(lr["kernel"]) <= 48 else lr["kernel"][:45] + "..."
                L.append(f"| {r['tokens']} | {cfg['config']}{' (peer)' if cfg in r['peer'] else ''} | {lr['part']} | "
                         f"`{name}` | {lr['us']:.1f} | {lr['launches']:.2f} | "
                         + (f"{lr['bytes'] / 1e6:.2f} | {lr['flops'] / 1e9:.2f} | {lr['GBps']:.0f} | "
                            f"{100 * lr['frac_copy']:.1f}% | {100 * lr['frac_matmul']:.1f}% |"
                            if lr.get("GBps") is not None else "| | | | |"))
    L += ["", "## Checks (fresh inputs, 1/4 of routes masked, NaN-poisoned output and scratch)", "",
          "| tokens | config | ok | norm-rel | why |", "| ---: | --- | --- | ---: | --- |"]
    for ck in res["checks"]:
        nrm = "" if ck["norm_rel"] is None else f"{ck['norm_rel']:.1e}"
        L.append(f"| {ck['tokens']} | {ck['config']} | {'yes' if ck['ok'] else 'NO'} | {nrm} | {ck['why']} |")
    entries = [((ck["tokens"], ck["config"]), e) for ck in res["checks"] for e in ck.get("launches") or ()]
    if entries:
        limits = {v["shared_limit"] for v in (m.get("tile_modes") or {}).values() if v.get("shared_limit")}
        L += tile_modes.entries_table(tile_modes.LABEL_99KB, max(limits) if limits else None,
                                      (("tokens", "---:"), ("config", "---")), entries)
    p = res["peer"]
    L += ["", "## Peer: SGLang Triton fused MoE, int4 W4A16", ""]
    if p["status"] != "ran":
        L.append(f"Status: {p['status']}" + (f" — {p['why']}" if "why" in p else "") + ".")
    else:
        L += [f"SGLang {p['sglang']} `{p['module']}`: its GPTQ/AWQ int4 Triton GEMM, int4 codes with a bf16 scale per "
              "64 weights (0.53125 B per weight, the same as MXFP4 + E8M0); routing table, clamped SwiGLU and the sum "
              "over routes in torch ops (SGLang's own are CUDA JIT or sgl-kernel ops). Checked against its own torch "
              "reference (norm-relative).", "",
              "| tokens | tiles | us | % roofline | norm-rel | note |", "| ---: | --- | ---: | ---: | ---: | --- |"]
        for r in res["rows"]:
            for q in r["peer"]:
                L.append(f"| {r['tokens']} | {q['config']} | {q.get('us', float('nan')):.1f} | "
                         f"{100 * q.get('frac_roofline', float('nan')):.1f}% | {q.get('norm_rel', float('nan')):.1e} | "
                         f"{'best' if q.get('best') else ''} {q.get('error') or q.get('why') or ''} |")
    if res["sass"]:
        L += ["", "## SASS (offline compiles, sm_86 and sm_90a)", "",
              "| config | cc | kernel | constexprs | warps | stages | regs | spill B | smem B | blocks/SM | warps/SM "
              "| limiter | loop instr |", "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| --- | ---: |"]
        for s in res["sass"]:
            shown = ("BM", "BN", "BK", "SPLIT", "PREFETCH", "FOLD")
            k = ", ".join(f"{a}={b}" for a, b in s["constexprs"].items() if a in shown)
            if "error" in s:
                L.append(f"| {s['config']} | {s['cc']} | {s['kernel']} | {k} | {s['num_warps']} | {s['num_stages']} | "
                         f"error: {s['error']} | | | | | | |")
                continue
            L.append(f"| {s['config']} | {s['cc']} | {s['kernel']} | {k} | {s['num_warps']} | {s['num_stages']} | "
                     f"{s['regs']} | {s['spill_stores']} | {s['smem']} | {s['blocks_per_sm']} | {s['warps_per_sm']} | "
                     f"{s['occupancy_limiter']} | {s['main_loop_instructions']} |")
    L += ["", "Bytes per launch: the packed weights of the experts routed, activations and scratch in and out "
          "(what the launch must move, not what padded tiles touch); FLOPs: 2 per multiply-add of real routes. "
          "% copy and % matmul: the launch's rate against the ceilings above."]
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out(ap, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    ap.add_argument("--tiles", default="both", choices=TILE_SETS,
                    help="launch-table sets: both (default), this card's own (card) or the 99 KB cards' (99kb)")
    ap.add_argument("--candidates", default=DEFAULT_CANDIDATES,
                    help="decode candidates: none (default), all, or a comma list of " + ", ".join(CANDIDATES))
    ap.add_argument("--peer", action="store_true", help="also time SGLang's Triton int4 W4A16 fused MoE")
    ap.add_argument("--no-sass", action="store_true", help="skip the offline sm_86 / sm_90a compiles")
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    parse_candidates(a.candidates)
    if any(t < 1 for t in a.tokens):
        ap.error(f"--tokens: every count must be >= 1, got {a.tokens}")
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    if not torch.cuda.is_available():
        print("bench_moe_breakdown.py needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    res = run(a)
    name = f"moe_breakdown_{res['meta']['device'].lower().replace(' ', '_')}"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    base = os.path.join(a.out, f"{name}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    md = to_markdown(res)
    with open(base + ".md", "w") as f:
        f.write(md)
    partial = os.path.join(a.out, "moe_breakdown_partial.json")
    if os.path.exists(partial):
        os.remove(partial)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What bounds each H200 Triton kernel, from offline compiles for sm_90a (no GPU).

    python benchmarks/sass_bounds.py [--out DIR] [--from-json PATH] [--only moe,indexer,...]

For every Triton kernel in the table of the portable-kernel issue (the MoE GEMMs in
their decode and prefill tile classes at the bench_moe shapes, ``_sparse_mla_kernel``
in the tiles the H200 launch table picks for prefill, decode and split decode, the
split combine, the native-fp8 indexer, the KV quant/dequant kernels), compiles it for
sm_90a with the specialisation a launch gets (backends/compile_matrix.py's jobs;
16-divisible pointers and integers), and reports registers, spills, shared memory,
theoretical occupancy on an H200 SM (65536 registers, 228 KB shared memory, 64 warps,
32 blocks), the main loop's instruction mix by class (sass_tools.py), whether the dots
became wgmma (HGMMA) or mma.sync (HMMA), and the bytes and FLOPs one main-loop iteration
of one block moves and does. From those it derives the instruction-issue ceiling: the
bytes/s or FLOP/s the whole GPU would reach if it issued one warp instruction per
scheduler per clock with no stall, set against the ceilings the H200 runs measured.

This is an offline proxy (Triton's compiler on this machine, which may differ from the
version the timings ran with), not a timing. Writes the series kernel_bounds_sm90a
(.md and .json) into --out (default benchmarks/results; the previous run is archived).
Under each row the report prints its reading from sass_bounds_notes.yaml (what bounds it
and what change would address it), written against the figures of the committed run:
re-read it when the kernels change. ``--from-json`` re-renders a written run's report
without compiling.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)    # the interpreter's triton.jit compiles nothing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
for _p in (ROOT, BENCH):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import results_dir  # noqa: E402
import sass_tools as ST  # noqa: E402

SERIES = "kernel_bounds_sm90a"
CC = 90
# H200 SXM: SMs, boost clock, schedulers per SM (one warp instruction each per clock).
SMS, CLOCK_HZ, SCHEDULERS = 132, 1.98e9, 4
# Ceilings the H200 runs measured (issue table; bench_moe / bench_attention / bench_indexer).
COPY_GBPS, BF16_TFLOPS, FP8_TFLOPS = 4249.0, 700.0, 1304.0
# bench_moe's shapes.
MOE_H, MOE_I, MOE_TOPK = 4096, 2048, 6
# Bytes of one token in the V4 paged pool (BYTES_PER_PAGE / PAGE_SIZE of compile_matrix's job).
POOL_TOKEN_BYTES = 149760 // 256
DIM = 512


def _kernel(mod: str, name: str):
    import importlib
    return getattr(importlib.import_module(f"capdispatch.backends.{mod}"), name)


def jobs(only=None) -> list:
    """(row id, Job, per-iteration estimate) for each kernel of the issue's table."""
    from capdispatch import bench
    from capdispatch.backends.moe import launch_table as ML
    from capdispatch.backends.moe import triton_kernels as MK
    from capdispatch.backends.sparse_attention import launch_table as AL
    M = bench.compile_matrix
    t = M.target("sm_90")
    out = []
    # MoE: 1/8/64 tokens over 64 experts are 1-6 routes per expert (one tile class), 4096 tokens 384.
    for row, avg in (("moe_decode", 1.0), ("moe_prefill", 384.0)):
        BM, BN1, BK1, W1, S1, BN2, BK2, W2, S2 = ML.tiles_for(avg, MOE_H, MOE_I, False)[:9]
        sig = MK.COMPILE_SIGNATURES
        out.append((row, M.Job("moe", "moe.triton_kernels:_gemm1_swiglu_kernel", f"BM={BM} n{BN1}k{BK1}w{W1}s{S1}",
                               dict(sig["_gemm1_swiglu_kernel"]),
                               dict(TOPK=MOE_TOPK, HAS_LIMIT=True, F32=False, BM=BM, BN=BN1, BK=BK1, SPLIT=1,
                                    PREFETCH=0),
                               num_warps=W1, num_stages=S1),
                    dict(weight_bytes=2 * BN1 * BK1 // 2 + 2 * BN1 * BK1 // 32, act_bytes=BM * BK1 * 2,
                         flops=2 * BM * 2 * BN1 * BK1, dtype="bf16", iters=MOE_H // BK1)))
        out.append((row, M.Job("moe", "moe.triton_kernels:_gemm2_kernel", f"BM={BM} n{BN2}k{BK2}w{W2}s{S2}",
                               dict(sig["_gemm2_kernel"]), dict(F32=False, BM=BM, BN=BN2, BK=BK2, SPLIT=1, PREFETCH=0),
                               num_warps=W2, num_stages=S2),
                    dict(weight_bytes=BN2 * BK2 // 2 + BN2 * BK2 // 32, act_bytes=BM * BK2 * 2,
                         flops=2 * BM * BN2 * BK2, dtype="bf16", iters=MOE_I // BK2)))
    cfgs = {k: AL.configs_for((9, 0), k) for k in AL.KINDS}
    c = cfgs["prefill"][0]
    out.append(("sparse_prefill", M.attention_job("sparse_prefill", 0, "prefill", c),
                dict(kv_bytes=c["BLOCK_N"] * DIM * 2, flops=4 * c["BLOCK_H"] * c["BLOCK_N"] * DIM, dtype="bf16")))
    c = cfgs["decode"][0]
    out.append(("decode_mla", M.attention_job("decode_mla", 2, "decode", c),
                dict(kv_bytes=c["BLOCK_N"] * POOL_TOKEN_BYTES, flops=4 * c["BLOCK_H"] * c["BLOCK_N"] * DIM,
                     dtype="bf16")))
    for c in cfgs["decode_split"][:2]:
        out.append(("decode_mla_split", M.attention_job("decode_mla", 2, "decode_split", c),
                    dict(kv_bytes=c["BLOCK_N"] * POOL_TOKEN_BYTES, flops=4 * c["BLOCK_H"] * c["BLOCK_N"] * DIM,
                         dtype="bf16")))
    matrix = M.jobs_for(t)
    comb = [j for j in matrix if j.op == "decode_mla" and j.name == "_combine_kernel"]
    out += [("decode_mla_split", j, dict(kv_bytes=AL.COMBINE_BLOCK_H * AL.COMBINE_BLOCK_D * 4)) for j in comb]
    from capdispatch.backends.indexer import launch_table as IL
    for j in matrix:
        if j.name == "_indexer_kernel" and j.variant == "fp8 next_n=1":
            out.append(("indexer", j, dict(kv_bytes=IL.BLOCK_N * (128 + 4), flops=2 * 64 * 128 * IL.BLOCK_N,
                                           dtype="fp8")))
    out += [("kv_cache", j, {}) for j in matrix if j.op == "kv_cache" and j.variant == "fp8"]
    if only:
        out = [x for x in out if x[0].split("_")[0] in only or x[0] in only]
    return out


def analyse(row: str, job, est: dict) -> dict:
    mod, name = job.kernel.split(":")
    ck = ST.compile_kernel(_kernel(mod, name), job.signature, job.constexprs, job.num_warps, job.num_stages, CC)
    n, mix = ST.main_loop(ck.sass)
    whole = ST.whole_kernel(ck.sass)
    if ck.regs is None:
        raise RuntimeError(f"ptxas -v printed no register count for {name} ({job.variant})")
    occ = ST.occupancy(ck.regs, ck.smem, job.num_warps)
    return dict(row=row, op=job.op, kernel=name, variant=job.variant, num_warps=job.num_warps,
                num_stages=job.num_stages, regs=ck.regs, spill_stores=ck.spill_stores, spill_loads=ck.spill_loads,
                smem=ck.smem, occupancy=dict(blocks=occ.blocks, warps=occ.warps, limiter=occ.limiter),
                ptx_mma=ST.ptx_mma_kinds(ck.ptx), kernel_instructions=sum(whole.values()),
                kernel_classes=ST.by_class(whole), loop_instructions=n, loop_classes=ST.by_class(mix),
                loop_top=mix.most_common(14), loop_mix=dict(mix), estimate=est)


def derive(r: dict) -> dict:
    """Per-iteration ratios, the issue ceiling and the overlap bracket of one analysed kernel.

    Per block-iteration on one SM: issue clocks = warp instructions / schedulers, memory
    clocks = bytes / (copy rate per SM per clock), tensor clocks = FLOPs / (matmul rate
    per SM per clock). With perfect overlap an iteration takes the largest of the three;
    with none (one block per SM, nothing prefetched) their sum. Each bracket is the
    fraction of the copy or matmul ceiling that follows."""
    est, n, w = r["estimate"], r["loop_instructions"], r["num_warps"]
    out = {}
    if not n:
        return out
    classes = ST.by_class(r.get("loop_mix") or {}) if r.get("loop_mix") else r["loop_classes"]
    r["loop_classes"] = classes
    warp_insns = n * w                      # warp instructions one block issues per iteration
    issue = warp_insns / SCHEDULERS         # an SM's issue clocks per block-iteration, at best
    rate = SMS * CLOCK_HZ / issue           # block-iterations per second, whole GPU
    bytes_ = est.get("weight_bytes", 0) + est.get("kv_bytes", 0)
    mem = bytes_ / (COPY_GBPS * 1e9 / SMS / CLOCK_HZ)
    tensor = 0.0
    if est.get("flops"):
        peak = FP8_TFLOPS if est.get("dtype") == "fp8" else BF16_TFLOPS
        tensor = est["flops"] / (peak * 1e12 / SMS / CLOCK_HZ)
    out.update(warp_insns_per_iter=warp_insns, issue_clocks=issue, memory_clocks=mem, tensor_clocks=tensor)
    if bytes_:
        out["bytes_per_iter"] = bytes_
        out["warp_insns_per_byte"] = warp_insns / bytes_
        out["issue_ceiling_gbps"] = rate * bytes_ / 1e9
        out["issue_ceiling_frac_copy"] = out["issue_ceiling_gbps"] / COPY_GBPS
        out["copy_bracket"] = (mem / max(mem, issue, tensor), mem / (mem + issue + tensor))
    if tensor:
        out["flops_per_iter"] = est["flops"]
        out["issue_ceiling_tflops"] = rate * est["flops"] / 1e12
        out["issue_ceiling_frac_mm"] = out["issue_ceiling_tflops"] / peak
        out["mm_bracket"] = (tensor / max(mem, issue, tensor), tensor / (mem + issue + tensor))
        out["tensor_share"] = (classes["tensor_wgmma"] + classes["tensor_mma"]) / n
    return out


# The figures measured on the H200 per row (2026-12-02, CUDA graphs): (label, measured, target).
ISSUE = {
    "moe_decode": ("moe `triton_w4a16`, 1 / 8 / 64 tokens", "28.0 / 37.1 / 37.8% of the weight-bytes roofline",
                   ">= 60%"),
    "moe_prefill": ("moe `triton_w4a16`, 4096 tokens", "34.9% of the bf16 compute roofline", ">= 50%"),
    "sparse_prefill": ("sparse_prefill `triton`, s=4096 / 16384, top-k 512", "27.9 / 28.5% of compute", ">= 45%"),
    "decode_mla": ("decode_mla `triton_fp8`, 4096 tokens (one-pass decode)", "17.6% of compute", ">= 30%"),
    "decode_mla_split": ("decode_mla `triton_fp8`, 1-64 tokens (split-K decode and combine)",
                         "1.29-2.17x FlashMLA's time at 1-32 tokens (as SGLang calls it)", "within 1.2x of FlashMLA"),
    "indexer": ("indexer native fp8, decode 64 x 16k / prefill 4096 x 28672",
                "62.2% of memory (decode) / 56.4% of compute (prefill)", ">= 60% memory / >= 40% compute"),
    "kv_cache": ("KV quant / dequant (native fp8)",
                 "random slots: kv_quant 78.5-79.7%, kv_dequant 83.2-84.8%; paged 85-92.5% of copy",
                 ">= 84% of copy bandwidth"),
}

# The reading of this run's figures per row, and the change that would address it.
NOTES_FILE = os.path.join(BENCH, "sass_bounds_notes.yaml")


def _fmt(v, spec="{:.0f}"):
    return "-" if v is None else spec.format(v)


def markdown(meta: dict, rows: list, notes: dict) -> str:
    L = [f"# What bounds the H200 Triton kernels: offline analysis for sm_90a",
         "",
         f"Written by `python benchmarks/sass_bounds.py`, {meta['date']}; Triton {meta['triton']} on a CPU "
         "(`triton.compile` for `GPUTarget('cuda', 90, 32)`, ptxas -v, nvdisasm). **Offline analysis: a proxy "
         "from the compiled code, not a timing.** The timings of the issue's table ran with Triton "
         f"{meta['timed_with']}, whose code generation may differ.",
         "",
         "Occupancy is theoretical, on an H200 SM: 65536 registers (allocated per warp in units of 256), "
         "228 KB shared memory (1 KB reserved per block), 64 warps, 32 blocks. The main loop is the largest "
         "backward branch of the SASS; its counts are per thread (one warp instruction each). The issue "
         f"ceiling assumes {SMS} SMs x {SCHEDULERS} schedulers each issuing one warp instruction per clock at "
         f"{CLOCK_HZ / 1e9:.2f} GHz with no stall, every SM busy: the most the loop's instruction count allows, "
         f"set against the measured ceilings (copy {COPY_GBPS:.0f} GB/s, bf16 matmul ~{BF16_TFLOPS:.0f} TFLOP/s, "
         f"fp8 {FP8_TFLOPS:.0f} TFLOP/s). Bytes per iteration are what one block reads from global memory "
         "per loop trip (weights or gathered K/V rows; activations listed apart).",
         "",
         "| op row | kernel | variant | warps | stages | regs | spill st / ld B | smem B | "
         "blocks/SM (warps, limiter) | PTX wgmma / mma.sync |",
         "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        o = r["occupancy"]
        L.append(f"| {r['row']} | `{r['kernel']}` | {r['variant']} | {r['num_warps']} | {r['num_stages']} | "
                 f"{_fmt(r['regs'])} | {_fmt(r['spill_stores'])} / {_fmt(r['spill_loads'])} | {r['smem']} | "
                 f"{o['blocks']} ({o['warps']}, {o['limiter']}) | {r['ptx_mma']['wgmma']} / {r['ptx_mma']['mma.sync']} |")
    L += ["", "Main loop, per thread per iteration (instruction classes: sass_tools.CLASSES), and per block "
          "per iteration: bytes read, FLOPs, SM clocks of issue / memory / tensor work, and the bracket of the "
          "bound ceiling reached with perfect overlap .. no overlap of the three.", "",
          "| op row | kernel | variant | insns | tensor (wgmma / mma) | global ld | shared | local | int | "
          "FP32+MUFU | f16x2 | conv | other | bytes | FLOPs | warp insns / byte | clocks issue / mem / tensor | "
          "issue ceiling | % of copy | % of mm |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        d, c = r["derived"], r["loop_classes"]
        if not r["loop_instructions"]:
            continue
        ceil = []
        if "issue_ceiling_gbps" in d:
            ceil.append(f"{d['issue_ceiling_gbps']:.0f} GB/s ({100 * d['issue_ceiling_frac_copy']:.0f}% of copy)")
        if "issue_ceiling_tflops" in d:
            ceil.append(f"{d['issue_ceiling_tflops']:.0f} TFLOP/s ({100 * d['issue_ceiling_frac_mm']:.0f}% of mm)")
        br = lambda k: "-" if k not in d else f"{100 * d[k][0]:.0f} .. {100 * d[k][1]:.0f}"  # noqa: E731
        L.append(
            f"| {r['row']} | `{r['kernel']}` | {r['variant']} | {r['loop_instructions']} | "
            f"{c['tensor_wgmma']} / {c['tensor_mma']} | {c['global_load']} | {c['shared']} | {c['local_spill']} | "
            f"{c['int_alu']} | {c['fp32'] + c['special_fn']} | {c['half']} | {c['conversion']} | {c['other']} | "
            f"{_fmt(d.get('bytes_per_iter'))} | {_fmt(d.get('flops_per_iter'))} | "
            f"{_fmt(d.get('warp_insns_per_byte'), '{:.2f}')} | "
            f"{d['issue_clocks']:.0f} / {d['memory_clocks']:.0f} / {d['tensor_clocks']:.0f} | "
            f"{'; '.join(ceil) or '-'} | {br('copy_bracket')} | {br('mm_bracket')} |")
    L += ["", "Main-loop opcodes (most frequent first, per kernel):", ""]
    for r in rows:
        top = ", ".join(f"{op} {k}" for op, k in r["loop_top"]) or "no loop; whole kernel: " + ", ".join(
            f"{k} {v}" for k, v in r["kernel_classes"].items() if v)
        L.append(f"- {r['row']} `{r['kernel']}` {r['variant']}: {top}")
    L += ["", "## Per row of the issue's table: what bounds it", ""]
    for row, (label, measured, target) in ISSUE.items():
        mine = [r for r in rows if r["row"] == row]
        if not mine:
            continue
        L += [f"### {label}", "", f"Measured on the H200 (2026-12-02, CUDA graphs): {measured}; target {target}.", ""]
        facts = []
        for r in mine:
            d, o = r["derived"], r["occupancy"]
            f = (f"`{r['kernel']}` ({r['variant']}): {_fmt(r['regs'])} registers, "
                 f"{_fmt(r['spill_stores'])} B spill stores, {r['smem']} B shared, {o['blocks']} block(s) = "
                 f"{o['warps']} warps per SM ({o['limiter']})")
            if r["loop_instructions"]:
                cl = r["loop_classes"]
                f += (f"; main loop {r['loop_instructions']} instructions per thread, of which "
                      f"{cl['tensor_wgmma']} wgmma and {cl['tensor_mma']} mma.sync tensor ops, "
                      f"{cl['int_alu']} integer, {cl['conversion']} conversion, "
                      f"{cl['fp32'] + cl['special_fn']} FP32/MUFU, {cl['half']} f16x2, {cl['global_load']} global loads, "
                      f"{cl['shared']} shared, {cl['local_spill']} local (spill)")
                if "issue_ceiling_gbps" in d:
                    f += (f"; {d['warp_insns_per_byte']:.2f} warp instructions per byte read, an issue ceiling "
                          f"of {d['issue_ceiling_gbps']:.0f} GB/s ({100 * d['issue_ceiling_frac_copy']:.0f}% of copy)")
                if "issue_ceiling_tflops" in d:
                    f += (f"; issue ceiling {d['issue_ceiling_tflops']:.0f} TFLOP/s "
                          f"({100 * d['issue_ceiling_frac_mm']:.0f}% of the matmul rate)")
                for k, what in (("copy_bracket", "copy"), ("mm_bracket", "matmul")):
                    if k in d:
                        f += (f"; {what} ceiling reached {100 * d[k][0]:.0f}% with issue, memory and tensor "
                              f"work overlapped, {100 * d[k][1]:.0f}% with none overlapped")
            facts.append(f"- {f}.")
        L += facts + [""]
        if row in notes:
            L += [notes[row], ""]
    return "\n".join(L) + "\n"


def load_notes() -> dict:
    if not os.path.exists(NOTES_FILE):
        return {}
    import yaml
    with open(NOTES_FILE, encoding="utf-8") as f:
        notes = yaml.safe_load(f) or {}
    unknown = sorted(set(notes) - set(ISSUE))
    if unknown:
        raise SystemExit(f"{NOTES_FILE}: unknown row(s) {', '.join(unknown)}; valid: {', '.join(ISSUE)}")
    return notes


def write(out_dir: str, meta: dict, rows: list) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    os.makedirs(out_dir, exist_ok=True)
    results_dir.archive_previous(out_dir, SERIES)
    base = os.path.join(out_dir, f"{SERIES}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(meta, rows, load_notes()))
    return base


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    results_dir.add_out(ap)
    ap.add_argument("--only", default="", help="comma-separated row prefixes (moe, sparse, decode, indexer, kv)")
    ap.add_argument("--from-json", help="re-render the report of a written run (no compiles)")
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            data = json.load(f)
        for r in data["rows"]:
            r["derived"] = derive(r)
        with open(os.path.splitext(a.from_json)[0] + ".md", "w") as f:
            f.write(markdown(data["meta"], data["rows"], load_notes()))
        return 0
    import triton
    only = {s.strip() for s in a.only.split(",") if s.strip()} or None
    valid = {r.split("_")[0] for r in ISSUE} | set(ISSUE)
    if only and not only <= valid:
        print(f"sass_bounds: --only {a.only!r}: unknown {', '.join(sorted(only - valid))}; "
              f"valid: {', '.join(sorted(valid))}", file=sys.stderr)
        return 2
    rows = []
    for row, job, est in jobs(only):
        print(f"compiling {row}: {job.name} {job.variant}", file=sys.stderr, flush=True)
        r = analyse(row, job, est)
        r["derived"] = derive(r)
        rows.append(r)
        print(f"  regs {r['regs']} spills {r['spill_stores']} smem {r['smem']} occ {r['occupancy']} "
              f"loop {r['loop_instructions']} {r['loop_classes']} {r['derived']}", file=sys.stderr, flush=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                triton=triton.__version__, timed_with="3.6.0", target="sm_90a")
    print(write(a.out, meta, rows) + ".md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time the candidate launch tables of the Triton attention kernels against the current
ones and against FlashMLA, all in their served form, in one run on a CUDA GPU.

    python benchmarks/bench_attention_candidates.py --out DIR [--budget-s 300]
        [--decode-tokens 1 8 32 64 128 4096] [--prefill-tokens 4096 16384]
        [--tiles card 99kb] [--codecs triton_fp8 triton] [--tables NAME ...]

Served form (as calibration times it): every backend bound with ``checks=False``
and called inside one ``capdispatch.batch()`` (FlashMLA's decode schedule built by the
first call, before timing); decode replayed from a CUDA graph up to SGLang's capture
bound for this card's memory (``bench.served.capture_max_bs``), eager above it; prefill eager.
Shapes: DeepSeek-V4 at TP 1, 64 heads, head dim 512 (448 e4m3 nope + 64 bf16 rope per
584-byte pool row); decode: a 128-entry SWA list over a page-256 pool plus a 512-entry
c4 list over a page-64 pool, per token; prefill: top-k 512 bf16 rows of s_kv 65536.

Per size: the ceilings measured in this run (copy bandwidth, bf16 matmul rate), the
torch reference on fresh inputs, FlashMLA served, then each Triton backend with the
current launch table and with each candidate table (launch_table.CANDIDATE_TABLES;
with ``--tiles 99kb`` the 99 KB tables: PORTABLE_CONFIGS against CANDIDATE_TABLES_99KB,
under the 99 KB shared-memory limit), each checked against the reference before it is
timed. The u8 codec (``triton``) times the current table and the table that won for
``triton_fp8`` at that size (each table costs compiles). Candidates run inside
``sparse_attention.kernels.tables_as``, which the ops' launch plans are keyed by.

Targets: decode Triton <= 1.3x served FlashMLA at 1-64 tokens and <= 1.5x at 4096;
sparse prefill Triton >= 45% of the bf16 matmul rate at 4k and 16k tokens.
Whatever is not started within --budget-s seconds is reported as skipped.
Writes attention_candidates_<card>_<stamp>.json and .md into --out.

Why the current kernels miss (H200, 132 SMs; the issue's figures): see
docs/ops/sparse_attention.md, "Why the Triton kernels miss, per size, and the candidate tables".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import bench_attention as BA  # noqa: E402 (the script's own folder)
import tile_modes  # noqa: E402
from ceilings import bench as _bench, copy_bandwidth, describe, matmul_rate, run_facts  # noqa: E402
from results_dir import add_out, archive_previous  # noqa: E402

DECODE_TARGETS = ((64, 1.3), (1 << 62, 1.5))   # (up to tokens, served Triton / served FlashMLA)
PREFILL_TARGET = 0.45                          # fraction of the bf16 matmul rate
PREFILL_KV, PREFILL_TOPK = 65536, 512


def decode_target(T):
    return next(r for t, r in DECODE_TARGETS if T <= t) if T <= 64 or T >= 4096 else None


def candidate_sources(tiles):
    from capdispatch.backends.sparse_attention import launch_table as LT
    return LT.CANDIDATE_TABLES if tiles == "card" else LT.CANDIDATE_TABLES_99KB


def tables(tiles, only=None):
    """The current table, then TILES' candidates (those named in ONLY, when given)."""
    src = candidate_sources(tiles)
    return [("current", "the launch table as it is", None)] + [
        (n, why, t) for n, (why, t) in src.items() if only is None or n in only]


class Runner:
    def __init__(self, args, reg, bw, tflops, start):
        import torch

        import capdispatch as cd
        from capdispatch import bench
        self.args, self.reg, self.bw, self.tflops, self.start = args, reg, bw, tflops, start
        self.capture = bench.served.capture_max_bs(torch.cuda.get_device_properties(0).total_memory)
        self.rows = []

    def left(self):
        return self.args.budget_s - (time.monotonic() - self.start)

    def checked(self, tiles, call):
        """CALL under TILES' launch-table entries, every launch compiled first and recorded
        (shared memory, registers, spills); on this card's own tiles with its own limit."""
        if tiles != "card":
            return tile_modes.checked(tiles, call)
        import torch

        import capdispatch as cd
        from capdispatch import bench
        props = torch.cuda.get_device_properties(0)
        optin = getattr(props, "shared_memory_per_block_optin", None)
        if not optin:
            return call(), [], None
        cc = torch.cuda.get_device_capability(0)
        with bench.tiles_as(bench.TileTarget(capability=cc, shared_bytes=int(optin), label="this card")) as scope:
            try:
                return call(), list(scope.launches), None
            except Exception as exc:   # noqa: BLE001 - reported as the entry's error
                return None, list(scope.launches), exc

    def time_backend(self, op, backend, inputs, want, graph, tiles="card", table=None, name="current"):
        """Served time of BACKEND with TABLE forced (None: the launch table), checked first."""
        import contextlib

        import capdispatch as cd
        from capdispatch.backends.sparse_attention import kernels as K
        if self.left() <= 0:
            return dict(skipped=f"not started: past --budget-s {self.args.budget_s}")
        fn = cd.bind(op, "cuda:0", backend=backend, checks=False, registry=self.reg)
        call = lambda: fn(*inputs)  # noqa: E731
        scope = K.tables_as(f"candidate {tiles}:{name}", table) if table is not None else contextlib.nullcontext()
        t0 = time.monotonic()
        launches = []
        try:
            with scope, cd.batch():
                got, launches, err = self.checked(tiles, call)   # the batch's first call: its per-batch work
                launches = tile_modes.launch_rows(launches)
                if err is not None:
                    raise err
                ok, rel, serr = BA._check(op, got, want)
                with tile_modes.timing(tiles):
                    if graph:
                        ms = BA._bench_graph(call, self.args.rep)
                    else:
                        ms = _bench(call, self.args.warmup, self.args.rep)
        except Exception as exc:   # noqa: BLE001 - one failing entry must not hide the others
            return dict(error=f"{type(exc).__name__}: {exc}"[:400], launches=launches)
        return dict(ms=ms, graph=graph, correct=bool(ok), out_rel_err=rel, stat_abs_err=serr,
                    launches=launches, seconds=time.monotonic() - t0)

    def add(self, **row):
        self.rows.append(row)
        r = row
        res = f"{r['ms']:.4f} ms{' (graph)' if r.get('graph') else ''} correct={r.get('correct')}" if "ms" in r \
            else r.get("error") or r.get("skipped")
        extra = "".join(f" {k}={r[k]:.2f}" for k in ("over_flashmla", "frac_compute") if r.get(k) is not None)
        print(f"[{time.monotonic() - self.start:6.1f}s] {r['op']} {r['size']} {r['backend']} "
              f"[{r['tiles']}:{r['table']}]: {res}{extra}", flush=True)


def run(args):
    import torch
    if not torch.cuda.is_available():
        print("bench_attention_candidates: needs a CUDA device", file=sys.stderr)
        return 2
    import capdispatch as cd
    start = time.monotonic()
    facts = run_facts(args.seed)
    print(describe(facts))
    # Once per run: the report is rewritten after every size under this run's stamp.
    archive_previous(args.out, series(facts["device"]))
    bw, _ = copy_bandwidth(args.copy_bytes, args.warmup, args.rep)
    tflops, _ = matmul_rate(8192, args.warmup, args.rep)
    print(f"copy bandwidth {bw:.0f} GB/s (read+write); bf16 matmul {tflops:.0f} TFLOP/s")
    reg = BA.registry()
    R = Runner(args, reg, bw, tflops, start)
    gen = torch.Generator(device="cuda").manual_seed(facts["seed"])
    avail = {op: BA.runnable(op, reg) for op in ("decode_mla", "sparse_prefill")}
    for op, a in avail.items():
        for b, why in a.items():
            print(f"[{op}] {b}: {'runnable' if why is None else 'not runnable: ' + why}")

    def meta():
        return dict(facts, copy_gbps=bw, bf16_tflops=tflops, heads=BA.H, capture_max_bs=R.capture,
                    budget_s=args.budget_s, elapsed_s=time.monotonic() - start, availability=avail,
                    do_bench=dict(warmup_ms=args.warmup, rep_ms=args.rep, return_mode="median"),
                    tables={t: {n: w for n, w, _ in tables(t, args.tables)} for t in args.tiles})

    # Inputs and reference once per size; FlashMLA served once per size (card tiles only).
    cases = [("decode_mla", T) for T in args.decode_tokens] + [("sparse_prefill", s) for s in args.prefill_tokens]
    flash = {}
    for op, size in cases:
        if R.left() <= 0:
            R.add(op=op, size=size, backend="*", tiles="*", table="*",
                  skipped=f"not started: past --budget-s {args.budget_s}")
            continue
        if op == "decode_mla":
            inputs, acc = BA.decode_inputs(dict(tokens=size), gen)
            graph = size <= R.capture
            codecs = [c for c in args.codecs if avail[op].get(c) is None]
            lib = "flashmla"
        else:
            inputs, acc = BA.prefill_inputs(dict(s=size, s_kv=PREFILL_KV, topk=PREFILL_TOPK), gen)
            graph = False
            codecs = ["triton"] if avail[op].get("triton") is None else []
            lib = "flashmla_sparse"
        flops, nbytes = BA.work(op, acc)
        t_compute = flops / tflops / 1e9
        t_mem = nbytes / bw / 1e6
        want = cd.bind(op, "cuda:0", backend="torch", registry=reg)(*inputs)
        base = dict(op=op, size=size, flops=flops, bytes=nbytes, compute_ms=t_compute, memory_ms=t_mem)
        if avail[op].get(lib) is None:
            r = R.time_backend(op, lib, inputs, want, graph)
            flash[(op, size)] = r.get("ms") if r.get("correct") else None
            R.add(**base, tiles="card", backend=lib, table="library", **r,
                  frac_compute=(t_compute / r["ms"]) if "ms" in r else None)
        else:
            flash[(op, size)] = None
            R.add(**base, tiles="card", backend=lib, table="library", skipped=avail[op][lib])
        fl = flash[(op, size)]
        # This card's tables first, then the 99 KB ones, per size: a run cut by the budget
        # still has both table sets for the sizes it reached.
        for tiles in args.tiles:
            best_fp8 = None
            for codec in codecs:
                ts = tables(tiles, args.tables)
                if codec == "triton" and op == "decode_mla" and "triton_fp8" in codecs:
                    ts = [t for t in ts if t[0] in ("current", best_fp8)]
                best = None
                for name, why, table in ts:
                    r = R.time_backend(op, codec, inputs, want, graph, tiles, table, name)
                    row = dict(base, tiles=tiles, backend=codec, table=name, why=why, **r)
                    if "ms" in r:
                        row["frac_compute"] = t_compute / r["ms"]
                        row["frac_memory"] = t_mem / r["ms"]
                        if fl:
                            row["over_flashmla"] = r["ms"] / fl
                        if r.get("correct") and (best is None or r["ms"] < best[1]):
                            best = (name, r["ms"])
                    R.add(**row)
                if codec == "triton_fp8" and best:
                    best_fp8 = best[0]
                if best:
                    tgt = decode_target(size) if op == "decode_mla" else PREFILL_TARGET
                    cur = next((x.get("ms") for x in R.rows if x["op"] == op and x["size"] == size
                                and x["tiles"] == tiles and x["backend"] == codec and x["table"] == "current"), None)
                    val = (best[1] / fl if fl else None) if op == "decode_mla" else t_compute / best[1]
                    R.rows.append(dict(summary=True, op=op, size=size, tiles=tiles, backend=codec, best=best[0],
                                       best_ms=best[1], current_ms=cur, flashmla_ms=fl, value=val, target=tgt,
                                       met=(val is not None and tgt is not None and
                                            (val <= tgt if op == "decode_mla" else val >= tgt))))
        del inputs, want
        torch.cuda.empty_cache()
        write(args.out, meta(), R.rows, quiet=True)    # after every size: a run stopped from outside keeps its rows
    write(args.out, meta(), R.rows)
    return 0 if all(r.get("correct", True) for r in R.rows) else 1


def _slug(name):
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def series(device):
    """The results series of a run on DEVICE."""
    return f"attention_candidates_{_slug(device)}"


def write(out, meta, rows, quiet=False):
    os.makedirs(out, exist_ok=True)
    stamp = meta["date"].replace("-", "").replace(":", "").split("+")[0]
    base = os.path.join(out, f"{series(meta['device'])}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1, default=str)
    L = [f"# Attention launch-table candidates on {meta['device']}", "",
         f"- date: {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, "
         f"cc {meta['compute_capability']}; seed {meta['seed']}; heads {meta['heads']}",
         f"- ceilings (this run): copy {meta['copy_gbps']:.0f} GB/s (read+write), bf16 matmul "
         f"{meta['bf16_tflops']:.0f} TFLOP/s",
         f"- served form: checks=False, one capdispatch.batch(); decode in a CUDA graph up to "
         f"{meta['capture_max_bs']} tokens, eager above; prefill eager; do_bench median",
         f"- run took {meta['elapsed_s']:.0f} s (budget {meta['budget_s']} s)", ""]
    for tiles, ts in meta["tables"].items():
        L += [f"Tables ({tile_modes.label(tiles)}):", ""] + [f"- `{n}`: {w}" for n, w in ts.items()] + [""]
    L += ["## Targets", "", "| op | size | tiles | backend | best table | best ms | current ms | FlashMLA ms | "
          "value | target | met |", "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r.get("summary"):
            v = "—" if r["value"] is None else (f"{r['value']:.2f}x FlashMLA" if r["op"] == "decode_mla"
                                                 else f"{100 * r['value']:.0f}% compute")
            t = "—" if r["target"] is None else (f"<= {r['target']}x" if r["op"] == "decode_mla"
                                                  else f">= {100 * r['target']:.0f}%")
            L.append(f"| {r['op']} | {r['size']} | {r['tiles']} | {r['backend']} | {r['best']} | {r['best_ms']:.4f} | "
                     f"{'—' if r['current_ms'] is None else format(r['current_ms'], '.4f')} | "
                     f"{'—' if r['flashmla_ms'] is None else format(r['flashmla_ms'], '.4f')} | {v} | {t} | "
                     f"{'yes' if r['met'] else 'no'} |")
    L += ["", "## Every run", "", "| op | size | tiles | backend | table | ms | graph | / FlashMLA | % compute | "
          "% memory | correct | launches (shared B, regs, spills) |",
          "| --- | ---: | --- | --- | --- | ---: | --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        if r.get("summary"):
            continue
        if "ms" not in r:
            L.append(f"| {r['op']} | {r['size']} | {r['tiles']} | {r['backend']} | {r['table']} | "
                     f"{r.get('error') or r.get('skipped')} | | | | | | |")
            continue
        la = "; ".join(_launch_cell(e) for e in (r.get("launches") or []))
        L.append(f"| {r['op']} | {r['size']} | {r['tiles']} | {r['backend']} | {r['table']} | {r['ms']:.4f} | "
                 f"{'yes' if r.get('graph') else 'no'} | "
                 + (f"{r['over_flashmla']:.2f}x" if r.get("over_flashmla") else "—") + " | "
                 + (f"{100 * r['frac_compute']:.1f}" if r.get("frac_compute") else "—") + " | "
                 + (f"{100 * r['frac_memory']:.1f}" if r.get("frac_memory") else "—")
                 + f" | {r.get('correct')} | {la} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(L) + "\n")
    if not quiet:
        print(f"wrote {base}.json and {base}.md")


def _launch_cell(e):
    c = e.get("config") or {}
    tile = "x".join(str(c[k]) for k in ("BLOCK_H", "BLOCK_N") if k in c)
    opts = "".join(f" {k[4]}{c[k]}" for k in ("num_warps", "num_stages") if k in c)
    return (f"{e.get('kernel', '').split(':')[-1]} {tile}{opts}: {e.get('shared_bytes')} B, "
            f"{e.get('registers')} regs, {e.get('spills')} spills")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(p)
    p.add_argument("--decode-tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 4096])
    p.add_argument("--prefill-tokens", type=int, nargs="*", default=[4096, 16384],
                   help="prefill sizes (none: decode only)")
    p.add_argument("--tiles", nargs="+", choices=tile_modes.TILES, default=list(tile_modes.TILES))
    p.add_argument("--codecs", nargs="+", choices=("triton_fp8", "triton"), default=["triton_fp8", "triton"])
    p.add_argument("--tables", nargs="*", default=None, metavar="NAME",
                   help="candidate tables to time besides the current one (default: every candidate "
                        "of each --tiles set; none: the current tables alone)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no timing after this many seconds of the run (default 300)")
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=40, help="do_bench measuring time, ms")
    p.add_argument("--seed", type=int, default=None)
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    for name, vals in (("--decode-tokens", a.decode_tokens), ("--prefill-tokens", a.prefill_tokens)):
        if any(v <= 0 for v in vals):
            p.error(f"{name} must be positive, got {vals}")
    if a.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {a.budget_s}")
    if a.tables:
        known = set().union(*(candidate_sources(t) for t in a.tiles))
        unknown = sorted(set(a.tables) - known)
        if unknown:
            p.error(f"--tables: no candidate table {', '.join(unknown)} for --tiles {' '.join(a.tiles)}; "
                    f"known: {', '.join(sorted(known))}")
    return a


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

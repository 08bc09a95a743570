"""Time the backends on a share of this card's SMs: each target card's SM count, through a CUDA
green context (torch.cuda.green_contexts), as evidence for the default orders of cards we
cannot run (docs/policies.md: a projection).

    python benchmarks/bench_sm_share.py --out DIR [--cards rtx-3080,rtx-3090,rtx-4090]
        [--ops moe decode_mla] [--sizes 1,8,64,4096] [--seed N] [--timeout S]

Per card (and once for the whole card, first): a child process makes a green context of the
card's SM count current before anything else touches the GPU, emulates the card on the device
(capdispatch.extend.emulate_card: its launch tables, shared-memory limit, split counts and
fp8 codec, as an emu: rank does), measures the copy bandwidth
and the bf16 matmul rate there (eagerly and replayed from a CUDA graph), then runs `dispatch
bench --device cuda:0 --op OP --sizes ... --format json`: every runnable backend of the op in
the served form, each checked against the op's reference first; the report keeps the
backends whose requirements the card meets.

The partition is checked, failing closed: the matmul rate must fall to k/N of the whole
card's, within PARTITION_TOL, in both timing modes (a graph replayed outside the green
context would run on every SM); a card whose partition did not take gets no projection.

What the numbers are: this card's SMs, clocks, caches, instructions and launch tables, k of
them. A kernel bound by its SMs would take about t_k on the target; one bound by memory would
take t_k x BW_k / BW_card (BW_k: the copy bandwidth measured on the k SMs; BW_card: the
target's published bandwidth, capdispatch's speed model). The report gives both ends of that
bracket per backend and size, and where one backend is ahead at both ends, the order it
supports. It does not capture the target's own architecture (SM86 has no wgmma; its clocks, caches and
memory system): the docs call it a projection, never a measurement.

Writes sm_share_<card>_<stamp>.json/.md (report.py) into --out. Exit status: 0 every card
measured with its partition in effect; 1 a child failed or a partition did not take; 2 bad
arguments; 3 no CUDA device or no green contexts in this torch.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys

import report
from results_dir import add_out

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_CARDS = ("rtx-3080", "rtx-3090", "rtx-4090")
DEFAULT_OPS = ("moe", "decode_mla")
DEFAULT_SIZES = (1, 8, 64, 4096)
PARTITION_TOL = 0.2          # the measured rate's share may be k/N x (1 +- this)
CHILD_TIMEOUT_S = 1500.0


def _args(argv):
    p = argparse.ArgumentParser(prog="bench_sm_share.py", description=__doc__.split("\n\n")[0])
    add_out(p)
    p.add_argument("--cards", default=",".join(DEFAULT_CARDS),
                   help=f"catalog cards whose SM count to time on (default {','.join(DEFAULT_CARDS)})")
    p.add_argument("--ops", nargs="+", default=list(DEFAULT_OPS), help=f"ops to time (default {' '.join(DEFAULT_OPS)})")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="the ops' sizes, as `dispatch bench --sizes` (default 1,8,64,4096)")
    p.add_argument("--seed", type=int, default=0, help="dispatch bench's --seed (default 0)")
    p.add_argument("--timeout", type=float, default=CHILD_TIMEOUT_S,
                   help=f"seconds each child may take (default {CHILD_TIMEOUT_S:g})")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)     # K SMs (0: the whole card)
    p.add_argument("--ceilings", default=None, help=argparse.SUPPRESS)
    p.add_argument("--emulate", default=None, help=argparse.SUPPRESS)                # the child's card
    a = p.parse_args(argv)
    a.cards = tuple(x.strip() for x in a.cards.split(",") if x.strip())
    a.ops = tuple(a.ops)
    import capdispatch as cd
    from capdispatch import bench
    for card in a.cards:
        if card not in bench.speed.CARDS:
            p.error(f"--cards {card}: no published bandwidth for it in the speed model "
                    f"(known: {', '.join(sorted(bench.speed.CARDS))})")
        try:
            sm_count(card)
        except cd.CapdispatchError as exc:
            p.error(f"--cards {card}: {exc}")
    ops = set(bench.registry.build(plugins=False).ops)
    for op in a.ops:
        if op not in ops:
            p.error(f"--ops {op}: not an op (known: {', '.join(sorted(ops))})")
    if a.timeout <= 0:
        p.error(f"--timeout {a.timeout:g}: expected seconds above 0")
    return a


def sm_count(card: str) -> int:
    import capdispatch as cd
    return int(cd.probe(f"sim:{card}").sm_count)


def partition_ok(rate_k: float, rate_full: float, k: int, n: int, tol: float = PARTITION_TOL) -> bool:
    """Did the green context take: is RATE_K about k/N of RATE_FULL?"""
    if not (rate_k > 0 and rate_full > 0 and 0 < k <= n):
        return False
    share = rate_k / rate_full
    return (1 - tol) * k / n <= share <= (1 + tol) * k / n


def bracket(t_k: float, bw_k_gbps: float, bw_card_gbps: float) -> tuple:
    """(SM-bound, memory-bound) time on the target card from T_K, the time on its SM count
    here: t_k, and t_k x BW_k / BW_card (never below t_k: the target's SMs are no faster)."""
    return t_k, t_k * max(1.0, bw_k_gbps / bw_card_gbps)


def order_supported(rows: dict) -> list:
    """ROWS: backend -> (low, high). The pairs (faster, slower) where one backend is ahead
    at both ends of the bracket."""
    out = []
    names = sorted(rows)
    for a in names:
        for b in names:
            if a < b:
                (la, ha), (lb, hb) = rows[a], rows[b]
                if la < lb and ha < hb:
                    out.append((a, b))
                elif lb < la and hb < ha:
                    out.append((b, a))
    return out


# ------------------------------------------------------------------ the child (one partition)

def child(a) -> int:
    import torch
    if a.child:
        from torch.cuda import green_contexts
        if not green_contexts.SUPPORTED:
            print("bench_sm_share.py: this torch has no CUDA green contexts", file=sys.stderr)
            return 3
        ctx = green_contexts.GreenContext.create(num_sms=a.child, device_id=0)
        ctx.set_context()
        torch.cuda.set_stream(ctx.Stream())
    if a.emulate:       # the card's launch tables, shared memory, split counts and fp8 codec
        import capdispatch as cd
        from capdispatch import extend
        extend.emulate_card(cd.probe(f"sim:{a.emulate}"), 0)
    import ceilings
    bw, _ = ceilings.copy_bandwidth()
    eager, _ = ceilings.matmul_rate()
    graph, _ = ceilings.matmul_rate(timer=ceilings.bench_graph)
    with open(a.ceilings, "w", encoding="utf-8") as fh:
        json.dump({"sms": a.child or torch.cuda.get_device_properties(0).multi_processor_count,
                   "copy_gbps": bw, "bf16_tflops_eager": eager, "bf16_tflops_graph": graph}, fh)
    # `python -m capdispatch bench` in this process, whose green context and emulation it must run under.
    sys.argv = ["dispatch", "bench", "--device", "cuda:0", "--op", ",".join(a.ops), "--sizes", a.sizes,
                "--seed", str(a.seed), "--format", "json"]
    try:
        runpy.run_module("capdispatch", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def _run_child(a, k: int, folder: str, card=None) -> dict:
    os.makedirs(folder, exist_ok=True)
    ceil = os.path.join(folder, "ceilings.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(k), "--ceilings", ceil, "--out", folder,
           *(("--emulate", card) if card else ()),
           "--cards", ",".join(a.cards), "--ops", *a.ops, "--sizes", a.sizes, "--seed", str(a.seed)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, ROOT, env.get("PYTHONPATH")) if p)
    with open(os.path.join(folder, "child.log"), "w", encoding="utf-8") as log:
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=a.timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {a.timeout:g} s (log: {log.name})"}
    if p.returncode not in (0,):
        return {"error": f"exit {p.returncode} (log: {os.path.join(folder, 'child.log')})"}
    try:
        with open(ceil, encoding="utf-8") as fh:
            c = json.load(fh)
        return {"ceilings": c, "bench": json.loads(p.stdout)}
    except (OSError, ValueError) as exc:
        return {"error": f"unreadable output: {type(exc).__name__}: {exc}"}


def times(bench_json: dict) -> dict:
    """(op, size) -> {backend: ms} over the rows that passed their check."""
    out = {}
    for op, d in (bench_json.get("ops") or {}).items():
        for r in d.get("rows") or ():
            if r.get("ok") and r.get("ms") is not None:
                out.setdefault((op, r["size"]), {})[r["backend"]] = r["ms"]
    return out


def runnable(card: str, op: str) -> set:
    """The backends of OP whose requirements CARD meets (with this machine's libraries)."""
    import capdispatch as cd
    return {c.backend for c in cd.resolve(op, f"sim:{card}").candidates if c.ok}


def project(full: dict, part: dict, card: str, k: int, can=runnable) -> dict:
    """One card's section of the report from the whole card's and its partition's results:
    the backends CAN(card, op) says the card runs."""
    c0, c = full["ceilings"], part["ceilings"]
    took = {m: partition_ok(c[f"bf16_tflops_{m}"], c0[f"bf16_tflops_{m}"], k, c0["sms"]) for m in ("eager", "graph")}
    sec = {"card": card, "sms": k, "of": c0["sms"], "ceilings": c, "partition": took, "rows": [], "orders": []}
    if not all(took.values()):
        sec["error"] = ("the green context did not take: bf16 rate " +
                        ", ".join(f"{m} {c[f'bf16_tflops_{m}']:.0f} of {c0[f'bf16_tflops_{m}']:.0f} TFLOP/s"
                                  for m in ("eager", "graph")) + f", expected about {k}/{c0['sms']} of it")
        return sec
    bw_card = bench_bw(card)
    whole, part_times = times(full["bench"]), times(part["bench"])
    runs = {op: can(card, op) for op, _ in part_times}
    for (op, size), by in sorted(part_times.items()):
        ends = {b: bracket(ms, c["copy_gbps"], bw_card) for b, ms in by.items() if b in runs[op]}
        for b, (lo, hi) in sorted(ends.items()):
            sec["rows"].append({"op": op, "size": size, "backend": b, "ms_on_k_sms": lo, "ms_memory_bound": hi,
                                "ms_whole_card": whole.get((op, size), {}).get(b)})
        sec["orders"] += [{"op": op, "size": size, "faster": f, "slower": s} for f, s in order_supported(ends)]
    return sec


def main(argv=None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    if a.child is not None:
        return child(a)
    import torch
    if not torch.cuda.is_available():
        print("bench_sm_share.py: no CUDA device", file=sys.stderr)
        return 3
    from torch.cuda import green_contexts
    if not green_contexts.SUPPORTED:
        print(f"bench_sm_share.py: torch {torch.__version__} has no CUDA green contexts", file=sys.stderr)
        return 3
    n = torch.cuda.get_device_properties(0).multi_processor_count
    out = os.path.abspath(a.out)
    stamp = report.stamp()
    work = os.path.join(out, f"sm_share_{stamp}")
    full = _run_child(a, 0, os.path.join(work, "whole"))
    sections, rc = [], 0
    if "error" in full:
        print(f"bench_sm_share.py: the whole card: {full['error']}", file=sys.stderr)
        return 1
    for card in a.cards:
        k = sm_count(card)
        if k >= n:
            sections.append({"card": card, "sms": k, "of": n, "error": f"needs {k} SMs, this card has {n}"})
            continue
        part = _run_child(a, k, os.path.join(work, card), card)
        sec = project(full, part, card, k) if "error" not in part else {"card": card, "sms": k, "of": n,
                                                                         "error": part["error"]}
        rc |= 1 if "error" in sec else 0
        sections.append(sec)
    env = report.environment(0)
    md = [f"Each card's SM count of this card's {n}, through a CUDA green context; t_k and t_k x BW_k / BW_card "
          f"per backend (ms, served form, `dispatch bench`). A projection: this card's architecture, k of its SMs.",
          ""]
    for s in sections:
        md.append(f"## {s['card']}: {s['sms']} of {s['of']} SMs")
        if "error" in s:
            md += ["", f"not projected: {s['error']}", ""]
            continue
        c = s["ceilings"]
        md += ["", f"partition: copy {c['copy_gbps']:.0f} GB/s, bf16 {c['bf16_tflops_eager']:.0f} TFLOP/s eager, "
                   f"{c['bf16_tflops_graph']:.0f} in a graph; the card's bandwidth {bench_bw(s['card'])} GB/s", "",
               "| op | size | backend | ms on k SMs | ms memory-bound | ms whole card |", "|---|---|---|---|---|---|"]
        md += [_row(r) for r in s["rows"]]
        md += ["", "ahead at both ends: " + ("; ".join(f"{o['op']} {o['size']}: {o['faster']} before {o['slower']}"
                                                       for o in s["orders"]) or "none"), ""]
    report.write(out, "sm_share", env, {"cards": sections, "whole": full["ceilings"], "sizes": a.sizes,
                                        "ops": list(a.ops), "partition_tol": PARTITION_TOL}, md,
                 title="Backends on a target card's SM count (green contexts): a projection")
    return rc


def _row(r) -> str:
    whole = "-" if r["ms_whole_card"] is None else f"{r['ms_whole_card']:.4f}"
    return (f"| {r['op']} | {r['size']} | {r['backend']} | {r['ms_on_k_sms']:.4f} | {r['ms_memory_bound']:.4f} | "
            f"{whole} |")


def bench_bw(card: str):
    from capdispatch import bench
    return bench.speed.CARDS[card][0]


if __name__ == "__main__":
    sys.exit(main())

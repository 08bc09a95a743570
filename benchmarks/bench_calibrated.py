"""The effect of a calibrated policy on a CUDA GPU: at every size of each op's ladder,
what `bind` returns under the policy (and under the built-in default) against the
fastest runnable backend.

    python benchmarks/bench_calibrated.py --policy FILE [--ops decode_mla sparse_prefill]
                                          [--sizes N,N,...] [--out DIR]

Each entry (`bind` with the policy, `bind` with the built-in default, every runnable
backend bound explicitly) is checked against the op's torch reference on fresh random
inputs (DeepSeek-V4 shapes: capdispatch.calibrate.inputs, the builders `dispatch bench`
uses), then timed the same way (`do_bench_cudagraph` median inside a CUDA graph at every
size: capdispatch.calibrate.ladder.timed_in_graph). Reports policy / fastest and default / fastest per size; the target is
policy / fastest <= 1.10 everywhere. Writes JSON + markdown into --out.

Importable without a GPU; it only needs CUDA when run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys

from results_dir import archive_previous  # the script's own folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TARGET = 1.10


def run(args) -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("bench_calibrated: needs a CUDA device", file=sys.stderr)
        return 2
    import capdispatch as cd
    from capdispatch.calibrate import ladder, measure, timing

    timer = timing.cuda_timer(args.warmup, args.rep)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    prof = ladder.PROFILES["full"]
    out_rows, worst = [], {}
    for op in args.ops:
        sizes = ladder.parse_sizes(args.sizes) if args.sizes else ladder.DEFAULT_SIZES[op]
        res_policy = cd.resolve(op, "cuda:0", policy=args.policy)
        res_default = cd.resolve(op, "cuda:0")
        fns = {c.backend: cd.bind(op, "cuda:0", backend=c.backend) for c in res_policy.candidates if c.ok}
        for size in sizes:
            entries = dict(fns)
            entries["bind (policy)"] = cd.bind(op, "cuda:0", policy=args.policy)
            entries["bind (default)"] = cd.bind(op, "cuda:0")
            inputs_of = {"bind (policy)": res_policy.backend_for(size),
                         "bind (default)": res_default.backend_for(size)}
            rows = measure.measure(op, (size,), entries, device="cuda", platform="cuda", profile=prof,
                                   gen=gen, timer=timer, inputs_of=inputs_of)
            t = {r.backend: r.ms for r in rows if r.ok}
            backends = {b: ms for b, ms in t.items() if b in fns}
            fastest = min(backends, key=backends.get) if backends else None
            row = dict(op=op, size=size, graph=rows[0].graph, times_ms=t, fastest=fastest,
                       policy_backend=inputs_of["bind (policy)"], default_backend=inputs_of["bind (default)"],
                       failed={r.backend: r.detail for r in rows if not r.ok})
            for label in ("policy", "default"):
                ms = t.get(f"bind ({label})")
                row[f"{label}_over_fastest"] = ms / backends[fastest] if ms and fastest else None
            out_rows.append(row)
            ratio = row["policy_over_fastest"]
            worst[op] = max(worst.get(op, 0.0), ratio or float("inf"))
            print(f"[{op}] {size:6d}{' graph' if row['graph'] else '      '}  fastest {fastest} "
                  f"{backends.get(fastest, float('nan')) * 1e3:9.1f} us; policy ({row['policy_backend']}) "
                  f"{_x(ratio)}; default ({row['default_backend']}) {_x(row['default_over_fastest'])}"
                  + (f"; FAILED {row['failed']}" if row["failed"] else ""), flush=True)
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), cc=list(torch.cuda.get_device_capability()),
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), seed=args.seed,
                policy=args.policy, timer=timer.describe, target=TARGET, worst_policy_over_fastest=worst)
    _write(args.out, meta, out_rows)
    ok = all(r["policy_over_fastest"] is not None and r["policy_over_fastest"] <= TARGET for r in out_rows)
    print(f"policy within {TARGET:.2f}x of the fastest at every size: {ok}; worst per op: "
          + ", ".join(f"{op} {v:.2f}x" for op, v in worst.items()))
    return 0 if ok and not any(r["failed"] for r in out_rows) else 1


def _x(v):
    return f"{v:.2f}x" if v is not None else "n/a"


def _write(out_dir, meta, rows):
    os.makedirs(out_dir, exist_ok=True)
    slug = "".join(c if c.isalnum() else "_" for c in meta["device"]).strip("_").lower()
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    archive_previous(out_dir, f"calibrated_{slug}")
    base = os.path.join(out_dir, f"calibrated_{slug}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)
    lines = [f"# A calibrated policy through bind on {meta['device']}", "",
             f"- date {meta['date']}; torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; "
             f"seed {meta['seed']}; policy {meta['policy']}", f"- timer: {meta['timer']}", "",
             "| op | size | graph | fastest | fastest us | policy picks | policy / fastest | default picks | default / fastest |",
             "| --- | ---: | --- | --- | ---: | --- | ---: | --- | ---: |"]
    for r in rows:
        f = r["fastest"]
        us = f"{r['times_ms'][f] * 1e3:.1f}" if f else ""
        lines.append(f"| {r['op']} | {r['size']} | {'yes' if r['graph'] else 'no'} | {f} | {us} | "
                     f"{r['policy_backend']} | {_x(r['policy_over_fastest'])} | {r['default_backend']} | "
                     f"{_x(r['default_over_fastest'])} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {base}.json and {base}.md")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="the calibrated policy (dispatch bench --write-policy)")
    p.add_argument("--ops", nargs="+", default=["decode_mla", "sparse_prefill"])
    p.add_argument("--sizes", default=None, help="instead of each op's ladder")
    p.add_argument("--warmup", type=float, default=25.0)
    p.add_argument("--rep", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

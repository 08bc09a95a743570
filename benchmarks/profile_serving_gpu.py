"""Where a serving call's host time goes on a GPU host: torch.profiler over eager calls.

For each Triton backend at bench_overhead's decode-sized problem (1 token), the call
``cd.bind(op, device, backend=..., checks=False)`` is made ITERS times under
``torch.profiler`` (CPU and CUDA activities). Reported per call: the GPU kernels launched
(Triton's and torch's, by name), and the torch operators with the most self CPU time
(allocations, dtype conversions, copies) — what the call does besides Triton's own
launcher, which bench_overhead times as the bare call.

  python benchmarks/profile_serving_gpu.py [--device cuda:N] [--case OP:BACKEND ...]
                                           [--iters N] [--top N] [--out DIR]

Needs CUDA. Host figures under the profiler are inflated by its own bookkeeping; the
counts and the ranking are what this is for, bench_overhead gives the times.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as BO  # noqa: E402 (the script's own folder: the same inputs)
from report import card_slug  # noqa: E402 (the script's own folder)
from results_dir import add_out  # noqa: E402 (the script's own folder)

CASES = ("kv_dequant:triton_fp8", "kv_quant:triton_fp8", "decode_mla:triton_fp8", "decode_mla:triton",
         "sparse_prefill:triton", "indexer:triton", "moe:triton_w4a16")


def profile_case(op, backend, device, iters, top):
    import torch
    from torch.profiler import ProfilerActivity, profile

    import capdispatch as cd
    gen = torch.Generator().manual_seed(0)
    args, kw = BO.inputs(op, torch.device(device), gen)
    fn = cd.bind(op, device, backend=backend, checks=False)
    for _ in range(5):
        fn(*args, **kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(*args, **kw)
        torch.cuda.synchronize()
    kernels = collections.Counter()
    cpu_ops = collections.Counter()
    cpu_us = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
        elif e.name.startswith("aten::") or e.name.startswith("cuda"):
            cpu_ops[e.name] += 1
            cpu_us[e.name] += e.self_cpu_time_total
    return dict(
        op=op, backend=backend, iters=iters,
        kernels_per_call={k: v / iters for k, v in kernels.most_common()},
        cpu_ops_per_call=[dict(name=n, calls=cpu_ops[n] / iters, self_us=cpu_us[n] / iters)
                          for n, _ in cpu_us.most_common(top)])


def markdown(meta, rows) -> str:
    out = [f"# Serving-call host profile, {meta['device_name']}", "",
           f"{meta['date']}; torch {meta['torch']}, triton {meta['triton']}; {meta['iters']} eager calls "
           "each of `cd.bind(op, device, backend=B, checks=False)` at bench_overhead's 1-token problem, "
           "under torch.profiler (its own bookkeeping inflates the times; the counts are exact).", ""]
    for r in rows:
        out.append(f"## {r['op']} ({r['backend']})")
        out.append("")
        ks = ", ".join(f"`{k}` x{v:g}" for k, v in r["kernels_per_call"].items()) or "none"
        out.append(f"GPU kernels per call: {ks}.")
        out.append("")
        out.append("| torch operator / CUDA runtime call | calls per call | self CPU us per call |")
        out.append("| --- | ---: | ---: |")
        out += [f"| `{c['name']}` | {c['calls']:g} | {c['self_us']:.1f} |" for c in r["cpu_ops_per_call"]]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--case", action="append", choices=CASES, help="OP:BACKEND (default: all)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--top", type=int, default=10)
    add_out(ap, default=None, help="write profile_serving_<card>_<stamp>.md/.json here")
    a = ap.parse_args(argv)
    import torch
    import triton
    if not torch.cuda.is_available():
        print("profile_serving_gpu: needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for case in a.case or CASES:
        op, backend = case.split(":")
        try:
            r = profile_case(op, backend, a.device, a.iters, a.top)
        except Exception as exc:   # noqa: BLE001 - one case failing must not hide the others
            print(f"{case}: failed: {type(exc).__name__}: {exc}")
            continue
        rows.append(r)
        print(f"{case}: kernels/call {r['kernels_per_call']}")
        for c in r["cpu_ops_per_call"]:
            print(f"    {c['name']:40s} {c['calls']:5g} calls {c['self_us']:8.1f} us")
    name = torch.cuda.get_device_name(torch.device(a.device))
    stamp = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(device_name=name, date=stamp.isoformat(timespec="seconds"), torch=torch.__version__,
                triton=triton.__version__, iters=a.iters)
    if a.out:
        base = os.path.join(a.out, f"profile_serving_{card_slug(name)}_{stamp:%Y%m%dT%H%M%S}")
        with open(base + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=2)
        with open(base + ".md", "w") as f:
            f.write(markdown(meta, rows) + "\n")
        print(f"wrote {base}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

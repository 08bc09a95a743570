"""Time SGLang's real FusedMoE layer routed to a capdispatch moe backend, at
DeepSeek-V4 shapes, on a CUDA GPU.

    CAPDISPATCH_SET=moe=triton_w4a16 python benchmarks/bench_sglang_moe_route.py \
        [--tokens 1 8 64 512 4096] [--out DIR]

The layer is built exactly as tests/sglang_moe_scenario.py's `gpu` mode builds it
(SGLang's launcher resolution, publish, the plugin's rank hook, FusedMoE with an
Fp8Config of MXFP4 experts, SGLang's weight loader, process_weights_after_loading):
rank 0 of an EP2 launch on GPU 0, 64 local experts of 128, H 4096, I 2048, top-k 6,
so about half the routes arrive as -1. Per token count: one forward checked
against the torch reference (norm-relative error, the tests' triton_w4a16
tolerance), then the layer's forward (dispatch + capdispatch kernel + combine)
timed with triton.testing.do_bench (median, eager: the layer's host time included),
beside the floor of the bytes it must move (the packed weights of each local expert
some route reaches, the activations in and out) over the device-to-device copy
bandwidth measured in the same run (benchmarks/ceilings.py). Writes
sglang_moe_route_<gpu>_<utc>.json and .md into --out (default benchmarks/results).

Needs SGLang installed (--no-deps, see tests/requirements-nodeps.txt) and CUDA.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import sys
import tempfile

from results_dir import add_out, archive_previous  # the script's own folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    add_out(ap)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, TESTS)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ceilings
    from report import card_slug
    import sglang_moe_scenario as sc   # imports sglang_prelude first
    import sglang_fake_models as fake
    import torch
    import triton.testing

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = fake.write(os.path.join(tmp, "dsv4"), {**fake.DSV4, "n_routed_experts": 128,
                                                        "num_experts_per_tok": 6, "hidden_size": 4096,
                                                        "moe_intermediate_size": 2048})
        r, ckpt = sc.build_gpu_rank(model, gen)
    layer, method = r.pop("_layer", None), r.pop("_method", None)
    r.pop("logs", None)
    if layer is None:
        print(f"moe is not routed on this rank: {r.get('why')}", file=sys.stderr)
        return 1
    rows = []
    gbps, _ = ceilings.copy_bandwidth()
    per_expert = r["prepared"]["bytes_per_expert_after"]
    el = sc.E_GLOBAL // sc.EP
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.runtime_context import get_parallel
    import types
    for t in args.tokens:
        check = sc.forward(layer, method, 0, gen, ckpt, t)
        x = (torch.randn(t, sc.H, generator=gen) * 0.5).bfloat16().cuda()
        tw, ids = sc._routing(gen, t)
        topk = StandardTopKOutput(tw, ids, torch.zeros(t, sc.E_GLOBAL, device="cuda"))
        with get_parallel().override(tp_group=types.SimpleNamespace(world_size=sc.EP)):
            ms = triton.testing.do_bench(lambda: layer.forward(x, topk), return_mode="median")
        experts = int(torch.unique(ids[(ids >= 0) & (ids < el)]).numel())     # rank 0's local experts
        nbytes = experts * per_expert + 2 * t * sc.H * 2
        floor_us = nbytes / (gbps * 1e3)
        rows.append({"tokens": t, "ms": ms, "floor_us": floor_us, "local_experts_touched": experts,
                     "bytes": nbytes, "rel_err": check["rel_err"],
                     "max_abs_over_max_ref": check["max_abs_over_max_ref"],
                     "local_masked_routes": check["local_masked"], "routes": t * sc.TOPK})
        print(f"T={t:5d}  {ms * 1e3:9.1f} us  (floor {floor_us:.1f} us, {experts} experts)  rel_err {check['rel_err']:.2e}  "
              f"masked {check['local_masked']}/{t * sc.TOPK}", flush=True)
    name = card_slug(torch.cuda.get_device_name(0))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    os.makedirs(args.out, exist_ok=True)
    archive_previous(args.out, f"sglang_moe_route_{name}")
    base = os.path.join(args.out, f"sglang_moe_route_{name}_{stamp}")
    result = {"seed": seed, "device": torch.cuda.get_device_name(0), "backend": r["backend"],
              "why": r["why"], "prepared": r["prepared"], "copy_gbps": gbps, "rows": rows}
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=2, default=str)
    with open(base + ".md", "w") as f:
        f.write(f"# SGLang FusedMoE routed to capdispatch {r['backend']} ({result['device']})\n\n")
        f.write(f"Seed {seed}; rank 0 of EP2, 64 local experts, H 4096, I 2048, top-k 6; "
                f"{r['prepared']['bytes_per_expert_after']:.0f} B per expert after preparation "
                f"(packed {r['prepared']['packed_bytes_per_expert']}). Eager forward (host time "
                f"included); floor = bytes / {gbps:.0f} GB/s (device-to-device copy, this run).\n\n")
        f.write("| tokens | layer forward (us) | floor (us) | local experts touched | rel. error | masked routes |\n"
                "|---:|---:|---:|---:|---:|---:|\n")
        for row in rows:
            f.write(f"| {row['tokens']} | {row['ms'] * 1e3:.1f} | {row['floor_us']:.1f} | "
                    f"{row['local_experts_touched']} | {row['rel_err']:.2e} | "
                    f"{row['local_masked_routes']}/{row['routes']} |\n")
    print(f"wrote {base}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark the routed-expert MoE backends at DeepSeek-V4 expert shapes on a CUDA GPU.

    python benchmarks/bench_moe.py [--tokens 1 2 4 8 16 32 64 4096] [--out DIR]
                                   [--backends triton_w4a16 torch flashinfer_cutlass_w4a16 marlin_w4a16]
    python benchmarks/bench_moe.py --build-flashinfer-jit [--out DIR]

Shapes: E = 64 local experts, H = 4096, I = 2048, top-k 6, packed MXFP4 with
E8M0 scales (13,369,344 B per expert), clamped SwiGLU (limit 10), uniform
random routing with renormalised weights times 1.5.

What it does:
  1. measures the ceilings: device-to-device copy bandwidth (2 GiB copy_, bytes
     read + written) and the dense bf16 matmul rate (8192^3, torch.matmul);
  2. per token count: fresh random inputs (seed printed), each backend checked
     against the torch reference (norm-relative error reported, must be within
     the tests' W4A16 tolerance) and then timed with triton.testing.do_bench
     (median; do_bench flushes L2 between repeats); with --graphs each backend but the
     torch reference is also timed inside a CUDA graph (do_bench_cudagraph median, after
     eager warm-up), as a serving engine replays decode, and the fraction of the
     roofline is taken from that time: at a few tokens the eager figure is Triton's
     launcher on the host, not the kernels;
  3. roofline per token count: weight bytes that must be read (distinct experts
     routed x packed bytes per expert, plus activations) over the copy bandwidth,
     and FLOPs (6 * routes * H * I) over the measured bf16 rate; the bound is the
     larger of the two; each backend's time is reported as a fraction of it;
  4. writes moe_<gpu>_<utc>.json and .md into --out (default benchmarks/results).

FlashInfer's SM90 W4A16 path (flashinfer_cutlass_w4a16) is JIT-built the first
time it is used; ``--build-flashinfer-jit`` only builds it (timed, for running
detached ahead of the benchmark); when the module is not built yet and
``--allow-jit`` is not given the backend is skipped with the reason.

With ``--tiles 99kb`` only ``triton_w4a16`` runs, with the tiles and the shared-memory
limit of the 99 KB cards (SM86, SM89, SM120; tile_modes.py): a kernel whose compiled
form needs more than 101376 B fails as it would there; the results are the series
``moe_<gpu>_99kb``.

Importable without a GPU; it needs CUDA only when run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import sys
import time

from ceilings import bench as _bench, bench_graph as _bench_graph, copy_bandwidth, matmul_rate  # noqa: E402 (the script's own folder)
from results_dir import add_out, archive_previous  # noqa: E402 (the script's own folder)
import tile_modes  # noqa: E402 (the script's own folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

E, H, I, TOPK = 64, 4096, 2048, 6
SWIGLU_LIMIT = 10.0
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 4096)
DEFAULT_BACKENDS = ("triton_w4a16", "torch", "flashinfer_cutlass_w4a16", "marlin_w4a16")
TOL_NORM = 1.5e-2


def roofline(tokens, experts, per_expert, copy_gbps, bf16_tflops):
    """(bytes, FLOPs, ms at the copy bandwidth, ms at the bf16 rate) of one MoE call:
    the routed experts' packed weights plus activations in and out and the routing,
    and two GEMMs (gate+up, down) over every route."""
    routes = tokens * TOPK
    nbytes = experts * per_expert + 2 * tokens * H * 2 + routes * 8
    flops = 6 * routes * H * I
    return nbytes, flops, nbytes / (copy_gbps * 1e9) * 1e3, flops / (bf16_tflops * 1e12) * 1e3


def flashinfer_sm90_status():
    """(importable, built, detail)."""
    try:
        import flashinfer
        from flashinfer.jit import env as jit_env
    except Exception as exc:
        return False, False, f"flashinfer not importable: {type(exc).__name__}: {exc}"
    base = getattr(jit_env, "FLASHINFER_JIT_DIR", None) or getattr(jit_env, "FLASHINFER_WORKSPACE_DIR", None)
    built = False
    if base is not None:
        built = any(p.name.startswith("fused_moe_90") and p.suffix == ".so" for p in base.rglob("*.so"))
    return True, built, f"flashinfer {flashinfer.__version__}, JIT dir {base}"


def build_flashinfer_jit():
    import torch
    from flashinfer.fused_moe.core import get_cutlass_fused_moe_module
    cc = torch.cuda.get_device_capability()
    arch = f"{cc[0] * 10 + cc[1]}"
    t0 = time.time()
    get_cutlass_fused_moe_module(arch)
    return {"arch": arch, "seconds": round(time.time() - t0, 1)}


def _graph_time(fn):
    """(median ms of FN replayed from a CUDA graph, None) or (None, why capture failed)."""
    try:
        return _bench_graph(fn), None
    except Exception as exc:   # the row keeps its eager time and says why
        return None, f"{type(exc).__name__}: {exc}"


def _registry():
    """The built-in ops (moe among them), no plugins."""
    import capdispatch as cd
    from capdispatch import bench
    return bench.registry.build(plugins=False)


def _weights_copy(w):
    import capdispatch as cd
    from capdispatch import bench
    return bench.inputs.copy_weights(w)


def _available(name, allow_jit):
    import torch
    cc = torch.cuda.get_device_capability()
    if name in ("torch", "triton_w4a16"):
        return True, ""
    if name == "flashinfer_cutlass_w4a16":
        if cc != (9, 0):
            return False, f"needs SM90, device is cc {cc}"
        ok, built, detail = flashinfer_sm90_status()
        if not ok:
            return False, detail
        if not built and not allow_jit:
            return False, f"fused_moe_90 JIT module not built ({detail}); run --build-flashinfer-jit or --allow-jit"
        return True, detail
    if name == "marlin_w4a16":
        try:
            import sgl_kernel  # noqa: F401
            from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe  # noqa: F401
        except Exception as exc:
            return False, f"SGLang Marlin MoE not importable: {type(exc).__name__}: {exc}"
        return True, ""
    return False, f"{name} not benchmarked here"


def run(tokens, backends, out_dir, allow_jit, seed, tiles="card", graphs=False):
    import torch
    import triton

    import capdispatch as cd
    from capdispatch.backends.moe import prepare
    from capdispatch.backends.moe import reference as R

    gen = torch.Generator().manual_seed(seed)
    reg = _registry()
    dev_name = torch.cuda.get_device_name()
    bw, _ = copy_bandwidth()
    rate, _ = matmul_rate()
    print(f"[moe] {dev_name}: copy {bw:.0f} GB/s, bf16 matmul {rate:.0f} TFLOP/s, seed {seed}", flush=True)

    base = R.random_weights(E, H, I, gen=gen, device="cuda", swiglu_limit=SWIGLU_LIMIT)
    per_expert = base.packed_bytes_per_expert()
    fns, prepared, skipped = {}, {}, {}
    for name in backends:
        ok, why = _available(name, allow_jit)
        if not ok:
            skipped[name] = why
            print(f"[moe] skip {name}: {why}", flush=True)
            continue
        try:
            w = base if name in ("torch", "triton_w4a16") else _weights_copy(base)
            t0 = time.time()
            prepare(w, name)
            prep_s = time.time() - t0
            assert w.bytes_per_expert() == per_expert, (name, w.bytes_per_expert(), per_expert)
            fns[name] = cd.bind("moe", "cuda:0", backend=name, registry=reg)
            prepared[name] = (w, round(prep_s, 2))
        except Exception as exc:          # report, keep benchmarking the rest
            skipped[name] = f"prepare/bind failed: {type(exc).__name__}: {exc}"
            print(f"[moe] skip {name}: {skipped[name]}", flush=True)

    rows = []
    limit = tile_modes.target(tiles).shared_bytes if tiles != "card" else None
    for T in tokens:
        x = torch.randn(T, H, generator=gen).bfloat16().cuda()
        tw, ids = R.random_routing(T, TOPK, E, gen=gen, device="cuda")
        routes = T * TOPK
        experts = int(torch.unique(ids[ids >= 0]).numel())
        nbytes, flops, t_bw, t_fl = roofline(T, experts, per_expert, bw, rate)
        bound = max(t_bw, t_fl)
        ref = R.moe(x, base, tw, ids)
        row = {"tokens": T, "routes": routes, "experts_touched": experts, "weight_bytes": nbytes,
               "flops": flops, "roofline_ms_bytes": t_bw, "roofline_ms_flops": t_fl, "roofline_ms": bound,
               "bound_by": "bytes" if t_bw >= t_fl else "flops", "backends": {}}
        for name, fn in fns.items():
            w = prepared[name][0]
            got, launches, err = tile_modes.checked(tiles, lambda: fn(x, w, tw, ids))
            launches = tile_modes.launch_rows(launches)
            if launches:
                print(f"[moe] T={T:5d} {name} {tile_modes.label(tiles)}: {tile_modes.describe(launches, limit)}",
                      flush=True)
            if err is not None:
                row["backends"][name] = {"error": f"{type(err).__name__}: {err}", "ok": False, "launches": launches}
                print(f"[moe] T={T:5d} {name:26s} FAILED {type(err).__name__}: {err}", flush=True)
                continue
            nrm = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            ok = bool(torch.isfinite(got).all()) and nrm <= TOL_NORM
            with tile_modes.timing(tiles):
                eager = _bench(lambda: fn(x, w, tw, ids), rep=100 if name == "torch" else 200)
                graph, graph_err = (_graph_time(lambda: fn(x, w, tw, ids))
                                    if graphs and name != "torch" else (None, None))
            ms = graph if graph is not None else eager
            row["backends"][name] = {"ms": ms, "eager_ms": eager, "graph_ms": graph, "graph_error": graph_err,
                                     "norm_rel_err": nrm, "ok": ok, "launches": launches,
                                     "fraction_of_roofline": bound / ms,
                                     "effective_GBps": nbytes / ms / 1e6,
                                     "TFLOPs": flops / ms / 1e9}
            tag = f" [{tile_modes.label(tiles)}]" if tiles != "card" else ""
            how = (f"graph {graph * 1e3:8.1f} us, eager {eager * 1e3:8.1f} us" if graph is not None
                   else f"{eager * 1e3:10.1f} us" + (f" (graph capture failed: {graph_err})" if graph_err else ""))
            print(f"[moe] T={T:5d} {name:26s}{tag} {how}  {100 * bound / ms:5.1f}% of roofline "
                  f"({row['bound_by']})  err {nrm:.2e}{'' if ok else '  FAILED CHECK'}", flush=True)
        rows.append(row)

    meta = {"device": dev_name, "cc": list(torch.cuda.get_device_capability()), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "seed": seed,
            "shape": {"E": E, "H": H, "I": I, "topk": TOPK, "swiglu_limit": SWIGLU_LIMIT},
            "packed_bytes_per_expert": per_expert, "copy_GBps": bw, "bf16_TFLOPs": rate,
            "prepare_seconds": {k: v[1] for k, v in prepared.items()}, "skipped": skipped,
            "tiles": tiles, "tiles_label": tile_modes.label(tiles), "shared_limit": limit,
            "graphs": graphs}
    try:
        import flashinfer
        meta["flashinfer"] = flashinfer.__version__
    except Exception:
        pass
    return {"meta": meta, "rows": rows}


def to_markdown(res):
    m = res["meta"]
    names = sorted({n for r in res["rows"] for n in r["backends"]},
                   key=lambda n: ["triton_w4a16", "flashinfer_cutlass_w4a16", "marlin_w4a16", "torch"].index(n)
                   if n in ("triton_w4a16", "flashinfer_cutlass_w4a16", "marlin_w4a16", "torch") else 9)
    tiles = m.get("tiles", "card")
    out = [f"# MoE (DeepSeek-V4 routed experts) on {m['device']}"
           + (f": {m['tiles_label']}" if tiles != "card" else ""), ""] + tile_modes.header_lines(tiles) + [
           "" if tiles != "card" else None,
           f"{m['date_utc']}; torch {m['torch']}, Triton {m['triton']}, CUDA {m['cuda']}"
           + (f", FlashInfer {m['flashinfer']}" if "flashinfer" in m else "") + f"; seed {m['seed']}.", "",
           f"E={m['shape']['E']}, H={m['shape']['H']}, I={m['shape']['I']}, top-k {m['shape']['topk']}, "
           f"{m['packed_bytes_per_expert']} B per expert (packed MXFP4 + E8M0). Ceilings: copy "
           f"{m['copy_GBps']:.0f} GB/s, bf16 matmul {m['bf16_TFLOPs']:.0f} TFLOP/s.", "",
           "| tokens | experts | roofline (us) | bound | "
           + " | ".join(f"{n}{' (' + m['tiles_label'] + ')' if tiles != 'card' else ''} us (% roofline)" for n in names)
           + " |",
           "| ---: | ---: | ---: | --- | " + " | ".join("---:" for _ in names) + " |"]
    out = [line for line in out if line is not None]
    for r in res["rows"]:
        cells = []
        for n in names:
            b = r["backends"].get(n)
            if b is not None and "error" in b:
                cells.append(f"error: {b['error']}")
                continue
            if b is None:
                cells.append("—")
                continue
            eager = (f"; eager {b['eager_ms'] * 1e3:.1f}" if b.get("graph_ms") is not None
                     else (f"; graph capture failed: {b['graph_error']}" if b.get("graph_error") else ""))
            cells.append(f"{b['ms'] * 1e3:.1f} ({100 * b['fraction_of_roofline']:.1f}%{eager})"
                         + ("" if b["ok"] else " FAIL"))
        out.append(f"| {r['tokens']} | {r['experts_touched']} | {r['roofline_ms'] * 1e3:.1f} | {r['bound_by']} | "
                   + " | ".join(cells) + " |")
    ent = [(r["tokens"], n, e) for r in res["rows"] for n, b in r["backends"].items() for e in b.get("launches") or ()]
    if ent and tiles != "card":
        out += tile_modes.entries_table(m["tiles_label"], m["shared_limit"], (("tokens", "---:"), ("backend", "---")),
                                        [((t, n), e) for t, n, e in ent])
    if m["skipped"]:
        out += ["", "Skipped:"] + [f"- `{k}`: {v}" for k, v in m["skipped"].items()]
    out += ["", "Every timed backend was checked against the torch reference on the same inputs first "
            f"(norm-relative error <= {TOL_NORM}; 'FAIL' marks a row that was not)."]
    if m.get("graphs"):
        out += ["", "Times are medians of replays from a CUDA graph (the eager do_bench median follows "
                "'eager'); torch is timed eagerly only."]
    return "\n".join(out) + "\n"


def series(device: str, tiles: str) -> str:
    """The results series of a run on DEVICE with --tiles TILES."""
    return f"moe_{device.lower().replace(' ', '_')}{tile_modes.suffix(tiles)}"


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    ap.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS))
    add_out(ap)
    ap.add_argument("--allow-jit", action="store_true", help="let FlashInfer JIT-build inside the benchmark")
    ap.add_argument("--build-flashinfer-jit", action="store_true", help="only build FlashInfer's MoE module")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--graphs", action="store_true",
                    help="also time each backend but torch inside a CUDA graph; the roofline "
                         "fraction then comes from the graph time")
    tile_modes.add_argument(ap)
    return ap


def parse_args(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.tiles != "card":     # only capdispatch's Triton MoE has a launch table
        a.backends = [b for b in a.backends if b == "triton_w4a16"]
        if not a.backends:
            ap.error("--tiles 99kb times triton_w4a16 only; --backends does not name it")
    return a


def main(argv=None):
    a = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_moe.py needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    if a.build_flashinfer_jit:
        info = build_flashinfer_jit()
        print(f"[moe] built FlashInfer fused_moe_{info['arch']} in {info['seconds']} s", flush=True)
        with open(os.path.join(a.out, "moe_flashinfer_jit.json"), "w") as f:
            json.dump(info, f, indent=1)
        return 0
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    res = run(a.tokens, a.backends, a.out, a.allow_jit, seed, a.tiles, a.graphs)
    name = series(res["meta"]["device"], a.tiles)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    archive_previous(a.out, name)
    base = os.path.join(a.out, f"{name}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(to_markdown(res))
    print(to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

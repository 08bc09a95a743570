"""Host (CPU) time per eager call: what ``cd.bind(op, device)`` returns against the bare kernel.

For every op and every backend that runs on DEVICE, one decode-sized problem (1 token):
  bare      the kernel alone: Triton's own launcher (``kernel.run`` replayed with the
            arguments our host code computed, recorded from one call), the library call
            the adapter makes, with the arguments it made (the way SGLang calls it: index
            cleaning and scheduler metadata, done once per batch there, are hoisted out and
            counted apart), or for the torch backends the Python function itself;
  bound     ``cd.bind(op, device, backend=...)``: the custom op (dispatcher, fake-free
            eager path, argument checks);
  serving   ``cd.bind(..., checks=False)``;
  host      for the Triton backends, the serving call with every Triton launch made a
            no-op (``JITFunction.run`` returns at once): capdispatch's own Python and the
            outputs and scratch it allocates, without Triton's launcher, so that
            serving - host is what the launches cost through Triton.
Also the dispatch floor: a no-op capdispatch-style custom op against a no-op Python call,
and the size-bucket dispatcher over two no-op kernels against the first one called directly
(the dispatcher's own cost, whatever the kernels cost);
and per op with two runnable backends, the size-bucket dispatcher ``bind`` returns under
a policy whose buckets pick different backends (``{SIZE: "<=16", prefer: [A]}, {prefer:
[B]}``, the 1-token call taking A) against A's serving call: the dispatcher's own cost.

Timing: ``time.perf_counter`` over blocks of ITERS calls (no synchronisation inside a
block, one after it), median of REPEATS blocks, bare / bound / serving interleaved block by
block so that drift on a shared host hits them alike. On CUDA a decode-sized kernel is
shorter than its host time, so this is the host's cost; on the CPU the torch backends
compute synchronously, so there the difference bound - bare is the overhead.

Targets (issue 14, H200 host): bound <= 1.2 x bare, and <= 30 us for kv_dequant and
decode_mla at 1 token.

  python benchmarks/bench_overhead.py [--device cpu|cuda:N] [--op OP ...] [--skip-torch]
                                      [--iters N] [--repeats N] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

from results_dir import add_out, archive_previous  # the script's own folder
from report import card_slug  # noqa: E402 (the script's own folder)

# The ops `inputs` builds a decode-sized problem for; the ops measured come from the registry,
# and one without a problem here gets a row saying so.
PROBLEMS = ("kv_quant", "kv_dequant", "decode_mla", "sparse_prefill", "indexer", "moe")
TARGET_RATIO, TARGET_US = 1.2, 30.0
TARGET_OPS = ("kv_dequant", "decode_mla")

# Library entry points the external adapters call (module, attribute path): recorded on
# one call, then replayed as the bare call.
LIBRARY_CALLS = {
    "flashmla": [("flash_mla", "flash_mla_with_kvcache")],
    "flashmla_sparse": [("flash_mla", "flash_mla_sparse_fwd")],
    "flashinfer_sparse_mla": [("flashinfer.mla", "SparseMLASm120Wrapper.run")],
    "deepgemm": [("deep_gemm", "fp8_paged_mqa_logits")],
    "flashinfer_cutlass_w4a8": [("flashinfer.fused_moe", "cutlass_fused_moe")],
    "flashinfer_cutlass_w4a16": [("flashinfer.fused_moe", "cutlass_fused_moe")],
    "flashinfer_trtllm_w4a8": [("flashinfer.fused_moe", "trtllm_fp4_block_scale_routed_moe")],
    "marlin_w4a16": [("sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe", "fused_marlin_moe")],
}


# --------------------------------------------------------------------------- #
# Inputs: DeepSeek-V4 decode shapes on CUDA, small ones on the CPU (the torch
# reference computes synchronously there; small work keeps the overhead visible)
# --------------------------------------------------------------------------- #
def inputs(op, device, gen):
    import torch
    cuda = device.type == "cuda"
    H = 64 if cuda else 16
    if op in ("kv_quant", "kv_dequant", "decode_mla"):
        from capdispatch.backends.kv_cache import reference as KV

        def pool(tokens, page_size):
            pages = -(-tokens // page_size)
            p = KV.new_pool(pages, page_size, device)
            rows = torch.randn(pages * page_size, 512, generator=gen).bfloat16().to(device)
            KV.kv_quant(rows, p, torch.arange(pages * page_size, device=device), page_size)
            return p
        if op == "kv_quant":
            p = pool(256 * 64, 256)
            k = torch.randn(1, 512, generator=gen).bfloat16().to(device)
            return (k, p, torch.tensor([77], dtype=torch.int32, device=device), 256), {}
        if op == "kv_dequant":
            p = pool(256 * 64, 256)
            ids = torch.randint(0, 256 * 64, (1,), generator=gen, dtype=torch.int32).to(device)
            return (p, ids, 256), {}
        swa, c4 = pool(1024, 256), pool(65536 if cuda else 1024, 64)
        q = (torch.randn(1, 1, H, 512, generator=gen) * 2).bfloat16().to(device)
        idx = torch.randint(0, 1024, (1, 1, 128 if cuda else 64), generator=gen, dtype=torch.int32).to(device)
        cidx = torch.randint(0, c4.shape[0] * 64, (1, 1, 512 if cuda else 64), generator=gen,
                             dtype=torch.int32).to(device)
        ln = torch.full((1,), idx.shape[-1], dtype=torch.int32, device=device)
        cln = torch.full((1,), cidx.shape[-1], dtype=torch.int32, device=device)
        sink = torch.randn(H, generator=gen).to(device)
        return (q, swa, idx, 256, 512 ** -0.5, ln, sink, c4, cidx, 64, cln), {}
    if op == "sparse_prefill":
        s_kv, topk = (65536, 512) if cuda else (1024, 64)
        q = (torch.randn(1, H, 512, generator=gen) * 2).bfloat16().to(device)
        kv = torch.randn(s_kv, 1, 512, generator=gen).bfloat16().to(device)
        idx = torch.randint(0, s_kv, (1, 1, topk), generator=gen, dtype=torch.int32).to(device)
        sink = torch.randn(H, generator=gen).to(device)
        return (q, kv, idx, 512 ** -0.5, 512, sink, None), {}
    if op == "indexer":
        from capdispatch.backends.indexer import layout as L
        S = 65536 if cuda else 1024
        pages = S // L.PAGE_TOKENS
        kv = torch.randint(0, 0x78, (pages, L.PAGE_BYTES), generator=gen, dtype=torch.uint8)
        scales = kv[:, L.SCALE_OFFSET:].view(torch.float32)
        scales.copy_(torch.rand(scales.shape, generator=gen) + 0.5)
        q = torch.randint(0, 0x78, (1, 1, 64, 128), generator=gen, dtype=torch.uint8)
        w = torch.rand(1, 64, generator=gen)
        ctx = torch.tensor([S], dtype=torch.int32)
        bt = torch.randperm(pages, generator=gen).int().view(1, pages)
        to = lambda t: t.to(device)  # noqa: E731
        return (to(q).view(torch.float8_e4m3fn), to(kv), to(w), to(ctx), to(bt), None, S, False), {}
    if op == "moe":
        from capdispatch.backends.moe import reference as M
        E, Hd, I = (64, 4096, 2048) if cuda else (8, 128, 64)
        w = M.random_weights(E, Hd, I, gen=gen, device=device)
        tw, ids = M.random_routing(1, 6, E, gen=gen, device=device)
        x = torch.randn(1, Hd, generator=gen).bfloat16().to(device)
        return (x, w, tw, ids), {}
    raise ValueError(op)


# --------------------------------------------------------------------------- #
# Bare calls
# --------------------------------------------------------------------------- #
def _resolve_attr(module, path):
    import importlib
    obj = importlib.import_module(module)
    *head, last = path.split(".")
    for part in head:
        obj = getattr(obj, part)
    return obj, last


def recorded_library_calls(backend, call):
    """Run CALL once with the library entry points of BACKEND recorded; a replay of them."""
    targets = LIBRARY_CALLS.get(backend)
    if not targets:
        return None
    from capdispatch.backends.moe import sglang_marlin as marlin_adapter
    marlin_adapter._sglang.cache_clear()      # the adapter caches the function: look it up again
    rec, saved = [], []
    for module, path in targets:
        owner, name = _resolve_attr(module, path)
        orig = getattr(owner, name)
        saved.append((owner, name, orig))

        def spy(*a, _orig=orig, **kw):
            rec.append((_orig, a, kw))
            return _orig(*a, **kw)
        setattr(owner, name, spy)
    try:
        call()
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)
        marlin_adapter._sglang.cache_clear()

    def replay():
        for f, a, kw in rec:
            f(*a, **kw)
    return replay if rec else None


def recorded_triton_launches(call):
    """Run CALL once with every Triton kernel launch recorded; a replay of exactly those
    launches through Triton's own launcher (``JITFunction.run``)."""
    from triton.runtime.jit import JITFunction
    rec = []
    orig = JITFunction.run

    def spy(self, *a, **kw):
        rec.append((self, a, kw))
        return orig(self, *a, **kw)
    JITFunction.run = spy
    try:
        call()
    finally:
        JITFunction.run = orig

    def replay():
        for k, a, kw in rec:
            orig(k, *a, **kw)
    return replay if rec else None


def without_triton_launches(call):
    """CALL with every Triton launch a no-op: the host path besides Triton's launcher."""
    from triton.runtime.jit import JITFunction
    orig = JITFunction.run

    def run():
        JITFunction.run = lambda self, *a, **kw: None
        try:
            call()
        finally:
            JITFunction.run = orig
    return run


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #
def interleaved_us(fns, iters, repeats, sync):
    """Median microseconds per call of each of FNS (dict name -> callable)."""
    for f in fns.values():
        f()
    sync()
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                f()
            t1 = time.perf_counter()
            sync()
            samples[k].append((t1 - t0) / iters * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def dispatch_floor(iters, repeats):
    """A no-op custom op defined as capdispatch's are, against a plain Python call."""
    import torch
    lib = torch.library.Library("capdispatch_bench", "FRAGMENT")
    lib.define("noop(Tensor x, int n, *, bool checks=True) -> ()")

    def noop(x, n, *, checks=True):
        return None
    lib.impl("noop", noop, "CompositeExplicitAutograd")
    op = torch.ops.capdispatch_bench.noop.default
    x = torch.empty(1)
    # The size-bucket dispatcher (dispatch/sized.py) over two no-op kernels, against the
    # first one called directly: its own work per call, whatever the kernels cost.
    import capdispatch as cd
    from capdispatch import bench

    def small(x, n, *, checks=True):
        return None

    def big(x, n, *, checks=True):
        return None
    disp = bench.sized.dispatcher("noop", bench.SizeArg(key="tokens", index=0, name="x"), ((16, small),), big, ((16, "small"), (None, "big")))
    r = interleaved_us({"python": lambda: noop(x, 1), "custom_op": lambda: op(x, 1),
                        "bucket_dispatcher": lambda: disp(x, 1), "bucket_direct": lambda: small(x, 1)},
                       iters, repeats, lambda: None)
    del lib
    return r


def host_facts(device):
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    facts = dict(cpu=cpu, cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                 python=platform.python_version(), torch=torch.__version__,
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    try:
        import triton
        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    try:
        facts["load_average"] = [round(x, 2) for x in os.getloadavg()]   # a shared host's noise
    except OSError:
        facts["load_average"] = None
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
        facts["cuda"] = torch.version.cuda
    return facts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda:0 when present, else cpu)")
    ap.add_argument("--op", action="append", default=[], metavar="OP[,OP]",
                    help="ops to measure (default: every op capdispatch registers)")
    ap.add_argument("--skip-torch", action="store_true",
                    help="leave out the torch reference backends (slow on a GPU at these shapes)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    add_out(ap)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)

    import random

    import torch

    import capdispatch as cd
    from capdispatch import extend
    dev_name = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(dev_name)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cpu":
        torch.set_num_threads(1)     # host cost, not intra-op parallelism (and no thread contention)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    facts = host_facts(device)
    facts["seed"] = seed
    print(f"host: {facts['cpu']} ({facts['cpu_count']} cpus), torch {facts['torch']}, triton {facts['triton']}"
          + (f", {facts['gpu']}" if device.type == "cuda" else ", no GPU") + f"; seed {seed}")
    floor = dispatch_floor(args.iters * 5, args.repeats)
    print(f"dispatch floor: python no-op {floor['python']:.2f} us, custom op no-op {floor['custom_op']:.2f} us; "
          f"size-bucket dispatcher over no-op kernels {floor['bucket_dispatcher']:.2f} us against "
          f"{floor['bucket_direct']:.2f} us direct")

    reg = extend.registry.builtin()
    try:
        ops = extend.op_list(args.op, "--op", reg) if args.op else list(reg.ops)
    except cd.BadInput as exc:
        ap.error(str(exc))
    rows = []
    runnable = {}            # op -> [(backend, serving fn, args, kwargs)] in registry order
    for op in ops:
        if op not in PROBLEMS:
            rows.append(dict(op=op, backend="*", skipped="no decode-sized problem for this op in "
                             "benchmarks/bench_overhead.py `inputs`; add one there to measure it"))
            continue
        for backend in reg.backends(op):
            name = backend.name
            if args.skip_torch and name == "torch":
                continue
            try:
                bound = cd.bind(op, dev_name, backend=name)
                serving = cd.bind(op, dev_name, backend=name, checks=False)
            except cd.Unsatisfiable as exc:
                rows.append(dict(op=op, backend=name, skipped=str(exc).splitlines()[0][:160]))
                continue
            a, kw = inputs(op, device, gen)
            if op == "moe" and name not in ("torch", "triton_w4a16"):
                from capdispatch.backends.moe import prepare
                prepare(a[1], name)
            call = lambda: bound(*a, **kw)  # noqa: E731
            bare, bare_kind = None, None
            if name == "torch":
                raw = _raw_torch(op)
                bare, bare_kind = (lambda: raw(*a, **kw)), "python function"
            elif device.type == "cuda":
                bare = recorded_library_calls(name, call)
                bare_kind = "library call" if bare else None
                if bare is None:
                    bare, bare_kind = recorded_triton_launches(call), "Triton launcher"
            fns = {"bound": call, "serving": lambda: serving(*a, **kw)}
            if bare is not None:
                fns["bare"] = bare
            if bare_kind == "Triton launcher":
                fns["host"] = without_triton_launches(fns["serving"])
            us = interleaved_us(fns, args.iters, args.repeats, sync)
            row = dict(op=op, backend=name, bare_kind=bare_kind, **{f"{k}_us": v for k, v in us.items()})
            if "bare_us" in row:
                row["ratio"] = row["bound_us"] / row["bare_us"]
                row["serving_ratio"] = row["serving_us"] / row["bare_us"]
            rows.append(row)
            print("  " + _line(row))
            runnable.setdefault(op, []).append((name, serving, a, kw))

    buckets = []
    for op, ran in runnable.items():
        if len(ran) < 2:
            continue
        (small, small_fn, a, kw), (big, _, _, _) = ran[0], ran[1]
        size = reg.ops[op].size
        pol = cd.policy_from_dict({"schema": 1, "ops": {op: [{size.key: "<=16", "prefer": [small]},
                                                                {"prefer": [big]}]}}, "bench_overhead")
        disp = cd.bind(op, dev_name, policy=pol, checks=False)
        if not getattr(disp, "buckets", None):
            continue
        us = interleaved_us({"dispatcher": lambda: disp(*a, **kw), "direct": lambda: small_fn(*a, **kw)},
                            args.iters, args.repeats, sync)
        b = dict(op=op, small=small, big=big, dispatcher_us=us["dispatcher"], direct_us=us["direct"])
        buckets.append(b)
        print(f"  {op:15s} bucket dispatcher ({small} <=16, else {big}) {us['dispatcher']:.1f} us, "
              f"{small} direct {us['direct']:.1f} us, dispatcher cost {us['dispatcher'] - us['direct']:.2f} us")

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    slug = card_slug(facts.get("gpu"))
    os.makedirs(args.out, exist_ok=True)
    archive_previous(args.out, f"overhead_{slug}")
    base = os.path.join(args.out, f"overhead_{slug}_{stamp}")
    meta = dict(facts, device=dev_name, iters=args.iters, repeats=args.repeats, dispatch_floor_us=floor,
                gpu_present=device.type == "cuda")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows, buckets=buckets), f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(report(meta, rows, buckets))
    print(f"wrote {os.path.basename(base)}.md / .json")
    return 0


def _raw_torch(op):
    import importlib
    mod, attr = {"kv_quant": ("kv_cache.reference", "kv_quant"), "kv_dequant": ("kv_cache.reference", "kv_dequant"),
                 "decode_mla": ("decode_mla.reference", "decode_mla"),
                 "sparse_prefill": ("sparse_prefill.reference", "sparse_prefill"),
                 "indexer": ("indexer.reference", "fp8_paged_mqa_logits"), "moe": ("moe.reference", "moe")}[op]
    return getattr(importlib.import_module("capdispatch.backends." + mod), attr)


def _fmt(x):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def _line(r):
    if "skipped" in r:
        return f"{r['op']:<15} {r['backend']:<25} skipped: {r['skipped']}"
    s = f"{r['op']:<15} {r['backend']:<25} bound {_fmt(r['bound_us'])} us, serving {_fmt(r['serving_us'])} us"
    if "bare_us" in r:
        s += f", bare ({r['bare_kind']}) {_fmt(r['bare_us'])} us, bound/bare {r['ratio']:.2f}"
    if "host_us" in r:
        s += f"; host path without launches {_fmt(r['host_us'])} us"
    return s


def report(meta, rows, buckets=()) -> str:
    gpu = meta["gpu_present"]
    title = (f"# Host overhead per call, {meta.get('gpu')}" if gpu else
             "# Host overhead per call: CPU host, no GPU (torch backends and custom-op dispatch only)")
    out = [title, "",
           f"{meta['date']}; host CPU {meta['cpu']} ({meta['cpu_count']} cpus, {meta['torch_threads']} torch thread(s)); Python {meta['python']}, "
           f"torch {meta['torch']}, triton {meta['triton']}" + (f", CUDA {meta.get('cuda')}" if gpu else "")
           + f"; device {meta['device']}; median of {meta['repeats']} blocks of {meta['iters']} eager calls; "
           f"seed {meta['seed']}; load average at start {meta.get('load_average')}.", ""]
    if not gpu:
        out += ["Measured without a GPU: the torch backends compute synchronously on the CPU (small shapes, "
                "see bench_overhead.py), so bound - bare is the custom-op and validation overhead; the "
                "Triton and library backends need a GPU and are not in this table. The H200 targets "
                "(bound <= 1.2 x bare, <= 30 us for kv_dequant / decode_mla at 1 token) apply to the "
                "GPU run.", ""]
    fl = meta["dispatch_floor_us"]
    out += [f"Dispatch floor: no-op Python call {fl['python']:.2f} us, no-op custom op (define + impl, "
            f"CompositeExplicitAutograd) {fl['custom_op']:.2f} us."
            + (f" The size-bucket dispatcher `bind` returns under a bucketed policy, over two no-op kernels: "
               f"{fl['bucket_dispatcher']:.2f} us against {fl['bucket_direct']:.2f} us for the first kernel "
               f"called directly, so {fl['bucket_dispatcher'] - fl['bucket_direct']:.2f} us of its own per call."
               if "bucket_dispatcher" in fl else ""), "",
            "| op | backend | bare | bare us | bound us | serving (checks=False) us | bound - bare us | "
            "bound / bare | serving / bare | host path without launches us |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "skipped" in r:
            continue
        bare = r.get("bare_us")
        host = _fmt(r.get("host_us"))
        out.append(f"| {r['op']} | {r['backend']} | {r.get('bare_kind') or '—'} | {_fmt(bare)} | "
                   f"{_fmt(r['bound_us'])} | {_fmt(r['serving_us'])} | "
                   f"{_fmt(r['bound_us'] - bare) if bare else '—'} | "
                   f"{r['ratio']:.2f} | {r['serving_ratio']:.2f} | {host} |" if bare else
                   f"| {r['op']} | {r['backend']} | — | — | {_fmt(r['bound_us'])} | {_fmt(r['serving_us'])} "
                   f"| — | — | — | {host} |")
    if any("host_us" in r for r in rows):
        out += ["", "Host path without launches: the serving call with every Triton launch a no-op "
                "(capdispatch's Python and the outputs and scratch it allocates); serving minus it is what "
                "the launches cost through Triton's launcher, which the bare column times alone."]
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        out += ["", "Not run here: " + "; ".join(f"{r['op']}={r['backend']}" for r in skipped) + "."]
    if buckets:
        out += ["", "Size-bucket dispatcher (``bind`` under a policy with buckets; serving, 1 token):", "",
                "| op | buckets | dispatcher us | first bucket's kernel direct us | dispatcher cost us |",
                "| --- | --- | ---: | ---: | ---: |"]
        out += [f"| {b['op']} | <=16: {b['small']}, else {b['big']} | {_fmt(b['dispatcher_us'])} | "
                f"{_fmt(b['direct_us'])} | {b['dispatcher_us'] - b['direct_us']:.2f} |" for b in buckets]
    if gpu:
        out += ["", "Targets: " + ", ".join(
            f"{r['op']}={r['backend']} {'meets' if r.get('ratio', 9) <= TARGET_RATIO and (r['op'] not in TARGET_OPS or r['bound_us'] <= TARGET_US) else 'misses'}"
            for r in rows if "skipped" not in r) + "."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())

"""capdispatch's own host path per call, on the CPU: every Triton launch replaced by a recorder.

For each Triton backend (kv_quant, kv_dequant, decode_mla triton / triton_fp8,
sparse_prefill, indexer, moe triton_w4a16) this runs what ``cd.bind`` returns, bound
(checks on) and serving (``checks=False``), on CPU tensors with the kernels built for
Triton's interpreter, and with ``kernel[grid](...)`` made a no-op that records its
arguments. What is left is exactly the wrapper's Python: argument normalisation,
checks, allocations, split scratch, device scope, launch-table lookups and building
the launch arguments, which on a GPU host come on top of Triton's own launcher.

  launch    the recorded launches replayed through the same no-op (``kernel[grid](*args)``):
            the floor every call pays, in this harness, for reaching the launcher;
  bound     the bound call; host path = bound - launch;
  serving   the ``checks=False`` call; host path = serving - launch;
  calls     Python and C functions entered per call of the host path (bound, serving),
            less those of the launch replay: a count a busy host does not disturb.

``decode_mla`` runs the decode-sized call of the H200 (1 token, 64 heads, an extra pool)
twice: as the CPU plans it (one pass), and with the split-K plan a GPU makes at that size
(``--splits``, default 8: the split kernel, its scratch and the combine launch).

Timing: the calling thread's CPU time (``time.thread_time``: time spent descheduled on a
busy shared host does not count; ``--clock perf`` for ``time.perf_counter``) over blocks
of ITERS calls, the fastest of REPEATS blocks (``--median``: the median block), the
variants interleaved block by block. ``--profile``
prints cProfile's top functions of the serving call per case.

  TRITON_INTERPRET=1 python benchmarks/profile_host_path.py [--case NAME ...] [--iters N]
                     [--repeats N] [--splits N] [--profile [TOP]] [--median] [--json FILE]

(The script sets TRITON_INTERPRET=1 itself when it is unset.) Numbers are this
machine's CPU; they rank the wrapper's costs, they are not the GPU host's figures.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

CASES = ("kv_quant/triton_fp8", "kv_quant/triton_u8", "kv_dequant/triton_fp8", "kv_dequant/triton_u8",
         "kv_dequant/triton_fp8+out", "decode_mla/triton_fp8", "decode_mla/triton",
         "decode_mla/triton_fp8+split", "decode_mla/triton+split", "sparse_prefill/triton", "indexer/triton",
         "moe/triton_w4a16")


# --------------------------------------------------------------------------- #
# The no-op launcher
# --------------------------------------------------------------------------- #
class Recorder:
    """While active, every interpreted kernel launch (``kernel[grid](...)``) records
    (kernel name, grid, args, kwargs) and returns without running."""

    def __init__(self):
        self.calls = []
        self.keep = True

    @contextlib.contextmanager
    def active(self):
        from triton.runtime.interpreter import InterpretedFunction
        orig = InterpretedFunction.run
        rec = self

        def run(self, *args, grid, warmup, **kwargs):
            if rec.keep:
                rec.calls.append((self, grid, args, kwargs))
        InterpretedFunction.run = run
        try:
            yield self
        finally:
            InterpretedFunction.run = orig

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def replay(calls):
    """The recorded launches made again through ``kernel[grid](...)`` (the no-op)."""
    def launch():
        for k, grid, a, kw in calls:
            k[grid](*a, **kw)
    return launch


def signature(calls, inputs=()):
    """What the kernels receive, by parameter name: every scalar, and every tensor as its
    dtype and where its data starts — (``"in"``, the input it points into, the byte
    offset) for the call's INPUTS, (``"new"``, shape, strides) for what the host path
    allocated. Two versions of the host path that agree here launch the same work
    (a kernel sees a tensor's pointer and dtype, not its shape or its view)."""
    import torch
    bases = [(t.untyped_storage().data_ptr(), t) for t in inputs]

    def arg(x):
        if not isinstance(x, torch.Tensor):
            return repr(x)
        base = x.untyped_storage().data_ptr()
        for j, (b, t) in enumerate(bases):
            if b == base:
                return ("tensor", str(x.dtype), "in", j, x.data_ptr() - t.data_ptr())
        return ("tensor", str(x.dtype), "new", tuple(x.shape), tuple(x.stride()), x.storage_offset())
    out = []
    for k, g, a, kw in calls:
        named = dict(zip(k.arg_names, a), **kw)    # positional or by keyword: the same launch
        out.append((k.__name__, repr(g), {n: arg(v) for n, v in sorted(named.items())}))
    return out


def _tensors(args, kwargs):
    """Every input tensor of a call, MoeWeights' parts included, in a fixed order."""
    import torch
    found = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif hasattr(x, "w13_scale"):              # MoeWeights
            walk([x.w13, x.w13_scale, x.w2, x.w2_scale] + [x.aux[k] for k in sorted(x.aux)])
        elif isinstance(x, (list, tuple)):
            for p in x:
                walk(p)
    walk(list(args) + [kwargs[k] for k in sorted(kwargs)])
    return found


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
def _load(op, backend):
    """What ``cd.bind(op, device, backend=backend)`` returns (and its checks=False variant),
    without the decision: the CPU cannot pass the fp8 backends' feature checks."""
    import capdispatch as cd
    from capdispatch import bench, extend
    fn = extend.registry.builtin().backend(op, backend).load()
    return fn, bench.without_checks(fn)


def case_inputs(case, gen):
    """(op, backend, args, kwargs, split) of CASE, on CPU tensors at decode sizes (1 token)."""
    import torch
    op, _, rest = case.partition("/")
    backend, _, variant = rest.partition("+")
    dev = torch.device("cpu")
    if op in ("kv_quant", "kv_dequant"):
        from capdispatch.backends.kv_cache import reference as KV
        pool = KV.new_pool(64, 256, dev)
        if op == "kv_quant":
            k = torch.randn(1, 512, generator=gen).bfloat16()
            return op, backend, (k, pool, torch.tensor([77], dtype=torch.int32), 256), {}, None
        ids = torch.randint(0, 256 * 64, (1,), generator=gen, dtype=torch.int32)
        kw = {"out": torch.empty(1, 1, 512, dtype=torch.bfloat16)} if variant == "out" else {}
        return op, backend, (pool, ids, 256), kw, None
    if op == "decode_mla":
        from capdispatch.backends.kv_cache import reference as KV
        H = 64
        swa, c4 = KV.new_pool(4, 256, dev), KV.new_pool(16, 64, dev)
        q = torch.randn(1, 1, H, 512, generator=gen).bfloat16()
        idx = torch.randint(0, 1024, (1, 1, 128), generator=gen, dtype=torch.int32)
        cidx = torch.randint(0, 1024, (1, 1, 512), generator=gen, dtype=torch.int32)
        ln = torch.full((1,), 128, dtype=torch.int32)
        cln = torch.full((1,), 512, dtype=torch.int32)
        sink = torch.randn(H, generator=gen)
        return (op, backend, (q, swa, idx, 256, 512 ** -0.5, ln, sink, c4, cidx, 64, cln), {},
                "split" if variant == "split" else None)
    if op == "sparse_prefill":
        H = 64
        q = torch.randn(1, H, 512, generator=gen).bfloat16()
        kv = torch.randn(1024, 1, 512, generator=gen).bfloat16()
        idx = torch.randint(0, 1024, (1, 1, 512), generator=gen, dtype=torch.int32)
        sink = torch.randn(H, generator=gen)
        return op, backend, (q, kv, idx, 512 ** -0.5, 512, sink, None), {}, None
    if op == "indexer":
        from capdispatch.backends.indexer import layout as L
        S = 4096
        pages = S // L.PAGE_TOKENS
        kv = torch.randint(0, 0x78, (pages, L.PAGE_BYTES), generator=gen, dtype=torch.uint8)
        q = torch.randint(0, 0x78, (1, 1, 64, 128), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
        w = torch.rand(1, 64, generator=gen)
        ctx = torch.tensor([S], dtype=torch.int32)
        bt = torch.randperm(pages, generator=gen).int().view(1, pages)
        return op, backend, (q, kv, w, ctx, bt, None, S, False), {}, None
    if op == "moe":
        from capdispatch.backends.moe import reference as M
        E, Hd, I = 8, 256, 128
        w = M.random_weights(E, Hd, I, gen=gen, device=dev)
        tw, ids = M.random_routing(1, 6, E, gen=gen, device=dev)
        x = torch.randn(1, Hd, generator=gen).bfloat16()
        return op, backend, (x, w, tw, ids), {}, None
    raise ValueError(f"unknown case {case!r}; valid: {', '.join(CASES)}")


@contextlib.contextmanager
def split_plan(n):
    """Make the decode split-K plan N on the CPU, as a GPU plans a 1-token, 64-head call."""
    from capdispatch.backends.decode_mla import triton_kernels as D
    from capdispatch.backends.sparse_attention import kernels as K
    orig = K.decode_splits

    def splits(device, T, H, total, block_h=32, block_n=32, max_splits=None):
        return n
    K.decode_splits = splits
    _forget_plans(D)
    try:
        yield
    finally:
        K.decode_splits = orig
        _forget_plans(D)


def _forget_plans(module):
    """Drop the decode launch plans made so far (they hold the split decision)."""
    module.forget_plans()


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #
def interleaved_us(fns, iters, repeats, best=True, clock=time.thread_time):
    """Microseconds per call of each of FNS (name -> callable), blocks interleaved: the
    fastest block (BEST: the least disturbed by other work on a shared host), else the
    median block."""
    for f in fns.values():
        f()
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = clock()
            for _ in range(iters):
                f()
            samples[k].append((clock() - t0) / iters * 1e6)
    pick = min if best else statistics.median
    return {k: pick(v) for k, v in samples.items()}


def calls_per_call(fn, n=20):
    """Python functions and C functions / methods entered per call of FN (``sys.setprofile``
    events): a count that the load of a shared host does not disturb."""
    count = [0]

    def hook(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1
    fn()
    sys.setprofile(hook)
    try:
        for _ in range(n):
            fn()
    finally:
        sys.setprofile(None)
    return (count[0] - 1) / n       # less the setprofile(None) call itself


def profile_top(fn, calls, top):
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def measure(case, gen, rec, iters, repeats, splits, profile=0, best=True, clock=time.thread_time):
    """One case's row: launch / bound / serving microseconds, the launches one serving call
    makes, and their signature."""
    op, backend, a, kw, split = case_inputs(case, gen)
    bound, serving = _load(op, backend)
    scope = split_plan(splits) if split else contextlib.nullcontext()
    with scope, rec.active():
        rec.keep = True
        inputs = _tensors(a, kw)
        bound(*a, **kw)
        checked_sig = signature(rec.take(), inputs)
        serving(*a, **kw)
        calls = rec.take()
        rec.keep = False
        fns = {"launch": replay(calls), "bound": lambda: bound(*a, **kw), "serving": lambda: serving(*a, **kw)}
        us = interleaved_us(fns, iters, repeats, best, clock)
        prof = profile_top(fns["serving"], max(iters, 200), profile) if profile else None
        counts = {k: calls_per_call(f) for k, f in fns.items()}
    sig = signature(calls, inputs)
    row = dict(case=case, op=op, backend=backend, launches=[c[0] for c in sig], launch_us=us["launch"],
               bound_us=us["bound"], serving_us=us["serving"], bound_host_us=us["bound"] - us["launch"],
               serving_host_us=us["serving"] - us["launch"], same_launch_checked=sig == checked_sig,
               bound_calls=counts["bound"] - counts["launch"], serving_calls=counts["serving"] - counts["launch"])
    return row, sig, prof


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", choices=CASES, help="cases to run (default: all)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--splits", type=int, default=8, help="the split-K plan of the +split decode cases")
    ap.add_argument("--profile", type=int, nargs="?", const=12, default=0, metavar="TOP",
                    help="print cProfile's TOP functions (default 12) of each serving call")
    ap.add_argument("--json", help="write the rows (and each case's launch signature) to this file")
    ap.add_argument("--median", action="store_true", help="the median block instead of the fastest")
    ap.add_argument("--clock", choices=("thread", "perf"), default="thread",
                    help="thread CPU time (default) or wall time (time.perf_counter)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] in ("", "0"):
        ap.error("the harness runs the interpreted kernels' host path: TRITON_INTERPRET must be 1")

    import platform

    import torch
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed)
    rec = Recorder()
    print(f"CPU host path, no GPU: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"torch {torch.__version__}; {args.clock} clock, {'median' if args.median else 'fastest'} of "
          f"{args.repeats} blocks of {args.iters} calls; us per call")
    print(f"{'case':<30} {'launch':>7} {'bound':>7} {'serving':>8} {'host(b)':>8} {'host(s)':>8} "
          f"{'calls(b)':>8} {'calls(s)':>8}  launches")
    rows, sigs = [], {}
    for case in args.case or CASES:
        row, sig, prof = measure(case, gen, rec, args.iters, args.repeats, args.splits, args.profile,
                                 not args.median, time.thread_time if args.clock == "thread" else time.perf_counter)
        rows.append(row)
        sigs[case] = sig
        print(f"{case:<30} {row['launch_us']:7.1f} {row['bound_us']:7.1f} {row['serving_us']:8.1f} "
              f"{row['bound_host_us']:8.1f} {row['serving_host_us']:8.1f} {row['bound_calls']:8.0f} "
              f"{row['serving_calls']:8.0f}  {'+'.join(row['launches'])}"
              + ("" if row["same_launch_checked"] else "  (checked call launches differently!)"))
        if prof:
            print(prof)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, signatures=sigs), f, indent=1)
    return 0 if all(r["same_launch_checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())

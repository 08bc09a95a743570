"""Shared by the GPU benchmarks: timing, and the two ceilings measured on the card.

Every benchmark divides by ceilings measured in the same run (never datasheet
figures): a large device-to-device copy counted as bytes read + written, and a
large matrix product on random data.
"""
from __future__ import annotations


def bench(fn, warmup=25, rep=200):
    """Median milliseconds of FN: CUDA events, warm-up first (do_bench; ms arguments)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn, warmup=25, rep=200):
    """Median milliseconds of FN replayed from a CUDA graph, after eager warm-up (the
    calibration timer's graph mode: cuda_timer)."""
    from capdispatch.bench import cuda_timer
    return cuda_timer(warmup_ms=warmup, rep_ms=rep)(fn, graph=True)


def copy_bandwidth(nbytes=2 << 30, warmup=25, rep=200):
    """Device-to-device copy: (GB/s counting read + write, ms)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), warmup, rep)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / ms / 1e6, ms


def matmul_rate(n=8192, warmup=25, rep=200, fp8=False, timer=None):
    """(TFLOP/s, dtype) of an n^3 product on random data: bf16, or fp8 scaled_mm
    when FP8 and the card has it (falls back to bf16 and says so). TIMER(fn, warmup, rep)
    -> ms: `bench` (eager, the default) or `bench_graph`."""
    timer = timer or bench
    import torch
    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    try:
        if fp8 and torch.cuda.get_device_capability() >= (8, 9):
            try:
                a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
                one = torch.tensor(1.0, device="cuda")
                fn = lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,  # noqa: E731
                                              out_dtype=torch.bfloat16)
                fn()
                return 2 * n ** 3 / timer(fn, warmup, rep) / 1e9, "fp8"
            except Exception as exc:  # older torch: the bf16 rate, said aloud
                print(f"fp8 scaled_mm unavailable ({type(exc).__name__}: {exc}); using the bf16 rate")
        return 2 * n ** 3 / timer(lambda: a @ b, warmup, rep) / 1e9, "bf16"
    finally:
        del a, b
        torch.cuda.empty_cache()


def run_facts(seed=None) -> dict:
    """What every result file records: the card, the software, the time (UTC) and the
    run's seed (a fresh one unless SEED is given)."""
    import datetime
    import platform
    import random

    import torch
    import triton
    cc = torch.cuda.get_device_capability()
    return dict(device=torch.cuda.get_device_name(), compute_capability=f"{cc[0]}.{cc[1]}",
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                seed=seed if seed is not None else random.SystemRandom().randrange(2**31))


def describe(facts) -> str:
    """The header line a benchmark prints from run_facts()."""
    f = facts
    return (f"device: {f['device']} (cc {f['compute_capability']}), torch {f['torch']}, triton {f['triton']}, "
            f"CUDA {f['cuda']}, seed {f['seed']}")

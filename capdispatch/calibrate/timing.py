"""Timers: `timer(fn, graph) -> ms`, the median of many runs after a warm-up."""
from __future__ import annotations

import statistics
import time


def cuda_timer(warmup_ms: float = 25, rep_ms: float = 100):
    """CUDA events through Triton's benchmarking: `do_bench` (L2 flushed between runs)
    eagerly, `do_bench_cudagraph` for calls timed inside a CUDA graph."""
    def timer(fn, graph: bool) -> float:
        import triton.testing
        if graph:
            _warm_up(fn, warmup_ms)
            return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    timer.describe = (f"CUDA events (triton.testing.do_bench median, warm-up {warmup_ms:g} ms, "
                      f"{rep_ms:g} ms of runs; do_bench_cudagraph inside CUDA graphs)")
    return timer


def _warm_up(fn, ms: float) -> None:
    """Eager calls for about MS milliseconds (compiles, clocks), before a graph is captured."""
    import torch
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        fn()
        torch.cuda.synchronize()


def cpu_timer(min_runs: int = 5, budget_s: float = 0.2, max_runs: int = 1000):
    """Wall clock (perf_counter) on the CPU: one warm-up call, then at least MIN_RUNS and
    up to BUDGET_S seconds of runs; the median."""
    def timer(fn, graph: bool) -> float:
        fn()
        times, start = [], time.perf_counter()
        while len(times) < min_runs or (time.perf_counter() - start < budget_s and len(times) < max_runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3
    timer.describe = (f"CPU wall clock (perf_counter median of >= {min_runs} runs, "
                      f"{budget_s:g} s budget, after one warm-up call)")
    return timer

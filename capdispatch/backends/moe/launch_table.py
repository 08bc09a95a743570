"""Launch table of the Triton W4A16 MoE (triton_kernels.py): tile sizes, warps and
pipeline stages of its two GEMM launches, by the mean routes per active expert."""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Tiles", "tiles_for", "ROUTING_LAUNCHES", "routing_launch"]


class Tiles(NamedTuple):
    """Tile sizes, warps, pipeline stages, split-K parts and weight prefetch of the two GEMM launches."""
    BM: int           # routes per block (one expert's rows)
    BN1: int          # GEMM1 N tile (over I; gate and up tiles both)
    BK1: int          # GEMM1 K tile (over H)
    W1: int           # GEMM1 warps
    S1: int           # GEMM1 software-pipeline stages
    BN2: int          # GEMM2 N tile (over H)
    BK2: int          # GEMM2 K tile (over I)
    W2: int
    S2: int
    SK1: int = 1      # GEMM1 split-K parts (> 1: float32 partials, then a SwiGLU reduce launch)
    SK2: int = 1      # GEMM2 split-K parts (> 1: float32 partials, summed by the combine)
    PF: int = 0       # 1: both GEMMs load the next K tile's weight bytes before decoding this one


def tiles_for(avg_rows: float, H: int, I: int, interpreted: bool) -> Tiles:
    """Tiles from the mean routes per active expert. The decode and prefill rows are
    the best of benchmarks/sweep_moe_triton.py on an H200 at DSv4 shapes. Decode: a
    32-wide GEMM1 N tile spreads six experts' rows over twice the SMs, the fastest of 71
    candidates at 1 token timed in CUDA graphs and within 5% of the best at 4
    (moe_tiles_nvidia_h200_20261202T064344.md). A 64-wide two-stage GEMM1 is 4-7% faster
    on the H200 at 8-64 tokens (archive/moe_tiles_nvidia_h200_20261202T062322.md) but
    spills 376-1044 B at DSv4's hidden size on every target of the compile matrix, where
    this one spills none, and has not run on a 99 KB card: not taken. Prefill: four GEMM2
    warps are 6% faster at 4096 tokens. The middle rows are reasoned, not measured."""
    if interpreted:
        return Tiles(16, 32, 64, 4, 1, 32, 64, 4, 1)
    if avg_rows <= 16:
        return Tiles(16, 32, 128, 4, 3, 64, 128, 4, 3)
    if avg_rows <= 64:
        return Tiles(32, 64, 128, 4, 3, 64, 128, 4, 3)
    if avg_rows <= 128:
        return Tiles(64, 64, 64, 4, 3, 128, 64, 8, 3)
    # Prefill: 128 rows share each decoded weight tile (the decode is ALU work per weight).
    return Tiles(128, 64, 64, 8, 3, 128, 64, 4, 3)


# The one-program routing kernel's scan chunk (routes per step) and warps, by route count:
# (most routes, CH, warps), first match. Its time is a chain of dependent scans over
# [CH, experts], so a decode call wants the smallest chunk that holds its routes; one warp
# also skips the cross-warp exchanges of each scan. Timed on an H200 in CUDA graphs at 64
# experts and top-6 (benchmarks/sweep_moe_routing.py, 2026-12-03): 6 routes 2.4 us against
# 6.1 us with (128, 4); 48 routes 6.0 us against 7.8 us (a 32-route chunk on one warp is as fast);
# 384 routes (128, 4) stays the fastest, 17.9 us.
# benchmarks/results/moe_routing_nvidia_h200_20261203T163549.md
ROUTING_LAUNCHES = ((16, 16, 1), (64, 64, 4), (None, 128, 4))


def routing_launch(routes: int) -> tuple:
    """(CH, num_warps) of the routing kernel for ROUTES routes (ROUTING_LAUNCHES)."""
    return next((ch, warps) for most, ch, warps in ROUTING_LAUNCHES if most is None or routes <= most)

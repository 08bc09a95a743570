"""Launch table of the Triton W4A16 MoE (triton_kernels.py): tile sizes, warps and
pipeline stages of its two GEMM launches, by the mean routes per active expert."""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Tiles", "tiles_for", "mean_rows", "ROUTING_LAUNCHES", "routing_launch"]


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


def mean_rows(routes: int, experts: int) -> float:
    """Mean routes per active expert that ROUTES routes over EXPERTS experts give, known on
    the host without reading the routing: the routes over the experts they are expected to
    touch when routing is uniform, E * (1 - (1 - 1/E) ** R) (34 of 64 experts for 8 tokens
    of top-6, as measured; 5.8 for one token; all 64 from 64 tokens)."""
    if routes <= 0 or experts <= 0:
        return 1.0
    touched = experts * (1.0 - (1.0 - 1.0 / experts) ** routes)
    return routes / max(1.0, touched)


def tiles_for(avg_rows: float, H: int, I: int, interpreted: bool) -> Tiles:
    """Tiles from the mean routes per active expert, the best of
    benchmarks/sweep_moe_triton.py on an H200 at DSv4 shapes, timed in CUDA graphs with
    every candidate checked against the reference first (AVG_ROWS: mean_rows). Decode, about
    one route per expert (1-4 tokens at 64 experts): a 32-wide GEMM1 N tile spreads six
    experts' rows over twice the SMs (55.9 us at 1 token). Up to 4 routes per expert (8-32
    tokens) a 64-wide GEMM1 (290.8 against 297.7 us at 8 tokens, 374.2 against 386.3 at 16,
    426.0 against 451.4 at 32), up to 16 (64 tokens) a 128-wide one on two stages (459.6
    against 497.2 us): the
    wider tile amortises each K step's activation fragments over more decoded weights
    (benchmarks/results: moe_tiles_nvidia_h200_20261203T191511.md and
    archive/...T190638.md). Built as a launch with aligned tensors is (Triton specialises
    on 16-byte alignment), none of them spills on any target from sm_80 to sm_120a, and all
    fit 99 KB; the compile matrix's build for any alignment spills 0.35-3.1 KB in the wider
    two (docs/ops/moe.md). GEMM2's tile moves the time by at most 1% there. Prefill: four GEMM2 warps are 6% faster at 4096 tokens. The 17-128 rows are
    reasoned, not measured."""
    if interpreted:
        return Tiles(16, 32, 64, 4, 1, 32, 64, 4, 1)
    if avg_rows <= 1.2:
        return Tiles(16, 32, 128, 4, 3, 64, 128, 4, 3)
    if avg_rows <= 4:
        return Tiles(16, 64, 128, 4, 3, 64, 128, 4, 3)
    if avg_rows <= 16:
        return Tiles(16, 128, 128, 4, 2, 64, 128, 4, 3)
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
# The largest chunk, 128, keeps the [CH, experts] int32 scan scratch within 99 KB cards.
ROUTING_LAUNCHES = ((16, 16, 1), (64, 64, 4), (None, 128, 4))


def routing_launch(routes: int) -> tuple:
    """(CH, num_warps) of the routing kernel for ROUTES routes (ROUTING_LAUNCHES)."""
    return next((ch, warps) for most, ch, warps in ROUTING_LAUNCHES if most is None or routes <= most)

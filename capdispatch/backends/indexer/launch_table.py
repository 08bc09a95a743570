"""Launch table of the indexer's Triton kernel (triton_kernels.py)."""
from __future__ import annotations

__all__ = ["BLOCK_N", "NUM_WARPS", "NUM_STAGES"]

BLOCK_N = 64          # tokens per step (one page)
NUM_WARPS = 4       # one query row (64 heads) per program
NUM_STAGES = 2      # software pipelining of the page loads

"""Launch table of the KV-cache Triton kernels (triton_kernels.py)."""
from __future__ import annotations

__all__ = ["QUANT_TOKENS_PER_PROG", "QUANT_NUM_WARPS", "DEQUANT_TOKENS_PER_PROG", "DEQUANT_NUM_WARPS"]

# Tokens per program and warps, tuned on an H200 at 262144 tokens, page size 256,
# random slots (T in 4..32 x warps in 2..16; 16 x 4 best or within 1% for all four).
QUANT_TOKENS_PER_PROG = 16
QUANT_NUM_WARPS = 4
DEQUANT_TOKENS_PER_PROG = 16
DEQUANT_NUM_WARPS = 4

"""Index lists for the external decode kernels (FlashMLA, FlashInfer SM120), in one launch.

Both libraries treat only -1 as masked, bound-check nothing else and tile top-k by 64.
Cleaning an index tensor with small torch ops (cast, two comparisons, and, where, pad)
costs five or six launches, about as much as the attention kernel itself inside a CUDA
graph at decode sizes. This kernel does cast, bound check and padding in one pass.
This module imports triton at import time; the adapters import it when they run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import ArgumentError
from ..arg_checks import index_dtype
from ..device_scope import cdiv, on_device
from ..triton_common.env import interpreted

__all__ = ["clean_ids"]

MAX_BLOCK = 1024      # ids per program at most


@triton.jit
def _clean_ids_kernel(src_ptr, dst_ptr, K_IN, K_OUT, capacity, stride_src, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < K_IN
    v = tl.load(src_ptr + row * stride_src + offs, mask=inside, other=-1).to(tl.int64)
    keep = inside & (v >= 0) & (v < capacity)
    tl.store(dst_ptr + row * K_OUT + offs, tl.where(keep, v, -1).to(tl.int32), mask=offs < K_OUT)


def clean_ids(idx: torch.Tensor, capacity: int, align: int, *, out: torch.Tensor | None = None):
    """int32 [..., k'] copy of the integer ids IDX [..., k]: ids outside [0, capacity) become
    -1 and each list is padded with -1 to k' = k rounded up to a multiple of ALIGN (the
    libraries': library_args.DECODE_TOPK_ALIGN).
    OUT, when given, must be a contiguous int32 tensor of that shape."""
    index_dtype(idx, "index ids")
    k = idx.shape[-1]
    k_out = k + (-k) % align
    shape = tuple(idx.shape[:-1]) + (k_out,)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=idx.device)
    elif tuple(out.shape) != shape or out.dtype != torch.int32 or not out.is_contiguous():
        raise ArgumentError(f"out must be a contiguous int32 tensor of shape {shape}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    src = idx.reshape(-1, max(k, 1))
    if src.stride(-1) != 1:
        src = src.contiguous()
    rows = src.shape[0]
    if rows and k_out:
        block = min(MAX_BLOCK, triton.next_power_of_2(k_out))
        with on_device(idx.device):
            _clean_ids_kernel[(rows, cdiv(k_out, block))](
                src, out, k, k_out, int(capacity), src.stride(0), BLOCK=block, num_warps=4)
    return out



INTERPRETED = interpreted(_clean_ids_kernel)


# Types of the kernel's runtime arguments, for an offline compile (backends/compile_matrix.py).
COMPILE_SIGNATURES = {
    "_clean_ids_kernel": {"src_ptr": "*i32", "dst_ptr": "*i32", "K_IN": "i32", "K_OUT": "i32", "capacity": "i32",
                          "stride_src": "i32"},
}

"""row_scale in Triton (imported only when the backend is bound, or by the compile matrix)."""
import torch
import triton
import triton.language as tl

from capdispatch.backends.torch_ops import custom_op

from . import OPS

BLOCK_D = 64
COMPILE_SIGNATURES = {"_row_scale_kernel": {"x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "D": "i32"}}


@triton.jit
def _row_scale_kernel(x_ptr, w_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask)
    tl.store(out_ptr + row * D + cols, x * tl.load(w_ptr + row), mask=mask)


def _row_scale(x, w, *, checks=True):
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty_like(x)
    n, d = x.shape
    if n:
        _row_scale_kernel[(n, triton.cdiv(d, BLOCK_D))](x, w, out, d, BLOCK_D=BLOCK_D)
    return out


row_scale = custom_op(OPS[0], "triton", _row_scale)

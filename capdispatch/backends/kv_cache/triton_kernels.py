"""Triton kernels for the DeepSeek-V4 paged KV cache (layout: backends/v4_layout.py).

Two codecs share one kernel body per direction, selected by the ``NATIVE_FP8``
constexpr:

* ``*_fp8``: the host passes the pool as a float8_e4m3fn view and the kernel
  uses Triton's ``tl.float8e4nv`` conversions (hardware cvt; needs compute
  capability >= 8.9 on NVIDIA GPUs).
* ``*_u8``: the host passes only uint8 pool views; e4m3fn encode/decode are
  bit manipulations (integer ops plus one exact float32 add / float16 widening,
  see triton_common/codec.py), so no fp8 type is ever emitted and the kernel
  compiles on SM80/SM86, where Triton rejects fp8e4nv.

Both are bit-identical to the torch backend (reference.py) for finite inputs.
Each program handles TOKENS_PER_PROG tokens as one [T, 8, 64] block (7 nope
tiles + the rope tail as an 8th "tile"), so loads/stores are wide and
contiguous; all address arithmetic is int64. This module imports triton at
module level and is meant to be imported lazily (at backend bind time).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .. import launch_limits as _limits
from ..device_scope import cdiv, on_device_of
from ..triton_common.env import check_device, interpreted, jit_module
from ..v4_layout import DATA_BYTES, DIM, DIM_NOPE, FP8_MAX, NUM_TILES, SCALE_BYTES, SCALE_EPS, TILE
from .reference import check_dequant_args, check_quant_args

__all__ = ["kv_quant_fp8", "kv_quant_u8", "kv_dequant_fp8", "kv_dequant_u8"]

# Layout constants as Triton constexpr globals (module-level constexprs are allowed in kernels).
_DIM_NOPE = tl.constexpr(DIM_NOPE)
_NUM_TILES = tl.constexpr(NUM_TILES)
_SCALE_EPS = tl.constexpr(SCALE_EPS)

# The toolbox's codec and pool-row helpers (triton_common), built the way these kernels are.
_f32_to_e4m3fn_bits = jit_module("codec").f32_to_e4m3fn_bits
_rows = jit_module("v4_rows")
_row_tiles = _rows.row_tiles
_token_bases = _rows.token_bases
_load_rows = _rows.load_rows

from .launch_table import (DEQUANT_NUM_WARPS, DEQUANT_TOKENS_PER_PROG, QUANT_NUM_WARPS,  # noqa: E402,F401
                           QUANT_TOKENS_PER_PROG)


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #
@triton.jit
def _program_tokens(pid, n_tokens, loc_ptr, TOKENS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BYTES_PER_PAGE: tl.constexpr):
    tok = pid.to(tl.int64) * TOKENS + tl.arange(0, TOKENS).to(tl.int64)
    tmask = tok < n_tokens
    loc = tl.load(loc_ptr + tok, mask=tmask, other=0).to(tl.int64)
    data_base, scale_base = _token_bases(loc, PAGE_SIZE, BYTES_PER_PAGE)
    return tok, tmask, data_base, scale_base


@triton.jit
def _kv_quant_kernel(
    k_ptr,  # bf16 [n, 512], row stride k_stride
    pool_ptr,  # float8e4nv (NATIVE_FP8) or uint8 view of the pool
    loc_ptr,  # int32/int64 [n]
    n_tokens,
    k_stride,
    PAGE_SIZE: tl.constexpr,
    BYTES_PER_PAGE: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    TOKENS: tl.constexpr,
):
    tok, tmask, data_base, scale_base = _program_tokens(
        tl.program_id(0), n_tokens, loc_ptr, TOKENS, PAGE_SIZE, BYTES_PER_PAGE)
    tile, col = _row_tiles()  # [8], [8, 64] = 0..511: 7 nope tiles + the rope tail as tile 7
    is_nope = (tile < _NUM_TILES)[None, :, None]
    is_rope = (tile == _NUM_TILES)[None, :, None]
    tm3 = tmask[:, None, None]

    # One contiguous 1024-byte row per token.
    xb = tl.load(k_ptr + tok[:, None, None] * k_stride + col[None, :, :], mask=tm3, other=0.0)
    x = xb.to(tl.float32)

    # Scale exponent e = ceil(log2(max(amax, eps) / 448)) computed exactly from the
    # bits of amax = M * 2**E (M in [1, 2)): 448 * 2**e >= amax  <=>  e >= E - 8 + (M > 1.75).
    # No division/log2, so no dependence on approximate GPU math.
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), _SCALE_EPS)  # [T, 8]
    ab = amax.to(tl.int32, bitcast=True)
    e = (ab >> 23) - (127 + 8) + ((ab & 0x7FFFFF) > 0x600000).to(tl.int32)
    inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)  # exactly 2**-e
    # y = x / 2**e is exact, and |y| <= amax / 2**e <= 448 by the choice of e, so
    # the contract's clamp(y, -448, 448) is the identity here and is left out
    # (bit-identical to the torch backend, which applies it).
    y = x * inv_scale[:, :, None]

    nope_off = data_base[:, None, None] + col[None, :, :]
    if NATIVE_FP8:
        tl.store(pool_ptr + nope_off, y.to(tl.float8e4nv), mask=tm3 & is_nope)
    else:
        tl.store(pool_ptr + nope_off, _f32_to_e4m3fn_bits(y).to(tl.uint8), mask=tm3 & is_nope)

    # Rope: raw bf16 bits of tile 7 into bytes 448..575 of the token.
    pool_bf16 = pool_ptr.to(tl.pointer_type(tl.bfloat16))
    # (col - 448 is 0..63 on tile 7; other tiles are masked off)
    rope_off = ((data_base + _DIM_NOPE) >> 1)[:, None, None] + (col - _DIM_NOPE)[None, :, :]
    tl.store(pool_bf16 + rope_off, xb, mask=tm3 & is_rope)

    # All 8 scale bytes of a token (7 exponents + pad byte 0) in one store op.
    pool_u8 = pool_ptr.to(tl.pointer_type(tl.uint8))
    sbyte = tl.where(tile[None, :] < _NUM_TILES, e + 127, 0).to(tl.uint8)
    tl.store(pool_u8 + scale_base[:, None] + tile[None, :], sbyte, mask=tmask[:, None])


@triton.jit
def _kv_dequant_kernel(
    pool_ptr,  # float8e4nv (NATIVE_FP8) or uint8 view of the pool
    ids_ptr,  # int32/int64 [n]
    out_ptr,  # bf16 [n, 1, 512], row stride out_stride
    n_tokens,
    out_stride,
    PAGE_SIZE: tl.constexpr,
    BYTES_PER_PAGE: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    TOKENS: tl.constexpr,
):
    tok, tmask, data_base, scale_base = _program_tokens(
        tl.program_id(0), n_tokens, ids_ptr, TOKENS, PAGE_SIZE, BYTES_PER_PAGE)
    _, col = _row_tiles()
    out = _load_rows(pool_ptr, data_base, scale_base, tmask, NATIVE_FP8)
    # One contiguous 1024-byte row per token.
    tl.store(out_ptr + tok[:, None, None] * out_stride + col[None, :, :], out, mask=tmask[:, None, None])


# The kernels hard-code the layout; keep them honest if backends/v4_layout.py ever changes.
assert (DIM, DIM_NOPE, TILE, DATA_BYTES, SCALE_BYTES) == (512, 448, 64, 576, 8)
assert FP8_MAX == 448.0 and SCALE_EPS == 1e-8


# --------------------------------------------------------------------------- #
# Host side
# --------------------------------------------------------------------------- #
INTERPRETED = interpreted(_kv_quant_kernel)
_FP8 = torch.float8_e4m3fn


def _check_device(t: torch.Tensor, native_fp8: bool) -> None:
    check_device(t, interpreted=INTERPRETED, kernels="Triton KV-cache kernels", native_fp8=native_fp8,
                 instead="use kv_quant_u8 / kv_dequant_u8")


def _launch_quant(k, pool, loc, page_size, native_fp8, checks):
    k, u8, loc = check_quant_args(k, pool, loc, page_size, checks)
    n = k.shape[0]
    if checks:
        _check_device(u8, native_fp8)
    if n == 0:
        return
    with on_device_of(u8):
        _limits.launch(_kv_quant_kernel, (cdiv(n, QUANT_TOKENS_PER_PROG),))(
            k, u8.view(_FP8) if native_fp8 else u8, loc, n, k.stride()[0], page_size, u8.shape[1], native_fp8,
            QUANT_TOKENS_PER_PROG, num_warps=QUANT_NUM_WARPS)


def _launch_dequant(pool, token_ids, page_size, out, native_fp8, checks):
    u8, ids, out = check_dequant_args(pool, token_ids, page_size, out, checks)
    n = ids.shape[0]
    if checks:
        _check_device(u8, native_fp8)
    if out is None:
        out = torch.empty((n, 1, DIM), dtype=torch.bfloat16, device=u8.device)
        out_stride = DIM
    else:
        out_stride = out.stride()[0]
    if n == 0:
        return out
    with on_device_of(u8):
        _limits.launch(_kv_dequant_kernel, (cdiv(n, DEQUANT_TOKENS_PER_PROG),))(
            u8.view(_FP8) if native_fp8 else u8, ids, out, n, out_stride, page_size, u8.shape[1], native_fp8,
            DEQUANT_TOKENS_PER_PROG, num_warps=DEQUANT_NUM_WARPS)
    return out


def kv_quant_fp8(k: torch.Tensor, pool: torch.Tensor, loc: torch.Tensor, page_size: int, *,
                 checks: bool = True) -> None:
    """kv_quant with Triton's native fp8 conversion (cc >= 8.9). Same contract as reference.kv_quant."""
    _launch_quant(k, pool, loc, page_size, True, checks)


def kv_quant_u8(k: torch.Tensor, pool: torch.Tensor, loc: torch.Tensor, page_size: int, *,
                checks: bool = True) -> None:
    """kv_quant with an integer e4m3fn encoder (no fp8 types; SM80/86 ok). Same contract as reference.kv_quant."""
    _launch_quant(k, pool, loc, page_size, False, checks)


def kv_dequant_fp8(pool: torch.Tensor, token_ids: torch.Tensor, page_size: int,
                   out: torch.Tensor | None = None, *, checks: bool = True) -> torch.Tensor:
    """kv_dequant with Triton's native fp8 conversion (cc >= 8.9). Same contract as reference.kv_dequant."""
    return _launch_dequant(pool, token_ids, page_size, out, True, checks)


def kv_dequant_u8(pool: torch.Tensor, token_ids: torch.Tensor, page_size: int,
                  out: torch.Tensor | None = None, *, checks: bool = True) -> torch.Tensor:
    """kv_dequant with an integer e4m3fn decoder (no fp8 types; SM80/86 ok). Same contract as reference.kv_dequant."""
    return _launch_dequant(pool, token_ids, page_size, out, False, checks)


# Custom ops (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_kv_quant_fp8 = custom_op(OPS[0], "triton_fp8", kv_quant_fp8)
op_kv_quant_u8 = custom_op(OPS[0], "triton_u8", kv_quant_u8)
op_kv_dequant_fp8 = custom_op(OPS[1], "triton_fp8", kv_dequant_fp8)
op_kv_dequant_u8 = custom_op(OPS[1], "triton_u8", kv_dequant_u8)


# Types of each kernel's runtime arguments (uint8 pool; the native variant passes it as
# *fp8e4nv): what an offline compile for a GPUTarget needs (backends/compile_matrix.py).
COMPILE_SIGNATURES = {
    "_kv_quant_kernel": {"k_ptr": "*bf16", "pool_ptr": "*u8", "loc_ptr": "*i64", "n_tokens": "i32",
                         "k_stride": "i32"},
    "_kv_dequant_kernel": {"pool_ptr": "*u8", "ids_ptr": "*i32", "out_ptr": "*bf16", "n_tokens": "i32",
                           "out_stride": "i32"},
}

"""@triton.jit access to the DeepSeek-V4 paged KV pool (layout: backends/v4_layout.py), shared
by the KV dequant kernel and the paged attention kernels.

A K row is handled as [8, 64]: the 7 nope tiles, then the rope tail as an 8th tile, so the
tile scales broadcast along the last axis without being materialised and each token's
loads are wide and contiguous. All offsets are int64.

Load through ``env.jit_module("v4_rows")`` (see there), never by a plain import.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..v4_layout import DATA_BYTES, DIM, DIM_NOPE, NUM_TILES, ROPE_BYTE_OFFSET, ROPE_ELEM_BYTES, \
    SCALE_BYTES, TILE
from .env import jit_module

__all__ = ["row_tiles", "token_bases", "load_rows", "load_rows_direct"]

_codec = jit_module("codec")
_e4m3fn_bits_to_f32 = _codec.e4m3fn_bits_to_f32
_ue8m0_to_f32 = _codec.ue8m0_to_f32
_ue8m0_to_bf16 = _codec.ue8m0_to_bf16
_e4m3fn_bits_to_bf16_scaled = _codec.e4m3fn_bits_to_bf16_scaled
_round_bf16 = _codec.round_bf16

_NUM_TILES = tl.constexpr(NUM_TILES)
_ROW_TILES = tl.constexpr(NUM_TILES + 1)      # the rope tail is the last tile
_TILE = tl.constexpr(TILE)
_DIM_NOPE = tl.constexpr(DIM_NOPE)
_DATA_BYTES = tl.constexpr(DATA_BYTES)
_SCALE_BYTES = tl.constexpr(SCALE_BYTES)
_ROPE_BYTE_OFFSET = tl.constexpr(ROPE_BYTE_OFFSET)

# The [8, 64] view and the bf16 rope addressing rely on these.
assert DIM == (NUM_TILES + 1) * TILE and DIM - DIM_NOPE == TILE and ROPE_ELEM_BYTES == 2
assert SCALE_BYTES == NUM_TILES + 1 and ROPE_BYTE_OFFSET == DIM_NOPE


@triton.jit
def row_tiles():
    """(tile index [8], column of each value [8, 64] = 0..511) of a K row."""
    tile = tl.arange(0, _ROW_TILES)
    col = tile[:, None] * _TILE + tl.arange(0, _TILE)[None, :]
    return tile, col


@triton.jit
def token_bases(loc, PAGE_SIZE: tl.constexpr, BYTES_PER_PAGE: tl.constexpr):
    """int64 pool slots LOC -> (byte offset of each token's data bytes, of its scale bytes)."""
    page = loc // PAGE_SIZE
    slot = loc % PAGE_SIZE
    page_base = page * BYTES_PER_PAGE
    data_base = page_base + slot * _DATA_BYTES
    scale_base = page_base + PAGE_SIZE * _DATA_BYTES + slot * _SCALE_BYTES
    return data_base, scale_base


@triton.jit
def load_rows(pool_ptr, data_base, scale_base, valid, NATIVE_FP8: tl.constexpr):
    """The tokens at DATA_BASE / SCALE_BASE (from token_bases, [N]) -> dequantised bf16
    rows [N, 8, 64], exactly as kv_dequant; rows where VALID is false are zeros and none
    of their bytes are loaded.

    POOL_PTR is a uint8 pointer (integer e4m3fn decode), or float8e4nv with NATIVE_FP8.
    The 8 scale bytes of a token (7 exponents + the pad byte) are one load; the pad
    byte scales only tile 7's masked-off nope part, which the rope replaces."""
    tile, col = row_tiles()
    is_nope = (tile < _NUM_TILES)[None, :, None]
    is_rope = (tile == _NUM_TILES)[None, :, None]
    vm = valid[:, None, None]
    nope_off = data_base[:, None, None] + col[None, :, :]
    if NATIVE_FP8:
        v = tl.load(pool_ptr + nope_off, mask=vm & is_nope, other=0.0).to(tl.float32)
    else:
        v = _e4m3fn_bits_to_f32(tl.load(pool_ptr + nope_off, mask=vm & is_nope, other=0))
    pool_u8 = pool_ptr.to(tl.pointer_type(tl.uint8))
    sb = tl.load(pool_u8 + scale_base[:, None] + tile[None, :], mask=valid[:, None], other=0)
    nope = (v * _ue8m0_to_f32(sb)[:, :, None]).to(tl.bfloat16)
    pool_bf16 = pool_ptr.to(tl.pointer_type(tl.bfloat16))
    # (col - DIM_NOPE is 0..63 on tile 7; the other tiles are masked off)
    rope_off = ((data_base + _ROPE_BYTE_OFFSET) >> 1)[:, None, None] + (col - _DIM_NOPE)[None, :, :]
    rope = tl.load(pool_bf16 + rope_off, mask=vm & is_rope, other=0.0)
    return tl.where(is_rope, rope, nope)


@triton.jit
def load_rows_direct(pool_ptr, data_base, scale_base, valid, EMULATE: tl.constexpr):
    """load_rows of a uint8 POOL_PTR with the direct e4m3fn -> bf16 decode
    (codec.e4m3fn_bits_to_bf16_scaled: PTX, no float32 step), the same rows bit for bit.
    EMULATE (the interpreter, which runs no PTX) computes what the PTX computes with
    Triton integer and float32 operations: the same bf16 placement of the code's bits,
    times 2**120 and the scale, rounded once."""
    tile, col = row_tiles()
    is_nope = (tile < _NUM_TILES)[None, :, None]
    is_rope = (tile == _NUM_TILES)[None, :, None]
    vm = valid[:, None, None]
    c = tl.load(pool_ptr + data_base[:, None, None] + col[None, :, :], mask=vm & is_nope, other=0)
    sb = tl.load(pool_ptr + scale_base[:, None] + tile[None, :], mask=valid[:, None], other=0)
    if EMULATE:
        x = c.to(tl.int32)
        lane = ((x << 4) & 0x07F0) | ((x << 8) & 0x8000)        # the PTX's bf16 bits: value x 2**-120
        v = (lane << 16).to(tl.float32, bitcast=True) * 1.329227995784916e36   # x 2**120
        v = _round_bf16(v * _ue8m0_to_f32(sb)[:, :, None])
        v = tl.where((x & 0x7F) == 0x7F, float("nan"), v)
        # To bf16 by its bits: the interpreter's float32 -> bf16 cast gets bf16 subnormals wrong.
        nope = (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        sc = tl.broadcast_to(_ue8m0_to_bf16(sb)[:, :, None], c.shape)
        nope = _e4m3fn_bits_to_bf16_scaled(c, sc)
    pool_bf16 = pool_ptr.to(tl.pointer_type(tl.bfloat16))
    rope_off = ((data_base + _ROPE_BYTE_OFFSET) >> 1)[:, None, None] + (col - _DIM_NOPE)[None, :, :]
    rope = tl.load(pool_bf16 + rope_off, mask=vm & is_rope, other=0.0)
    return tl.where(is_rope, rope, nope)

"""Triton kernels for the DeepSeek-V4 paged KV cache (layout: see layout.py).

Two codecs share one kernel body per direction, selected by the ``NATIVE_FP8``
constexpr:

* ``*_fp8``: the host passes the pool as a float8_e4m3fn view and the kernel
  uses Triton's ``tl.float8e4nv`` conversions (hardware cvt; needs compute
  capability >= 8.9 on NVIDIA GPUs).
* ``*_u8``: the host passes only uint8 pool views; e4m3fn encode/decode are
  bit manipulations (integer ops plus one exact float32 add / float16 widening,
  see the codec functions), so no fp8 type is ever emitted and the kernel
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

from ...errors import ArgumentError, UnsupportedDeviceError
from ..device_scope import cdiv, capability as _capability, on_device
from .layout import DATA_BYTES, DIM, DIM_NOPE, FP8_MAX, SCALE_BYTES, SCALE_EPS, TILE
from .reference import check_dequant_args, check_quant_args

__all__ = ["kv_quant_fp8", "kv_quant_u8", "kv_dequant_fp8", "kv_dequant_u8"]

# Layout constants as Triton constexpr globals (module-level constexprs are allowed in kernels).
_DIM_NOPE = tl.constexpr(DIM_NOPE)
_DATA_BYTES = tl.constexpr(DATA_BYTES)
_SCALE_BYTES = tl.constexpr(SCALE_BYTES)
_SCALE_EPS = tl.constexpr(SCALE_EPS)

# Tokens per program and warps, tuned on an H200 at 262144 tokens, page size 256,
# random slots (T in 4..32 x warps in 2..16; 16 x 4 best or within 1% for all four).
QUANT_TOKENS_PER_PROG = 16
QUANT_NUM_WARPS = 4
DEQUANT_TOKENS_PER_PROG = 16
DEQUANT_NUM_WARPS = 4


# --------------------------------------------------------------------------- #
# Bit-level e4m3fn codec (no fp8 types anywhere, so it builds for SM80/SM86)
# --------------------------------------------------------------------------- #
@triton.jit
def _f32_to_e4m3fn_bits(y):
    """float32 with |y| <= 448 -> e4m3fn code (int32, 0..255), round-to-nearest-even.

    Exact for every such float32, subnormal codes and the carry into the next
    binade included; 448 -> 0x7E; the sign of zero is kept. |y| > 448 and
    non-finite y are out of contract (the quant kernel never produces them).

    Within the binade [2**E, 2**(E+1)) (E clamped below at -6, the subnormal
    range) e4m3 values are spaced 2**(E-3), which is exactly the float32 ulp of
    2**(E+20). So |y| + 2**(E+20) lets the FPU's own RNE round |y| onto the e4m3
    grid; the difference of the bit patterns is |y| in grid steps q (8..16 for
    normals, 0..8 below 2**-6), and code = q + 8 * (E + 6) (q == 16 carries into
    the next exponent by itself). Integer ops plus this one exact float add.
    """
    u = y.to(tl.int32, bitcast=True)
    eb = tl.maximum(u & 0x7F800000, 121 << 23)  # bits of 2**max(E, -6)
    magic = eb + (20 << 23)  # bits of 2**(E + 20)
    s = tl.abs(y) + magic.to(tl.float32, bitcast=True)
    code = (s.to(tl.int32, bitcast=True) - magic) + ((eb >> 20) - (121 << 3))
    return code | ((u >> 24) & 0x80)  # sign bit -> bit 7


@triton.jit
def _e4m3fn_bits_to_f32(c):
    """e4m3fn code (integer tensor, values 0..255) -> float32, exact for all 256 codes.

    The code's 7 magnitude bits placed at bit 7 of a float16 (5-bit exponent, bias
    15) give the same value times 2**-8 for normals and subnormals alike; the
    float16 -> float32 conversion is exact in hardware (subnormals included).
    0x7F / 0xFF -> NaN; 0x80 -> -0.0 (sign set with bit operations, never negation,
    which loses -0.0 in the Triton interpreter).
    """
    c = c.to(tl.int32)
    h = ((c << 7) & 0x3F80) | ((c << 8) & 0x8000)
    v = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((c & 0x7F) == 0x7F, float("nan"), v)


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #
@triton.jit
def _token_bases(pid, n_tokens, loc_ptr, TOKENS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BYTES_PER_PAGE: tl.constexpr):
    tok = pid.to(tl.int64) * TOKENS + tl.arange(0, TOKENS).to(tl.int64)
    tmask = tok < n_tokens
    loc = tl.load(loc_ptr + tok, mask=tmask, other=0).to(tl.int64)
    page = loc // PAGE_SIZE
    slot = loc % PAGE_SIZE
    page_base = page * BYTES_PER_PAGE
    data_base = page_base + slot * _DATA_BYTES
    scale_base = page_base + PAGE_SIZE * _DATA_BYTES + slot * _SCALE_BYTES
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
    tok, tmask, data_base, scale_base = _token_bases(
        tl.program_id(0), n_tokens, loc_ptr, TOKENS, PAGE_SIZE, BYTES_PER_PAGE)
    tile = tl.arange(0, 8)  # 7 nope tiles + the rope tail as tile 7
    inner = tl.arange(0, 64)
    col = tile[:, None] * 64 + inner[None, :]  # [8, 64] = 0..511
    is_nope = (tile < 7)[None, :, None]
    is_rope = (tile == 7)[None, :, None]
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
    sbyte = tl.where(tile[None, :] < 7, e + 127, 0).to(tl.uint8)
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
    tok, tmask, data_base, scale_base = _token_bases(
        tl.program_id(0), n_tokens, ids_ptr, TOKENS, PAGE_SIZE, BYTES_PER_PAGE)
    tile = tl.arange(0, 8)
    inner = tl.arange(0, 64)
    col = tile[:, None] * 64 + inner[None, :]
    is_nope = (tile < 7)[None, :, None]
    is_rope = (tile == 7)[None, :, None]
    tm3 = tmask[:, None, None]

    nope_off = data_base[:, None, None] + col[None, :, :]
    if NATIVE_FP8:
        v = tl.load(pool_ptr + nope_off, mask=tm3 & is_nope, other=0.0).to(tl.float32)
    else:
        v = _e4m3fn_bits_to_f32(tl.load(pool_ptr + nope_off, mask=tm3 & is_nope, other=0))

    # All 8 scale bytes in one load (the pad byte is ignored: tile 7 is rope).
    pool_u8 = pool_ptr.to(tl.pointer_type(tl.uint8))
    sb = tl.load(pool_u8 + scale_base[:, None] + tile[None, :], mask=tmask[:, None], other=0)
    # 2**(byte-127) from the exponent bits: byte 0 -> 0.0, 255 -> inf (SGLang's torch reference).
    scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    nope = (v * scale[:, :, None]).to(tl.bfloat16)

    pool_bf16 = pool_ptr.to(tl.pointer_type(tl.bfloat16))
    # (col - 448 is 0..63 on tile 7; other tiles are masked off)
    rope_off = ((data_base + _DIM_NOPE) >> 1)[:, None, None] + (col - _DIM_NOPE)[None, :, :]
    rope = tl.load(pool_bf16 + rope_off, mask=tm3 & is_rope, other=0.0)

    # One contiguous 1024-byte row per token.
    out = tl.where(is_rope, rope, nope)
    tl.store(out_ptr + tok[:, None, None] * out_stride + col[None, :, :], out, mask=tm3)


# The kernels hard-code the layout; keep them honest if layout.py ever changes.
assert (DIM, DIM_NOPE, TILE, DATA_BYTES, SCALE_BYTES) == (512, 448, 64, 576, 8)
assert FP8_MAX == 448.0 and SCALE_EPS == 1e-8


# --------------------------------------------------------------------------- #
# Host side
# --------------------------------------------------------------------------- #
# triton.jit picks the interpreter at decoration time (TRITON_INTERPRET=1 at import).
INTERPRETED = not isinstance(_kv_quant_kernel, triton.runtime.jit.JITFunction)




def _check_device(t: torch.Tensor, native_fp8: bool) -> None:
    if t.device.type == "cpu":
        if not INTERPRETED:
            raise ArgumentError("Triton KV-cache kernels need CUDA tensors "
                             "(CPU tensors only when imported with TRITON_INTERPRET=1)")
        return
    if native_fp8 and t.device.type == "cuda" and torch.version.hip is None:
        cc = _capability(t.device)
        if cc < (8, 9):
            raise UnsupportedDeviceError(
                f"native-fp8 KV kernels need compute capability >= 8.9 (device has {cc[0]}.{cc[1]}); "
                "use kv_quant_u8 / kv_dequant_u8"
            )


def _launch_quant(k, pool, loc, page_size, native_fp8, checks):
    k, u8, loc = check_quant_args(k, pool, loc, page_size, checks)
    n = k.shape[0]
    if checks:
        _check_device(u8, native_fp8)
    if n == 0:
        return
    dst = u8.view(torch.float8_e4m3fn) if native_fp8 else u8
    T = QUANT_TOKENS_PER_PROG
    with on_device(u8.device):
        _kv_quant_kernel[(cdiv(n, T),)](
            k, dst, loc, n, k.stride(0),
            PAGE_SIZE=page_size, BYTES_PER_PAGE=u8.shape[1],
            NATIVE_FP8=native_fp8, TOKENS=T, num_warps=QUANT_NUM_WARPS,
        )


def _launch_dequant(pool, token_ids, page_size, out, native_fp8, checks):
    u8, ids, out = check_dequant_args(pool, token_ids, page_size, out, checks)
    n = ids.shape[0]
    if checks:
        _check_device(u8, native_fp8)
    if out is None:
        out = torch.empty((n, 1, DIM), dtype=torch.bfloat16, device=u8.device)
    if n == 0:
        return out
    src = u8.view(torch.float8_e4m3fn) if native_fp8 else u8
    T = DEQUANT_TOKENS_PER_PROG
    with on_device(u8.device):
        _kv_dequant_kernel[(cdiv(n, T),)](
            src, ids, out, n, out.stride(0),
            PAGE_SIZE=page_size, BYTES_PER_PAGE=u8.shape[1],
            NATIVE_FP8=native_fp8, TOKENS=T, num_warps=DEQUANT_NUM_WARPS,
        )
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
from .ops import kv_dequant_op, kv_quant_op  # noqa: E402

op_kv_quant_fp8 = kv_quant_op("triton_fp8", kv_quant_fp8)
op_kv_quant_u8 = kv_quant_op("triton_u8", kv_quant_u8)
op_kv_dequant_fp8 = kv_dequant_op("triton_fp8", kv_dequant_fp8)
op_kv_dequant_u8 = kv_dequant_op("triton_u8", kv_dequant_u8)


# Types of each kernel's runtime arguments (uint8 pool; the native variant passes it as
# *fp8e4nv): what an offline compile for a GPUTarget needs (backends/compile_matrix.py).
COMPILE_SIGNATURES = {
    "_kv_quant_kernel": {"k_ptr": "*bf16", "pool_ptr": "*u8", "loc_ptr": "*i64", "n_tokens": "i32",
                         "k_stride": "i32"},
    "_kv_dequant_kernel": {"pool_ptr": "*u8", "ids_ptr": "*i32", "out_ptr": "*bf16", "n_tokens": "i32",
                           "out_stride": "i32"},
}

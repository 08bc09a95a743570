"""@triton.jit number codecs shared by the kernels: e4m3fn encode/decode with integer
operations (no fp8 type, so they build for SM80/SM86, where Triton rejects fp8e4nv),
UE8M0 scale bytes, and round-to-nearest-even to bf16 for the interpreter.

Load through ``env.jit_module("codec")`` (see there), never by a plain import.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["f32_to_e4m3fn_bits", "e4m3fn_bits_to_f32", "e4m3fn_bits_to_f16", "ue8m0_to_f32", "round_bf16"]


@triton.jit
def f32_to_e4m3fn_bits(y):
    """float32 with |y| <= 448 -> e4m3fn code (int32, 0..255), round-to-nearest-even.

    Exact for every such float32, subnormal codes and the carry into the next
    binade included; 448 -> 0x7E; the sign of zero is kept. |y| > 448 and
    non-finite y are out of contract (callers never produce them).

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
def _e4m3fn_as_f16_bits(c):
    """The float16 bits (int32) whose value is int32 e4m3fn code C's value times 2**-8.

    The code's 7 magnitude bits placed at bit 7 of a float16 (5-bit exponent, bias
    15 = 7 + 8) give that for normals and subnormals alike. The sign goes in with bit
    operations, never negation, which loses -0.0 in the Triton interpreter."""
    return ((c << 7) & 0x3F80) | ((c << 8) & 0x8000)


@triton.jit
def e4m3fn_bits_to_f32(c):
    """e4m3fn codes (integer tensor, 0..255) -> float32, exact for all 256 codes
    (float16 -> float32 is exact, subnormals included); 0x7F / 0xFF -> NaN, 0x80 -> -0.0."""
    c = c.to(tl.int32)
    v = _e4m3fn_as_f16_bits(c).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((c & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def e4m3fn_bits_to_f16(c):
    """e4m3fn codes (integer tensor, 0..255) -> float16, exact for every finite code
    (every e4m3fn value is a float16; times 256 is exact); 0x7F / 0xFF -> NaN."""
    c = c.to(tl.int32)
    v = _e4m3fn_as_f16_bits(c).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
    return tl.where((c & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def ue8m0_to_f32(b):
    """UE8M0 scale bytes (integer tensor) -> float32 2**(b - 127) from the exponent bits:
    byte 0 -> 0.0 and 255 -> inf, as the KV pool's torch reference decodes them."""
    return (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x):
    """float32 -> the nearest bf16 value (ties to even), still as float32; finite inputs.

    For the interpreter, whose float32 -> bf16 cast truncates: rounding first makes
    that cast exact, so interpreted results round like the GPU's cvt.rn.bf16."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)

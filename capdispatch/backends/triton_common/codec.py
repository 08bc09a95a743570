"""@triton.jit number codecs shared by the kernels: e4m3fn encode/decode with integer
operations (no fp8 type, so they build for SM80/SM86, where Triton rejects fp8e4nv),
UE8M0 scale bytes, and round-to-nearest-even to bf16 for the interpreter.

Load through ``env.jit_module("codec")`` (see there), never by a plain import.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["f32_to_e4m3fn_bits", "e4m3fn_bits_to_f32", "e4m3fn_bits_to_f16", "ue8m0_to_f32", "round_bf16",
           "e4m3fn_scaled_bf16_ptx", "E4M3FN_SCALED_BF16_PTX", "ue8m0_to_bf16", "e4m3fn_bits_to_bf16_scaled"]


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


def e4m3fn_scaled_bf16_ptx() -> str:
    """PTX of the direct decode: four e4m3fn bytes (one 32-bit register, $2) and their four
    bf16 scales (two bf16x2 registers, $3 = values 0-1, $4 = values 2-3) -> the four scaled
    bf16 values ($0 = values 0-1, $1 = values 2-3). Each value depends on its own byte and
    scale only, so it is exact whichever four values Triton's layout packs together.

    Per pair, prmt puts each byte in the low half of a 16-bit lane with its top bit
    replicated in the high half; a 4-bit left shift and a mask leave the sign at bit 15 and
    the 7 magnitude bits at bits 10..4: that bf16 is the e4m3 value times 2**-120 (normals
    and subnormals alike: exponent field 0 is the subnormal range of both formats). Then
    fma.rn.bf16x2 (no flush of subnormal inputs or results) times 2**120 (exact) and
    times the scale (one rounding of the exact product, as the float32 product and a bf16
    cast give); the -0.0 addend keeps the sign of zero products. NaN codes (0x7F, 0xFF:
    low 7 bits all ones) are found on the four bytes at once (those 7 bits + 1 carry into
    bit 7 of their byte, never further); prmt replicates that bit over the lane, and
    OR-ing 0x7FC0 there makes the value NaN (ptxas folds the mask and the OR into one
    LOP3). The OR comes after the fmas: compiled for the H200's 64 x 64 tile (sm_90a,
    Triton 3.9) this order gives a 2406-instruction main loop and 1548 B of spills, the
    OR before the fmas 2523 and 2096 B."""
    lines = ["{", ".reg .b32 p, n, m, c120, nz;", "mov.b32 c120, 0x7B807B80;", "mov.b32 nz, 0x80008000;",
             "and.b32 n, $2, 0x7F7F7F7F;", "add.u32 n, n, 0x01010101;"]
    for out, sel, nan_sel, scale in (("$0", "0x9180", "0x9988", "$3"), ("$1", "0xB3A2", "0xBBAA", "$4")):
        lines += [f"prmt.b32 p, $2, 0, {sel};", "shl.b32 p, p, 4;", "and.b32 p, p, 0x87F087F0;",
                  "fma.rn.bf16x2 p, p, c120, nz;", f"fma.rn.bf16x2 p, p, {scale}, nz;",
                  f"prmt.b32 m, n, 0, {nan_sel};", "and.b32 m, m, 0x7FC07FC0;", f"or.b32 {out}, p, m;"]
    return "\n".join(lines + ["}"])


E4M3FN_SCALED_BF16_PTX = tl.constexpr(e4m3fn_scaled_bf16_ptx())


@triton.jit
def ue8m0_to_bf16(b):
    """UE8M0 scale bytes (integer tensor) -> bf16 2**(b - 127), exact (bf16 has float32's
    exponent range): byte 0 -> 0.0 and 255 -> inf, as ue8m0_to_f32."""
    return (b.to(tl.int32) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e4m3fn_bits_to_bf16_scaled(c, scale):
    """uint8 e4m3fn codes and a bf16 scale tensor of their shape -> bf16 code value x scale,
    rounded once: bit for bit what e4m3fn_bits_to_f32(c) * scale (float32) -> bf16 gives,
    for all 256 codes (NaN for 0x7F / 0xFF). PTX (GPU only): e4m3fn_scaled_bf16_ptx."""
    return tl.inline_asm_elementwise(E4M3FN_SCALED_BF16_PTX, "=r,=r,r,r,r", [c, scale], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)

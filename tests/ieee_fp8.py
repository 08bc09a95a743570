"""Pure-Python IEEE-style float8 e4m3fn reference (no torch, no numpy: struct/math only).

e4m3fn ("fn" = finite, NaN-only): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
bits; no infinities; the only NaN codes are 0x7F and 0xFF; max finite 448 (0x7E);
subnormals m * 2**-9; 0x80 is -0.0.

Also small helpers to move between Python floats and float32 / bfloat16 bit
patterns, used by the KV-cache tests.
"""

from __future__ import annotations

import math
import struct

E4M3_MAX = 448.0
E4M3_NAN_CODES = (0x7F, 0xFF)


def decode(code: int) -> float:
    """Value of the e4m3fn ``code`` (0..255) as a Python float (NaN for 0x7F/0xFF)."""
    if not 0 <= code <= 0xFF:
        raise ValueError(f"code out of range: {code}")
    sign = -1.0 if code & 0x80 else 1.0
    exp = (code >> 3) & 0xF
    man = code & 0x7
    if exp == 0xF and man == 0x7:
        return math.copysign(math.nan, sign)
    if exp == 0:
        mag = math.ldexp(man, -9)  # subnormal: m * 2**-9
    else:
        mag = math.ldexp(8 + man, exp - 7 - 3)  # (1 + m/8) * 2**(e-7)
    return math.copysign(mag, sign)


def encode(x: float, saturate: bool = True) -> int:
    """e4m3fn code of ``x`` with round-to-nearest-even.

    ``saturate=True`` clamps finite overflow (and +-inf) to +-448, like the KV
    cache's ``clamp(x, -448, 448)`` before the cast. With ``saturate=False``
    anything that rounds past 448 becomes NaN (0x7F | sign). NaN -> 0x7F | sign.
    The sign of zero is kept (-0.0 -> 0x80).
    """
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    if math.isnan(x):
        return sign | 0x7F
    a = abs(x)
    if a >= math.ldexp(1.0, -6):
        if math.isinf(a):
            return sign | (0x7E if saturate else 0x7F)
        mant, e2 = math.frexp(a)  # a = mant * 2**e2, mant in [0.5, 1)
        exp = e2 - 1  # a = (2 * mant) * 2**exp, 2 * mant in [1, 2)
        q = round(mant * 16)  # 8..16: 1.mmm * 8; exact scaling, round() is half-even
        if q == 16:  # mantissa carry
            q, exp = 8, exp + 1
        code = ((exp + 7) << 3) | (q - 8)
        if exp + 7 > 15 or code > 0x7E:
            return sign | (0x7E if saturate else 0x7F)
        return sign | code
    # Subnormal range: multiples of 2**-9; q == 8 is the smallest normal (0x08).
    q = round(math.ldexp(a, 9))
    return sign | q


# --------------------------------------------------------------------------- #
# float32 / bfloat16 bit helpers
# --------------------------------------------------------------------------- #
def f32_bits(x: float) -> int:
    """float32 bit pattern of ``x`` (rounded to float32 by struct)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def to_f32(x: float) -> float:
    """Round a Python float to float32 (RNE) and back."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bf16_bits(x: float) -> int:
    """bfloat16 bit pattern of ``x``: float32 first, then round-to-nearest-even on the low 16 bits.

    NaN keeps its sign and is made quiet (0x7FC0 | sign); callers compare NaNs by class.
    """
    b = f32_bits(x)
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return ((b >> 16) & 0x8000) | 0x7FC0
    b += 0x7FFF + ((b >> 16) & 1)
    return (b >> 16) & 0xFFFF


def bf16_from_bits(bits: int) -> float:
    return f32_from_bits((bits & 0xFFFF) << 16)


def is_nan_bf16_bits(bits: int) -> bool:
    return (bits & 0x7FFF) > 0x7F80


def ue8m0_scale_exponent(amax: float, eps: float = 1e-8) -> int:
    """Smallest integer e with 448 * 2**e >= max(amax, eps), i.e. the exact
    ceil(log2(max(amax, eps) / 448)) for finite amax (exact comparisons, no log2)."""
    a = max(amax, to_f32(eps))  # eps is a float32 constant in every backend
    e = math.frexp(a)[1] - 9
    while math.ldexp(E4M3_MAX, e) < a:
        e += 1
    while math.ldexp(E4M3_MAX, e - 1) >= a:
        e -= 1
    return e

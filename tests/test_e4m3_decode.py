"""The uint8 codec's direct e4m3fn -> bf16 decode (triton_common/codec.py: the PTX of
``e4m3fn_scaled_bf16_ptx``; triton_common/v4_rows.py: ``load_rows_direct``) bit for bit
against torch's float8_e4m3fn -> float32, times the UE8M0 scale, -> bfloat16 (what
kv_dequant computes).

Three levels, none needing a GPU except the last:

* the PTX itself, run by a small emulator of the instructions it uses (below: each
  instruction's PTX ISA semantics on numpy uint32 words; an instruction it does not know
  fails the test): all 256 codes x all 256 scale bytes in each of the four places of a
  packed word, the other three places random and checked too, so each value is shown to
  depend only on its own byte and scale. Triton packs whichever four values of a thread
  its layout puts next to each other (on the 8-warp decode tiles: tiles t and t + 4 of two
  rows; docs/ops/sparse_attention.md), so that independence is what makes the decode exact
  on every tile;
* under the interpreter: the emulated path of ``load_rows_direct`` (the same bf16
  placement, times 2**120 and the scale, one rounding) against ``load_rows`` and
  kv_dequant on fresh random pool bytes with every code, NaN codes included; and the
  attention kernel with the direct decode on the 64-head tiles (tables_as on the CPU),
  one valid entry per token so the output is the decoded row;
* offline: the kernel with the direct decode built for sm_80, sm_86, sm_90a and sm_120a;
* ``gpu``: the same row kernel with the PTX (the compiled layout), and
  tests/test_decode_mla.py::test_gpu_pool_decode_exact with the direct tables.
"""
from __future__ import annotations

import functools
import os
import re
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from triton_env import HAS_CUDA, INTERPRET, _triton_interpreter  # noqa: E402,F401 (autouse fixture)
from attention_checks import new_seed, v4_pool  # noqa: E402

from capdispatch.backends.kv_cache import reference as KV  # noqa: E402
from capdispatch.backends import v4_layout as L  # noqa: E402


# --------------------------------------------------------------------------- #
# Reference: torch's own conversions
# --------------------------------------------------------------------------- #
def _ref_bits(codes: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits of e4m3fn(codes) x 2**(scale_byte - 127) as kv_dequant computes it
    (float32 product, one cast to bf16); scale byte 0 is 0.0, 255 is inf."""
    v = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).float()
    s = torch.from_numpy(scale_bytes.astype(np.int32) << 23).view(torch.float32)
    return (v * s).bfloat16().view(torch.int16).numpy().view(np.uint16)


def _is_nan_bits(b: np.ndarray) -> np.ndarray:
    return ((b & 0x7F80) == 0x7F80) & ((b & 0x007F) != 0)


def _is_subnormal_bits(b: np.ndarray) -> np.ndarray:
    return ((b & 0x7F80) == 0) & ((b & 0x007F) != 0)


# --------------------------------------------------------------------------- #
# A PTX emulator for the instructions the decode uses (PTX ISA semantics)
# --------------------------------------------------------------------------- #
def _bf16_round(x: np.ndarray) -> np.ndarray:
    """float64 values -> uint16 bf16 bits, round to nearest even, subnormals kept, past the
    largest finite bf16 -> inf (IEEE 754; fma.rn.bf16x2 rounds once, no flush)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros(x.shape, dtype=np.uint16)
    nan = np.isnan(x)
    out[nan] = 0x7FFF                       # canonical NaN (payload not compared)
    fin = np.isfinite(x)
    a = np.abs(np.where(fin, x, 0.0))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    q = np.exp2(np.maximum(e, -126.0) - 7.0)           # bf16 spacing at that binade
    r = np.rint(a / q) * q                             # rint: ties to even
    over = r >= 2.0 ** 128
    with np.errstate(over="ignore"):
        f32 = r.astype(np.float32)                     # exact on the bf16 grid (inf past it: replaced)
    bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
    bits = np.where(over, np.uint16(0x7F80), bits)
    bits = np.where(fin & ~nan, bits, out)
    bits = np.where(np.isinf(x), np.uint16(0x7F80), bits)
    sign = np.signbit(x) & ~nan
    return np.where(sign, bits | np.uint16(0x8000), bits).astype(np.uint16)


def _bf16_value(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _lanes(w):
    return (w & np.uint32(0xFFFF)).astype(np.uint16), (w >> np.uint32(16)).astype(np.uint16)


def _fma_bf16x2(a, b, c):
    """fma.rn.bf16x2: per 16-bit lane a * b + c rounded once. The decode's addend is -0.0;
    a bf16 x bf16 product is exact in float64, so with a zero addend float64 then one
    rounding is the fused result (another addend fails closed)."""
    out = []
    for la, lb, lc in zip(_lanes(a), _lanes(b), _lanes(c)):
        assert np.all((lc & 0x7FFF) == 0), "emulated fma.rn.bf16x2 takes a zero addend only"
        va, vb, vc = _bf16_value(la), _bf16_value(lb), _bf16_value(lc)
        with np.errstate(invalid="ignore", over="ignore"):
            out.append(_bf16_round(va * vb + vc))
    return out[0].astype(np.uint32) | (out[1].astype(np.uint32) << np.uint32(16))


def _prmt(a, b, sel: int):
    """prmt.b32 (default mode): byte i of the result is byte sel[i] & 7 of {b, a}, or with
    sel[i] & 8 that byte's top bit replicated over the byte."""
    src = [(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)] + \
          [(b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = src[s & 7]
        if s & 8:
            byte = np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
        out |= byte << np.uint32(8 * i)
    return out


_STMT = re.compile(r"^([a-z0-9.]+)\s+(.*?);?$")


def run_ptx(ptx: str, inputs: dict) -> dict:
    """Run the decode's PTX block on uint32 arrays: INPUTS maps "$2".. to arrays; returns
    every register. Only the instructions below are known; anything else fails the test."""
    regs = {k: np.asarray(v, dtype=np.uint32) for k, v in inputs.items()}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", tok):
            return np.uint32(int(tok, 0))
        raise AssertionError(f"PTX operand {tok!r} is read before it is written")

    body = ptx.strip()
    assert body.startswith("{") and body.endswith("}"), body
    for line in body[1:-1].split("\n"):
        line = line.strip()
        if not line:
            continue
        if line.startswith(".reg .b32"):
            continue
        m = _STMT.match(line)
        assert m, f"cannot read PTX statement {line!r}"
        opc, args = m.group(1), [t.strip() for t in m.group(2).split(",")]
        dst = args[0]
        with np.errstate(over="ignore"):
            if opc == "mov.b32":
                r = np.broadcast_to(val(args[1]), next(iter(inputs.values())).shape).astype(np.uint32)
            elif opc == "and.b32":
                r = val(args[1]) & val(args[2])
            elif opc == "or.b32":
                r = val(args[1]) | val(args[2])
            elif opc == "add.u32":
                r = (np.asarray(val(args[1])).astype(np.uint64) + np.asarray(val(args[2])).astype(np.uint64)) \
                    & np.uint64(0xFFFFFFFF)
            elif opc == "shl.b32":
                r = (np.asarray(val(args[1])).astype(np.uint64) << np.uint64(int(args[2]))) & np.uint64(0xFFFFFFFF)
            elif opc == "prmt.b32":
                r = _prmt(val(args[1]), val(args[2]), int(args[3], 0))
            elif opc == "fma.rn.bf16x2":
                r = _fma_bf16x2(val(args[1]), val(args[2]), val(args[3]))
            else:
                raise AssertionError(f"the emulator does not know PTX {opc!r}: teach it before trusting the test")
        regs[dst] = np.asarray(r).astype(np.uint32)
    return regs


@functools.lru_cache(maxsize=None)
def _ptx() -> str:
    from capdispatch.backends.triton_common.codec import e4m3fn_scaled_bf16_ptx
    return e4m3fn_scaled_bf16_ptx()


def _scale_bf16_bits(sb: np.ndarray) -> np.ndarray:
    """What codec.ue8m0_to_bf16 computes: the byte in the bf16 exponent field."""
    return (sb.astype(np.uint32) << 7).astype(np.uint16)


def _decode_words(codes4: np.ndarray, scales4: np.ndarray, ptx: str | None = None) -> np.ndarray:
    """Run the PTX on [n, 4] code bytes and scale bytes -> [n, 4] bf16 bits (the places in
    a packed word in Triton's order: byte k of $2, bf16 k % 2 of $3 (k < 2) or $4)."""
    w = sum(codes4[:, k].astype(np.uint32) << np.uint32(8 * k) for k in range(4))
    s = _scale_bf16_bits(scales4).astype(np.uint32)
    regs = run_ptx(ptx or _ptx(), {"$2": w, "$3": s[:, 0] | (s[:, 1] << np.uint32(16)),
                            "$4": s[:, 2] | (s[:, 3] << np.uint32(16))})
    lo0, hi0 = _lanes(regs["$0"])
    lo1, hi1 = _lanes(regs["$1"])
    return np.stack([lo0, hi0, lo1, hi1], axis=1)


def _assert_bits_equal(got, want, what):
    got, want = np.asarray(got, dtype=np.uint16), np.asarray(want, dtype=np.uint16)
    gn, wn = _is_nan_bits(got), _is_nan_bits(want)
    bad = (gn != wn) | (~gn & (got != want))
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} values differ; first at {tuple(i)}: "
                             f"got 0x{int(got[tuple(i)]):04x}, want 0x{int(want[tuple(i)]):04x}")


def test_emulator_knows_the_instructions_and_fails_closed():
    """The emulator's own checks: prmt's sign replication and byte choice, the fma's single
    rounding (ties to even, subnormal results, overflow to inf), and an unknown instruction
    or a non-zero fma addend refused."""
    a = np.array([0x80FF017F], dtype=np.uint32)
    assert int(_prmt(a, np.uint32(0), 0x9180)[0]) == 0x0001007F   # byte0 0x7F, sign 0x00 | byte1 0x01, sign 0x00
    assert int(_prmt(a, np.uint32(0), 0xB3A2)[0]) == 0xFF80FFFF   # byte2 0xFF, sign 0xFF | byte3 0x80, sign 0xFF
    one, half_ulp = 0x3F80, 0x3B80                                # 1.0, 2**-8 (half an ulp of 1.0)
    assert _bf16_round(np.array([1.0 + 2.0 ** -8]))[0] == one                      # tie -> even
    assert _bf16_round(np.array([1.0 + 3 * 2.0 ** -8]))[0] == 0x3F82               # tie -> even (up)
    assert _bf16_round(np.array([2.0 ** -133]))[0] == 0x0001                        # smallest subnormal
    assert _bf16_round(np.array([2.0 ** -135]))[0] == 0x0000                        # below half of it
    assert _bf16_round(np.array([-(2.0 ** 128)]))[0] == 0xFF80                      # overflow -> -inf
    assert _bf16_round(np.array([-0.0]))[0] == 0x8000
    w = np.array([one | (one << 16)], dtype=np.uint32)
    h = np.array([half_ulp | (half_ulp << 16)], dtype=np.uint32)
    nz = np.array([0x80008000], dtype=np.uint32)
    assert int(_fma_bf16x2(w, h, nz)[0]) == (half_ulp | (half_ulp << 16))
    with pytest.raises(AssertionError, match="zero addend"):
        _fma_bf16x2(w, h, w)
    with pytest.raises(AssertionError, match="does not know"):
        run_ptx("{\nsub.u32 $0, $2, 1;\n}", {"$2": np.zeros(1)})


def test_ptx_decode_is_exact_for_every_code_and_scale_in_every_place():
    """All 256 codes x all 256 scale bytes (NaN codes, subnormal codes, signed zeros, scale
    0.0 and inf, bf16 subnormal and overflowing products) in each place k of the packed
    word; the other three places carry fresh random codes and scales and are checked too,
    so no value depends on its neighbours' bytes or scales."""
    _exhaustive(seed=new_seed())


def _exhaustive(ptx=None, seed=0):
    rng = np.random.default_rng(seed)
    code, scale = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    code, scale = code.ravel(), scale.ravel()
    for k in range(4):
        codes4 = rng.integers(0, 256, (code.size, 4))
        scales4 = rng.integers(0, 256, (code.size, 4))
        codes4[:, k], scales4[:, k] = code, scale
        _assert_bits_equal(_decode_words(codes4, scales4, ptx), _ref_bits(codes4, scales4), f"place {k} seed={seed}")


def _sub(old, new):
    """A mutation of the PTX: OLD (which must be in it) replaced by NEW."""
    def mutate(ptx):
        assert old in ptx, f"mutation {old!r} no longer applies to the PTX"
        return ptx.replace(old, new)
    return mutate


@pytest.mark.parametrize("broken", [
    pytest.param(_sub("0x7FC07FC0", "0x00000000"), id="no-nan-codes"),  # 0x7F / 0xFF -> +-480 x scale
    pytest.param(_sub("0x87F087F0", "0x07F007F0"), id="no-sign"),
    pytest.param(_sub("shl.b32 p, p, 4", "shl.b32 p, p, 3"), id="shift-3"),
    pytest.param(_sub("p, p, $4, nz", "p, p, $3, nz"), id="one-scale-word-per-pack"),
    pytest.param(_sub("0xB3A2", "0x9180"), id="pair-0-twice"),
    pytest.param(_sub("mov.b32 nz, 0x80008000", "mov.b32 nz, 0x00000000"), id="plus-zero-addend"),
])
def test_exactness_check_catches_broken_decodes(broken):
    """The exhaustive check fails for decodes that are wrong in one way each: NaN codes
    not made NaN (what a decode without the NaN step gives: +-480 x the scale), the sign
    lost, a shift of the wrong width, one scale word for the whole pack, the first pair
    decoded twice, a +0.0 addend (-0.0 products come out +0.0)."""
    with pytest.raises(AssertionError, match="values differ"):
        _exhaustive(broken(_ptx()))


def test_ptx_decode_nan_codes_and_zero_signs():
    """0x7F and 0xFF are NaN under every scale, 0x00 / 0x80 are +0 / -0 under every finite
    scale (the -0.0 addend keeps the sign of a zero product), and code x inf is +-inf."""
    codes4 = np.array([[0x7F, 0xFF, 0x00, 0x80]] * 256)
    scales4 = np.repeat(np.arange(256)[:, None], 4, axis=1)
    got = _decode_words(codes4, scales4)
    assert _is_nan_bits(got[:, :2]).all()
    assert (got[:255, 2] == 0x0000).all() and (got[:255, 3] == 0x8000).all()
    assert _is_nan_bits(got[255, 2:]).all()                       # 0 x inf
    one = _decode_words(np.array([[0x38, 0xB8, 0x7E, 0x01]]), np.array([[127, 127, 255, 0]]))
    assert one.tolist() == [[0x3F80, 0xBF80, 0x7F80, 0x0000]]     # 1.0, -1.0, 448 x inf, 2**-9 x 0


# --------------------------------------------------------------------------- #
# The row loader under the interpreter (and its PTX on a GPU)
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=None)
def _rows_kernel(interpreted: bool):
    """tests/e4m3_rows.py's kernel, loaded when first asked for under the test's
    TRITON_INTERPRET (so built for the interpreter or for the card), once per way."""
    import importlib.util
    import triton
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e4m3_rows.py")
    spec = importlib.util.spec_from_file_location(f"e4m3_rows_{'interpreted' if interpreted else 'compiled'}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (not isinstance(mod.rows_kernel, triton.runtime.jit.JITFunction)) == interpreted
    return mod.rows_kernel


def _random_pool(gen, pages, ps, *, nan_codes: bool):
    """A pool of fresh random bytes: every code (NaN codes too with NAN_CODES) in every row,
    random scale bytes with, in every row, one tile whose products are bf16 subnormals
    (bytes 1-8) and one of scale 0.0, inf or 1.0; rope bf16 values with zeros and
    subnormals."""
    pool, _ = v4_pool(gen, pages, ps, "cpu")
    data, scales = KV._page_views(pool, ps)
    rows = pages * ps
    codes = torch.randint(0, 256, (rows, L.DIM_NOPE), generator=gen, dtype=torch.int32).to(torch.uint8)
    allc = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if not nan_codes:
        allc = allc[(allc.int() & 0x7F) != 0x7F]
        codes[(codes.int() & 0x7F) == 0x7F] = 0x7E
    codes[:, :len(allc)] = allc[torch.randperm(len(allc), generator=gen)]
    data[..., :L.DIM_NOPE] = codes.view(pages, ps, L.DIM_NOPE)
    sb = torch.randint(0, 256, (rows, L.NUM_TILES), generator=gen, dtype=torch.int32)
    r = torch.arange(rows)
    sb[r, r % L.NUM_TILES] = torch.randint(1, 9, (rows,), generator=gen, dtype=torch.int32)  # subnormal products
    sb[r, (r + 3) % L.NUM_TILES] = torch.tensor([0, 255, 127])[r % 3].int()                # 0.0, inf, 1.0
    sb = sb.to(torch.uint8)
    scales[..., :L.NUM_TILES] = sb.view(pages, ps, L.NUM_TILES)
    rope = torch.randn(rows, L.DIM_ROPE, generator=gen).bfloat16()
    rope[:, :4] = torch.tensor([0.0, -0.0, 1e-39, -3e-39]).bfloat16()
    data[..., L.DIM_NOPE:] = rope.view(torch.uint8).view(pages, ps, 2 * L.DIM_ROPE)
    return pool


def _rows_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str, zero_signs: bool = True):
    """Bit for bit (NaN as NaN); without ZERO_SIGNS as values (-0.0 == +0.0)."""
    g, w = got.view(torch.int16).numpy().view(np.uint16), want.view(torch.int16).numpy().view(np.uint16)
    if not zero_signs:
        g, w = np.where(g == 0x8000, 0, g), np.where(w == 0x8000, 0, w)
    _assert_bits_equal(g, w, what)


def _run_rows(pool, ids, ps, direct: bool, device: str):
    out = torch.full((ids.numel(), 512), float("nan"), dtype=torch.bfloat16, device=device)
    k = _rows_kernel(INTERPRET)
    block = 4
    k[(-(-ids.numel() // block),)](pool.to(device), ids.to(device), out, ids.numel(),
                                   PAGE_SIZE=ps, BYTES_PER_PAGE=pool.shape[1], DIRECT=direct,
                                   EMULATE=INTERPRET, BLOCK=block)
    return out.cpu()


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's emulated decode")
def test_interpreted_direct_rows_match_kv_dequant_bit_for_bit():
    """Fresh random pool bytes, NaN codes included: the direct loader's rows (emulated
    path) are kv_dequant's bit for bit (NaN as NaN, zeros with their signs, bf16
    subnormal products). (The float32 loader is compared on the GPU only: under the
    interpreter its bf16 cast is wrong for bf16 subnormals, see the next test.)"""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    ps, pages = 8, 3
    pool = _random_pool(gen, pages, ps, nan_codes=True)
    ids = torch.randperm(pages * ps, generator=gen)[:10].int()
    want = KV.kv_dequant(pool, ids, ps)[:, 0]
    direct = _run_rows(pool, ids, ps, True, "cpu")
    _rows_bits_equal(direct, want, f"direct seed={seed}")
    bits = want.view(torch.int16).numpy().view(np.uint16)
    assert _is_nan_bits(bits).any() and _is_subnormal_bits(bits[:, :L.DIM_NOPE]).any()   # both reached it


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's cast")
def test_interpreter_bf16_cast_of_subnormals_is_still_wrong():
    """Why the emulated decode converts to bf16 by its bits: Triton's interpreter casts
    float32 values in bf16's subnormal range to wrong bf16 values (2**-127 -> 0.0, not the
    subnormal 0x0040), while the GPU's cvt.rn.bf16 is exact. The float32 loader's rows
    under the interpreter differ from kv_dequant there (the GPU test compares them). If
    this starts failing, the interpreter was fixed and the bit conversion can go."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    ps, pages = 8, 3
    pool = _random_pool(gen, pages, ps, nan_codes=False)
    ids = torch.randperm(pages * ps, generator=gen)[:10].int()
    want = KV.kv_dequant(pool, ids, ps)[:, 0].view(torch.int16).numpy().view(np.uint16)
    got = _run_rows(pool, ids, ps, False, "cpu").view(torch.int16).numpy().view(np.uint16)
    sub = _is_subnormal_bits(want)
    _assert_bits_equal(got[~sub], want[~sub], f"outside bf16's subnormals, seed={seed}")
    assert (got[sub] != want[sub]).any(), f"seed={seed}: the interpreter's bf16 cast of subnormals is exact now"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA device without TRITON_INTERPRET")
def test_gpu_direct_rows_match_kv_dequant_bit_for_bit():
    """The PTX on the card (the compiled layout packs the [BLOCK, 8, 64] tile's values its
    own way) against kv_dequant on fresh random pool bytes, NaN codes included."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    ps, pages = 64, 3
    pool = _random_pool(gen, pages, ps, nan_codes=True)
    ids = torch.randperm(pages * ps, generator=gen)[:150].int()
    want = KV.kv_dequant(pool.cuda(), ids.cuda(), ps)[:, 0].cpu()
    _rows_bits_equal(_run_rows(pool, ids, ps, True, "cuda"), want, f"direct seed={seed}")


# --------------------------------------------------------------------------- #
# The attention kernel with the direct decode on the 64-head tiles (interpreter)
# --------------------------------------------------------------------------- #
# Tiles the direct tables give 64 heads: the H200's 64 x 64 and the 99 KB cards' 64 x 16
# (8 warps), and the 32 x 16 one (8 warps) that a 64-head call runs as two head blocks.
_DIRECT_TILES = [dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1, DIRECT=True),
                 dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=1, DIRECT=True),
                 dict(BLOCK_H=32, BLOCK_N=16, num_warps=8, num_stages=1, DIRECT=True)]


def test_direct_tables_hold_the_tiles_tested_here():
    """Every decode entry of the direct candidate tables decodes directly, and the 64-head
    tiles of those tables are the ones the interpreter test below runs."""
    from capdispatch.backends.sparse_attention import launch_table as LT
    tiles = set()
    for table in (LT.CANDIDATE_TABLES["direct"][1], LT.CANDIDATE_TABLES_99KB["direct"][1]):
        for kind in ("decode", "decode_split"):
            for c in table[kind]:
                assert c.get("DIRECT") is True, c
                if c["BLOCK_H"] >= 32 and c["num_warps"] == 8:
                    tiles.add((c["BLOCK_H"], c["BLOCK_N"]))
        assert all("DIRECT" not in c for c in table["prefill"])
    assert tiles == {(t["BLOCK_H"], t["BLOCK_N"]) for t in _DIRECT_TILES}, tiles


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's emulated decode")
@pytest.mark.parametrize("cfg", _DIRECT_TILES, ids=lambda c: f"h{c['BLOCK_H']}n{c['BLOCK_N']}w{c['num_warps']}")
@pytest.mark.parametrize("splits", [1, 2], ids=lambda s: f"splits{s}")
def test_interpreted_direct_decode_on_64_head_tiles_is_the_pool_row(cfg, splits):
    """One valid entry per token, 64 heads: the output is the decoded row for every head,
    kv_dequant's bit for bit (as values: P x V turns -0.0 into +0.0), on fresh random pool bytes (every finite code in each row, random
    scale bytes 60-200, the rope's zeros). (Rows with NaN codes or bf16-subnormal values
    cannot be seen through the attention: a NaN key poisons the softmax, and the
    interpreter's output cast gets bf16 subnormals wrong; the row kernel above checks
    those bit for bit.)"""
    from test_decode_mla import _tk
    from capdispatch.backends.sparse_attention import kernels as K
    tk = _tk()
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    ps, tokens, h = 16, 2, 64
    pool = _random_pool(gen, 2, ps, nan_codes=False)
    data, scales = KV._page_views(pool, ps)
    scales[..., :L.NUM_TILES] = torch.randint(60, 201, scales[..., :L.NUM_TILES].shape, generator=gen,
                                              dtype=torch.int32).to(torch.uint8)
    rope = data[..., L.DIM_NOPE:].contiguous().view(torch.bfloat16)
    rope[..., 2:4] = torch.tensor([0.5, -2.0]).bfloat16()       # the subnormals out, the signed zeros kept
    data[..., L.DIM_NOPE:] = rope.view(torch.uint8)
    chosen = torch.randperm(2 * ps, generator=gen)[:tokens]
    idx = torch.full((tokens, 1, 32), -1, dtype=torch.int32)
    idx[torch.arange(tokens), 0, torch.randint(0, 32, (tokens,), generator=gen)] = chosen.int()
    q = (torch.randn(tokens, 1, h, 512, generator=gen) * 1e-3).bfloat16()
    want = KV.kv_dequant(pool, chosen.int(), ps)[:, 0]
    table = {k: (cfg,) for k in ("prefill", "decode", "decode_split")}
    with K.tables_as(f"direct test {cfg}", table, on_cpu=True):
        o, _ = tk._launch(q, pool, idx, ps, 1.0, None, None, None, None, None, None, None, False,
                          num_splits=splits)
    got = o[:, 0]
    assert torch.isfinite(want.float()).all(), f"seed={seed}"
    for head in range(h):
        _rows_bits_equal(got[:, head], want, f"{cfg} splits={splits} head {head} seed={seed}", zero_signs=False)


def test_direct_decode_compiles_for_every_target():
    """The direct decode's kernels build offline (ptxas included) for sm_80, sm_86 and sm_120a
    with the 99 KB tables' tiles and for sm_90a with the H200's, within each target's opt-in
    shared memory (fma.rn.bf16x2 and prmt exist from sm_80)."""
    pytest.importorskip("triton")
    from test_sparse_prefill import SMEM_OPTIN, compile_offline
    small = dict(BLOCK_H=32, BLOCK_N=16, num_warps=8, num_stages=1, DIRECT=True)
    big = dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1, DIRECT=True)
    jobs = [(80, 1, small, True, 4), (86, 1, small, True, 4), (120, 1, small, True), (90, 1, big, True)]
    for job, r in zip(jobs, compile_offline(jobs)):
        assert "error" not in r, (job, r)
        assert r["ptxas_rc"] == 0, (job, r["log"])
        assert r["regs"] <= 255 and r["shared"] <= SMEM_OPTIN[job[0]], (job, r)

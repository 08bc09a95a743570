"""KV-cache kernels (DeepSeek-V4 "V4" layout): torch reference and the Triton backends.

CPU (no CUDA): the torch backend runs on CPU and the Triton kernels run under the
Triton interpreter (TRITON_INTERPRET=1, set below before triton_kernels is
imported) at small sizes. With CUDA, the same tests also run on the GPU at larger
sizes (``gpu`` marker; skipped without CUDA by tests/conftest.py).

Every random test draws a fresh seed (``random.SystemRandom``) and puts it in its
assertion messages; set KV_TEST_SEED=<int> to replay one.

Interpreter caveats, measured (triton 3.9, see test_interpreter_fp8_cast_artefact):
  * ``tl.float32 -> tl.float8e4nv`` in the interpreter is not IEEE RNE: its numpy
    emulation (triton/runtime/interpreter.py ``_convert_float``) rounds ties away
    from zero, does not carry a mantissa overflow into the exponent (1.9375 ->
    0x38 = 1.0 and 0.484375 -> 0x28 = 0.25, i.e. errors of 2x, not one ulp), and
    truncates instead of rounding into the subnormal range (0.00146484375 -> 0x00
    instead of 0x01). So under the interpreter the native-fp8 quant pool is NOT
    byte-identical to torch; the test checks it against the interpreter's own cast
    of the same float32 values instead (all other bytes must match torch), and
    the fp8-quant accuracy tests are xfail(strict=True) there.
  * ``.to(tl.float32)`` on fp8 maps the NaN codes 0x7F/0xFF to +-480 in the
    interpreter, so native-fp8 NaN decoding is xfail(strict=True) there.
  * ``tl.float32 -> tl.bfloat16`` in the interpreter truncates and mishandles
    bf16-subnormal results; dequant outputs are exact bf16 values, so only scale
    bytes 3..9 (bf16-subnormal outputs, never produced by kv_quant, whose scale
    bytes are 92..247) are affected: xfail(strict=True) under the interpreter.
  All pass on a GPU. The integer (u8) codec is exact under the interpreter too.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import random
import sys

import pytest
import torch

# The interpreter's numpy emulation warns on inf*0 and NaN reductions in the test data.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

from triton_env import HAS_CUDA, INTERPRET, _triton_interpreter  # noqa: E402,F401 (autouse fixture)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ieee_fp8 as F  # noqa: E402

from capdispatch.backends import v4_layout as L  # noqa: E402
import v4_offsets as O  # noqa: E402
from capdispatch.backends.kv_cache import reference as R  # noqa: E402


def _has_native_fp8_cuda() -> bool:
    return HAS_CUDA and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)


_gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
_interp = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")
_no_interp_on_gpu = pytest.mark.skipif(INTERPRET, reason="GPU Triton run with TRITON_INTERPRET set")
_fp8_cc = pytest.mark.skipif(HAS_CUDA and not _has_native_fp8_cuda(), reason="native fp8 needs cc >= 8.9")

# (backend, device)
CASES = [
    pytest.param("torch", "cpu", id="torch-cpu"),
    pytest.param("triton_u8", "cpu", id="triton_u8-interp", marks=_interp),
    pytest.param("triton_fp8", "cpu", id="triton_fp8-interp", marks=_interp),
    pytest.param("torch", "cuda", id="torch-cuda", marks=_gpu),
    pytest.param("triton_u8", "cuda", id="triton_u8-cuda", marks=_gpu + [_no_interp_on_gpu]),
    pytest.param("triton_fp8", "cuda", id="triton_fp8-cuda", marks=_gpu + [_no_interp_on_gpu, _fp8_cc]),
]
TRITON_CASES = [c for c in CASES if c.values[0] != "torch"]


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=None)
def _tk():
    """triton_kernels, imported (inside a test, so under the interpreter fixture)."""
    import importlib

    from capdispatch.backends.kv_cache import triton_kernels

    if INTERPRET and not triton_kernels.INTERPRETED:  # imported earlier without the interpreter
        triton_kernels = importlib.reload(triton_kernels)
    return triton_kernels


def ops(backend):
    if backend == "torch":
        return R.kv_quant, R.kv_dequant
    tk = _tk()
    if backend == "triton_u8":
        return tk.kv_quant_u8, tk.kv_dequant_u8
    return tk.kv_quant_fp8, tk.kv_dequant_fp8


def interpreted(backend, device):
    return backend != "torch" and device == "cpu"


def tokens_per_prog():
    return max(_tk().QUANT_TOKENS_PER_PROG, _tk().DEQUANT_TOKENS_PER_PROG)


def n_tokens(device, small=3, large=257):
    """A token count that is not a multiple of the per-program token count."""
    T = tokens_per_prog() if (INTERPRET or HAS_CUDA) else 8
    blocks = small if device == "cpu" else large
    return blocks * T + (T // 2 + 1 if T > 1 else 0)


def new_seed():
    env = os.environ.get("KV_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def rand_k(n, gen, device):
    """bf16 K rows: nope = randn * 2**U[-24, 24] per (token, tile), never zero;
    rope = random bf16 bit patterns (NaN/inf/subnormal payloads too: copied raw)."""
    nope = torch.randn(n, L.NUM_TILES, L.TILE, generator=gen)
    nope *= torch.exp2(torch.randint(-24, 25, (n, L.NUM_TILES, 1), generator=gen).float())
    nope = nope.view(n, L.DIM_NOPE).bfloat16()
    nope[nope == 0] = 1.0
    rope = torch.randint(-(2**15), 2**15, (n, L.DIM_ROPE), generator=gen, dtype=torch.int16)
    return torch.cat([nope, rope.view(torch.bfloat16)], dim=1).to(device)


def carry_row(device):
    """A fixed K row whose RNE needs a mantissa carry / tie / subnormal rounding
    (tile amax 448 so values are encoded unscaled). Appended to random inputs so
    the interpreter's fp8-cast artefact is always exercised (deterministic xfail)."""
    row = torch.ones(L.DIM, dtype=torch.float32)
    row[:8] = torch.tensor([448.0, 1.9375, 0.484375, 1.0625, 0.00146484375, -1.9375, 15.5, 0.1])
    return row.bfloat16().to(device).unsqueeze(0)


def num_pages_for(n, page_size, spare=1.5):
    return max(2, math.ceil(n * spare / page_size) + 1)


def poisoned_pool(num_pages, page_size, device, byte):
    return torch.full((num_pages, L.bytes_per_page(page_size)), byte, dtype=torch.uint8, device=device)


def addressed_mask(pool, loc, page_size):
    """Bool mask of the pool bytes that kv_quant must write for slots ``loc``."""
    flat = torch.zeros(pool.numel(), dtype=torch.bool, device=pool.device)
    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    base = page * pool.shape[1]
    data = base + slot * L.DATA_BYTES
    scale = base + L.scale_offset(page_size) + slot * L.SCALE_BYTES
    flat[(data[:, None] + torch.arange(L.DATA_BYTES, device=pool.device)).flatten()] = True
    flat[(scale[:, None] + torch.arange(L.SCALE_BYTES, device=pool.device)).flatten()] = True
    return flat.view_as(pool)


def quant_checked(quant, k, loc, page_size, num_pages, msg):
    """Run ``quant`` on two pools poisoned with different bytes: every addressed byte
    must be written (both runs agree) and no other byte touched. Returns the pool."""
    pools = []
    for byte in (0xAB, 0x54):
        pool = poisoned_pool(num_pages, page_size, k.device, byte)
        assert quant(k, pool, loc, page_size) is None
        pools.append(pool)
    mask = addressed_mask(pools[0], loc, page_size)
    assert torch.equal(pools[0][mask], pools[1][mask]), f"{msg}: some addressed pool bytes were not written"
    assert bool((pools[0][~mask] == 0xAB).all()) and bool((pools[1][~mask] == 0x54).all()), (
        f"{msg}: pool bytes outside the addressed slots were modified"
    )
    return pools[0]


def dequant_checked(dequant, pool, ids, page_size, msg, out_stride=None):
    """Run ``dequant`` with ``out=`` poisoned twice (a NaN, then 0xABAB bits): every
    output element must be written (the runs agree). With ``out_stride`` the output
    is a strided view into a wider workspace whose other elements must stay
    untouched. Also checks the no-``out`` call returns the same values."""
    n = ids.shape[0]
    lead = 3 if out_stride else 0
    results = []
    for bits in (0x7FC1, -0x5455):
        width = out_stride or L.DIM
        ws = torch.full((n, 1, width), bits, dtype=torch.int16, device=pool.device).view(torch.bfloat16)
        out = ws[:, :, lead : lead + L.DIM]
        if out_stride:
            assert out.stride(0) == out_stride and not out.is_contiguous()
        res = dequant(pool, ids, page_size, out=out)
        assert res is out or res.data_ptr() == out.data_ptr(), f"{msg}: out= not returned"
        outside = torch.ones(ws.shape, dtype=torch.bool, device=ws.device)
        outside[:, :, lead : lead + L.DIM] = False
        assert bool((ws.view(torch.int16)[outside] == bits).all()), f"{msg}: wrote outside out="
        results.append(out.clone())
    a, b = (r.view(torch.int16) for r in results)
    nan_a, nan_b = (a & 0x7FFF) > 0x7F80, (b & 0x7FFF) > 0x7F80
    assert torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]), f"{msg}: some outputs not written"
    fresh = dequant(pool, ids, page_size)
    assert fresh.shape == (n, 1, L.DIM) and fresh.dtype == torch.bfloat16 and fresh.is_contiguous()
    assert_bf16_bits_equal(fresh, results[0], msg + " (out=None)")
    return results[0]


def bits16(t):
    return t.contiguous().view(torch.int16)


def assert_bf16_bits_equal(got, want, msg):
    """Bit equality of bf16 tensors; NaN matches any NaN (by class), signed zeros differ."""
    g, w = bits16(got).cpu(), bits16(want).cpu()
    gn, wn = (g & 0x7FFF) > 0x7F80, (w & 0x7FFF) > 0x7F80
    bad = (gn != wn) | (~wn & (g != w))
    if bool(bad.any()):
        idx = bad.nonzero()[:8].tolist()
        detail = [(i, hex(g[tuple(i)].item() & 0xFFFF), hex(w[tuple(i)].item() & 0xFFFF)) for i in idx]
        raise AssertionError(f"{msg}: {int(bad.sum())} bf16 mismatches (index, got, want): {detail}")


# Interpreter fp32 -> fp8e4nv cast probe ------------------------------------ #
@functools.lru_cache(maxsize=None)
def _interp_cast_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m).to(tl.float8e4nv), mask=m)

    return cast_kernel


def interp_fp8_cast(x):
    """float32 CPU tensor -> uint8 codes through the interpreter's tl.float8e4nv cast."""
    x = x.contiguous().float().flatten()
    y = torch.empty(x.numel(), dtype=torch.float8_e4m3fn)
    _interp_cast_kernel()[(max(1, -(-x.numel() // 1024)),)](x, y, x.numel(), BLOCK=1024)
    return y.view(torch.uint8)


def _around_codes():
    """Every e4m3 value, the midpoints between neighbours and quarter points, both signs."""
    vals = [F.decode(c) for c in range(0x7F)]
    xs = []
    for a, b in zip(vals[:-1], vals[1:]):
        xs += [a, (a + b) / 2, a + (b - a) / 4, a + 3 * (b - a) / 4]
    xs.append(vals[-1])
    return torch.tensor(xs + [-v for v in xs], dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def interp_cast_evidence():
    """(mismatching, total, examples) of interpreter cast vs IEEE RNE over _around_codes()."""
    x = _around_codes()
    got = interp_fp8_cast(x).tolist()
    want = [F.encode(v) for v in x.tolist()]
    bad = [(v, g, w) for v, g, w in zip(x.tolist(), got, want) if g != w]
    ex = [f"{v!r}->0x{g:02x} (IEEE 0x{w:02x})" for v, g, w in bad[:4]]
    return len(bad), len(want), ex


def xfail_if_interp_cast_broken(request, backend, device):
    if backend == "triton_fp8" and interpreted(backend, device):
        bad, total, ex = interp_cast_evidence()
        if bad:
            request.applymarker(pytest.mark.xfail(
                strict=True,
                reason=(f"Triton interpreter fp32->fp8e4nv cast is not RNE ({bad}/{total} probe values "
                        f"differ, e.g. {', '.join(ex)}); passes on GPU"),
            ))


# --------------------------------------------------------------------------- #
# Layout
# --------------------------------------------------------------------------- #
def test_layout_constants():
    assert (L.DIM_NOPE, L.DIM_ROPE, L.TILE, L.NUM_TILES) == (448, 64, 64, 7)
    assert (L.DATA_BYTES, L.SCALE_BYTES, L.TOKEN_BYTES) == (576, 8, 584)
    for p, want in [(1, 1152), (64, 37440), (256, 149760)]:
        got = L.bytes_per_page(p)
        assert got == want and got % 576 == 0 and got >= p * 584 and got - p * 584 < 576
    assert L.scale_offset(64) == 64 * 576
    assert O.token_data_offset(65, 64) == 37440 + 576
    assert O.token_scale_offset(65, 64) == 37440 + 64 * 576 + 8
    with pytest.raises(ValueError):
        L.bytes_per_page(0)
    assert "import torch" not in inspect.getsource(L)  # pure Python on purpose


def test_scale_exponent_formula_all_bf16():
    """The Triton kernels derive the UE8M0 exponent from the bits of amax
    (e = E - 8 + (M > 1.75)); the torch backend evaluates SGLang's float32
    ceil(log2(max(amax, 1e-8) / 448)). Both must agree for every finite bf16 amax."""
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)  # +0 .. max finite
    amax = bits.view(torch.bfloat16).float().clamp_min(L.SCALE_EPS)
    float_formula = torch.ceil(torch.log2(amax / L.FP8_MAX)).to(torch.int32)
    ab = amax.view(torch.int32)
    bit_formula = (ab >> 23) - (127 + 8) + ((ab & 0x7FFFFF) > 0x600000).to(torch.int32)
    assert torch.equal(float_formula, bit_formula)
    for i in range(0, amax.numel(), 97):  # exact pure-Python check on a sample
        assert F.ue8m0_scale_exponent(amax[i].item()) == bit_formula[i].item()
    assert int(bit_formula.min()) == -35 and int(bit_formula.max()) == 120  # bytes 92..247


# --------------------------------------------------------------------------- #
# Quantise -> dequantise
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("backend,device", CASES)
def test_roundtrip_error_bound(request, backend, device):
    xfail_if_interp_cast_broken(request, backend, device)
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    page_size = 64
    k = torch.cat([rand_k(n_tokens(device), gen, device), carry_row(device)])
    n = k.shape[0]
    num_pages = num_pages_for(n, page_size)
    loc = torch.randperm(num_pages * page_size, generator=gen)[:n].to(device)
    quant, dequant = ops(backend)

    pool = quant_checked(quant, k, loc, page_size, num_pages, msg)
    out = dequant_checked(dequant, pool, loc, page_size, msg)

    x = k[:, : L.DIM_NOPE].float().view(n, L.NUM_TILES, L.TILE)
    d = out[:, 0, : L.DIM_NOPE].float().view(n, L.NUM_TILES, L.TILE)
    sc = R._page_views(pool, page_size)[1][loc.long() // page_size, loc.long() % page_size]
    scale = torch.exp2(sc[:, : L.NUM_TILES].float() - 127).unsqueeze(-1)
    # e4m3: half-ulp relative 2**-4 for normals, absolute scale * 2**-10 in the subnormal range.
    bound = x.abs() * 2.0**-4 + scale * 2.0**-10
    err = (d - x).abs()
    assert bool(torch.isfinite(d).all()), msg
    worst = (err - bound).flatten().argmax()
    assert bool((err <= bound).all()), (
        f"{msg}: fp8 error bound exceeded, worst x={x.flatten()[worst].item()} "
        f"got={d.flatten()[worst].item()} scale={scale.expand_as(x).flatten()[worst].item()}"
    )
    assert bool(((d == 0) | (torch.sign(d) == torch.sign(x))).all()), f"{msg}: sign flipped"
    # Scales: exactly ceil(log2(amax/448)) + 127, pad byte 0.
    amax = x.abs().amax(-1).clamp_min(L.SCALE_EPS)
    want_sc = (torch.ceil(torch.log2(amax / L.FP8_MAX)) + 127).to(torch.uint8)
    assert torch.equal(sc[:, : L.NUM_TILES], want_sc), msg
    assert bool((sc[:, L.NUM_TILES] == 0).all()), f"{msg}: pad byte not 0"
    assert torch.equal(bits16(out[:, 0, L.DIM_NOPE :]), bits16(k[:, L.DIM_NOPE :])), f"{msg}: rope not bit-exact"


@pytest.mark.parametrize("backend,device", TRITON_CASES)
def test_quant_pool_identical_to_torch(backend, device):
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    page_size = 64
    k = torch.cat([rand_k(n_tokens(device), gen, device), carry_row(device)])
    n = k.shape[0]
    num_pages = num_pages_for(n, page_size)
    loc = torch.randperm(num_pages * page_size, generator=gen)[:n].to(device)

    want = quant_checked(R.kv_quant, k, loc, page_size, num_pages, msg + " (torch)")
    got = quant_checked(ops(backend)[0], k, loc, page_size, num_pages, msg)
    if not interpreted(backend, device) or backend == "triton_u8":
        assert torch.equal(got, want), f"{msg}: {(got != want).sum().item()} pool bytes differ from torch"
        return

    # Native fp8 under the interpreter: every byte except the fp8 nope codes must
    # match torch, and the codes must equal the interpreter's own float32->fp8e4nv
    # cast of the exact float32 values torch stages (x / 2**e). The remaining
    # difference to torch is the interpreter cast artefact, measured here.
    data_w, scale_w = R._page_views(want, page_size)
    data_g, scale_g = R._page_views(got, page_size)
    page, slot = loc.long() // page_size, loc.long() % page_size
    nope_mask = torch.zeros_like(got, dtype=torch.bool)
    R._page_views(nope_mask.view(torch.uint8), page_size)[0][page, slot, : L.DIM_NOPE] = True
    assert torch.equal(got[~nope_mask], want[~nope_mask]), f"{msg}: non-fp8 bytes differ from torch"
    x = k[:, : L.DIM_NOPE].float().view(n, L.NUM_TILES, L.TILE)
    staged = x / torch.exp2(scale_w[page, slot, : L.NUM_TILES].float() - 127).unsqueeze(-1)
    model = interp_fp8_cast(staged.clamp(-448, 448)).view(n, L.DIM_NOPE)
    codes = data_g[page, slot, : L.DIM_NOPE]
    assert torch.equal(codes, model), f"{msg}: fp8 codes differ from the interpreter cast model"
    differ = int((codes != data_w[page, slot, : L.DIM_NOPE]).sum())
    print(f"[interp evidence] {msg}: {differ}/{codes.numel()} fp8 codes differ from torch "
          f"(interpreter cast artefact); probe {interp_cast_evidence()}")


@pytest.mark.gpu
def test_torch_cuda_matches_cpu():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    k = rand_k(n_tokens("cuda"), gen, "cpu")
    n, page_size = k.shape[0], 256
    num_pages = num_pages_for(n, page_size)
    loc = torch.randperm(num_pages * page_size, generator=gen)[:n]
    cpu = quant_checked(R.kv_quant, k, loc, page_size, num_pages, f"cpu seed={seed}")
    gpu = quant_checked(R.kv_quant, k.cuda(), loc.cuda(), page_size, num_pages, f"cuda seed={seed}")
    assert torch.equal(cpu, gpu.cpu()), f"seed={seed}"
    assert_bf16_bits_equal(R.kv_dequant(gpu, loc.cuda(), page_size), R.kv_dequant(cpu, loc, page_size),
                           f"seed={seed}")


# --------------------------------------------------------------------------- #
# Decode: all 256 codes, scale bytes
# --------------------------------------------------------------------------- #
def _code_pool(device, page_size=4, loc=5):
    """A pool whose token ``loc`` holds the 256 e4m3 codes (then 0..191), scale byte 127."""
    num_pages = loc // page_size + 2
    pool = poisoned_pool(num_pages, page_size, device, 0xAB)
    codes = torch.cat([torch.arange(256), torch.arange(L.DIM_NOPE - 256)]).to(torch.uint8)
    data, scales = R._page_views(pool, page_size)
    data[loc // page_size, loc % page_size, : L.DIM_NOPE] = codes.to(device)
    scales[loc // page_size, loc % page_size] = torch.tensor([127] * 7 + [0], dtype=torch.uint8).to(device)
    return pool, codes, torch.tensor([loc], device=device)


def _want_code_bits(codes):
    return torch.tensor([F.bf16_bits(F.decode(int(c))) for c in codes], dtype=torch.int32).to(torch.int16)


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("which", ["finite", "nan"])
def test_decode_all_256_codes(request, backend, device, which):
    if which == "nan" and backend == "triton_fp8" and interpreted(backend, device):
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="Triton interpreter: fp8 .to(tl.float32) maps NaN codes 0x7F/0xFF to +-480"))
    pool, codes, ids = _code_pool(device)
    out = ops(backend)[1](pool, ids, 4)[0, 0, : L.DIM_NOPE]
    want = _want_code_bits(codes)
    sel = torch.tensor([(int(c) & 0x7F) == 0x7F for c in codes])
    if which == "finite":
        sel = ~sel
        assert codes[sel].unique().numel() == 254
    got = bits16(out).cpu()[sel]
    for c, g, w in zip(codes[sel].tolist(), got.tolist(), want[sel].tolist()):
        if F.is_nan_bf16_bits(w):
            assert F.is_nan_bf16_bits(g), f"{backend}/{device}: code 0x{c:02x} -> 0x{g & 0xFFFF:04x}, want NaN"
        else:
            assert g == w, f"{backend}/{device}: code 0x{c:02x} -> 0x{g & 0xFFFF:04x}, want 0x{w & 0xFFFF:04x}"
    # -0.0 really is distinguished
    assert bits16(out).cpu()[0x80].item() & 0xFFFF == 0x8000


# Scale bytes whose decoded values are fully determined (the product code * 2**(b-127)
# is exact in float32 and in bf16 unless it overflows to +-inf):
#   "normal":    0 (scale 0.0), 10..254 (bf16-normal results), 255 (scale +inf);
#   "subnormal": 3..9, where results are bf16 subnormals (still exact, no rounding).
# Valid pools only hold bytes 92..247 (see test_scale_exponent_formula_all_bf16).
# Bytes 1 and 2 can produce products that need bf16 rounding: left out.
SCALE_BYTE_SETS = {"normal": [0] + list(range(10, 256)), "subnormal": list(range(3, 10))}


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("byte_set", list(SCALE_BYTE_SETS))
def test_decode_scale_bytes(request, backend, device, byte_set):
    if byte_set == "subnormal" and interpreted(backend, device):
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="Triton interpreter: its float32->bf16 cast (_convert_float) gets "
                                "bf16-subnormal results wrong"))
    scale_bytes = SCALE_BYTE_SETS[byte_set]
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    page_size = 16
    n = len(scale_bytes) // L.NUM_TILES + 1
    num_pages = num_pages_for(n, page_size)
    pool = torch.randint(0, 256, (num_pages, L.bytes_per_page(page_size)), generator=gen, dtype=torch.uint8)
    ids = torch.randperm(num_pages * page_size, generator=gen)[:n]
    sb = torch.tensor([scale_bytes[i % len(scale_bytes)] for i in range(n * L.NUM_TILES)],
                      dtype=torch.uint8).view(n, L.NUM_TILES)
    R._page_views(pool, page_size)[1][ids // page_size, ids % page_size, : L.NUM_TILES] = sb
    codes = R._page_views(pool, page_size)[0][ids // page_size, ids % page_size, : L.DIM_NOPE]

    out = ops(backend)[1](pool.to(device), ids.to(device), page_size)[:, 0, : L.DIM_NOPE]

    def scale_of(b):
        return 0.0 if b == 0 else math.inf if b == 255 else math.ldexp(1.0, b - 127)

    want = []
    for t in range(n):
        for j, c in enumerate(codes[t].tolist()):
            v = F.decode(c) * scale_of(int(sb[t, j // L.TILE]))
            if math.isfinite(v) and abs(v) > 3.4028234663852886e38:
                v = math.copysign(math.inf, v)  # float32 overflow
            want.append(F.bf16_bits(v))
    want = torch.tensor(want, dtype=torch.int32).to(torch.int16).view(n, L.DIM_NOPE)
    out = out.cpu()
    if backend == "triton_fp8" and interpreted(backend, device):
        # NaN codes decode to +-480 in the interpreter (see test_decode_all_256_codes[nan]).
        keep = (codes & 0x7F) != 0x7F
        out, want = out[keep], want[keep]
    assert_bf16_bits_equal(out, want.view(torch.bfloat16), f"{backend}/{device} {byte_set} seed={seed}")


# --------------------------------------------------------------------------- #
# Encode: adversarial values against the pure-Python IEEE reference
# --------------------------------------------------------------------------- #
def _bf16_exact(vals):
    t = torch.tensor(vals, dtype=torch.float64)
    b = t.to(torch.bfloat16)
    bad = [v for v, w in zip(t.tolist(), b.double().tolist()) if v != w]
    assert not bad, f"adversarial values not representable in bf16: {bad[:5]}"
    return b


def _adversarial_rows(gen):
    """Rows of 512 bf16 values (each tile 64 values) hitting the RNE corner cases."""
    def tile(vals, fill):
        vals = list(vals)[: L.TILE]
        return vals + [fill] * (L.TILE - len(vals))

    mids = [(F.decode(c) + F.decode(c + 1)) / 2 for c in range(0x7E)]  # exact ties, all binades
    rows = []
    # Row 0: amax exactly 448 (scale byte 127, values encoded unscaled).
    t0 = [448.0, 1.0625, 1.1875, 1.9375, 0.484375, 440.0, 432.0, 424.0, 446.0, 444.0,
          2.0**-10, 3 * 2.0**-10, 15 * 2.0**-10, 2.0**-11, -(2.0**-11), -0.0, 0.0, -(2.0**-130),
          2.0**-130, 2.0**-9, -(2.0**-9), 7 * 2.0**-9, 2.0**-6, 0.099609375, -0.30078125, 255.0,
          258.0, 272.0, -272.0, 304.0]
    t1 = [3.0] * 64  # all-equal tile: scale 2**-7, 3 -> 384
    t2 = [-7.0] * 64  # all-equal at 448 * 2**-6: -> -448 (0xFE)
    t3 = [0.0, -0.0] * 32  # all zeros: amax -> eps, scale byte 92
    t4 = tile([450.0, 2.125, 2.375, -2.125, 0.0009765625 * 2, 3 * 0.0009765625], 1.0)  # scale 2
    t5 = tile([446.0, 444.0, 1.0625, 0.0], -0.0)  # amax just below 448
    t6 = tile([448 * 2.0**-20] + [m * 2.0**-20 for m in mids[:40]], -(2.0**-31))  # ties, scale 2**-20
    rope = [float(i) - 31.5 for i in range(64)]
    rows.append(tile(t0, 0.5) + t1 + t2 + t3 + t4 + t5 + t6 + rope)
    # Row 1: extreme magnitudes: near bf16 max (scale byte 247) and bf16 subnormals (< eps).
    big = tile([1.75 * 2.0**127, -1.625 * 2.0**127, 2.0**126, 1.0], 2.0**100)
    tiny = tile([2.0**-129, -(2.0**-129), 3 * 2.0**-132], 2.0**-133)
    rows.append(big + tiny + tile(mids[80:126] + [448.0], 1.0) + tile(mids[:64], 448.0)
                + tile([-m for m in mids[60:124]], 448.0) + tile([448.0], 0.0) + tile([3.0], -0.0) + rope)
    # Rows 2..: random ties at random scales, every tile has its amax = 448 * 2**e.
    for _ in range(3):
        row = []
        for _t in range(L.NUM_TILES):
            e = int(torch.randint(-30, 31, (1,), generator=gen))
            idx = torch.randint(0, len(mids), (63,), generator=gen).tolist()
            sgn = torch.randint(0, 2, (63,), generator=gen).tolist()
            row += [448.0 * 2.0**e] + [(-1) ** s * mids[i] * 2.0**e for i, s in zip(idx, sgn)]
        rows.append(row + rope)
    k = torch.stack([_bf16_exact(r) for r in rows])
    k = torch.cat([k, rand_k(4, gen, "cpu")])  # plus random rows, also checked value by value
    return k


def _python_expected_pool_bytes(k):
    """Per token: (576 data bytes, 8 scale bytes) from the pure-Python reference."""
    out = []
    for row in k:
        xs = row.float().tolist()
        data, scales = [], []
        for t in range(L.NUM_TILES):
            tile = xs[t * L.TILE : (t + 1) * L.TILE]
            e = F.ue8m0_scale_exponent(max(abs(v) for v in tile))
            data += [F.encode(math.ldexp(v, -e)) for v in tile]  # exact x / 2**e
            scales.append(e + 127)
        rope = row[L.DIM_NOPE :].contiguous().view(torch.uint8).tolist()
        out.append((data + rope, scales + [0]))
    return out


@pytest.mark.parametrize("backend,device", CASES)
def test_encode_adversarial(request, backend, device):
    xfail_if_interp_cast_broken(request, backend, device)
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    k = _adversarial_rows(gen)
    n, page_size = k.shape[0], 4
    num_pages = num_pages_for(n, page_size)
    loc = torch.randperm(num_pages * page_size, generator=gen)[:n]
    pool = quant_checked(ops(backend)[0], k.to(device), loc.to(device), page_size, num_pages, msg).cpu()
    data, scales = R._page_views(pool, page_size)
    for i, (want_data, want_scales) in enumerate(_python_expected_pool_bytes(k)):
        p, s = divmod(int(loc[i]), page_size)
        got_scales = scales[p, s].tolist()
        assert got_scales == want_scales, f"{msg}: token {i} scale bytes {got_scales} != {want_scales}"
        got_data = data[p, s].tolist()
        if got_data != want_data:
            bad = [(j, k[i, j].item(), hex(g), hex(w)) for j, (g, w) in enumerate(zip(got_data, want_data))
                   if g != w]
            raise AssertionError(f"{msg}: token {i}: {len(bad)} data bytes differ (col, x, got, want): {bad[:6]}")


# --------------------------------------------------------------------------- #
# The u8 codec functions on their own, exhaustively
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=None)
def _codec_kernels():
    import triton
    import triton.language as tl

    from capdispatch.backends.triton_common.env import jit_module

    # Triton resolves callees through module globals (not closures). The codec is the
    # toolbox's (the KV, attention and indexer kernels decode with it), built as these are.
    global _ENC, _DEC, _DEC16
    codec = jit_module("codec")
    _ENC, _DEC, _DEC16 = codec.f32_to_e4m3fn_bits, codec.e4m3fn_bits_to_f32, codec.e4m3fn_bits_to_f16

    @triton.jit
    def encode_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, _ENC(tl.load(x_ptr + o, mask=m)), mask=m)

    @triton.jit
    def decode_kernel(c_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, _DEC(tl.load(c_ptr + o, mask=m)), mask=m)

    @triton.jit
    def decode16_kernel(c_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, _DEC16(tl.load(c_ptr + o, mask=m)), mask=m)

    return encode_kernel, decode_kernel, decode16_kernel


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=_interp, id="interp"),
                                    pytest.param("cuda", marks=_gpu + [_no_interp_on_gpu], id="cuda")])
def test_u8_codec_exhaustive(device):
    """Integer encoder on every bf16 value with |v| <= 448 (the quant kernel's staged
    values are bf16 values times a power of two) plus random float32 values, and
    the decoder on all 256 codes, against the pure-Python IEEE reference."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    encode_kernel, decode_kernel, decode16_kernel = _codec_kernels()
    allbf = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    x = torch.cat([
        allbf[allbf.abs() <= 448],
        (torch.rand(20000, generator=gen) * 2 - 1) * 448,
        (torch.rand(20000, generator=gen) * 2 - 1) * 2.0**-6,
        torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126, 448.0, -448.0, 447.99]),
    ])
    y = torch.empty(x.numel(), dtype=torch.int32, device=device)
    encode_kernel[(-(-x.numel() // 4096),)](x.to(device), y, x.numel(), BLOCK=4096)
    want = torch.tensor([F.encode(v) for v in x.tolist()], dtype=torch.int32)
    bad = (y.cpu() != want).nonzero().flatten()
    assert bad.numel() == 0, (
        f"seed={seed}: {bad.numel()} encodes differ, e.g. "
        f"{[(x[i].item(), hex(y[i].item()), hex(want[i].item())) for i in bad[:5].tolist()]}"
    )

    codes = torch.arange(256, dtype=torch.uint8)
    f = torch.empty(256, dtype=torch.float32, device=device)
    decode_kernel[(1,)](codes.to(device), f, 256, BLOCK=256)
    for c, v in enumerate(f.cpu().tolist()):
        w = F.decode(c)
        if math.isnan(w):
            assert math.isnan(v), f"code 0x{c:02x} -> {v}, want NaN"
        else:
            assert F.f32_bits(v) == F.f32_bits(w), f"code 0x{c:02x} -> {v!r}, want {w!r}"
    h = torch.full((256,), 1000.0, dtype=torch.float16, device=device)   # poisoned: no e4m3 value
    decode16_kernel[(1,)](codes.to(device), h, 256, BLOCK=256)
    for c, (v, w) in enumerate(zip(h.cpu().float().tolist(), f.cpu().tolist())):
        if math.isnan(w):
            assert math.isnan(v), f"float16 decode: code 0x{c:02x} -> {v}, want NaN"
        else:
            assert F.f32_bits(v) == F.f32_bits(w), f"float16 decode: code 0x{c:02x} -> {v!r}, want {w!r}"


# --------------------------------------------------------------------------- #
# Addressing: page sizes, index dtypes, strided out=, pool dtype views
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("page_size", [1, 64, 256])
def test_addressing(backend, device, page_size):
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    quant, dequant = ops(backend)
    n = n_tokens(device, small=2, large=100)
    k = rand_k(n, gen, device)
    num_pages = num_pages_for(n, page_size, spare=2.0)
    loc64 = torch.randperm(num_pages * page_size, generator=gen)[:n]  # non-contiguous slot order
    for idx_dtype in (torch.int32, torch.int64):
        msg = f"{backend}/{device} P={page_size} {idx_dtype} seed={seed}"
        loc = loc64.to(idx_dtype).to(device)
        pool = quant_checked(quant, k, loc, page_size, num_pages, msg)
        ref = quant_checked(R.kv_quant, k, loc64.to(device), page_size, num_pages, msg + " (torch)")
        ref_out = R.kv_dequant(ref, loc64.to(device), page_size)
        if backend != "triton_fp8" or not interpreted(backend, device):
            assert torch.equal(pool, ref), f"{msg}: pool differs from torch"
        # Dequant of the torch pool: fresh output, strided out= view, shuffled ids, pool as bf16 view.
        ids = loc[torch.randperm(n, generator=gen).to(device)]
        want = R.kv_dequant(ref, ids, page_size)
        got = dequant_checked(dequant, ref, ids, page_size, msg)
        assert_bf16_bits_equal(got, want, msg)
        got = dequant_checked(dequant, ref, ids, page_size, msg + " strided out=", out_stride=L.DIM + 77)
        assert_bf16_bits_equal(got, want, msg + " out=")
        got = ops(backend)[1](ref.view(torch.bfloat16), ids, page_size)
        assert_bf16_bits_equal(got, want, msg + " bf16 pool view")
        # The backend reads back what it wrote (under the interpreter the native-fp8
        # pool carries the cast artefact, so compare with torch decoding that pool).
        own_want = R.kv_dequant(pool, loc, page_size) if interpreted(backend, device) else ref_out
        assert_bf16_bits_equal(dequant(pool, loc, page_size), own_want, msg + " own pool")


@pytest.mark.parametrize("backend,device", CASES)
def test_empty(backend, device):
    quant, dequant = ops(backend)
    pool = poisoned_pool(2, 64, device, 0xAB)
    quant(torch.empty(0, L.DIM, dtype=torch.bfloat16, device=device), pool,
          torch.empty(0, dtype=torch.int64, device=device), 64)
    assert bool((pool == 0xAB).all())
    out = dequant(pool, torch.empty(0, dtype=torch.int32, device=device), 64)
    assert out.shape == (0, 1, L.DIM) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("backend,device", CASES)
def test_validation(backend, device):
    quant, dequant = ops(backend)
    P = 64
    pool = R.new_pool(2, P, device)
    assert pool.shape == (2, L.bytes_per_page(P)) and pool.dtype == torch.uint8
    k = torch.ones(3, L.DIM, dtype=torch.bfloat16, device=device)
    loc = torch.arange(3, device=device)
    with pytest.raises(TypeError):
        quant(k.float(), pool, loc, P)
    with pytest.raises(ValueError):
        quant(k[:, :256], pool, loc, P)
    with pytest.raises(TypeError):
        quant(k, pool, loc.float(), P)
    with pytest.raises(ValueError):
        quant(k, pool, loc[:2], P)
    with pytest.raises(ValueError):
        quant(k, pool[:, : P * 584 - 1].contiguous(), loc, P)  # rows too short for the page size
    with pytest.raises(ValueError):
        quant(k, pool.t(), loc, P)
    with pytest.raises(ValueError):
        dequant(pool, loc, P, out=torch.empty(3, L.DIM, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError):
        dequant(pool, loc, P, out=torch.empty(3, 1, L.DIM, dtype=torch.float32, device=device))
    with pytest.raises(ValueError):
        dequant(pool, loc.view(3, 1), P)


def test_triton_rejects_cpu_without_interpreter():
    tk = _tk()
    if tk.INTERPRETED:
        pytest.skip("kernels were imported under the interpreter")
    with pytest.raises(ValueError):
        tk.kv_dequant_u8(R.new_pool(1, 64, "cpu"), torch.zeros(1, dtype=torch.int64), 64)


# --------------------------------------------------------------------------- #
# Interpreter artefact evidence, GPU-only checks
# --------------------------------------------------------------------------- #
@_interp
def test_interpreter_fp8_cast_artefact():
    """Documents (does not hide) the interpreter's fp32->fp8e4nv cast deviation.

    The integer codec (triton_u8) computes exact RNE under the same interpreter,
    and torch's cast equals the pure-Python IEEE encoder on these values, so the
    deviation is the interpreter's emulation, not the kernels. If a Triton release
    fixes it, the fp8 xfails above stop applying automatically (they are probed).
    """
    x = _around_codes()
    want = torch.tensor([F.encode(v) for v in x.tolist()], dtype=torch.uint8)
    assert torch.equal(x.to(torch.float8_e4m3fn).view(torch.uint8), want), "torch cast must be IEEE RNE"
    bad, total, examples = interp_cast_evidence()
    print(f"[interp evidence] fp32->fp8e4nv: {bad}/{total} probe values differ from IEEE RNE: {examples}")
    # Concrete cases measured with triton 3.9 (tie away from zero, lost carry, subnormal truncation).
    cases = {1.0625: 0x38, 1.9375: 0x40, 0.484375: 0x30, 0.00146484375: 0x01}
    got = interp_fp8_cast(torch.tensor(list(cases))).tolist()
    print("[interp evidence] value: interpreter vs IEEE:",
          {v: (hex(g), hex(w)) for (v, w), g in zip(cases.items(), got)})


@pytest.mark.gpu
def test_u8_kernels_compile_for_sm86():
    """The integer codec must build for SM86 (Ampere), where Triton rejects fp8e4nv."""
    if not HAS_CUDA:
        pytest.skip("needs the CUDA toolchain of a GPU machine")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tk = _tk()
    target = GPUTarget("cuda", 86, 32)
    common = {"PAGE_SIZE": 64, "BYTES_PER_PAGE": L.bytes_per_page(64), "TOKENS": 8}

    def build(fn, sig, native):
        consts = dict(common, NATIVE_FP8=native)
        sig = dict(sig, **{name: "constexpr" for name in consts})
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)

    q_sig = {"k_ptr": "*bf16", "pool_ptr": "*u8", "loc_ptr": "*i64", "n_tokens": "i32", "k_stride": "i32"}
    d_sig = {"pool_ptr": "*u8", "ids_ptr": "*i32", "out_ptr": "*bf16", "n_tokens": "i32", "out_stride": "i32"}
    for fn, sig in ((tk._kv_quant_kernel, q_sig), (tk._kv_dequant_kernel, d_sig)):
        compiled = build(fn, sig, False)
        assert "e4m3" not in compiled.asm["ptx"]
        with pytest.raises(Exception):
            build(fn, dict(sig, pool_ptr="*fp8e4nv"), True)

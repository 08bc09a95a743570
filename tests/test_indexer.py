"""Sparse indexer (fp8 paged MQA logits): torch reference, Triton, TileLang, DeepGEMM adapter.

CPU (no CUDA): the torch reference runs on the CPU, the Triton kernel under the
interpreter (TRITON_INTERPRET=1 set per test by the fixture below), TileLang's kernel
is lowered to CUDA source for the target of each device from sm_80 to sm_120a and built
with nvcc where it exists, checked against what each target can run (importorskip tilelang), and the
DeepGEMM adapter is exercised against a stand-in module that enforces DeepGEMM's host
checks. With CUDA (``gpu`` marker) the same comparisons run at DeepSeek-V4 shapes for
every backend that runs there.

Every random test draws a fresh seed (``random.SystemRandom``) and names it in its
assertion messages; set INDEXER_TEST_SEED=<int> to replay one.

Tolerances (stated against the float64 value and the absolute sum
A = s * sum_h |w_h| * sum_d |q_hd * k_d|, which bounds float32 rounding):
* float32 paths (torch reference, Triton under the interpreter): |err| <= 2e-5 * A
  (the bound (D + H + 2) * 2**-24 * A for D + H = 192 terms is 1.2e-5 * A);
* GPU, fp16 tensor cores over integer-widened fp8 (Triton/TileLang on cc < 8.9): 1e-4 * A;
* GPU, fp8 tensor cores (cc >= 8.9; Hopper's fp8 MMA accumulates with ~14 mantissa
  bits, DeepSeek-V3 report, sec. 3.3.2): 2**-10 * A.
Positions at or past a row's length must be exactly -inf for every capdispatch kernel.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import math
import os
import random
import re
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

from triton_env import HAS_CUDA, INTERPRET, _triton_interpreter  # noqa: E402,F401 (autouse fixture)


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ieee_fp8 as F  # noqa: E402

from capdispatch.backends.indexer import layout as L  # noqa: E402
from capdispatch.backends.indexer import reference as R  # noqa: E402
from capdispatch.backends.indexer.inputs import FINITE_CODES, make_case  # noqa: E402
from capdispatch.backends.indexer.inputs import rand_codes as _rand_codes  # noqa: E402

_interp = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")

REL_F32 = 2e-5
REL_FP16_MMA = 1e-4
REL_FP8_MMA = 2.0 ** -10


@functools.lru_cache(maxsize=None)
def _tk():
    from capdispatch.backends.indexer import triton_kernels
    if INTERPRET and not triton_kernels.INTERPRETED:
        triton_kernels = importlib.reload(triton_kernels)
    return triton_kernels


def new_seed():
    env = os.environ.get("INDEXER_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def _native_fp8_cuda():
    return HAS_CUDA and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
_F64_LUT = torch.tensor([F.decode(c) for c in range(256)], dtype=torch.float64)

def f64_logits(c):
    """Independent float64 computation (IEEE decode from tests/ieee_fp8.py, no torch fp8):
    returns (logits, A) as float64 [rows, S]; masked positions -inf, A the absolute sum."""
    q = c["q"].cpu().view(torch.uint8)
    pages = L.pages_u8(c["kv"].cpu())
    w = c["w"].cpu().double()
    bt = c["bt"].cpu()
    E = c["E"]
    B, N, H, _ = q.shape
    S = c["S"]
    out = torch.full((B * N, S), float("-inf"), dtype=torch.float64)
    A = torch.zeros((B * N, S), dtype=torch.float64)
    qd = _F64_LUT[q.long()]
    # Decode each distinct block-table row's pages once, as far as its longest row reaches.
    reach = {}
    for b in range(B):
        key = tuple(bt[b].tolist())
        reach[key] = max(reach.get(key, 0), int(E[b].max()))
    decoded = {}
    for key, emax in reach.items():
        np_ = -(-emax // 64)
        if np_ == 0:
            continue
        pg = pages[torch.tensor(key[:np_], dtype=torch.long)]                      # [np, 8448]
        kk = _F64_LUT[pg[:, :L.SCALE_OFFSET].reshape(np_ * 64, 128).long()]
        sc = pg[:, L.SCALE_OFFSET:].contiguous().view(torch.float32).reshape(-1).double()
        decoded[key] = (kk, sc)
    for b in range(B):
        if int(E[b].max()) == 0:
            continue
        k, sc = decoded[tuple(bt[b].tolist())]
        for j in range(N):
            e = int(E[b, j])
            if e == 0:
                continue
            r = b * N + j
            dots = qd[b, j] @ k[:e].T                                               # [H, e]
            absd = qd[b, j].abs() @ k[:e].abs().T
            out[r, :e] = sc[:e] * (w[r][:, None] * dots.clamp_min(0)).sum(0)
            A[r, :e] = sc[:e].abs() * (w[r].abs()[:, None] * absd).sum(0)
    return out, A


def check(got, want, A, rel, what, clean=True):
    got = got.detach().double().cpu()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    valid = torch.isfinite(want)
    if clean:
        bad = ~valid & ~(got == float("-inf"))
        assert not bad.any(), f"{what}: {int(bad.sum())} masked positions not -inf, first {bad.nonzero()[:4].tolist()}"
    g, wv, a = got[valid], want[valid], A[valid]
    assert torch.isfinite(g).all(), f"{what}: non-finite logits at valid positions"
    err = (g - wv).abs()
    ratio = (err / a.clamp_min(1e-300)).max().item() if err.numel() else 0.0
    assert (err <= rel * a + 1e-300).all(), (
        f"{what}: max |err| {err.max().item():.3g}, max |err|/A {ratio:.3g} > {rel:.3g}")
    return err.max().item() if err.numel() else 0.0, ratio


def run(backend, c, **kw):
    args = (c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, c["S"])
    if backend == "torch":
        return R.fp8_paged_mqa_logits(*args, **kw)
    if backend == "triton_u8":
        return _tk().fp8_paged_mqa_logits_u8(*args, **kw)
    if backend == "triton_native":
        return _tk().fp8_paged_mqa_logits_native(*args, **kw)
    if backend == "triton":
        return _tk().fp8_paged_mqa_logits(*args, **kw)
    if backend == "tilelang":
        from capdispatch.backends.indexer import tilelang_kernel
        return tilelang_kernel.fp8_paged_mqa_logits(*args, **kw)
    if backend == "deepgemm":
        from capdispatch.backends.indexer import deepgemm
        return deepgemm.fp8_paged_mqa_logits(*args, **kw)
    raise AssertionError(backend)


CPU_BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton_u8", id="triton_u8-interp", marks=_interp),
    pytest.param("triton_native", id="triton_native-interp", marks=_interp),
]

# (B, next_n, H, S, lens, ctx_2d): ragged lengths, L <= 0 rows, L > S (clamped), S not a
# multiple of 64, lengths that end inside a page, 1-D and 2-D length forms, next_n 1..3.
VARIANTS = [
    pytest.param(3, 1, 64, 200, [70, 0, 200], False, id="n1-ctx1d"),
    pytest.param(2, 2, 64, 150, [1, 150], False, id="n2-ctx1d-short"),
    pytest.param(2, 3, 16, 130, [[3, 64, 65], [0, 129, 500]], True, id="n3-ctx2d-clamp"),
    pytest.param(1, 2, 32, 257, [[256, 257]], True, id="n2-ctx2d-h32"),
    pytest.param(2, 1, 8, 100, [100, 37], False, id="n1-h8-heads-padded"),
]


# --------------------------------------------------------------------------- #
# fp8 decode
# --------------------------------------------------------------------------- #
def test_reference_decode_all_256_codes():
    got = R.decode_e4m3fn(torch.arange(256, dtype=torch.uint8))
    for c in range(256):
        want = F.decode(c)
        g = float(got[c])
        if math.isnan(want):
            assert math.isnan(g), c
        else:
            assert g == want and math.copysign(1, g) == math.copysign(1, want), (c, g, want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_finite_code_through_the_op(backend):
    """Each finite e4m3fn code c sits at K[t, 0] of its own token; q selects it with +1 and
    -1 heads weighted +1 / -1, so the logit is exactly decode(c) (all sums exact)."""
    codes = FINITE_CODES
    n = len(codes)                                   # 254 tokens on 4 pages
    P = 4
    vals = torch.zeros(P * 64, 128, dtype=torch.uint8)
    vals[:n, 0] = codes
    vals[:, 1:] = _rand_codes(torch.Generator().manual_seed(5), (P * 64, 127))
    kv = R.pack_index_k(vals.view(P, 64, 128), torch.ones(P, 64))
    H = 16
    q = torch.zeros(1, 1, H, 128, dtype=torch.uint8)
    q[0, 0, 0, 0] = 0x38                              # +1.0
    q[0, 0, 1, 0] = 0xB8                              # -1.0
    w = torch.zeros(1, H)
    w[0, 0], w[0, 1] = 1.0, -1.0
    c = dict(q=q.view(torch.float8_e4m3fn), kv=kv, w=w, ctx=torch.tensor([n], dtype=torch.int32),
             bt=torch.arange(P, dtype=torch.int32).view(1, P), S=P * 64)
    out = run(backend, c)
    want = torch.tensor([F.decode(int(x)) for x in codes], dtype=torch.float64)
    assert torch.equal(out[0, :n].double(), want), backend
    assert (out[0, n:] == float("-inf")).all()


# --------------------------------------------------------------------------- #
# Against the float64 computation and the torch reference
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kind", ["quant", "codes"])
@pytest.mark.parametrize("B,N,H,S,lens,ctx_2d", VARIANTS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_against_float64(backend, B, N, H, S, lens, ctx_2d, kind):
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    c = make_case(gen, B, N, H, S, lens, ctx_2d=ctx_2d, kind=kind)
    want, A = f64_logits(c)
    out = torch.full((B * N, S), float("nan"))        # poisoned: every element must be written
    got = run(backend, c, out=out)
    assert got is out
    check(got, want, A, REL_F32, f"{backend} {kind} seed={seed}")


@pytest.mark.parametrize("backend", [p for p in CPU_BACKENDS if p.values[0] != "torch"])
def test_matches_torch_reference(backend):
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    c = make_case(gen, 4, 2, 64, 320, [300, 2, 64, 129], kind="quant")
    want = run("torch", c)
    got = run(backend, c)
    _, A = f64_logits(c)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), ~fin), f"seed={seed}"
    err = (got - want)[fin].abs()
    assert (err.double() <= REL_F32 * A[fin]).all(), f"{backend} seed={seed} max err {err.max():.3g}"


def test_strided_out_and_int64_indices():
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    c = make_case(gen, 2, 1, 64, 100, [100, 37])
    want = run("torch", c)
    big = torch.full((2, 160), float("nan"))
    out = big[:, 7:107]
    c64 = dict(c, ctx=c["ctx"].long(), bt=c["bt"].long())
    got = run("torch", c64, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)
    assert torch.isnan(big[:, :7]).all() and torch.isnan(big[:, 107:]).all()


@_interp
def test_triton_strided_out_and_int64_indices():
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    c = make_case(gen, 2, 1, 64, 100, [100, 37])
    want = run("torch", c)
    big = torch.full((2, 160), float("nan"))
    out = big[:, 7:107]
    got = run("triton_u8", dict(c, ctx=c["ctx"].long(), bt=c["bt"].long()), out=out)
    _, A = f64_logits(c)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), ~fin), f"seed={seed}"
    assert ((got - want)[fin].abs().double() <= REL_F32 * A[fin]).all(), f"seed={seed}"
    assert torch.isnan(big[:, :7]).all() and torch.isnan(big[:, 107:]).all()


def test_positions_past_the_block_table_are_masked():
    """max_context_len may exceed 64 * max_blocks: those positions are -inf, never read."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    c = make_case(gen, 2, 1, 64, 300, [120, 128], max_blocks=2)
    want, A = f64_logits(c)
    for backend in ["torch"] + (["triton_u8", "triton_native"] if INTERPRET else []):
        check(run(backend, c), want, A, REL_F32, f"{backend} seed={seed}")


def test_empty_and_zero_length():
    c = dict(q=torch.zeros(0, 1, 64, 128, dtype=torch.float8_e4m3fn), kv=torch.zeros(1, 64, 1, 132, dtype=torch.uint8),
             w=torch.zeros(0, 64), ctx=torch.zeros(0, dtype=torch.int32), bt=torch.zeros(0, 4, dtype=torch.int32), S=64)
    assert run("torch", c).shape == (0, 64)
    c = dict(c, q=torch.zeros(1, 1, 64, 128, dtype=torch.float8_e4m3fn), w=torch.zeros(1, 64),
             ctx=torch.zeros(1, dtype=torch.int32), bt=torch.full((1, 4), -1, dtype=torch.int32))
    assert (run("torch", c) == float("-inf")).all()
    assert run("torch", dict(c, S=0)).shape == (1, 0)


def test_reference_chunking_is_exact(monkeypatch):
    """Small query chunks and one page per step give bit-identical logits."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    c = make_case(gen, 5, 2, 64, 400, [400, 1, 333, 64, 200])
    want = run("torch", c)
    monkeypatch.setattr(R, "QUERY_CHUNK", 4)
    got = run("torch", c, work_bytes=1)
    assert torch.equal(got, want), f"seed={seed}"


def test_reference_plan_is_bounded_by_the_chunk():
    """The accounted working set of one step never grows with the context length, and
    stays within the budget (index-K is gathered a few pages at a time, never a whole
    chunk's in fp32)."""
    plans = {}
    for tokens in (8192, 32768, 262144):
        pages = -(-tokens // 64)
        plans[tokens] = p = R.plan_steps(tokens, 1, 64, pages)
        assert p.batch_chunk * 1 <= L.QUERY_CHUNK and p.bytes <= R.DEFAULT_WORK_BYTES
    assert plans[8192] == plans[32768] == plans[262144]
    seed_fp32_gather = L.QUERY_CHUNK * 32768 * 128 * 4
    assert plans[32768].bytes * 32 < seed_fp32_gather


# --------------------------------------------------------------------------- #
# Argument checks
# --------------------------------------------------------------------------- #
def test_argument_errors():
    gen = torch.Generator().manual_seed(0)
    c = make_case(gen, 2, 1, 64, 64, [10, 20])
    a = (c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, 64)
    R.fp8_paged_mqa_logits(*a)
    bad = [
        (dict(q=c["q"].float()), TypeError, "q must be float8"),
        (dict(q=c["q"][..., :64]), ValueError, "q must be"),
        (dict(kv=c["kv"].view(-1, 64, 132)[:, :, :130]), ValueError, "kv_cache"),
        (dict(kv=c["kv"].view(torch.uint8).float()), TypeError, "kv_cache must hold bytes"),
        (dict(w=c["w"].double()), TypeError, "weights must be float32"),
        (dict(w=c["w"][:1]), ValueError, "weights must be"),
        (dict(ctx=c["ctx"].float()), TypeError, "context_lens must be int32"),
        (dict(ctx=c["ctx"].view(2, 1).expand(2, 3)), ValueError, "context_lens must be"),
        (dict(bt=c["bt"].float()), TypeError, "block_table must be int32"),
        (dict(bt=c["bt"][:1]), ValueError, "block_table must be"),
    ]
    names = ["q", "kv", "w", "ctx", "bt"]
    for change, exc, msg in bad:
        args = [change.get(n, c[n]) for n in names]
        with pytest.raises(exc, match=msg):
            R.fp8_paged_mqa_logits(*args, None, 64)
    with pytest.raises(ValueError, match="max_context_len"):
        R.fp8_paged_mqa_logits(*a[:6], -1)
    with pytest.raises(ValueError, match="out must be"):
        R.fp8_paged_mqa_logits(*a, out=torch.empty(2, 63))


# --------------------------------------------------------------------------- #
# SGLang 0.5.23's own reference (sglang/test/kernels/paged_mqa.py), where importable
# --------------------------------------------------------------------------- #
def _sglang_paged_mqa():
    pytest.importorskip("sglang")
    try:
        return importlib.import_module("sglang.test.kernels.paged_mqa")
    except Exception as exc:  # its import pulls sglang.srt.layers.attention.dsa.utils
        pytest.skip(f"sglang.test.kernels.paged_mqa does not import here: {exc!r}")


def _sglang_ref(P, c):
    """Run SGLang's reference on our inputs (it takes values and scales apart)."""
    pages = L.pages_u8(c["kv"])
    n = pages.shape[0]
    kv_fp8 = pages[:, :L.SCALE_OFFSET].contiguous().view(torch.float8_e4m3fn).view(n, 64, 128)
    kv_scales = pages[:, L.SCALE_OFFSET:].contiguous().view(torch.float32).view(n, 64)
    return P.ref_fp8_paged_mqa_logits(c["q"], kv_fp8, kv_scales, c["w"], c["ctx"], c["bt"], c["S"], 64)


def _check_against_sglang(P, c, backends, what):
    """SGLang's reference and ours are both float32 with different summation orders, so
    each is held to the float64 value within REL_F32 * A, and they to each other within
    twice that. (SGLang's own assert_paged_mqa_matches_ref uses a fixed atol=5e-5,
    rtol=1e-5 tuned to its generator's magnitudes; on fresh inputs with logits near 80
    a 16-ulp summation-order difference trips it, so it is not the criterion here.)"""
    ref = _sglang_ref(P, c)
    want, A = f64_logits(c)
    rows = c["q"].shape[0] * c["q"].shape[1]
    ref_v = ref[:rows, :c["S"]]
    check(ref_v, want, A, REL_F32, f"SGLang reference {what}", clean=False)
    valid = torch.isfinite(want)
    for backend in backends:
        got = run(backend, c)
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), f"{backend} {what}"
        check(got, want, A, REL_F32, f"{backend} {what}")
        diff = (got.double() - ref_v.double()).abs()[valid]
        assert (diff <= 2 * REL_F32 * A[valid]).all(), f"{backend} vs SGLang {what}: max {diff.max().item():.3g}"


@pytest.mark.parametrize("N", [1, 2])
def test_against_sglang_reference_fresh_inputs(N):
    P = _sglang_paged_mqa()
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    B = 3
    ctx = torch.randint(N, 400, (B,), generator=gen).tolist()
    S = 64 * -(-max(ctx) // 64)                          # SGLang's reference writes whole pages
    c = make_case(gen, B, N, 64, S, ctx, kind="quant", junk_table=False)
    backends = ["torch"] + (["triton_u8", "triton_native"] if INTERPRET else [])
    _check_against_sglang(P, c, backends, f"seed={seed}")


def test_against_sglang_reference_its_own_inputs():
    P = _sglang_paged_mqa()
    seed = new_seed()
    torch.manual_seed(seed)                              # SGLang's generator draws from the global RNG
    d = P.generate_paged_mqa_test_data(3, 2, 64, 300, 512, device="cpu")
    ctx = d["context_lens"]
    c = dict(q=d["q_fp8"], kv=d["kv_fused"], w=d["weights"], ctx=ctx, bt=d["block_table"], S=512, N=2,
             E=R.row_lengths(ctx, 2, 512))
    backends = ["torch"] + (["triton_u8"] if INTERPRET else [])
    _check_against_sglang(P, c, backends, f"SGLang's generator, seed={seed}")


def _module_source(module: str, rel: str):
    """A file of an installed package, read without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{module} is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], rel)
    if not os.path.exists(path):
        pytest.skip(f"{module} has no {rel}")
    with open(path) as f:
        return f.read()


def _signature_from_source(src, name):
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == name)
    a = fn.args
    pos = [x.arg for x in a.posonlyargs + a.args]
    return pos, len(a.defaults), [x.arg for x in a.kwonlyargs]


def test_contract_matches_sglang_call_site():
    """SGLang's DSv4 indexer calls fn(q, kv, weights, seq_lens, page_table, metadata,
    max_seq_len, clean_logits) positionally; its torch fallbacks take exactly these."""
    src = _module_source("sglang", "srt/layers/attention/dsv4/indexer.py")
    for name in ("fp8_paged_mqa_logits_torch", "fp8_paged_mqa_logits_torch_sm120"):
        pos, ndef, _ = _signature_from_source(src, name)
        assert len(pos) == 8 and ndef == 1 and pos[-1] == "clean_logits", (name, pos)
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == "fn"]
    assert calls and all(len(c.args) == 8 and not c.keywords for c in calls), [ast.dump(c)[:200] for c in calls]
    ours = list(inspect.signature(R.fp8_paged_mqa_logits).parameters.values())
    assert [p.kind for p in ours[:8]] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 8
    assert ours[7].name == "clean_logits" and ours[7].default is False


def test_backends_share_one_signature():
    want = list(inspect.signature(R.fp8_paged_mqa_logits).parameters)[:8]
    srcs = {"deepgemm": "deepgemm.py", "tilelang": "tilelang_kernel.py", "triton": "triton_kernels.py"}
    base = os.path.dirname(R.__file__)
    for name, fname in srcs.items():
        with open(os.path.join(base, fname)) as f:
            pos, ndef, kwonly = _signature_from_source(f.read(), "fp8_paged_mqa_logits")
        assert pos == want and kwonly == ["out", "checks"], (name, pos, kwonly)


# --------------------------------------------------------------------------- #
# DeepGEMM adapter
# --------------------------------------------------------------------------- #
def test_deepgemm_adapter_matches_library_signature():
    """The adapter's calls against the installed sgl-deep-gemm's real functions (read from
    its __init__.py: importing deep_gemm loads its CUDA extension)."""
    src = _module_source("deep_gemm", "__init__.py")
    pos, _, _ = _signature_from_source(src, "fp8_paged_mqa_logits")
    assert pos[:8] == ["q", "kv_cache", "weights", "context_lens", "block_table", "schedule_meta",
                       "max_context_len", "clean_logits"], pos
    pos, _, _ = _signature_from_source(src, "get_paged_mqa_logits_metadata")
    assert pos[:3] == ["context_lens", "block_kv", "num_sms"], pos
    assert "get_num_sms" in src


class _FakeDeepGEMM(types.ModuleType):
    """Stand-in for deep_gemm enforcing the host checks of DeepGEMM's fp8_paged_mqa_logits
    (csrc/apis/attention.hpp); positions past a row's length are left NaN (unwritten)."""
    NUM_SMS = 8

    def __init__(self):
        super().__init__("deep_gemm")
        self.calls = []

    def get_num_sms(self):
        return self.NUM_SMS

    def get_paged_mqa_logits_metadata(self, context_lens, block_kv, num_sms, indices=None):
        assert context_lens.dim() == 2 and context_lens.dtype == torch.int32 and context_lens.is_contiguous()
        assert block_kv == 64
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def fp8_paged_mqa_logits(self, q, kv_cache, weights, context_lens, block_table, schedule_meta,
                             max_context_len, clean_logits=False, indices=None):
        self.calls.append((q, kv_cache, weights, context_lens, block_table, schedule_meta))
        B, N, H, D = q.shape
        assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and D == 128
        assert kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4 and kv_cache.shape[1:] == (64, 1, 132)
        assert kv_cache.stride(1) == 132 and kv_cache.stride(3) == 1
        assert weights.dtype == torch.float32 and tuple(weights.shape) == (B * N, H) and weights.stride(1) == 1
        assert context_lens.dim() == 2 and tuple(context_lens.shape) == (B, N)
        assert context_lens.dtype == torch.int32 and context_lens.is_contiguous()
        assert block_table.dtype == torch.int32 and block_table.stride(1) == 1 and block_table.shape[0] == B
        assert schedule_meta.shape == (self.NUM_SMS + 1, 2) and schedule_meta.dtype == torch.int32
        assert not clean_logits, "DeepGEMM rejects clean_logits for paged logits"
        ref = R.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, None, max_context_len)
        stride = -(-max_context_len // 256) * 256
        out = torch.full((B * N, stride), float("nan"))[:, :max_context_len]
        fin = torch.isfinite(ref)
        out[fin] = ref[fin]
        return out


@pytest.mark.parametrize("N,ctx_2d,clean", [(1, False, False), (2, False, True), (2, True, True)])
def test_deepgemm_adapter_with_stand_in(monkeypatch, N, ctx_2d, clean):
    fake = _FakeDeepGEMM()
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    deepgemm = _fresh_adapter()
    try:
        _adapter_case(deepgemm, fake, N, ctx_2d, clean)
    finally:
        _fresh_adapter(drop=True)


def test_deepgemm_adapter_uses_the_callers_schedule(monkeypatch):
    """DeepGEMM's schedule: the caller's when given (as an argument, or through
    capdispatch.given("deepgemm_indexer", m)), one per batch inside capdispatch.batch(),
    else one per call."""
    import capdispatch as cd
    fake = _FakeDeepGEMM()
    made = []
    real = fake.get_paged_mqa_logits_metadata

    def counting(*a, **k):
        made.append(real(*a, **k))
        return made[-1]
    fake.get_paged_mqa_logits_metadata = counting
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    deepgemm = _fresh_adapter()
    try:
        gen = torch.Generator().manual_seed(1)
        c = make_case(gen, 2, 1, 64, 200, [70, 191])

        def call(meta=None):
            deepgemm.fp8_paged_mqa_logits(c["q"], c["kv"], c["w"], c["ctx"], c["bt"], meta, c["S"], False)
            return fake.calls[-1][5]
        theirs = torch.zeros(fake.NUM_SMS + 1, 2, dtype=torch.int32)
        assert call(theirs) is theirs and not made
        with cd.given("deepgemm_indexer", theirs):
            assert call() is theirs and not made
        with cd.batch():
            first, second = call(), call()
        assert first is second is made[0] and len(made) == 1
        assert call() is made[1] and call() is made[2]
    finally:
        _fresh_adapter(drop=True)


def _fresh_adapter(drop=False):
    """(Re)import the adapter module so it binds whatever `deep_gemm` is in sys.modules now."""
    name = "capdispatch.backends.indexer.deepgemm"
    sys.modules.pop(name, None)
    pkg = importlib.import_module("capdispatch.backends.indexer")
    if hasattr(pkg, "deepgemm"):
        delattr(pkg, "deepgemm")
    return None if drop else importlib.import_module(name)


def _adapter_case(deepgemm, fake, N, ctx_2d, clean):
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    lens = [[5, 70], [190, 191]] if ctx_2d else [70, 191]
    if N == 1:
        lens = [70, 191]
    c = make_case(gen, 2, N, 64, 200, lens, ctx_2d=ctx_2d)
    want, A = f64_logits(c)
    got = deepgemm.fp8_paged_mqa_logits(c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, c["S"], clean)
    check(got, want, A, REL_F32, f"deepgemm stand-in seed={seed}", clean=clean)
    ctx2 = fake.calls[-1][3]
    assert torch.equal(ctx2.long(), R.row_lengths(c["ctx"], N, 10**9))
    if N == 1 and not ctx_2d:
        assert ctx2.data_ptr() == c["ctx"].data_ptr()      # a view, no copy


# --------------------------------------------------------------------------- #
# TileLang: lowering to CUDA source for every target (sm_120 included) with no GPU
# --------------------------------------------------------------------------- #
def _tilelang_kernel():
    pytest.importorskip("tilelang")
    from capdispatch.backends.indexer import tilelang_kernel
    return tilelang_kernel


# The devices the kernel is built for, by compute capability, and the TileLang/nvcc target
# each must get: arch-specific (`a`) from SM90, where the kernel's wgmma (SM90) needs it and
# the JIT builds for the card it runs on anyway.
_TILELANG_DEVICES = [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90a"),
                     ((10, 0), "sm_100a"), ((12, 0), "sm_120a")]
_CC_IDS = [f"cc{major}.{minor}" for (major, minor), _ in _TILELANG_DEVICES]


@functools.lru_cache(maxsize=None)
def _ptx_table():
    import yaml
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ptx_instructions.yaml")) as f:
        table = yaml.safe_load(f)
    assert table["schema"] == 1
    return table["instructions"]


def _target_accepts(rule: dict, target: str) -> bool:
    m = re.fullmatch(r"sm_(\d+)([af]?)", target)
    assert m, target
    if "only" in rule:
        return target in rule["only"]
    return int(m.group(1)) >= rule["min_sm"]


@functools.lru_cache(maxsize=None)
def _tilelang_source(target: str) -> str:
    """The kernel lowered for `target` (about 10 s each: lowered once per target per run)."""
    return _tilelang_kernel().lower_cuda_source(target)


def _nvcc_env(nvcc):
    return dict(os.environ, PATH=os.path.dirname(nvcc) + os.pathsep + os.environ.get("PATH", ""))


@functools.lru_cache(maxsize=None)
def _tilelang_ptx(target: str) -> str:
    """The lowered source built to PTX by nvcc for exactly `target`, as TileLang's JIT builds
    it (-std=c++20, its templates and CUTLASS), then assembled by ptxas for that target."""
    import subprocess
    import tempfile
    import tilelang.env as tenv
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (CUDA toolkit, or pip install nvidia-cuda-nvcc nvidia-cuda-cccl "
                    "nvidia-cuda-runtime nvidia-cuda-crt nvidia-nvvm of one CUDA version)")
    inc = os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include")
    with tempfile.TemporaryDirectory() as d:
        cu, ptx, cubin = (os.path.join(d, "k" + ext) for ext in (".cu", ".ptx", ".cubin"))
        with open(cu, "w") as f:
            f.write(_tilelang_source(target))
        cmd = [nvcc, "-ptx", "-std=c++20", "-w", "-O3", f"-arch={target}", "-I" + tenv.TILELANG_TEMPLATE_PATH,
               "-I" + tenv.CUTLASS_INCLUDE_DIR, "-I" + inc, "-o", ptx, cu]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_nvcc_env(nvcc))
        assert p.returncode == 0, p.stderr[-3000:]
        ptxas = _find_nvcc("ptxas")
        assert ptxas, f"nvcc at {nvcc} but no ptxas"
        p = subprocess.run([ptxas, f"-arch={target}", ptx, "-o", cubin], capture_output=True, text=True,
                           timeout=600, env=_nvcc_env(nvcc))
        assert p.returncode == 0, f"ptxas -arch={target}: {p.stderr[-3000:]}"
        assert os.path.getsize(cubin) > 0
        with open(ptx) as f:
            return f.read()


@pytest.mark.parametrize("cc,want", _TILELANG_DEVICES, ids=_CC_IDS)
def test_tilelang_target_per_device(cc, want):
    assert _tilelang_kernel().target_arch(*cc) == want


@pytest.mark.parametrize("cc,_want", _TILELANG_DEVICES, ids=_CC_IDS)
def test_tilelang_lowers_to_cuda(cc, _want):
    K = _tilelang_kernel()
    src = _tilelang_source(K.target_arch(*cc))
    assert "fp8_paged_mqa_logits_kernel" in src and "__global__" in src
    if cc < (8, 9):
        # No fp8 MMA exists below cc 8.9: the bytes are widened to fp16 and fp16 MMA runs.
        assert "kFloat8" not in src and "mma_sync<tl::DataType::kFloat16" in src
        assert not K.native_fp8_for_arch(K.target_arch(*cc))
    elif cc == (9, 0):
        assert "wgmma_ss<tl::DataType::kFloat8_e4m3" in src
    else:
        assert "mma_sync<tl::DataType::kFloat8_e4m3" in src and "wgmma" not in src


@pytest.mark.parametrize("cc,_want", _TILELANG_DEVICES, ids=_CC_IDS)
def test_tilelang_source_uses_only_what_its_target_runs(cc, _want):
    """The CUDA source lowered for the device's target calls no wrapper of an instruction that
    target cannot take (tests/ptx_instructions.yaml). A kernel built for `sm_90` that calls
    wgmma compiles, and asserts on the device at its first launch (the H200 failure)."""
    target = _tilelang_kernel().target_arch(*cc)
    src = _tilelang_source(target)
    bad = [f"{name} ({rule['source']})" for name, rule in _ptx_table().items()
           if not _target_accepts(rule, target) and any(re.search(rx, src) for rx in rule["cuda"])]
    assert not bad, f"source lowered for {target} uses what {target} cannot run: {bad}"


@pytest.mark.parametrize("cc,_want", _TILELANG_DEVICES, ids=_CC_IDS)
def test_tilelang_ptx_uses_only_what_its_target_runs(cc, _want):
    """Built with nvcc for the device's target: ptxas accepts it, its PTX holds no instruction
    the target cannot take, and no device-side assert (`__assertfail`: a CUTLASS / TileLang
    template path compiled out for this target, such as wgmma without sm_90a). No GPU needed."""
    K = _tilelang_kernel()
    target = K.target_arch(*cc)
    ptx = _tilelang_ptx(target)
    bad = [name for name, rule in _ptx_table().items()
           if not _target_accepts(rule, target) and re.search(rule["ptx"], ptx)]
    assert not bad, f"PTX for {target} uses {bad}"
    assert "__assertfail" not in ptx, f"PTX for {target} calls __assertfail: a template path is compiled out"
    # The multiply is the one the variant means to run.
    rules = _ptx_table()
    if cc == (9, 0):
        assert re.search(rules["wgmma"]["ptx"], ptx)
    elif K.native_fp8_for_arch(target):
        assert re.search(rules["mma.e4m3"]["ptx"], ptx)
    else:
        assert re.search(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32\b", ptx)


def test_ptx_instruction_table_agrees_with_ptxas():
    """Each entry of tests/ptx_instructions.yaml, assembled alone for every target it names or
    excludes: ptxas accepts it exactly where the table says."""
    import subprocess
    import tempfile
    ptxas = _find_nvcc("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not found (CUDA toolkit)")
    targets = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a", "sm_120", "sm_120a"]
    wrong = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "probe.ptx")
        for name, rule in _ptx_table().items():
            for target in targets:
                with open(path, "w") as f:
                    f.write(f".version 9.0\n.target {target}\n.address_size 64\n"
                            f".visible .entry probe() {{\n{rule['probe']}\nret;\n}}\n")
                p = subprocess.run([ptxas, f"-arch={target}", path, "-o", os.path.join(d, "probe.cubin")],
                                   capture_output=True, text=True, timeout=60)
                if (p.returncode == 0) != _target_accepts(rule, target):
                    wrong.append(f"{name} on {target}: ptxas {'accepts' if p.returncode == 0 else 'rejects'}"
                                 f" ({p.stderr.strip()[:160]})")
    assert not wrong, wrong


def test_tilelang_lowers_mtp_and_2d_lengths():
    K = _tilelang_kernel()
    src = K.lower_cuda_source("sm_86", next_n=2, ctx_2d=True)
    assert "__global__" in src


def test_tilelang_adapter_uses_the_installed_api():
    tilelang = pytest.importorskip("tilelang")
    K = _tilelang_kernel()
    params = inspect.signature(tilelang.compile).parameters
    assert "target" in params and "pass_configs" in params
    assert "target" in inspect.signature(tilelang.lower).parameters
    for key in K.PASS_CONFIGS:
        assert key in set(tilelang.PassConfigKey)
    f = K.build_kernel(1, False, True, 64)
    names = [f.buffer_map[v].name for v in f.params if v in f.buffer_map]
    assert names == ["q", "pages", "pages_f32", "weights", "context_lens", "block_table", "splits", "out"], names


# --------------------------------------------------------------------------- #
# Declarations and dispatch
# --------------------------------------------------------------------------- #
def registry():
    """A fresh registry: the built-in op packages (default.yaml names their ops) plus this one."""
    from capdispatch.backends.registry import BUILTIN_OP_PACKAGES, Registry
    reg = Registry()
    for pkg in dict.fromkeys(BUILTIN_OP_PACKAGES + ("capdispatch.backends.indexer",)):
        importlib.import_module(pkg).register(reg)
    return reg


@pytest.fixture
def hide_libs(monkeypatch):
    """Make distributions look absent from this machine (assume_libs can only add)."""
    from importlib import metadata as md
    from capdispatch.capabilities import libraries

    def hide(*names):
        hidden = {n.lower().replace("_", "-") for n in names}

        class _Meta:
            PackageNotFoundError = md.PackageNotFoundError

            @staticmethod
            def version(name):
                if name.lower().replace("_", "-") in hidden:
                    raise md.PackageNotFoundError(name)
                return md.version(name)
        monkeypatch.setattr(libraries, "metadata", _Meta)
    return hide


ASSUME = ["sgl-deep-gemm==0.2.3.post2", "tilelang==0.1.12", "triton==3.9.0", "torch==2.13.0"]

# What docs/ops/indexer.md recommends for capdispatch/policies/default.yaml.
RECOMMENDED_POLICY = """\
schema: 1
ops:
  indexer: [deepgemm, tilelang, triton, torch]
devices:
  - match: {cc: "<8.9"}
    ops:
      indexer: [triton, tilelang, torch]
"""


def test_registration():
    from capdispatch.backends import indexer
    from capdispatch.backends.registry import Registry
    reg = Registry()
    indexer.register(reg)
    assert list(reg.ops) == ["indexer"] and reg.ops["indexer"].reference == "torch"
    assert {b.name for b in reg.backends("indexer")} == {"deepgemm", "tilelang", "triton", "torch"}
    for b in reg.backends("indexer"):
        module, _, fn = b.impl.partition(":")
        assert module.startswith("capdispatch.backends.indexer.") and fn == "op_fp8_paged_mqa_logits"


def test_declarations_import_no_kernel_library():
    import subprocess
    code = ("import sys, capdispatch.backends.indexer as m\n"
            "from capdispatch.backends.registry import Registry\n"
            "m.register(Registry())\n"
            "print(sorted(x for x in sys.modules if x.split('.')[0] in "
            "('torch', 'triton', 'tilelang', 'deep_gemm', 'sglang')))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("device", ["sim:rtx-5090", "sim:rtx-pro-6000", "sim:rtx-3080", "sim:rtx-4090"])
def test_deepgemm_rejected_without_wgmma_or_tcgen05(device):
    import capdispatch as cd
    res = cd.resolve("indexer", device, registry=registry(), assume_libs=ASSUME, env={})
    cand = {c.backend: c for c in res.candidates}["deepgemm"]
    bad = [ch for ch in cand.checks if not ch.ok]
    assert [ch.code for ch in bad] == ["feature:wgmma|tcgen05"], bad
    assert "wgmma" in bad[0].message and "tcgen05" in bad[0].message
    # Below cc 8.9 the default policy prefers Triton (device entry), above it TileLang.
    assert res.backend == ("triton" if res.device.cc < (8, 9) else "tilelang")


@pytest.mark.parametrize("device,hidden,want", [
    ("sim:h200", (), "deepgemm"),
    ("sim:b200", (), "deepgemm"),
    ("sim:h200", ("sgl-deep-gemm",), "tilelang"),
    ("sim:h200", ("sgl-deep-gemm", "tilelang"), "triton"),
    ("sim:rtx-5090", ("sgl-deep-gemm", "tilelang"), "triton"),
    ("sim:rtx-3080", ("sgl-deep-gemm", "tilelang", "triton"), "torch"),
])
def test_default_order(hide_libs, device, hidden, want):
    import capdispatch as cd
    hide_libs(*hidden)
    libs = [a for a in ASSUME if a.split("==")[0] not in hidden]
    res = cd.resolve("indexer", device, registry=registry(), assume_libs=libs, env={})
    assert res.backend == want, [(c.backend, [ch.message for ch in c.checks if not ch.ok]) for c in res.candidates]
    missing = {c.backend: c for c in res.candidates}
    for lib in hidden:
        name = {"sgl-deep-gemm": "deepgemm"}.get(lib, lib)
        assert any(ch.code == f"library:{lib}" and not ch.ok for ch in missing[name].checks)


def test_cpu_choice():
    import capdispatch as cd
    assert cd.resolve("indexer", "cpu", registry=registry(), env={}).backend == "torch"
    res = cd.resolve("indexer", "cpu", registry=registry(), env={"TRITON_INTERPRET": "1"},
                     assume_libs=["triton==3.9.0"])
    assert res.backend == "triton"


@pytest.mark.parametrize("device,want", [("sim:h200", "deepgemm"), ("sim:b200", "deepgemm"),
                                         ("sim:rtx-5090", "tilelang"), ("sim:rtx-4090", "tilelang"),
                                         ("sim:rtx-3080", "triton"), ("sim:a100", "triton")])
def test_recommended_policy(tmp_path, device, want):
    import capdispatch as cd
    p = tmp_path / "indexer.yaml"
    p.write_text(RECOMMENDED_POLICY)
    res = cd.resolve("indexer", device, registry=registry(), assume_libs=ASSUME, env={}, policy=[str(p)])
    assert res.backend == want


@_interp
def test_bind_triton_on_cpu():
    import capdispatch as cd
    fn = cd.bind("indexer", "cpu", backend="triton", registry=registry(), env={"TRITON_INTERPRET": "1"})
    from capdispatch.backends.indexer import triton_kernels
    assert fn.__name__ == "indexer_triton" and fn is triton_kernels.op_fp8_paged_mqa_logits


# --------------------------------------------------------------------------- #
# GPU: DeepSeek-V4 shapes (64 heads x 128, pages of 64 tokens)
# --------------------------------------------------------------------------- #
def _gpu_backends():
    out = [("torch", REL_F32), ("triton_u8", REL_FP16_MMA)]
    if _native_fp8_cuda():
        out += [("triton_native", REL_FP8_MMA), ("triton", REL_FP8_MMA)]
    try:
        import tilelang  # noqa: F401
        out.append(("tilelang", REL_FP8_MMA if _native_fp8_cuda() else REL_FP16_MMA))
    except Exception:
        pass
    try:
        import deep_gemm  # noqa: F401
        if torch.cuda.get_device_capability()[0] in (9, 10):
            out.append(("deepgemm", REL_FP8_MMA))
    except Exception:
        pass
    return out


def _gpu_case(gen, shape):
    """decode: B rows of next_n, contexts around ctx; prefill: one request's causal rows
    (the DSv4 C4 indexer: row i sees (start + i + 1) // 4 compressed tokens)."""
    if shape[0] == "decode":
        _, B, N, ctx = shape
        lens = torch.randint(max(N, ctx // 2), ctx + 1, (B,), generator=gen).tolist()
        return make_case(gen, B, N, 64, ctx, lens, device="cuda", kind="quant", junk_table=False)
    _, rows, start = shape
    lens = [[(start + i + 1) // 4] for i in range(rows)]
    S = (start + rows) // 4
    return make_case(gen, rows, 1, 64, S, lens, ctx_2d=True, device="cuda", kind="quant", junk_table=False,
                     shared_pages=True)


GPU_SHAPES = [("decode", 64, 1, 8192), ("decode", 16, 2, 16384), ("decode", 3, 1, 65536),
              ("prefill", 2048, 6144)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_gpu_backends_match_float64(shape):
    if not HAS_CUDA or INTERPRET:
        pytest.skip("needs a CUDA device without TRITON_INTERPRET")
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    c = _gpu_case(gen, shape)
    want, A = f64_logits(c)
    report = []
    for backend, rel in _gpu_backends():
        clean = backend != "deepgemm"
        got = run(backend, c, **({} if clean else {"clean_logits": False}))
        torch.cuda.synchronize()
        err, ratio = check(got, want, A, rel, f"{backend} {shape} seed={seed}", clean=clean)
        report.append(f"{backend}: max|err| {err:.3g}, max|err|/A {ratio:.3g}")
    print(f"[{shape} seed={seed}] " + "; ".join(report))


@pytest.mark.gpu
def test_gpu_poisoned_output_fully_written():
    if not HAS_CUDA or INTERPRET:
        pytest.skip("needs a CUDA device without TRITON_INTERPRET")
    gen = torch.Generator().manual_seed(new_seed())
    c = _gpu_case(gen, ("decode", 8, 2, 4096))
    for backend, _ in _gpu_backends():
        if backend == "deepgemm":
            continue
        out = torch.full((16, c["S"]), float("nan"), device="cuda")
        got = run(backend, c, out=out)
        assert not torch.isnan(got).any(), backend


@pytest.mark.gpu
def test_gpu_reference_memory_is_bounded_by_its_chunk():
    """The torch reference's peak memory beyond inputs and result at 8k and 32k tokens
    (prefill rows, C4 context = tokens / 4) stays within the accounted step size."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    extra = {}
    for tokens in (8192, 32768):
        S = tokens // 4
        P = -(-S // 64)
        kv = torch.randint(0, 0x70, (P, 64, 1, 132), dtype=torch.uint8, generator=gen).cuda()
        kv.view(P, -1)[:, L.SCALE_OFFSET:].view(torch.float32).fill_(1.0 / 64)
        q = torch.randint(0, 0x70, (tokens, 1, 64, 128), dtype=torch.uint8, generator=gen).cuda()
        w = torch.randn(tokens, 64, generator=gen).cuda()
        ctx = ((torch.arange(tokens) + 1) // 4).int().cuda()
        bt = torch.arange(P, dtype=torch.int32).cuda().expand(tokens, P)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = R.fp8_paged_mqa_logits(q.view(torch.float8_e4m3fn), kv, w, ctx, bt, None, S)
        torch.cuda.synchronize()
        extra[tokens] = torch.cuda.max_memory_allocated() - base - out.numel() * 4
        plan = R.plan_steps(tokens, 1, 64, P)
        assert extra[tokens] <= plan.bytes * 1.25 + (8 << 20), (tokens, extra[tokens], plan)
        del out
    assert extra[32768] <= extra[8192] * 1.25 + (8 << 20), extra


_AOT_SCRIPT = r"""
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from capdispatch.backends.indexer import triton_kernels as tk
assert isinstance(tk._indexer_kernel, triton.runtime.jit.JITFunction)
SIG = {"q_ptr": "*u8", "kv_ptr": "*u8", "w_ptr": "*fp32", "ctx_ptr": "*i32", "bt_ptr": "*i32",
       "out_ptr": "*fp32", "max_ctx": "i32", "tokens_per_split": "i32", "kv_page_stride": "i32",
       "w_stride": "i32", "ctx_stride": "i32", "bt_stride": "i32", "out_stride": "i32"}
out = {}
for cc, native, next_n in json.loads(sys.argv[1]):
    const = dict(NEXT_N=next_n, HP=64, H=64, D=128, CTX_2D=next_n > 1,
                 NATIVE_FP8=native, BLOCK=64, NUM_STAGES=2)
    sig = dict(SIG, **({"q_ptr": "*fp8e4nv", "kv_ptr": "*fp8e4nv"} if native else {}))
    src = ASTSource(fn=tk._indexer_kernel, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
    try:
        out[f"{cc}-{native}-{next_n}"] = triton.compile(src, target=GPUTarget("cuda", cc, 32)).asm["ptx"]
    except Exception as exc:
        out[f"{cc}-{native}-{next_n}"] = "ERROR " + type(exc).__name__ + ": " + str(exc)[:2000]
print(json.dumps(out))
"""

_AOT_CASES = [
    (86, False, 1, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"),
    (90, True, 1, "wgmma.mma_async.sync.aligned"),
    (90, True, 2, "wgmma.mma_async.sync.aligned"),
    (120, True, 1, "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"),
    (86, True, 1, "ERROR"),
]


@functools.lru_cache(maxsize=None)
def _aot_ptx():
    """Build the Triton kernel ahead of time for several CUDA targets in a fresh process
    (the JIT, not the interpreter; Triton ships ptxas, so no GPU is needed)."""
    import json
    import subprocess
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cases = json.dumps([[cc, native, n] for cc, native, n, _ in _AOT_CASES])
    p = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, cases], capture_output=True, text=True, env=env,
                       timeout=600, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cc,native,next_n,want", _AOT_CASES)
def test_triton_kernel_compiles_for_each_target(cc, native, next_n, want):
    """sm_86 gets the uint8 variant (no fp8 anywhere in it; the native one is refused
    there, as Triton admits fp8e4nv only from cc 8.9); sm_90 multiplies fp8 with wgmma,
    sm_120 with fp8 mma.sync."""
    ptx = _aot_ptx()[f"{cc}-{native}-{next_n}"]
    if want == "ERROR":
        assert ptx.startswith("ERROR") and "fp8e4nv" in ptx, ptx[:300]
        return
    assert want in ptx, ptx[:300]
    assert ("e4m3" in ptx) == native


def _find_nvcc(tool: str = "nvcc"):
    """`tool` (nvcc, ptxas) from PATH, CUDA_HOME, or the pip `nvidia-cuda-nvcc` package; None if absent."""
    import shutil
    cands = [shutil.which(tool), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", tool)]
    try:
        import nvidia
        for base in list(nvidia.__path__):
            cands += [os.path.join(base, sub, "bin", tool) for sub in ("cu13", "cu12", "cuda_nvcc")]
    except ImportError:
        pass
    return next((c for c in cands if c and os.path.isfile(c)), None)

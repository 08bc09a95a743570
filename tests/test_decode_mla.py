"""decode_mla: torch reference, Triton kernels (uint8 integer decode and native fp8),
FlashMLA / FlashInfer adapters, declarations.

Contract: capdispatch/backends/decode_mla/reference.py (SGLang 0.5.23's DSv4 decode call
site with FlashMLA's decode semantics: lse natural-log [b, h, s_q], sink not included,
+inf and out 0 for a query with no valid entry).

CPU (no CUDA): torch on the CPU, Triton under the interpreter (TRITON_INTERPRET=1 set
per test before the kernel module is imported) at small sizes. ``gpu``-marked tests run
the full DeepSeek-V4 decode/extend shapes (h = 64, page size 256, top-k 512 plus a
compressed pool with page size 64). Fresh seeds from ``random.SystemRandom``, named in
messages; ATTN_TEST_SEED=<int> replays one.

Pools are written with the KV op's torch ``kv_quant`` from random bf16 rows, so they hold
exactly what DeepSeek-V4 stores. Tolerances, against the fp32 torch reference on the same
pool: out ||out - ref|| / ||ref|| <= 1e-2, lse |got - ref| <= 1e-3 where finite and the
same infinities (reasons as in test_sparse_prefill.py: the dequantised rows are exact
bf16 values on both sides, the kernels round P and the output to bf16 and accumulate in
fp32). The float64 check decodes the pool bytes independently (pure-Python IEEE e4m3
table from tests/ieee_fp8.py, layout offsets from layout.py).

Interpreter caveats: see test_sparse_prefill.py (bf16 dot); the native-fp8 loads decode
finite codes correctly under the interpreter (NaN codes do not, and pools written by
kv_quant never hold them).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

from triton_env import HAS_CUDA, INTERPRET, _triton_interpreter  # noqa: E402,F401 (autouse fixture)


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ieee_fp8 as F  # noqa: E402

from capdispatch.backends.decode_mla import reference as R  # noqa: E402
from capdispatch.backends.decode_mla.library_args import DECODE_TOPK_ALIGN  # noqa: E402
from capdispatch.backends import v4_layout as L  # noqa: E402
import v4_offsets as O  # noqa: E402
from capdispatch.backends.kv_cache import reference as KV  # noqa: E402

from attention_checks import (ASSUME, OUT_RTOL, SCALE, STAT_ATOL, assert_stats_close,  # noqa: E402,F401
                              flashmla_runs, new_seed, rel_err, v4_pool as make_pool)
from capdispatch.backends.decode_mla.inputs import make_case  # noqa: E402

_gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
_interp = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")
_no_interp_on_gpu = pytest.mark.skipif(INTERPRET, reason="GPU Triton run with TRITON_INTERPRET set")


def _native_fp8_cuda() -> bool:
    return HAS_CUDA and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)


def _flashinfer_runs() -> bool:
    if not HAS_CUDA or torch.cuda.get_device_capability()[0] != 12:
        return False
    try:
        from flashinfer.mla import SparseMLASm120Wrapper  # noqa: F401
    except Exception:   # noqa: BLE001
        return False
    return True


_fp8_cc = pytest.mark.skipif(HAS_CUDA and not _native_fp8_cuda(), reason="native fp8 needs cc >= 8.9")
_flashmla = pytest.mark.skipif(not flashmla_runs(), reason="needs sgl-flash-mla (flash_mla) on SM90/SM100")
_flashinfer = pytest.mark.skipif(not _flashinfer_runs(), reason="needs flashinfer-python on SM120/SM121")

CASES = [
    pytest.param("torch", "cpu", id="torch-cpu"),
    pytest.param("triton", "cpu", id="triton-interp", marks=_interp),
    pytest.param("triton_fp8", "cpu", id="triton_fp8-interp", marks=_interp),
    pytest.param("torch", "cuda", id="torch-cuda", marks=_gpu),
    pytest.param("triton", "cuda", id="triton-cuda", marks=_gpu + [_no_interp_on_gpu]),
    pytest.param("triton_fp8", "cuda", id="triton_fp8-cuda", marks=_gpu + [_no_interp_on_gpu, _fp8_cc]),
    pytest.param("flashmla", "cuda", id="flashmla-cuda", marks=_gpu + [_flashmla]),
    pytest.param("flashinfer_sparse_mla", "cuda", id="flashinfer-cuda", marks=_gpu + [_flashinfer]),
]
KERNEL_CASES = [c for c in CASES if c.values[0] != "torch"]
LOCAL_CASES = [c for c in CASES if c.values[0] in ("torch", "triton", "triton_fp8")]


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=None)
def _tk():
    from capdispatch.backends.decode_mla import triton_kernels
    from capdispatch.backends.sparse_attention import kernels as core
    if INTERPRET and not core.INTERPRETED:
        importlib.reload(core)
        triton_kernels = importlib.reload(triton_kernels)
    elif INTERPRET and not triton_kernels.INTERPRETED:
        triton_kernels = importlib.reload(triton_kernels)
    return triton_kernels


def op(backend):
    if backend == "torch":
        return R.decode_mla
    if backend == "triton":
        return _tk().decode_mla_u8
    if backend == "triton_fp8":
        return _tk().decode_mla_fp8
    from capdispatch.backends.decode_mla import flashinfer, flashmla
    return getattr({"flashmla": flashmla, "flashinfer_sparse_mla": flashinfer}[backend], backend)



def check_against(got, want, msg):
    o, lse = got
    ro, rlse = want
    assert o.shape == ro.shape and o.dtype == torch.bfloat16 and lse.shape == rlse.shape, msg
    assert bool(torch.isfinite(o).all()), f"{msg}: non-finite output"
    e = rel_err(o, ro)
    assert e <= OUT_RTOL, f"{msg}: out relative error {e:.3g} > {OUT_RTOL}"
    assert_stats_close(lse, rlse, msg + " lse")


@functools.lru_cache(maxsize=None)
def _e4m3_table():
    return torch.tensor([F.decode(c) for c in range(256)], dtype=torch.float64)


def dequant_f64(pool, page_size, token):
    """Token ``token`` of ``pool`` in float64, decoded from its bytes independently of
    torch's fp8 dtype and of the KV op's code (IEEE table + layout offsets)."""
    flat = pool.cpu().contiguous().view(-1)
    bpp = pool.shape[1]
    d = O.token_data_offset(token, page_size, bpp)
    s = O.token_scale_offset(token, page_size, bpp)
    codes = flat[d:d + 448].long()
    scales = torch.tensor([math.ldexp(1.0, int(x) - 127) for x in flat[s:s + 7].tolist()], dtype=torch.float64)
    nope = _e4m3_table()[codes] * scales.repeat_interleave(64)
    rope = torch.tensor([F.bf16_from_bits(int(x)) for x in flat[d + 448:d + 576].view(torch.int16).tolist()],
                        dtype=torch.float64)
    return torch.cat([nope, rope])


def dense_f64(q, pool, idx, page_size, sm_scale, topk_length=None, attn_sink=None, extra_pool=None,
              extra_indices=None, extra_page_size=None, extra_topk_length=None):
    b, s_q, h, _ = q.shape
    out = torch.zeros(b, s_q, h, 512, dtype=torch.float64)
    lse = torch.full((b, h, s_q), math.inf, dtype=torch.float64)
    lists = [(pool, idx, page_size, topk_length)]
    if extra_pool is not None:
        lists.append((extra_pool, extra_indices, extra_page_size, extra_topk_length))
    for bi in range(b):
        for si in range(s_q):
            rows = []
            for p, ix, ps, ln in lists:
                cap = p.shape[0] * ps
                n = ix.shape[2] if ln is None else int(ln[bi])
                rows += [dequant_f64(p, ps, t) for t in ix[bi, si, :n].tolist() if 0 <= t < cap]
            if not rows:
                continue
            k = torch.stack(rows)
            logits = (q[bi, si].double().cpu() @ k.T) * sm_scale
            l_e = torch.logsumexp(logits, dim=1)
            o = torch.softmax(logits, dim=1) @ k
            if attn_sink is not None:
                o = o * torch.sigmoid(l_e - attn_sink.double().cpu())[:, None]
            out[bi, si] = o
            lse[bi, :, si] = l_e
    return out, lse


# --------------------------------------------------------------------------- #
# Against the reference / float64
# --------------------------------------------------------------------------- #
VARIANTS = {
    "main": dict(),
    "lengths+sink": dict(lengths=True, sink=True),
    "extra": dict(extra=(4, 6, 24), lengths=True, sink=True),
    "mtp": dict(lengths=True, sink=True, s_q=2),
}


@pytest.mark.parametrize("backend,device", KERNEL_CASES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(backend, device, variant):
    seed = new_seed()
    msg = f"{backend}/{device}/{variant} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    v = dict(VARIANTS[variant])
    s_q = v.pop("s_q", 1)
    if device == "cuda":
        if "extra" in v:
            v["extra"] = (64, 40, 512)
        q, pool, idx, ps, kw = make_case(gen, 24, s_q, 64, device, page_size=256, num_pages=12, topk=512,
                                         lonely=(1,), **v)
    else:
        q, pool, idx, ps, kw = make_case(gen, 3, s_q, 20, device, lonely=(1,), **v)
    want = R.decode_mla(q, pool, idx, ps, SCALE, **kw)
    got = op(backend)(q, pool, idx, ps, SCALE, **kw)
    check_against(got, want, msg)


@pytest.mark.parametrize("backend,device", LOCAL_CASES[:3])
def test_against_float64_dense(backend, device):
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    q, pool, idx, ps, kw = make_case(gen, 3, 1, 18, device, topk=24, extra=(4, 5, 16), lengths=True,
                                     sink=True, lonely=(2,))
    got = op(backend)(q, pool, idx, ps, SCALE, **kw)
    want = dense_f64(q, pool, idx, ps, SCALE, **kw)
    check_against(tuple(t.cpu() for t in got), want, msg)
    if backend == "torch":
        # The fp32 reference must sit within a few fp32 ulps of the float64 lse: 8 ulps of
        # the largest |lse| (lse grows with the logits, so an absolute bound would be arbitrary).
        w = want[1][torch.isfinite(want[1])].abs()
        atol = 8 * 2.0**-23 * max(1.0, float(w.max())) if w.numel() else 0.0
        assert_stats_close(got[1], want[1], msg + f" lse (reference, 8 ulps = {atol:.2g})", atol=atol)


@_interp
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("splits", [2, 5])
def test_split_k_path(native, splits):
    """The decode-sized split-K kernel plus combine (forced here; on the GPU it is chosen
    for <= 64 tokens that would leave SMs idle) matches the reference."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    q, pool, idx, ps, kw = make_case(gen, 3, 1, 20, "cpu", topk=56, extra=(4, 6, 40), lengths=True,
                                     sink=True, lonely=(0,))
    tk = _tk()
    got = tk._launch(q, pool, idx, ps, SCALE, kw["topk_length"], kw["attn_sink"], kw["extra_pool"],
                     kw["extra_indices"], kw["extra_page_size"], kw["extra_topk_length"], None, native,
                     num_splits=splits)
    check_against(got, R.decode_mla(q, pool, idx, ps, SCALE, **kw), f"splits={splits} seed={seed}")


# --------------------------------------------------------------------------- #
# Masking, lonely queries, outputs, pool forms
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("backend,device", LOCAL_CASES)
def test_masked_entries_never_read(backend, device):
    """The pool is a window of a buffer whose pages before and after it are 0xFF bytes (NaN
    codes, infinite scales): ids < 0 reach the page before, ids >= capacity the page after;
    the tokens named only past topk_length are overwritten the same way. Any read of a
    masked entry would make the output non-finite, through uint8 or native fp8. The result
    equals the one with masked entries compacted away."""
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    b, h, ps, npg, topk = 4, 20, 16, 6, 48
    pool, buf = make_pool(gen, npg, ps, "cpu", spare_pages=2)
    cap = npg * ps
    nan_tokens = [3, 50, 77]
    data, scales = KV._page_views(pool, ps)
    for t in nan_tokens:
        data[t // ps, t % ps] = 0xFF
        scales[t // ps, t % ps] = 0xFF
    ok = torch.tensor([t for t in range(cap) if t not in nan_tokens])
    idx = torch.stack([ok[torch.randperm(len(ok), generator=gen)[:topk]] for _ in range(b)]).int()
    lengths = torch.randint(8, topk - 8, (b,), generator=gen, dtype=torch.int32)
    junk = torch.tensor([-1, -7, cap, cap + ps + 1], dtype=torch.int32)
    for i in range(b):
        n = int(lengths[i])
        idx[i, torch.randperm(n, generator=gen)[:4]] = junk
        idx[i, n:] = torch.tensor(nan_tokens, dtype=torch.int32)[torch.randint(0, 3, (topk - n,), generator=gen)]
    buf = buf.to(device)
    pool = buf[2:2 + npg]
    q = torch.randn(b, 1, h, 512, generator=gen).bfloat16().to(device)
    got = op(backend)(q, pool, idx.view(b, 1, topk).to(device), ps, SCALE, lengths.to(device))
    assert bool(torch.isfinite(got[0]).all()) and bool(torch.isfinite(got[1]).all()), \
        f"{msg}: a masked entry was read"
    rows = []
    for i in range(b):
        v = [t for t in idx[i, :int(lengths[i])].tolist() if 0 <= t < cap]
        v = torch.tensor(v)[torch.randperm(len(v), generator=gen)]
        rows.append(torch.cat([v, torch.full((topk - len(v),), -1)]))
    compact = torch.stack(rows).int().view(b, 1, topk).to(device)
    check_against(got, R.decode_mla(q, pool, compact, ps, SCALE), msg)


@pytest.mark.parametrize("backend,device", CASES)
def test_all_masked_query(backend, device):
    """No valid entry in either list: out exactly 0 and lse +inf (FlashMLA's decode
    convention), with or without a sink. Query 0: main list all -1 but the extra list
    valid (finite); query 1: both lengths 0; query 2: both lists all -1; query 3: normal."""
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    h = 64 if device == "cuda" else 20
    extra = (64, 8, 64) if device == "cuda" else (4, 6, 24)
    q, pool, idx, ps, kw = make_case(gen, 4, 1, h, device, topk=64, extra=extra, sink=True)
    etopk = kw["extra_indices"].shape[2]
    idx[0] = -1
    idx[2] = -1
    kw["extra_indices"][2] = -1
    kw["extra_indices"][0, 0, 0] = 5     # at least one valid extra entry for query 0
    kw["topk_length"] = torch.tensor([64, 0, 64, 64], dtype=torch.int32, device=device)
    kw["extra_topk_length"] = torch.tensor([etopk, 0, etopk, etopk], dtype=torch.int32, device=device)
    for sink in (kw["attn_sink"], None):
        o, lse = op(backend)(q, pool, idx, ps, SCALE, **dict(kw, attn_sink=sink))
        for i in (1, 2):
            assert bool((o[i].float() == 0).all()), f"{msg}: lonely query {i} output not 0"
            assert bool((lse[i] == math.inf).all()), f"{msg}: lonely lse {lse[i].flatten()[:4]}"
        for i in (0, 3):
            assert bool(torch.isfinite(lse[i]).all()) and bool((o[i].float() != 0).any()), f"{msg}: query {i}"


@pytest.mark.parametrize("backend,device", LOCAL_CASES)
def test_poisoned_out_fully_written(backend, device):
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    b, s_q, h = 3, 2, 20
    q, pool, idx, ps, kw = make_case(gen, b, s_q, h, device, extra=(4, 6, 24), lengths=True, sink=True,
                                     lonely=(1,))
    f = op(backend)
    fresh = f(q, pool, idx, ps, SCALE, **kw)
    for bits in (0x7FC1, -0x5455):
        ws = torch.full((b, s_q, h, 520), bits, dtype=torch.int16, device=device).view(torch.bfloat16)
        out = ws[..., 5:517]
        res = f(q, pool, idx, ps, SCALE, **kw, out=out)
        assert res[0].data_ptr() == out.data_ptr(), f"{msg}: out= not returned"
        assert torch.equal(out.view(torch.int16), fresh[0].view(torch.int16)), f"{msg}: out= not all written"
        assert bool((ws.view(torch.int16)[..., :5] == bits).all()), f"{msg}: wrote outside out="
        assert bool((ws.view(torch.int16)[..., 517:] == bits).all()), f"{msg}: wrote outside out="
        assert torch.equal(res[1], fresh[1]), msg


@pytest.mark.parametrize("backend,device", LOCAL_CASES)
def test_flashmla_view_of_the_pool(backend, device):
    """SGLang hands FlashMLA the pool as a [num_pages, page_size, 1, 584] view over the
    padded pages; the op accepts it and gives the same result as the 2-D pool."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    q, pool, idx, ps, kw = make_case(gen, 3, 1, 20, device, lengths=True, sink=True)
    view = pool[:, :ps * L.TOKEN_BYTES].view(pool.shape[0], ps, 1, L.TOKEN_BYTES)
    a = op(backend)(q, pool, idx, ps, SCALE, **kw)
    b_ = op(backend)(q, view, idx, ps, SCALE, **kw)
    c = op(backend)(q, view.view(torch.float8_e4m3fn), idx, None, SCALE, **kw)
    for x in (b_, c):
        assert torch.equal(a[0], x[0]) and torch.equal(a[1], x[1]), f"seed={seed}"


def test_reference_chunking_is_exact(monkeypatch):
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    q, pool, idx, ps, kw = make_case(gen, 5, 2, 8, "cpu", extra=(4, 6, 24), lengths=True, sink=True)
    whole = R.decode_mla(q, pool, idx, ps, SCALE, **kw)
    monkeypatch.setattr(R, "GATHER_BUDGET", 64 * 512 * 3)   # 3 tokens per chunk
    chunked = R.decode_mla(q, pool, idx, ps, SCALE, **kw)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b), f"seed={seed}"


def test_argument_errors():
    q = torch.zeros(2, 1, 4, 512, dtype=torch.bfloat16)
    pool = KV.new_pool(4, 16)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be"):
        R.decode_mla(q[:, 0], pool, idx, 16, SCALE)
    with pytest.raises(ValueError, match="needs >="):
        R.decode_mla(q, pool, idx, 64, SCALE)
    with pytest.raises(ValueError, match="page_size is required"):
        R.decode_mla(q, pool, idx, None, SCALE)
    with pytest.raises(ValueError, match="indices"):
        R.decode_mla(q, pool, idx[:1], 16, SCALE)
    with pytest.raises(ValueError, match="together"):
        R.decode_mla(q, pool, idx, 16, SCALE, extra_pool=pool)
    with pytest.raises(ValueError, match="topk_length"):
        R.decode_mla(q, pool, idx, 16, SCALE, topk_length=torch.zeros(3, dtype=torch.int32))
    view = pool[:, :16 * L.TOKEN_BYTES].view(4, 16, 1, L.TOKEN_BYTES)
    with pytest.raises(ValueError, match="page size 16"):
        R.decode_mla(q, view, idx, 8, SCALE)


# --------------------------------------------------------------------------- #
# Declarations, dispatch, external signatures
# --------------------------------------------------------------------------- #
def registry():
    from capdispatch.backends.registry import BUILTIN_OP_PACKAGES, Registry
    reg = Registry()
    for pkg in dict.fromkeys(BUILTIN_OP_PACKAGES + ("capdispatch.backends.decode_mla",)):
        importlib.import_module(pkg).register(reg)
    return reg


@pytest.mark.parametrize("device,want", [
    ("sim:h200", "flashmla"), ("sim:b200", "flashmla"), ("sim:rtx-5090", "flashinfer_sparse_mla"),
    ("sim:rtx-pro-6000", "flashinfer_sparse_mla"), ("sim:rtx-4090", "triton_fp8"), ("sim:rtx-3080", "triton"),
])
def test_default_choice(device, want):
    import capdispatch as cd
    res = cd.resolve("decode_mla", device, registry=registry(), assume_libs=ASSUME)
    assert res.backend == want


def test_requirements_name_what_is_missing():
    import capdispatch as cd
    res = cd.resolve("decode_mla", "sim:rtx-3080", registry=registry(), assume_libs=ASSUME)
    c = {x.backend: x for x in res.candidates}
    why = lambda name: [ch.code for ch in c[name].checks if not ch.ok]  # noqa: E731
    assert why("flashmla") == ["feature:wgmma|tcgen05"]
    assert why("flashinfer_sparse_mla") == ["feature:sm120_block_scaled_mma"]
    assert why("triton_fp8") == ["feature:fp8_e4m3"]
    res = cd.resolve("decode_mla", "sim:rtx-5090", registry=registry(), assume_libs=ASSUME)
    c = {x.backend: x for x in res.candidates}
    assert why("flashmla") == ["feature:wgmma|tcgen05"]
    res = cd.resolve("decode_mla", "sim:rtx-5090", registry=registry(),
                     assume_libs=["flashinfer-python==0.6.14", "triton==3.9.0", "torch==2.13.0"])
    c = {x.backend: x for x in res.candidates}
    assert "library:flashinfer-python" in why("flashinfer_sparse_mla")


def test_flashinfer_adapter_matches_library_signature():
    """The names the adapter passes exist in the installed flashinfer's real API."""
    pytest.importorskip("flashinfer", reason="pip install --no-deps flashinfer-python==0.7.2 apache-tvm-ffi")
    from flashinfer.mla import SparseMLASm120Wrapper
    init = inspect.signature(SparseMLASm120Wrapper.__init__).parameters
    for name in ("d_v", "kv_scale_format", "kv_cache_format", "device"):
        assert name in init, name
    run = inspect.signature(SparseMLASm120Wrapper.run).parameters
    assert list(run)[1:6] == ["q", "kv_cache", "indices", "output", "sm_scale"], list(run)
    for name in ("topk_length", "attn_sink", "extra_kv_cache", "extra_indices", "extra_topk_length",
                 "out_lse", "return_lse", "lse_scale"):
        assert name in run and run[name].kind == inspect.Parameter.KEYWORD_ONLY, name
    from capdispatch.backends.decode_mla import flashinfer
    src = inspect.getsource(flashinfer)
    for name in ("extra_kv_cache=", "extra_indices=", "extra_topk_length=", "topk_length=", "attn_sink=",
                 "out_lse=", "return_lse=False", "lse_scale=math.log(2.0)", "SparseMLASm120Wrapper(d_v=DIM",
                 'kv_scale_format="auto"', 'kv_cache_format="fp8"'):
        assert name in src, name


def _flash_mla_interface_source():
    import importlib.util
    spec = importlib.util.find_spec("flash_mla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sgl-flash-mla is not installed (pip install --no-deps sgl-flash-mla==1.0.0)")
    with open(os.path.join(list(spec.submodule_search_locations)[0], "flash_mla_interface.py")) as f:
        return f.read()


def test_flashmla_adapter_matches_library_signature():
    """flash_mla is a CUDA-only extension (it does not import on a CPU machine): its Python
    interface is read from the installed sources and the adapter's keywords checked."""
    import ast
    src = _flash_mla_interface_source()
    tree = ast.parse(src)
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    a = fns["flash_mla_with_kvcache"].args
    params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    from capdispatch.backends.decode_mla import flashmla
    call = inspect.getsource(flashmla.flashmla)
    for name in ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                 "softmax_scale", "is_fp8_kvcache", "indices", "attn_sink", "topk_length", "use_legacy",
                 "extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length"):
        assert name in params, name
        assert f"{name}=" in call, name
    assert "get_mla_metadata" in fns and "flash_mla.get_mla_metadata()[0]" in call


def test_contract_signatures_agree():
    from capdispatch.backends.decode_mla import flashinfer, flashmla
    want = list(inspect.signature(R.decode_mla).parameters)
    for fn in (flashmla.flashmla, flashinfer.flashinfer_sparse_mla):
        assert list(inspect.signature(fn).parameters) == want, fn.__name__
    if INTERPRET or HAS_CUDA:
        for fn in (_tk().decode_mla_u8, _tk().decode_mla_fp8):
            assert list(inspect.signature(fn).parameters) == want, fn.__name__


def _index_prep():
    from capdispatch.backends.decode_mla import index_prep
    if INTERPRET and not index_prep.INTERPRETED:
        index_prep = importlib.reload(index_prep)
    return index_prep


@pytest.mark.skipif(not (INTERPRET or HAS_CUDA), reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(3, 1, 70), (2, 2, 128), (4, 5), (2, 0)])
def test_clean_ids_matches_torch(dtype, shape):
    """The external adapters' one-launch index cleaning: ids outside [0, capacity) (any
    negative, capacity and beyond) become -1, lists padded with -1 to a multiple of 64,
    int32 out; every element of a poisoned output is written."""
    ip = _index_prep()
    seed = new_seed()
    g = torch.Generator().manual_seed(seed)
    cap = 1000
    idx = torch.randint(-20, cap + 50, shape, generator=g, dtype=torch.int64).to(dtype)
    if idx.numel():
        idx.view(-1)[0] = cap            # exactly the capacity: out of range
        idx.view(-1)[-1] = cap - 1       # the last valid id
    dev = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
    idx = idx.to(dev)
    k = shape[-1]
    assert DECODE_TOPK_ALIGN == 64       # both libraries' decode kernels tile top-k by 64
    k_out = k + (-k) % 64
    want = torch.where((idx >= 0) & (idx < cap), idx, -1).to(torch.int32)
    want = torch.nn.functional.pad(want, (0, k_out - k), value=-1)
    out = torch.full(tuple(shape[:-1]) + (k_out,), 0x7EADBEEF, dtype=torch.int32, device=dev)
    got = ip.clean_ids(idx, cap, DECODE_TOPK_ALIGN, out=out)
    assert got is out and torch.equal(got.cpu(), want.cpu()), f"seed={seed} shape={shape} {dtype}"
    non_contig = idx.transpose(-1, -2).contiguous().transpose(-1, -2) if len(shape) > 1 else idx
    assert torch.equal(ip.clean_ids(non_contig, cap, DECODE_TOPK_ALIGN).cpu(), want.cpu()), f"seed={seed} strided"


def test_clean_ids_errors():
    ip = _index_prep() if (INTERPRET or HAS_CUDA) else pytest.importorskip("capdispatch.backends.decode_mla.index_prep")
    with pytest.raises(TypeError, match="int32 or int64"):
        ip.clean_ids(torch.zeros(2, 3), 10, DECODE_TOPK_ALIGN)
    with pytest.raises(ValueError, match=r"contiguous int32 tensor of shape \(2, 64\)"):
        ip.clean_ids(torch.zeros(2, 3, dtype=torch.int32), 10, DECODE_TOPK_ALIGN,
                     out=torch.empty(2, 3, dtype=torch.int32))


@_interp
def test_bind_on_cpu():
    import capdispatch as cd
    fn = cd.bind("decode_mla", "cpu", backend="triton", registry=registry())
    assert fn.__name__ == "decode_mla_triton" and fn is _tk().op_decode_mla_u8


# --------------------------------------------------------------------------- #
# Offline compilation for real GPU targets (no GPU needed)
# --------------------------------------------------------------------------- #
def test_decode_kernels_compile_for_gpu_targets():
    """The uint8 (integer-decode) kernel builds for sm_86 and sm_120a, the native-fp8 one for
    sm_89 and sm_90a, with the main + extra pools and their default configuration, the
    split-K variant and its combine kernel too: shared memory within each target's limit,
    no spills for the portable (untimed) tiles. The native-fp8
    kernel is rejected for sm_86 by Triton itself (fp8e4nv needs cc >= 8.9): the reason
    the integer decoder exists."""
    from test_sparse_prefill import SMEM_OPTIN, compile_offline
    jobs = [(86, 1, None, True), (120, 1, None, True), (89, 2, None, True), (120, 1, None, True, 4),
            (86, "combine", None, False), (90, 2, None, True), (90, 2, None, True, 4),
            (86, 2, None, True)]
    res = compile_offline(jobs)
    for (cc, mode, *_), r in zip(jobs[:-1], res[:-1]):
        assert "error" not in r, (cc, mode, r)
        assert r["ptxas_rc"] == 0, (cc, mode, r["log"])
        # Portable (untimed) tiles must not spill; the H200's measured tiles were timed with theirs.
        assert r["regs"] <= 255 and (r.get("measured") or r["spill"] == 0), (cc, mode, r)
        assert r["shared"] <= SMEM_OPTIN[cc], (cc, mode, r)
    assert [r.get("measured") for r in res[:-1]] == [False] * 5 + [True, True]
    assert "fp8e4nv not supported" in res[-1].get("error", ""), res[-1]


@pytest.mark.parametrize("cc", [86, 89, 120])
def test_portable_decode_entries_compile_for_the_99kb_targets(cc):
    """Every one-pass decode entry of the portable table (the 64-head x 16-row tile that
    serves 128 tokens and more included) builds for sm_86, sm_89 and sm_120a with each
    codec their policy can choose (uint8 everywhere, native fp8 from sm_89), with the main
    + extra pools, within the 99 KB of those cards; only the entries timed with their
    spills (TIMED_PORTABLE) may spill. One target per test: a target's builds take a minute."""
    from capdispatch.backends.sparse_attention import launch_table as LT
    from test_sparse_prefill import SMEM_OPTIN, compile_offline
    cfgs = []
    for c in LT.PORTABLE_CONFIGS["decode"]:
        c = {k: v for k, v in c.items() if k != "max_tokens"}
        if c not in cfgs:
            cfgs.append(c)
    assert dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=1) in cfgs
    jobs = [(cc, mode, c, True) for mode in ((1,) if cc < 89 else (1, 2)) for c in cfgs]
    res = compile_offline(jobs)
    for job, r in zip(jobs, res):
        assert "error" not in r, (job, r)
        assert r["ptxas_rc"] == 0, (job, r["log"])
        assert r["regs"] <= 255 and (r["measured"] or r["spill"] == 0), (job, r)
        assert r["shared"] <= SMEM_OPTIN[cc], (job, r)


# --------------------------------------------------------------------------- #
# GPU: full DeepSeek-V4 shapes
# --------------------------------------------------------------------------- #
GPU_SHAPES = [
    pytest.param(1, dict(), id="b1"),
    pytest.param(32, dict(extra=(64, 256, 512)), id="b32-c4"),
    pytest.param(64, dict(extra=(2, 4096, 512)), id="b64-c128"),
    pytest.param(2048, dict(extra=(64, 256, 512)), id="extend2048-c4"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [
    "triton", pytest.param("triton_fp8", marks=_fp8_cc), pytest.param("flashmla", marks=_flashmla),
    pytest.param("flashinfer_sparse_mla", marks=_flashinfer)])
@pytest.mark.parametrize("tokens,extra", GPU_SHAPES)
def test_gpu_dsv4_shapes(backend, tokens, extra):
    """h = 64, SWA pool page size 256 (window 128 padded to a 128-wide list), compressed
    pool (c4: page 64, c128: page 2) with top-k 512, lengths and the sink."""
    if not HAS_CUDA or INTERPRET:
        pytest.skip("needs a CUDA device without TRITON_INTERPRET")
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    q, pool, idx, ps, kw = make_case(gen, tokens, 1, 64, "cuda", page_size=256, num_pages=64, topk=128,
                                     lengths=True, sink=True, lonely=(0,), **extra)
    want = R.decode_mla(q, pool, idx, ps, SCALE, **kw)
    got = op(backend)(q, pool, idx, ps, SCALE, **kw)
    check_against(got, want, f"{backend} tokens={tokens} seed={seed}")


# Scale bytes for the exactness test: 0 (scale 0.0), bytes whose products are bf16
# subnormals (1, 2), bytes around 127 (scale 1.0) and far above it.
_DECODE_SCALE_BYTES = (0, 1, 2, 60, 100, 120, 127, 133, 134, 135, 150, 200)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,direct", [("triton", False), ("triton", True),
                                            pytest.param("triton_fp8", False, marks=_fp8_cc)],
                         ids=["triton-f32", "triton-direct", "triton_fp8"])
@pytest.mark.parametrize("tokens", [1, 8, 128], ids=lambda t: f"t{t}")
def test_gpu_pool_decode_exact(backend, tokens, direct):
    """With one valid entry per token the output is that pool row, so the kernel's decode is
    checked bit for bit (as values: the sign of a zero may differ) against kv_dequant: every
    finite e4m3 code, under scale bytes from 0 (-> 0.0) to 200, several in one row, bf16
    rope values with subnormals and signed zeros; the split-K (1, 8 tokens) and one-pass
    (128) launches; the uint8 codec's float32 decode, its direct decode (the "direct"
    candidate table of this card's capability, launch_table.CANDIDATE_TABLES or
    CANDIDATE_TABLES_99KB) and native fp8 loads."""
    if not HAS_CUDA or INTERPRET:
        pytest.skip("needs a CUDA device without TRITON_INTERPRET")
    from capdispatch.backends.sparse_attention import kernels as K
    from capdispatch.backends.sparse_attention import launch_table as LT
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    ps, h = 64, 64
    npg = (tokens + ps - 1) // ps + 1
    pool, _ = make_pool(gen, npg, ps, "cpu")
    data, scales = KV._page_views(pool, ps)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    rows = npg * ps
    codes = finite[torch.randint(0, len(finite), (rows, 448), generator=gen)]
    codes[:, :len(finite)] = finite                       # every finite code in every row
    data[..., :448] = codes.view(npg, ps, 448)
    sb = torch.tensor(_DECODE_SCALE_BYTES, dtype=torch.uint8)
    scales[..., :7] = sb[torch.randint(0, len(sb), (rows, 7), generator=gen)].view(npg, ps, 7)
    rope = torch.randn(rows, 64, generator=gen).bfloat16()
    rope[:, :4] = torch.tensor([0.0, -0.0, 1e-39, -3e-39]).bfloat16()   # zeros and bf16 subnormals
    data[..., 448:] = rope.view(torch.uint8).view(npg, ps, 128)
    pool = pool.cuda()
    chosen = torch.randperm(rows, generator=gen)[:tokens]
    idx = torch.full((tokens, 1, 64), -1, dtype=torch.int32)
    slot = torch.randint(0, 64, (tokens,), generator=gen)
    idx[torch.arange(tokens), 0, slot] = chosen.int()
    q = (torch.randn(tokens, 1, h, 512, generator=gen) * 0.01).bfloat16().cuda()
    want = KV.kv_dequant(pool, chosen.int().cuda(), ps)[:, 0].float()
    if direct:
        card = torch.cuda.get_device_capability(0) == LT.CANDIDATE_CC
        table = (LT.CANDIDATE_TABLES if card else LT.CANDIDATE_TABLES_99KB)["direct"][1]
        with K.tables_as("direct decode exact", table):
            o, _ = op(backend)(q, pool, idx.cuda(), ps, SCALE)
    else:
        o, _ = op(backend)(q, pool, idx.cuda(), ps, SCALE)
    got = o[:, 0].float()
    assert torch.equal(got, want[:, None, :].expand_as(got)), \
        f"{backend} tokens={tokens} direct={direct} seed={seed}: " \
        f"{int((got != want[:, None, :]).sum())} values differ from kv_dequant"


@pytest.mark.gpu
def test_gpu_extend_allocates_no_scratch_and_decode_scratch_is_bounded():
    if not HAS_CUDA or INTERPRET:
        pytest.skip("needs a CUDA device without TRITON_INTERPRET")
    gen = torch.Generator().manual_seed(2)
    tk = _tk()
    for tokens, bound in ((4096, 0), (4, 2 * 2 * torch.cuda.get_device_properties(0).multi_processor_count
                                      * 64 * (512 + 1) * 4)):
        q, pool, idx, ps, kw = make_case(gen, tokens, 1, 64, "cuda", page_size=256, num_pages=64, topk=128,
                                         extra=(64, 256, 512), lengths=True, sink=True)
        tk.decode_mla_u8(q, pool, idx, ps, SCALE, **kw)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        tk.decode_mla_u8(q, pool, idx, ps, SCALE, **kw)
        torch.cuda.synchronize()
        outputs = tokens * 64 * (512 * 2 + 4)
        extra = torch.cuda.max_memory_allocated() - base - outputs
        assert extra <= bound + (1 << 20), (tokens, extra, bound)


# --------------------------------------------------------------------------- #
# capdispatch.batch(): FlashMLA's schedule once per batch (a stand-in library on the CPU)
# --------------------------------------------------------------------------- #
def _schedule_calls(monkeypatch):
    """The flashmla adapter over a stand-in flash_mla that records the schedule object
    each call receives and how many schedules were made."""
    import types

    from capdispatch.backends.decode_mla import flashmla as FM
    seen, made = [], []

    class Sched:
        pass

    def get_mla_metadata():
        made.append(Sched())
        return made[-1], None

    def flash_mla_with_kvcache(q, tile_scheduler_metadata, **kw):
        seen.append(tile_scheduler_metadata)
        b, s_q, h, _ = q.shape
        return torch.zeros(b, s_q, h, 512, dtype=torch.bfloat16), torch.zeros(b, h, s_q)

    fake = types.SimpleNamespace(get_mla_metadata=get_mla_metadata, flash_mla_with_kvcache=flash_mla_with_kvcache)
    monkeypatch.setattr(FM, "_flash_mla", lambda: fake)

    def call(q, lengths, idx):
        pool = torch.zeros(4, L.min_bytes_per_page(64), dtype=torch.uint8)
        return FM.flashmla(q, pool, idx, 64, SCALE, lengths, checks=False)
    return call, seen, made


def test_batch_scope_shares_one_flashmla_schedule_per_batch(monkeypatch):
    """Outside capdispatch.batch() every call makes its own schedule; inside, calls with
    the same shapes and the same topk_length object share one; another lengths tensor,
    another shape, a new block or an inner block get their own."""
    import capdispatch as cd
    call, seen, made = _schedule_calls(monkeypatch)
    q = torch.zeros(2, 1, 64, 512, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 64, dtype=torch.int32)
    lengths, other = torch.full((2,), 64, dtype=torch.int32), torch.full((2,), 64, dtype=torch.int32)
    call(q, lengths, idx), call(q, lengths, idx)
    assert len(made) == 2 and seen[0] is not seen[1]
    with cd.batch():
        for _ in range(3):                       # three layers of one batch
            call(q, lengths, idx)
        assert len(made) == 3 and seen[2] is seen[3] is seen[4]
        call(q, other, idx)                      # other valid counts: their own schedule
        call(torch.zeros(3, 1, 64, 512, dtype=torch.bfloat16), torch.full((3,), 64, dtype=torch.int32),
             torch.zeros(3, 1, 64, dtype=torch.int32))
        assert len(made) == 5
        with cd.batch():
            call(q, lengths, idx)
            assert len(made) == 6 and seen[-1] is not seen[2]
        call(q, lengths, idx)                    # the outer block's schedule again
        assert seen[-1] is seen[2]
    with cd.batch():
        call(q, lengths, idx)
    assert len(made) == 7 and seen[-1] is not seen[2]
    call(q, lengths, idx)
    assert len(made) == 8


def test_given_schedule_reaches_flashmla_unchanged(monkeypatch):
    """A schedule the caller made (SGLang's tile_scheduler_metadata) handed in with
    capdispatch.given() is the object FlashMLA receives, in or out of a batch() block,
    for every call of the block; none is made. After the block: the adapter's own again."""
    import capdispatch as cd
    call, seen, made = _schedule_calls(monkeypatch)
    q = torch.zeros(2, 1, 64, 512, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 64, dtype=torch.int32)
    lengths = torch.full((2,), 64, dtype=torch.int32)
    theirs = object()
    with cd.given("flashmla_decode", theirs):
        call(q, lengths, idx), call(q, lengths, idx)
    with cd.batch(given={"flashmla_decode": theirs}):
        call(q, lengths, idx)
        with cd.given("flashmla_decode", None):      # nothing handed in: the block's own
            call(q, lengths, idx)
        call(q, lengths, idx)
    assert seen[:3] == [theirs] * 3 and seen[4] is theirs and len(made) == 1 and seen[3] is made[0]
    call(q, lengths, idx)
    assert len(made) == 2 and seen[-1] is made[1]


def test_given_refuses_an_unknown_kind():
    import capdispatch as cd
    from capdispatch import extend
    with pytest.raises(extend.ArgumentError, match=r"unknown kind 'flashmla'; valid: flashmla_decode, "
                                               r"deepgemm_indexer"):
        cd.given("flashmla", object())
    with pytest.raises(extend.ArgumentError, match="unknown kind"):
        cd.batch(given={"sched": 1})


def test_batch_scope_stays_in_its_context():
    """The block is a context variable: another thread sees no block."""
    import threading

    import capdispatch as cd
    from capdispatch.backends import batch_scope as B
    got = []
    with cd.batch():
        key = lambda: ("k", ())  # noqa: E731
        assert B.shared(key, lambda: object()) is B.shared(key, lambda: object())
        t = threading.Thread(target=lambda: got.append(B.shared(key, lambda: object()) is
                                                       B.shared(key, lambda: object())))
        t.start()
        t.join()
    assert got == [False]


@pytest.mark.gpu
@_flashmla
def test_gpu_batch_scope_flashmla_matches_per_call_schedules():
    """On the card: three layer calls inside capdispatch.batch() (one schedule) give the
    outputs of three calls outside it (a schedule each), eagerly and replayed from a
    CUDA graph captured inside the block."""
    import capdispatch as cd
    fn = cd.bind("decode_mla", "cuda:0", backend="flashmla")     # checks on: ids cleaned
    gen = torch.Generator().manual_seed(new_seed())
    q, pool, idx, ps, kw = make_case(gen, 4, 1, 64, "cuda", page_size=64, num_pages=16, topk=64,
                                     extra=(64, 8, 128), lengths=True, sink=True)
    args = (q, pool, idx, ps, SCALE)
    want = [fn(*args, **kw) for _ in range(3)]
    with cd.batch():
        got = [fn(*args, **kw) for _ in range(3)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g[0], w[0], rtol=0, atol=0)
        torch.testing.assert_close(g[1], w[1], rtol=0, atol=0)
    g = torch.cuda.CUDAGraph()
    with cd.batch():
        fn(*args, **kw)                          # warm-up outside the capture
        torch.cuda.synchronize()
    with cd.batch():                             # the capture's own block: its first call schedules
        with torch.cuda.graph(g):
            outs = [fn(*args, **kw) for _ in range(3)]
    g.replay()
    torch.cuda.synchronize()
    for o in outs:
        torch.testing.assert_close(o[0], want[0][0], rtol=0, atol=0)

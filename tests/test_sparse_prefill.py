"""sparse_prefill: torch reference, Triton kernel, FlashMLA adapter, declarations.

Contract: SGLang 0.5.23's ``flash_mla_sparse_fwd`` (capdispatch/backends/sparse_prefill/reference.py).

CPU (no CUDA): the torch backend runs on the CPU and the Triton kernel under the Triton
interpreter (TRITON_INTERPRET=1, set per test by the fixture below, before the kernel
module is imported) at small sizes. With CUDA the same tests run on the GPU, plus the
``gpu``-marked ones at full DeepSeek-V4 shapes (h = 64, head dim 512, top-k 512).

Every random test draws a fresh seed (``random.SystemRandom``) and names it in its
assertion messages; ATTN_TEST_SEED=<int> replays one.

Tolerances (against the fp32 torch reference on the same inputs):
  * out (bf16): ||out - ref|| / ||ref|| <= 1e-2. Both are rounded to bf16 (relative
    half-ulp 2**-9 each) and the kernel also rounds the softmax weights P to bf16 before
    the P.V tensor-core product (another 2**-9 relative per weight); measured ~2e-3.
  * max_logits / lse (fp32): |got - ref| <= 1e-3 where finite, identical infinities.
    Both sides accumulate 512-term dot products of exact bf16 products in fp32
    (relative error <= 512 * 2**-24 of sum |q_i k_i| * scale, ~1e-5 for these inputs,
    whose logits are O(10)); exp2/log2 on the GPU are approximate to ~2**-22 relative.
  * against an independent float64 dense computation: the same bounds (the reference
    itself is fp32; its own error is far below them).

Interpreter caveat (triton 3.9, measured by test_interpreter_bf16_dot_artefact):
``tl.dot`` on bf16 operands multiplies the raw 16-bit patterns, and fp32 -> bf16 casts
truncate. Under the interpreter the kernel therefore feeds the same bf16 values to an
fp32 dot and rounds P and the output to bf16 (ties to even) with integer operations,
so interpreted results round like the GPU's; on the GPU the bf16 dot is used.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

from triton_env import HAS_CUDA, INTERPRET, _triton_interpreter  # noqa: E402,F401 (autouse fixture)


from capdispatch.backends.sparse_prefill import reference as R  # noqa: E402
from capdispatch.backends.sparse_prefill.inputs import make_case  # noqa: E402

from attention_checks import (ASSUME, OUT_RTOL, SCALE, STAT_ATOL, assert_stats_close,  # noqa: E402,F401
                              flashmla_runs, new_seed, rel_err)

_gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
_interp = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")
_no_interp_on_gpu = pytest.mark.skipif(INTERPRET, reason="GPU Triton run with TRITON_INTERPRET set")


_flashmla = pytest.mark.skipif(not flashmla_runs(), reason="needs sgl-flash-mla (flash_mla) on SM90/SM100")

CASES = [
    pytest.param("torch", "cpu", id="torch-cpu"),
    pytest.param("triton", "cpu", id="triton-interp", marks=_interp),
    pytest.param("torch", "cuda", id="torch-cuda", marks=_gpu),
    pytest.param("triton", "cuda", id="triton-cuda", marks=_gpu + [_no_interp_on_gpu]),
    pytest.param("flashmla_sparse", "cuda", id="flashmla-cuda", marks=_gpu + [_flashmla]),
]
KERNEL_CASES = [c for c in CASES if c.values[0] != "torch"]


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=None)
def _tk():
    from capdispatch.backends.sparse_attention import kernels
    from capdispatch.backends.sparse_prefill import triton_kernels
    if INTERPRET and not kernels.INTERPRETED:          # imported earlier without the interpreter
        importlib.reload(kernels)
        triton_kernels = importlib.reload(triton_kernels)
    elif INTERPRET and not triton_kernels.INTERPRETED:
        triton_kernels = importlib.reload(triton_kernels)
    return triton_kernels


def _attn():
    """The shared sparse-attention kernel module, built the way _tk()'s op module uses it."""
    _tk()
    from capdispatch.backends.sparse_attention import kernels
    return kernels


def op(backend):
    if backend == "torch":
        return R.sparse_prefill
    if backend == "triton":
        return _tk().sparse_prefill
    from capdispatch.backends.sparse_prefill import flashmla as external
    return external.flashmla_sparse



def check_against(got, want, msg):
    o, ml, lse = got
    ro, rml, rlse = want
    assert o.shape == ro.shape and o.dtype == torch.bfloat16, msg
    assert bool(torch.isfinite(o).all()), f"{msg}: non-finite output"
    e = rel_err(o, ro)
    assert e <= OUT_RTOL, f"{msg}: out relative error {e:.3g} > {OUT_RTOL}"
    assert_stats_close(ml, rml, msg + " max_logits")
    assert_stats_close(lse, rlse, msg + " lse")


def dense_f64(q, kv, idx, sm_scale, topk_length=None, attn_sink=None, use_legacy=True):
    """Independent float64 computation: per query, gather the valid rows, softmax, average."""
    q, kv, idx = q.double().cpu(), kv[:, 0].double().cpu(), idx[:, 0].long().cpu()
    s, h, _ = q.shape
    out = torch.zeros(s, h, 512, dtype=torch.float64)
    ml = torch.full((s, h), -math.inf, dtype=torch.float64)
    lse = torch.full((s, h), math.inf, dtype=torch.float64)     # a lonely query: +inf in both modes
    for i in range(s):
        n = idx.shape[1] if topk_length is None else int(topk_length[i])
        sel = [int(j) for j in idx[i, :n].tolist() if 0 <= j < kv.shape[0]]
        if not sel:
            continue
        k = kv[sel]                                   # [n, 512]
        logits = (q[i] @ k.T) * sm_scale              # [h, n], natural units
        m = logits.max(dim=1).values
        l_e = m + torch.log(torch.exp(logits - m[:, None]).sum(dim=1))
        o = torch.softmax(logits, dim=1) @ k
        if attn_sink is not None:
            o = o * torch.sigmoid(l_e - attn_sink.double().cpu())[:, None]
        out[i] = o
        ml[i] = m / math.log(2) if use_legacy else m
        lse[i] = l_e / math.log(2) if use_legacy else l_e
    return out, ml, lse


# --------------------------------------------------------------------------- #
# Against the reference / float64
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("backend,device", KERNEL_CASES)
@pytest.mark.parametrize("variant", ["plain", "lengths+sink", "current-stats"])
def test_matches_reference(backend, device, variant):
    seed = new_seed()
    msg = f"{backend}/{device}/{variant} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    big = device == "cuda"
    s, h, s_kv, topk = (300, 64, 2048, 512) if big else (6, 20, 90, 40)
    q, kv, idx, tl, sk = make_case(gen, s, h, s_kv, topk, device, lengths=variant == "lengths+sink",
                                   sink=variant == "lengths+sink", lonely=(1,))
    use_legacy = variant != "current-stats"
    want = R.sparse_prefill(q, kv, idx, SCALE, 512, sk, tl, use_legacy=use_legacy)
    got = op(backend)(q, kv, idx, SCALE, 512, sk, tl, use_legacy=use_legacy)
    check_against(got, want, msg)


@pytest.mark.parametrize("backend,device", CASES[:2])
@pytest.mark.parametrize("use_legacy", [True, False])
def test_against_float64_dense(backend, device, use_legacy):
    seed = new_seed()
    msg = f"{backend}/{device} legacy={use_legacy} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    q, kv, idx, tl, sk = make_case(gen, 5, 18, 70, 33, device, lengths=True, sink=True, lonely=(3,))
    got = op(backend)(q, kv, idx, SCALE, 512, sk, tl, use_legacy=use_legacy)
    want = dense_f64(q, kv, idx, SCALE, tl, sk, use_legacy)
    check_against(tuple(t.cpu() for t in got), want, msg)
    # The fp32 reference itself is far closer than the kernel bounds.
    if backend == "torch":
        assert_stats_close(got[2], want[2], msg + " lse (reference, 1e-5)", atol=1e-5)


# --------------------------------------------------------------------------- #
# Masking, lonely queries, the sink, outputs
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("backend,device", CASES[:2] + CASES[2:4])
def test_masked_entries_never_read(backend, device):
    """kv is a window of a NaN-poisoned buffer: -1 / -2 read the rows before it, ids >= s_kv
    the rows after it, and entries past topk_length point at NaN rows inside it. Any read
    of a masked entry would put NaN into the output. The result must equal the one on
    the same input with masked entries compacted away (they contribute nothing)."""
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    s, h, s_kv, topk = 6, 20, 64, 48
    buf = torch.full((s_kv + 8, 1, 512), float("nan"), dtype=torch.bfloat16)
    buf[4:4 + s_kv] = torch.randn(s_kv, 1, 512, generator=gen).bfloat16()
    nan_rows = torch.tensor([5, 17, 40])
    buf[4 + nan_rows] = float("nan")
    kv = buf.to(device)[4:4 + s_kv]
    q = torch.randn(s, h, 512, generator=gen).bfloat16().to(device)
    ok_ids = torch.tensor([i for i in range(s_kv) if i not in nan_rows.tolist()])
    idx = torch.stack([ok_ids[torch.randperm(len(ok_ids), generator=gen)[:topk]] for _ in range(s)]).int()
    lengths = torch.randint(10, topk - 8, (s,), generator=gen, dtype=torch.int32)
    junk = torch.tensor([-1, -2, s_kv, s_kv + 3], dtype=torch.int32)
    for i in range(s):
        pos = torch.randperm(int(lengths[i]), generator=gen)[:4]
        idx[i, pos] = junk
        idx[i, int(lengths[i]):] = nan_rows[torch.randint(0, 3, (topk - int(lengths[i]),), generator=gen)].int()
    got = op(backend)(q, kv, idx.unsqueeze(1).to(device), SCALE, 512, None, lengths.to(device))
    assert bool(torch.isfinite(got[0]).all()), f"{msg}: a masked entry was read (NaN in output)"
    # Compacted: only the valid entries, in shuffled order, no lengths.
    rows = []
    for i in range(s):
        v = [j for j in idx[i, :int(lengths[i])].tolist() if 0 <= j < s_kv]
        v = torch.tensor(v)[torch.randperm(len(v), generator=gen)]
        rows.append(torch.cat([v, torch.full((topk - len(v),), -1)]))
    compact = torch.stack(rows).int().unsqueeze(1).to(device)
    want = R.sparse_prefill(q, kv, compact, SCALE)
    check_against(got, want, msg)


@pytest.mark.parametrize("backend,device", CASES)
def test_all_masked_query(backend, device):
    """A query with no valid entry: out exactly 0; max_logits = -inf, lse = +inf in both
    statistics modes (sgl-flash-mla 1.0.0's legacy kernel, measured on an H200); with or
    without a sink; the other queries are unaffected."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    q, kv, idx, tl, sk = make_case(gen, 4, 64 if device == "cuda" else 20, 96, 64, device,
                                   sink=True, lonely=(0, 2))
    tl = torch.tensor([64, 0, 64, 64], dtype=torch.int32, device=device)   # query 1: lengths mask all
    for use_legacy in (True, False):
        msg = f"{backend}/{device} legacy={use_legacy} seed={seed}"
        o, ml, lse = op(backend)(q, kv, idx, SCALE, 512, sk, tl, use_legacy=use_legacy)
        for i in (0, 1, 2):
            assert bool((o[i].float() == 0).all()), f"{msg}: lonely query {i} output not 0"
            assert bool((ml[i] == -math.inf).all()), f"{msg}: lonely max_logits {ml[i][:4]}"
            want = math.inf
            assert bool((lse[i] == want).all()), f"{msg}: lonely lse {lse[i][:4]}, want {want}"
        assert bool(torch.isfinite(lse[3]).all()) and bool((o[3].float() != 0).any()), msg


@pytest.mark.parametrize("backend,device", CASES[:2] + CASES[2:4])
def test_sink(backend, device):
    """attn_sink scales the output by sigmoid(lse - sink) only: -inf leaves it unchanged,
    +inf zeroes it, max_logits / lse never change."""
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    q, kv, idx, tl, _ = make_case(gen, 5, 20, 80, 32, device, lengths=True)
    f = op(backend)
    base = f(q, kv, idx, SCALE, 512, None, tl)
    minus = f(q, kv, idx, SCALE, 512, torch.full((20,), -math.inf, device=device), tl)
    plus = f(q, kv, idx, SCALE, 512, torch.full((20,), math.inf, device=device), tl)
    assert torch.equal(minus[0], base[0]), f"{msg}: sink -inf changed the output"
    assert bool((plus[0].float() == 0).all()), f"{msg}: sink +inf did not zero the output"
    for r in (minus, plus):
        assert torch.equal(r[1], base[1]) and torch.equal(r[2], base[2]), f"{msg}: sink changed the statistics"


@pytest.mark.parametrize("backend,device", CASES[:2] + CASES[2:4])
def test_poisoned_out_fully_written(backend, device):
    """out= prefilled with NaN, then with other bits: every element is written (the two runs
    agree bit for bit and match the out=None call); a strided out (a slice of a wider
    buffer) is honoured and nothing outside it is touched."""
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    s, h = 5, 20
    q, kv, idx, tl, sk = make_case(gen, s, h, 64, 40, device, lengths=True, sink=True, lonely=(2,))
    f = op(backend)
    fresh = f(q, kv, idx, SCALE, 512, sk, tl)
    for bits in (0x7FC1, -0x5455):
        ws = torch.full((s, h, 520), bits, dtype=torch.int16, device=device).view(torch.bfloat16)
        out = ws[:, :, 3:515]
        res = f(q, kv, idx, SCALE, 512, sk, tl, out=out)
        assert res[0].data_ptr() == out.data_ptr(), f"{msg}: out= not returned"
        assert torch.equal(out.view(torch.int16), fresh[0].view(torch.int16)), f"{msg}: out= differs / not all written"
        assert bool((ws.view(torch.int16)[:, :, :3] == bits).all()), f"{msg}: wrote outside out="
        assert bool((ws.view(torch.int16)[:, :, 515:] == bits).all()), f"{msg}: wrote outside out="
        assert torch.equal(res[1], fresh[1]) and torch.equal(res[2], fresh[2]), msg


@pytest.mark.parametrize("backend,device", CASES[:2] + CASES[2:4])
def test_strided_inputs_and_int64(backend, device):
    """SGLang passes views (q.squeeze(1) of [s, 1, h, 512], kv slices of a workspace) and the
    kernels take int64 ids and lengths too: same results as contiguous int32 inputs."""
    seed = new_seed()
    msg = f"{backend}/{device} seed={seed}"
    gen = torch.Generator().manual_seed(seed)
    q, kv, idx, tl, sk = make_case(gen, 5, 12, 70, 36, device, lengths=True, sink=True, lonely=(4,))
    qw = torch.zeros(5, 24, 512, dtype=torch.bfloat16, device=device)
    qw[:, ::2] = q
    kvw = torch.zeros(70, 3, 512, dtype=torch.bfloat16, device=device)
    kvw[:, 1:2] = kv
    idxw = torch.full((5, 1, 50), -1, dtype=torch.int64, device=device)
    idxw[:, :, :36] = idx
    f = op(backend)
    want = f(q, kv, idx, SCALE, 512, sk, tl)
    got = f(qw[:, ::2], kvw[:, 1:2], idxw[:, :, :36], SCALE, 512, sk, tl.long())
    for a, b in zip(got, want):
        assert torch.equal(a, b), msg


def test_reference_chunking_changes_only_summation_order(monkeypatch):
    """The reference's query chunking (memory bound) changes nothing but the BLAS blocking of
    its batched products: max logits and lse are bit-identical, and an output differs by at
    most one bf16 ulp where the float32 value sat on a rounding boundary (seed 1456240461:
    1 of 36864 outputs)."""
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    q, kv, idx, tl, sk = make_case(gen, 9, 8, 64, 48, "cpu", lengths=True, sink=True)
    whole = R.sparse_prefill(q, kv, idx, SCALE, 512, sk, tl)
    monkeypatch.setattr(R, "GATHER_BUDGET", 48 * 512 * 2)   # 2 queries per chunk
    chunked = R.sparse_prefill(q, kv, idx, SCALE, 512, sk, tl)
    (o1, m1, l1), (o2, m2, l2) = whole, chunked
    assert torch.equal(m1, m2) and torch.equal(l1, l2), f"seed={seed}"
    a, b = o1.float(), o2.float()
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(2.0 ** -126))) - 7)
    diff = (a - b).abs()
    assert bool((diff <= ulp).all()), f"seed={seed}: max diff {float(diff.max())}"
    assert int((diff > 0).sum()) <= max(1, a.numel() // 1000), f"seed={seed}: {int((diff > 0).sum())} outputs differ"


def test_argument_errors():
    q = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    kv = torch.zeros(8, 1, 512, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="d_v"):
        R.sparse_prefill(q, kv, idx, SCALE, d_v=448)
    with pytest.raises(TypeError, match="bfloat16"):
        R.sparse_prefill(q.float(), kv, idx, SCALE)
    with pytest.raises(ValueError, match="h_kv"):
        R.sparse_prefill(q, torch.zeros(8, 2, 512, dtype=torch.bfloat16), idx, SCALE)
    with pytest.raises(ValueError, match="rows"):
        R.sparse_prefill(q, kv, idx[:1], SCALE)
    with pytest.raises(TypeError, match="int32 or int64"):
        R.sparse_prefill(q, kv, idx.float(), SCALE)
    with pytest.raises(ValueError, match="attn_sink"):
        R.sparse_prefill(q, kv, idx, SCALE, attn_sink=torch.zeros(3))
    with pytest.raises(ValueError, match="topk_length"):
        R.sparse_prefill(q, kv, idx, SCALE, topk_length=torch.zeros(3, dtype=torch.int32))


@_interp
def test_interpreter_bf16_dot_artefact():
    """Evidence for the interpreter workaround: its bf16 tl.dot multiplies raw bit patterns
    (if this starts failing, the interpreter was fixed and DOT_F32 can go)."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot16(a_ptr, b_ptr, c_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        tl.store(c_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))

    a = torch.randn(16, 16).bfloat16()
    b = torch.randn(16, 16).bfloat16()
    c = torch.empty(16, 16)
    dot16[(1,)](a, b, c)
    err = (c - a.float() @ b.float()).abs().max().item()
    print(f"[interp evidence] bf16 tl.dot max abs error {err:.3g}")
    assert err > 1.0


# --------------------------------------------------------------------------- #
# Declarations and dispatch
# --------------------------------------------------------------------------- #
def registry():
    """A fresh registry: the built-in op packages plus this one (if not built in yet)."""
    from capdispatch.backends.registry import BUILTIN_OP_PACKAGES, Registry
    reg = Registry()
    for pkg in dict.fromkeys(BUILTIN_OP_PACKAGES + ("capdispatch.backends.sparse_prefill",)):
        importlib.import_module(pkg).register(reg)
    return reg


@pytest.mark.parametrize("device", ["sim:rtx-5090", "sim:rtx-pro-6000", "sim:sm_120"])
def test_flashmla_sparse_rejected_on_sm120(device):
    """FlashMLA's sparse prefill has no SM120 kernel. With the library present, the
    feature requirement alone rejects it, and the reason names the missing features."""
    import capdispatch as cd
    res = cd.resolve("sparse_prefill", device, registry=registry(), assume_libs=ASSUME)
    cand = {c.backend: c for c in res.candidates}["flashmla_sparse"]
    assert not cand.ok
    bad = [ch for ch in cand.checks if not ch.ok]
    assert [ch.code for ch in bad] == ["feature:wgmma|tcgen05"]
    assert "wgmma" in bad[0].message and "tcgen05" in bad[0].message
    assert res.backend == "triton"


@pytest.mark.parametrize("device,want", [("sim:h200", "flashmla_sparse"), ("sim:b200", "flashmla_sparse"),
                                         ("sim:rtx-3080", "triton"), ("sim:rtx-4090", "triton")])
def test_default_choice(device, want):
    import capdispatch as cd
    assert cd.resolve("sparse_prefill", device, registry=registry(), assume_libs=ASSUME).backend == want


def test_flashmla_needs_the_library():
    import capdispatch as cd
    res = cd.resolve("sparse_prefill", "sim:h200", registry=registry(),
                     assume_libs=["triton==3.9.0", "torch==2.13.0"], env={})
    cand = {c.backend: c for c in res.candidates}["flashmla_sparse"]
    if cand.ok:
        pytest.skip("sgl-flash-mla is installed on this machine")
    assert any(ch.code == "library:sgl-flash-mla" and not ch.ok for ch in cand.checks)


@_interp
def test_bind_triton_on_cpu():
    import capdispatch as cd
    fn = cd.bind("sparse_prefill", "cpu", backend="triton", registry=registry())
    from capdispatch.backends.sparse_prefill import triton_kernels
    assert fn.__name__ == "sparse_prefill_triton" and fn is triton_kernels.op_sparse_prefill


def test_launch_configs_per_capability():
    """Measured tables answer only for their capability; every other card gets the portable
    tiles; split-K decode has its own list; a wrong kind is named with the valid ones."""
    from capdispatch.backends.sparse_attention import launch_table as K
    assert K.configs_for((9, 0), "prefill")[0] == dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1)
    # One token: the small split tile; from two tokens on, the 64-head tile.
    assert K.configs_for((9, 0), "decode_split", 1)[0]["BLOCK_H"] == 16
    assert K.configs_for((9, 0), "decode_split", 2)[0]["BLOCK_H"] == 64
    assert K.configs_for((9, 0), "decode_split", 2) == K.configs_for((9, 0), "decode_split")[1:]
    for cc in ((8, 0), (8, 6), (8, 9), (10, 0), (12, 0)):
        for kind in K.KINDS:
            assert K.configs_for(cc, kind) == K.PORTABLE_CONFIGS[kind], (cc, kind)
    # Each measured list ends with the portable tiles that serve any size: a smaller card
    # never runs out of options.
    for table in K.MEASURED_CONFIGS.values():
        for kind in K.KINDS:
            any_size = tuple(c for c in K.PORTABLE_CONFIGS[kind] if "max_tokens" not in c)
            assert table[kind][-len(any_size):] == any_size
    # The 99 KB cards: a single token gets the 16-head split tile, more tokens the 32-head one.
    assert K.configs_for((8, 6), "decode_split", 1)[0] == dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1,
                                                             max_tokens=1)
    assert K.configs_for((8, 6), "decode_split", 2)[0]["BLOCK_H"] == 32
    # One-pass decode there: the 32-head tile up to 127 tokens, 64 heads x 16 rows from 128
    # (timed at 128 and 4096); the split list never takes the 64-head tile.
    hp16 = dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=1)
    for t in (1, 64, 127):
        assert K.configs_for((8, 6), "decode", t)[0]["BLOCK_H"] == 32, t
    for t in (128, 4096):
        assert K.configs_for((8, 6), "decode", t)[0] == hp16, t
    assert hp16 not in K.configs_for((8, 6), "decode_split")
    with pytest.raises(ValueError, match="unknown kernel kind 'decode-split'; valid: prefill, decode, decode_split"):
        K.configs_for((9, 0), "decode-split")


@_interp
def test_split_plan_fills_whole_waves_and_bounds_scratch():
    """plan_splits (decode split-K): whole waves over partial ones, fewer splits on ties,
    and never 4 x SM count programs or more (the scratch bound)."""
    plan = _attn().plan_splits
    assert plan(32, 10, 132) == 4      # 128 programs x 3 blocks: one wave (5 splits: 160, two waves)
    assert plan(64, 10, 132) == 2      # 128 x 5, not 320 x 2 (three waves)
    assert plan(8, 10, 132) == 10      # 80 programs of one block each
    assert plan(4, 20, 132) == 20      # one token, 16-head tiles
    assert plan(256, 20, 132) == 1     # the GPU is already full
    assert plan(1, 1, 132) == 1
    for programs in (1, 3, 8, 50, 131, 263):
        for blocks in (1, 7, 10, 40, 200):
            s = plan(programs, blocks, 132)
            assert 1 <= s <= min(32, blocks) and (s == 1 or programs * s < 4 * 132), (programs, blocks, s)
            per = -(-blocks // s)
            assert -(-blocks // per) == s            # the effective count: what _run launches


def _flash_mla_interface_source():
    """flash_mla/flash_mla_interface.py of an installed sgl-flash-mla, read without
    importing the package (its __init__ loads the CUDA extension)."""
    import importlib.util
    spec = importlib.util.find_spec("flash_mla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sgl-flash-mla is not installed (pip install --no-deps sgl-flash-mla==1.0.0)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "flash_mla_interface.py")
    with open(path) as f:
        return f.read()


def _signature_from_source(src, name):
    import ast
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == name)
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args], [x.arg for x in a.kwonlyargs]


def test_flashmla_adapter_matches_library_signature():
    """The adapter's call against the installed library's real flash_mla_sparse_fwd."""
    pos, kwonly = _signature_from_source(_flash_mla_interface_source(), "flash_mla_sparse_fwd")
    # flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
    #                                use_legacy=..., return_log2_lse=...)
    assert pos[:7] == ["q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length"], pos
    assert "use_legacy" in pos + kwonly and "return_log2_lse" in pos + kwonly
    from capdispatch.backends.sparse_prefill import flashmla as external
    src = inspect.getsource(external.flashmla_sparse)
    # Always the legacy kernel (the current one is SM100f-only), base-2 statistics.
    assert "flash_mla.flash_mla_sparse_fwd(" in src and "use_legacy=True, return_log2_lse=True" in src


def test_contract_signatures_agree():
    """Every backend takes the same arguments as the reference, in the same order."""
    from capdispatch.backends.sparse_prefill import flashmla as external
    want = inspect.signature(R.sparse_prefill)
    assert list(inspect.signature(external.flashmla_sparse).parameters) == list(want.parameters)
    if INTERPRET or HAS_CUDA:
        assert list(inspect.signature(_tk().sparse_prefill).parameters) == list(want.parameters)


# --------------------------------------------------------------------------- #
# Offline compilation for real GPU targets (no GPU needed)
# --------------------------------------------------------------------------- #
COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
from capdispatch.backends.sparse_attention import kernels as K, launch_table as L
from triton.backends.nvidia.compiler import get_ptxas
res = []
for cc, mode, cfg, extra, *rest in json.loads(sys.argv[1]):
    kind = "prefill" if mode == 0 else ("decode_split" if rest and rest[0] > 1 else "decode")
    cfg = cfg or L.configs_for((cc // 10, cc % 10), kind)[0]
    measured = (cc // 10, cc % 10) in L.MEASURED_CONFIGS or cfg in L.TIMED_PORTABLE
    try:
        if mode == "combine":
            ck = K.compile_combine_offline(cc)
            ptx = ck.asm["ptx"]
        else:
            ck, ptx = K.compile_offline(cc, mode, cfg, extra=extra, num_splits=rest[0] if rest else 1)
    except Exception as e:
        res.append(dict(error=f"{type(e).__name__}: {e}"))
        continue
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(src, "w").write(ptx)
        arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
        r = subprocess.run([get_ptxas(cc).path, "-v", f"--gpu-name={arch}", src, "-o", dst],
                           capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    res.append(dict(cfg=cfg, measured=measured, shared=ck.metadata.shared, regs=int(regs.group(1)) if regs else None,
                    spill=int(spill.group(1)) if spill else None, ptxas_rc=r.returncode, log=r.stderr[-400:]))
print("RESULT " + json.dumps(res))
"""

# Opt-in shared memory per block (CUDA programming guide), as in features.yaml.
SMEM_OPTIN = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 120: 101376}


def compile_offline(jobs):
    """Compile in a fresh process without TRITON_INTERPRET: [(cc, kv_mode or "combine", cfg or None,
    extra[, num_splits])]."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, json.dumps(jobs)], capture_output=True, text=True,
                       env=env, cwd=root, timeout=600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"compile script failed: {p.stderr[-2000:]}"
    return json.loads(line[len("RESULT "):])


def test_prefill_kernel_compiles_for_gpu_targets():
    """The Triton prefill kernel builds for sm_80, sm_86, sm_90a and sm_120a on this CPU
    machine with its default configuration, within each target's opt-in shared memory
    (so the first configuration is the one that runs). Portable (untimed) tiles must not
    spill registers; a measured or timed tile may (it was timed with its spills)."""
    ccs = [80, 86, 90, 120]
    res = compile_offline([(cc, 0, None, False) for cc in ccs])
    assert [r.get("measured") for r in res] == [True, True, True, True], res
    for cc, r in zip(ccs, res):
        assert "error" not in r, (cc, r)
        assert r["ptxas_rc"] == 0, (cc, r["log"])
        assert r["regs"] <= 255 and (r["measured"] or r["spill"] == 0), (cc, r)
        assert r["shared"] <= SMEM_OPTIN[cc], (cc, r)


# --------------------------------------------------------------------------- #
# GPU: full DeepSeek-V4 shapes
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("flashmla_sparse", marks=_flashmla)])
@pytest.mark.parametrize("s,s_kv", [(4096, 8192), (1, 4096), (777, 16384)])
def test_gpu_dsv4_shapes(backend, s, s_kv):
    if not HAS_CUDA or INTERPRET:
        pytest.skip("needs a CUDA device without TRITON_INTERPRET")
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    q, kv, idx, tl, sk = make_case(gen, s, 64, s_kv, 512, "cuda", lengths=True, sink=True,
                                   lonely=(0,) if s > 1 else ())
    want = R.sparse_prefill(q, kv, idx, SCALE, 512, sk, tl)
    got = op(backend)(q, kv, idx, SCALE, 512, sk, tl)
    check_against(got, want, f"{backend} s={s} seed={seed}")


@pytest.mark.gpu
def test_gpu_reference_memory_is_bounded_by_its_chunk():
    """The torch reference's peak memory does not grow with the sequence beyond outputs."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    peaks = {}
    for s in (2048, 8192):
        q, kv, idx, _, _ = make_case(gen, s, 64, 8192, 512, "cuda", junk=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        R.sparse_prefill(q, kv, idx, SCALE)
        torch.cuda.synchronize()
        outputs = s * 64 * (512 * 2 + 8)
        peaks[s] = torch.cuda.max_memory_allocated() - base - outputs
    # Chunk working set: gathered fp32 rows (budget) + int64 ids/masks + scores/weights.
    bound = R.GATHER_BUDGET * 4 * 4
    assert peaks[8192] <= bound, peaks
    assert peaks[8192] <= peaks[2048] * 1.25 + (1 << 20), peaks


@pytest.mark.gpu
def test_gpu_triton_allocates_no_scratch():
    if not HAS_CUDA or INTERPRET:
        pytest.skip("needs a CUDA device without TRITON_INTERPRET")
    gen = torch.Generator().manual_seed(1)
    s = 4096
    q, kv, idx, tl, sk = make_case(gen, s, 64, 8192, 512, "cuda", lengths=True, sink=True)
    _tk().sparse_prefill(q, kv, idx, SCALE, 512, sk, tl)   # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _tk().sparse_prefill(q, kv, idx, SCALE, 512, sk, tl)
    torch.cuda.synchronize()
    outputs = s * 64 * (512 * 2 + 8)
    assert torch.cuda.max_memory_allocated() - base <= outputs + (1 << 20)

"""The SGLang route wrappers on a real GPU at DeepSeek-V4 shapes, without SGLang.

Each wrapper is called with the arguments SGLang 0.5.23's DSv4 backend passes (a
[pages, 256, 1, 584] view of the SWA pool and a [pages, 64, 1, 584] view of the
compressed pool, 64 padded heads, top-k lists padded to multiples of 64, the
backend's keywords), with the kernel capdispatch binds on this card installed for
it, and compared with capdispatch's torch reference on the same card. An "original"
that fails the test stands in for SGLang's function: a covered call must never
reach it.

Tolerances: attention outputs relative error (Frobenius) <= 1e-2, statistics 1e-3
absolute (tests/attention_checks.py); indexer logits |err| <= 2**-10 * A with A the
absolute sum s * sum_h |w_h| * sum_d |q_hd k_d| (fp8 tensor cores accumulate with
about 14 mantissa bits; tests/test_indexer.py).
"""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_checks import assert_stats_close, rel_err, v4_pool, v4_view  # noqa: E402

import capdispatch as cd  # noqa: E402
from capdispatch.adapters.sglang import routes  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="GPU run with TRITON_INTERPRET")]

KEY = ("cuda", 0)


def _seed():
    env = os.environ.get("ROUTES_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def _never(*args, **kwargs):
    raise AssertionError("a covered call reached SGLang's function")


@pytest.fixture
def bound():
    """op -> (backend name, kernel) as a rank on cuda:0 would install them."""
    out = {}
    for op in ("decode_mla", "sparse_prefill", "indexer"):
        res = cd.resolve(op, "cuda:0")
        fn = cd.bind(op, "cuda:0")
        routes._KERNELS.setdefault(op, {})[KEY] = fn
        out[op] = (res.backend, fn)
    yield out
    for op in out:
        routes._KERNELS.get(op, {}).pop(KEY, None)


def _ids(gen, b, topk, cap, valid):
    x = torch.full((b, topk), -1, dtype=torch.int32)
    for i in range(b):
        x[i, :valid] = torch.randperm(cap, generator=gen)[:valid].int()
    return x.view(b, 1, topk).cuda()


def _sglang_schedule(bound):
    """What SGLang passes as tile_scheduler_metadata: FlashMLA's schedule object where the
    route runs FlashMLA, any object elsewhere (no other backend reads it)."""
    if bound["decode_mla"][0] != "flashmla":
        return object()
    import flash_mla
    return flash_mla.get_mla_metadata()[0]


@pytest.mark.parametrize("b", [1, 64])
def test_decode_route_at_dsv4_shapes(bound, b):
    from capdispatch.backends.decode_mla import reference as R
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    h = 64
    q = (torch.randn(b, 1, h, 512, generator=gen) * 2).bfloat16().cuda()
    pool, _ = v4_pool(gen, 32, 256, "cuda")
    epool, _ = v4_pool(gen, 64, 64, "cuda")
    view, eview = v4_view(pool, 256), v4_view(epool, 64)
    idx, eidx = _ids(gen, b, 128, 32 * 256, 128), _ids(gen, b, 512, 64 * 64, 448)
    tl = torch.randint(1, 129, (b,), generator=gen, dtype=torch.int32).cuda()
    etl = torch.randint(0, 449, (b,), generator=gen, dtype=torch.int32).cuda()
    sink = (torch.randn(h, generator=gen) * 2).cuda()
    scale = 512 ** -0.5
    # The route hands SGLang's per-batch schedule on to FlashMLA (a fresh one, as SGLang makes
    # per batch); another backend ignores it.
    got = routes.mla_decode(_never, q=q, k_cache=view, block_table=None, cache_seqlens=None, head_dim_v=512,
                            tile_scheduler_metadata=_sglang_schedule(bound), softmax_scale=scale, is_fp8_kvcache=True,
                            indices=idx, topk_length=tl, attn_sink=sink, extra_k_cache=eview,
                            extra_indices_in_kvcache=eidx, extra_topk_length=etl, use_legacy=True)
    want = R.decode_mla(q, pool, idx, 256, scale, tl, sink, epool, eidx, 64, etl)
    msg = f"{bound['decode_mla'][0]} b={b} seed={seed}"
    assert got[0].shape == (b, 1, h, 512) and bool(torch.isfinite(got[0]).all()), msg
    assert rel_err(got[0], want[0]) <= 1e-2, msg
    assert_stats_close(got[1], want[1], msg + " lse")
    # The SM120 entry takes the same call by keywords.
    got120 = routes.mla_decode_sm120(_never, q=q, k_cache=view, head_dim_v=512, softmax_scale=scale,
                                     indices=idx, topk_length=tl, attn_sink=sink, extra_k_cache=eview,
                                     extra_indices_in_kvcache=eidx, extra_topk_length=etl)
    assert torch.equal(got120[0], got[0]), msg


@pytest.mark.parametrize("legacy", [True, False])
def test_sparse_prefill_route_at_dsv4_shapes(bound, legacy):
    from capdispatch.backends.sparse_prefill import reference as R
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    s, h, s_kv, topk = 512, 64, 8192, 640
    q = (torch.randn(s, h, 512, generator=gen) * 2).bfloat16().cuda()
    kv = torch.randn(s_kv, 1, 512, generator=gen).bfloat16().cuda()
    idx = torch.stack([torch.randperm(s_kv, generator=gen)[:topk] for _ in range(s)]).int()
    tl = torch.randint(1, topk + 1, (s,), generator=gen, dtype=torch.int32)
    idx = idx.unsqueeze(1).cuda()
    tl = tl.cuda()
    sink = (torch.randn(h, generator=gen) * 2).cuda()
    got = routes.mla_sparse_prefill(_never, q=q, kv=kv, indices=idx, sm_scale=512 ** -0.5, d_v=512,
                                    attn_sink=sink, topk_length=tl, use_legacy=legacy)
    want = R.sparse_prefill(q, kv, idx, 512 ** -0.5, 512, sink, tl, use_legacy=legacy)
    msg = f"{bound['sparse_prefill'][0]} legacy={legacy} seed={seed}"
    assert rel_err(got[0], want[0]) <= 1e-2, msg
    assert_stats_close(got[1], want[1], msg + " max_logits")
    assert_stats_close(got[2], want[2], msg + " lse")


@pytest.mark.parametrize("B,ctx", [(64, 2048), (4, 8192)])
def test_indexer_route_at_dsv4_shapes(bound, B, ctx):
    from capdispatch.backends.indexer import reference as R
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    H, pages = 64, ctx // 64
    P = B * pages + 3
    q = torch.randn(B, 1, H, 128, generator=gen).to(torch.float8_e4m3fn)
    codes, scales = R.quantize_index_k(torch.randn(P, 64, 128, generator=gen))
    w = torch.randn(B, H, generator=gen)
    lens = torch.randint(1, ctx + 1, (B,), generator=gen, dtype=torch.int32)
    table = torch.randperm(P, generator=gen)[:B * pages].view(B, pages).int()
    q, kv, w, lens, table = q.cuda(), R.pack_index_k(codes, scales).cuda(), w.cuda(), lens.cuda(), table.cuda()
    got = routes.indexer_logits(_never, q, kv, w, lens, table, None, ctx, False)
    want = R.fp8_paged_mqa_logits(q, kv, w, lens, table, None, ctx)
    # A: the same reference over absolute values (sign bits of the fp8 codes cleared).
    qa = (q.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    A = R.fp8_paged_mqa_logits(qa, R.pack_index_k(codes & 0x7F, scales).cuda(), w.abs(), lens, table, None, ctx)
    valid = torch.arange(ctx, device="cuda").unsqueeze(0) < lens.unsqueeze(1)
    msg = f"{bound['indexer'][0]} B={B} ctx={ctx} seed={seed}"
    assert bool((got[~valid] == float("-inf")).all()), msg
    err = (got[valid].double() - want[valid].double()).abs()
    ratio = (err / A[valid].double().clamp_min(1e-30)).max().item()
    assert ratio <= 2.0 ** -10, f"{msg}: max |err|/A {ratio:.3g}"

"""SGLang 0.5.23's own DeepSeek-V4 call sites, routed by the plugin on a real GPU.

For an SM90/SM100 card with SGLang 0.5.23 and sgl-flash-mla installed (passed on an
H200, 2026-12-02); everywhere else it skips, saying why.

What runs, with nothing simulated and no interpreter:
  * cuda:0 is probed as a rank probes its card (`gpus.device(0, via="auto")`), and the
    plugin's one decision pass decides for it with the routes forced by
    CAPDISPATCH_SET=decode_mla=triton_fp8,sparse_prefill=triton,indexer=triton;
    `rank.apply_routes` installs them through SGLang's HookRegistry on SGLang's real
    functions (the rank's environment switches go into a dict, not os.environ).
  * The calls go through SGLang's own names, as its DSv4 backend and indexer make them:
    decode through `functools.partial(flash_mla_interface.flash_mla_with_kvcache,
    use_legacy=True)` (built after the route, as DeepseekV4AttnBackend builds it),
    sparse prefill through `flash_mla_interface.flash_mla_sparse_fwd`, the indexer
    through `dsv4.indexer.fp8_paged_mqa_logits_torch` (the name the call site reads
    under SGLANG_FP8_PAGED_MQA_LOGITS_TORCH, which the route switches on). Shapes:
    64 heads, a [pages, 256, 1, 584] view of the SWA pool (page size 256), a
    [pages, 64, 1, 584] view of the compressed pool, top-k lists padded to 64.
  * Each routed output is compared with SGLang's own function on the same tensors:
    FlashMLA (sgl-flash-mla) for decode and sparse prefill, SGLang's torch indexer
    for the indexer. The routed decode and indexer are captured in torch.cuda.graph,
    replayed on fresh inputs copied into the captured tensors, and compared again
    (and bit for bit with an eager routed call on the same inputs).

Tolerances (tests/attention_checks.py): attention outputs relative error
(Frobenius) <= 1e-2 (OUT_RTOL), statistics 1e-3 absolute (STAT_ATOL), infinities
identical. Indexer logits: |err| <= 2**-8 * A, with A the absolute sum
sum_h |w_h| * relu-free sum_d |q_hd k_d| * s: SGLang's torch indexer rounds each
head's score to bf16 (2**-9) and the routed kernel accumulates fp8 products with
about 14 mantissa bits (2**-10, tests/test_indexer.py).

Outputs are allocated by the kernels: before each first call a block of the
output's size is left NaN-filled in the caching allocator (poison), which the
output's allocation normally takes, and every output element is checked to be
written (finite, or -inf where the contract says so).
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_checks import OUT_RTOL, SCALE, assert_stats_close, flashmla_runs, rel_err, v4_pool, v4_view  # noqa: E402
from test_routes_gpu import _ids, _seed  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="GPU run with TRITON_INTERPRET"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="needs SGLang 0.5.23 (tests/requirements-nodeps.txt)"),
    pytest.mark.skipif(not flashmla_runs(),
                       reason="needs sgl-flash-mla (flash_mla) importable on an SM90/SM100 card: the routed "
                              "outputs are compared with SGLang's own FlashMLA"),
]

FORCED = {"decode_mla": "triton_fp8", "sparse_prefill": "triton", "indexer": "triton"}
KEY = ("cuda", 0)


@pytest.fixture(scope="module")
def sg():
    """SGLang's modules with the plugin's routes installed for cuda:0, as a rank does."""
    import sglang_prelude  # noqa: F401  (before SGLang: offline; torchvision stand-in if absent)

    from capdispatch.adapters.sglang import decide, knobs, rank, gpus, routes, versions
    from capdispatch.adapters.sglang.records import LaunchInputs
    release = knobs.load().release(versions.installed() or "")
    if release is None:
        pytest.skip(f"SGLang {versions.installed()} is outside the knob map's tested range")
    fmi = importlib.import_module("sglang.kernels.ops.attention.flash_mla_interface")
    ind = importlib.import_module("sglang.srt.layers.attention.dsv4.indexer")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPDISPATCH_", "SGLANG_"))}
    env["CAPDISPATCH_SET"] = ",".join(f"{op}={b}" for op, b in FORCED.items())
    spec = gpus.device(0, env=env, via="auto")
    assert not spec.simulated and spec.id == "cuda:0"
    model = "DeepseekV4ForCausalLM"
    ops, reason = decide.applicable_ops(release, model, "fp8_e4m3")
    d = decide.decide_launch([spec], release, LaunchInputs(model, "fp8_e4m3", ops, reason, user_env={}),
                             env=env)
    choices = {op: d.choices[op][spec.id] for op in FORCED}
    assert {op: (c.backend, c.action) for op, c in choices.items()} == {
        op: (b, "routed") for op, b in FORCED.items()}, {op: c.why for op, c in choices.items()}
    # SGLang's own functions, before any hook of this process wraps them.
    own = {"decode": inspect.unwrap(fmi.flash_mla_with_kvcache),
           "prefill": inspect.unwrap(fmi.flash_mla_sparse_fwd),
           "indexer": inspect.unwrap(ind.fp8_paged_mqa_logits_torch)}
    switches = {}
    done = rank.apply_routes(release, choices, spec, rank.device_key(spec, 0), switches, {})
    assert all(done[op].routed for op in FORCED), {op: c.why for op, c in done.items()}
    assert switches.get("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH") == "true"
    yield {"fmi": fmi, "ind": ind, "own": own, "spec": spec}
    for op in FORCED:
        routes.remove(op, KEY)


def _poison(shape, dtype):
    """Leave a NaN-filled block of SHAPE x DTYPE in the caching allocator, which the next
    allocation of that size on this stream normally takes."""
    torch.empty(shape, dtype=dtype, device="cuda").fill_(float("nan"))


def _graph(fn):
    """fn() captured in a CUDA graph (warmed up on a side stream first, so compilation
    and autotuning stay outside the capture). Returns (graph, captured output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


# --------------------------------------------------------------------------- decode

def _decode_inputs(gen, b, h=64):
    q = (torch.randn(b, 1, h, 512, generator=gen) * 2).bfloat16().cuda()
    pool, _ = v4_pool(gen, 32, 256, "cuda")
    epool, _ = v4_pool(gen, 64, 64, "cuda")
    return dict(
        q=q, k_cache=v4_view(pool, 256), extra_k_cache=v4_view(epool, 64),
        indices=_ids(gen, b, 128, 32 * 256, 128), extra_indices_in_kvcache=_ids(gen, b, 512, 64 * 64, 448),
        topk_length=torch.randint(1, 129, (b,), generator=gen, dtype=torch.int32).cuda(),
        extra_topk_length=torch.randint(0, 449, (b,), generator=gen, dtype=torch.int32).cuda(),
        attn_sink=(torch.randn(h, generator=gen) * 2).cuda())


def _flashmla_decode(sg, x):
    """SGLang's own decode call (FlashMLA), a fresh schedule per call."""
    return sg["own"]["decode"](**x, block_table=None, cache_seqlens=None, head_dim_v=512,
                               tile_scheduler_metadata=sg["fmi"].get_mla_metadata()[0],
                               softmax_scale=SCALE, is_fp8_kvcache=True, use_legacy=True)


def _check_decode(got, want, msg):
    out, lse = got[0], got[1]
    assert out.shape == want[0].shape and bool(torch.isfinite(out).all()), msg + ": unwritten or non-finite out"
    assert not bool(torch.isnan(lse).any()), msg + ": unwritten lse"
    assert rel_err(out, want[0]) <= OUT_RTOL, msg
    assert_stats_close(lse, want[1], msg + " lse")


@pytest.mark.parametrize("b", [1, 64])
def test_routed_decode_at_sglangs_call_site_matches_flashmla_and_replays_in_a_cuda_graph(sg, b):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = _decode_inputs(gen, b)
    # DeepseekV4AttnBackend builds this partial after the rank hook; it holds the route.
    site = functools.partial(sg["fmi"].flash_mla_with_kvcache, use_legacy=True)

    def routed():
        return site(q=x["q"], k_cache=x["k_cache"], head_dim_v=512, block_table=None, cache_seqlens=None,
                    tile_scheduler_metadata=sg["fmi"].get_mla_metadata()[0], softmax_scale=SCALE,
                    is_fp8_kvcache=True, indices=x["indices"], topk_length=x["topk_length"],
                    attn_sink=x["attn_sink"], extra_k_cache=x["extra_k_cache"],
                    extra_indices_in_kvcache=x["extra_indices_in_kvcache"],
                    extra_topk_length=x["extra_topk_length"])
    msg = f"decode_mla={FORCED['decode_mla']} at flash_mla_with_kvcache b={b} seed={seed}"
    _poison((b, 1, 64, 512), torch.bfloat16)
    got = routed()
    want = _flashmla_decode(sg, x)
    _check_decode(got, want, msg)
    # Captured, then replayed on fresh inputs copied into the captured tensors.
    g, captured = _graph(routed)
    fresh = _decode_inputs(torch.Generator().manual_seed(seed + 1), b)
    for k, t in fresh.items():
        x[k].copy_(t)
    g.replay()
    torch.cuda.synchronize()
    want = _flashmla_decode(sg, x)
    _check_decode(captured, want, msg + " (CUDA graph replay)")
    eager = routed()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1]), msg + ": replay != eager"


def test_flashmla_adapter_at_sglangs_decode_site_runs_on_sglangs_schedule(sg, monkeypatch):
    """capdispatch's flashmla adapter bound at the decode route in served form
    (capdispatch.bind_resolution, checks off), called through SGLang's name for three
    layers of one batch with SGLang's one FlashMLASchedMeta: FlashMLA receives SGLang's
    schedule on every call (the route hands it on through capdispatch.given; the adapter
    makes none), and the outputs equal SGLang's own calls bit for bit, eager and replayed
    from a CUDA graph on fresh inputs."""
    import capdispatch as cd
    import flash_mla

    from capdispatch.adapters.sglang import routes
    res = cd.resolve("decode_mla", sg["spec"], selections=["decode_mla=flashmla"])
    assert res.backend == "flashmla"
    real, seen = flash_mla.flash_mla_with_kvcache, []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("tile_scheduler_metadata"))
        return real(*args, **kwargs)
    monkeypatch.setattr(flash_mla, "flash_mla_with_kvcache", spy)
    saved = routes.kernel("decode_mla", KEY)
    routes._KERNELS["decode_mla"][KEY] = cd.bind_resolution(res, checks=False)
    seed = _seed()
    b = 8

    def batch(gen):
        layers = [_decode_inputs(gen, b) for _ in range(3)]
        for x in layers[1:]:          # one batch: every layer has the batch's valid counts
            x["topk_length"], x["extra_topk_length"] = layers[0]["topk_length"], layers[0]["extra_topk_length"]
        return layers

    def forward(call, layers, sched):
        return [call(**x, block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=sched,
                     softmax_scale=SCALE, is_fp8_kvcache=True) for x in layers]
    site = functools.partial(sg["fmi"].flash_mla_with_kvcache, use_legacy=True)

    def own(**kw):
        return sg["own"]["decode"](**kw, use_legacy=True)
    msg = f"decode_mla=flashmla at flash_mla_with_kvcache b={b} seed={seed}"
    try:
        layers = batch(torch.Generator().manual_seed(seed))
        sched = sg["fmi"].get_mla_metadata()[0]
        got = forward(site, layers, sched)
        assert len(seen) == 3 and all(s is sched for s in seen), msg + ": FlashMLA did not get SGLang's schedule"
        want = forward(own, layers, sg["fmi"].get_mla_metadata()[0])
        for i, (g_, w_) in enumerate(zip(got, want)):
            assert torch.equal(g_[0], w_[0]) and torch.equal(g_[1], w_[1]), f"{msg} layer {i}: != SGLang's call"
        g, captured = _graph(lambda: forward(site, layers, sg["fmi"].get_mla_metadata()[0]))
        fresh = batch(torch.Generator().manual_seed(seed + 1))
        for x, f in zip(layers, fresh):
            for k, t in f.items():
                x[k].copy_(t)
        g.replay()
        torch.cuda.synchronize()
        want = forward(own, layers, sg["fmi"].get_mla_metadata()[0])
        for i, (g_, w_) in enumerate(zip(captured, want)):
            assert torch.equal(g_[0], w_[0]) and torch.equal(g_[1], w_[1]), f"{msg} layer {i} (replay)"
    finally:
        routes._KERNELS["decode_mla"][KEY] = saved


# --------------------------------------------------------------------------- sparse prefill

def test_routed_sparse_prefill_at_sglangs_call_site_matches_flashmla(sg):
    """_forward_prefill_sparse's call: keywords, SGLang's default use_legacy=True (base-2 statistics)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    s, h, s_kv, topk = 512, 64, 8192, 640
    q = (torch.randn(s, h, 512, generator=gen) * 2).bfloat16().cuda()
    kv = torch.randn(s_kv, 1, 512, generator=gen).bfloat16().cuda()
    idx = torch.stack([torch.randperm(s_kv, generator=gen)[:topk] for _ in range(s)]).int().unsqueeze(1).cuda()
    tl = torch.randint(1, topk + 1, (s,), generator=gen, dtype=torch.int32).cuda()
    sink = (torch.randn(h, generator=gen) * 2).cuda()
    kw = dict(q=q, kv=kv, indices=idx, sm_scale=SCALE, d_v=512, attn_sink=sink, topk_length=tl)
    _poison((s, h, 512), torch.bfloat16)
    got = sg["fmi"].flash_mla_sparse_fwd(**kw)          # SGLang's name: the route
    want = sg["own"]["prefill"](**kw)                   # SGLang's own: FlashMLA
    msg = f"sparse_prefill={FORCED['sparse_prefill']} at flash_mla_sparse_fwd seed={seed}"
    assert bool(torch.isfinite(got[0]).all()), msg + ": unwritten or non-finite out"
    assert rel_err(got[0], want[0]) <= OUT_RTOL, msg
    assert_stats_close(got[1], want[1], msg + " max_logits")
    assert_stats_close(got[2], want[2], msg + " lse")


# --------------------------------------------------------------------------- indexer

def _indexer_inputs(gen, B, ctx, H=64):
    from capdispatch.backends.indexer import reference as R
    pages = ctx // 64
    P = B * pages + 3
    q = torch.randn(B, 1, H, 128, generator=gen).to(torch.float8_e4m3fn)
    codes, scales = R.quantize_index_k(torch.randn(P, 64, 128, generator=gen))
    return dict(q=q.cuda(), kv=R.pack_index_k(codes, scales).cuda(),
                w=torch.randn(B, H, generator=gen).cuda(),
                lens=torch.randint(1, ctx + 1, (B,), generator=gen, dtype=torch.int32).cuda(),
                table=torch.randperm(P, generator=gen)[:B * pages].view(B, pages).int().cuda())


def _abs_sum(x, ctx):
    """A: the logits of the absolute values (fp8 sign bits cleared, |w|), exact (reference)."""
    from capdispatch.backends.indexer import reference as R
    qa = (x["q"].view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    ka = x["kv"].clone()
    ka.view(ka.shape[0], -1)[:, :64 * 128] &= 0x7F
    return R.fp8_paged_mqa_logits(qa, ka, x["w"].abs(), x["lens"], x["table"], None, ctx)


def _check_indexer(got, want, x, ctx, msg):
    valid = torch.arange(ctx, device="cuda").unsqueeze(0) < x["lens"].unsqueeze(1)
    assert got.shape == want.shape == (x["q"].shape[0], ctx), msg
    assert not bool(torch.isnan(got).any()), msg + ": unwritten logits"
    assert bool((got[~valid] == float("-inf")).all()), msg + ": positions past a row's length"
    err = (got[valid].double() - want[valid].double()).abs()
    ratio = (err / _abs_sum(x, ctx)[valid].double().clamp_min(1e-30)).max().item()
    assert ratio <= 2.0 ** -8, f"{msg}: max |err|/A {ratio:.3g}"


@pytest.mark.parametrize("B,ctx", [(64, 2048), (4, 8192)])
def test_routed_indexer_at_sglangs_call_site_matches_sglangs_own_and_replays_in_a_cuda_graph(sg, B, ctx):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = _indexer_inputs(gen, B, ctx)
    ind = sg["ind"]

    def routed():       # SGLang's call: (q, kv, weights, seq_lens, page_table, metadata, max_seq_len, clean)
        return ind.fp8_paged_mqa_logits_torch(x["q"], x["kv"], x["w"], x["lens"], x["table"], None, ctx, False)

    def own():
        return sg["own"]["indexer"](x["q"], x["kv"], x["w"], x["lens"], x["table"], None, ctx, False)
    msg = f"indexer={FORCED['indexer']} at fp8_paged_mqa_logits_torch B={B} ctx={ctx} seed={seed}"
    _poison((B, ctx), torch.float32)
    _check_indexer(routed(), own(), x, ctx, msg)
    g, captured = _graph(routed)
    fresh = _indexer_inputs(torch.Generator().manual_seed(seed + 1), B, ctx)
    for k, t in fresh.items():
        x[k].copy_(t)
    g.replay()
    torch.cuda.synchronize()
    _check_indexer(captured, own(), x, ctx, msg + " (CUDA graph replay)")
    assert torch.equal(captured, routed()), msg + ": replay != eager"

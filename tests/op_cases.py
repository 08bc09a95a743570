"""Small random inputs for every op, as (args, kwargs) of the op contract, and its out buffer.

Built from the op test modules' own case makers (fresh random data, -1 holes, out-of-range
ids, lengths, sinks); shared by test_custom_ops.py, which enumerates the ops and backends
from the registry. An op without a maker here (a new one) is tested on its declared
calibration case (Op.case) at its smallest size. Nothing here is zero-filled.
"""
from __future__ import annotations

import torch



def _filled_pool(gen, num_pages, page_size, device):
    from capdispatch.backends.kv_cache import reference as KV
    pool = KV.new_pool(num_pages, page_size, device)
    n = num_pages * page_size
    k = (torch.randn(n, 512, generator=gen) * 3).bfloat16().to(device)
    KV.kv_quant(k, pool, torch.arange(n, dtype=torch.int32, device=device), page_size)
    return pool


def case(op: str, gen: torch.Generator, device="cpu"):
    """(args, kwargs, out) for OP: kwargs without ``out``; ``out`` an uninitialised buffer
    of the op's first output (None for kv_quant, which writes its pool)."""
    if op == "kv_quant":
        from capdispatch.backends.kv_cache import reference as KV
        page_size, pages, n = 16, 4, 20
        k = (torch.randn(n, 512, generator=gen) * 3).bfloat16().to(device)
        loc = torch.randperm(pages * page_size, generator=gen)[:n].int().to(device)
        pool = KV.new_pool(pages, page_size, device)
        pool.copy_(torch.randint(0, 256, pool.shape, generator=gen, dtype=torch.uint8))
        return (k, pool, loc, page_size), {}, None
    if op == "kv_dequant":
        page_size, pages, n = 16, 4, 20
        pool = _filled_pool(gen, pages, page_size, device)
        ids = torch.randint(0, pages * page_size, (n,), generator=gen, dtype=torch.int32).to(device)
        return (pool, ids, page_size), {}, torch.empty((n, 1, 512), dtype=torch.bfloat16, device=device)
    if op == "decode_mla":
        from attention_checks import SCALE
        from test_decode_mla import make_case
        q, pool, idx, ps, kw = make_case(gen, 2, 1, 16, device, topk=40, extra=(8, 4, 24), lengths=True,
                                         sink=True)
        return (q, pool, idx, ps, SCALE), kw, torch.empty(q.shape, dtype=torch.bfloat16, device=device)
    if op == "sparse_prefill":
        from attention_checks import SCALE
        from test_sparse_prefill import make_case
        q, kv, idx, tl, sk = make_case(gen, 3, 16, 48, 40, device, lengths=True, sink=True)
        return ((q, kv, idx, SCALE), dict(d_v=512, attn_sink=sk, topk_length=tl, use_legacy=True),
                torch.empty(q.shape, dtype=torch.bfloat16, device=device))
    if op == "indexer":
        from test_indexer import make_case
        heads = 64 if str(device).startswith("cuda") else 16    # DeepGEMM's kernels: 64 heads
        c = make_case(gen, 2, 1, heads, 150, [70, 131], device=device)
        rows = c["q"].shape[0] * c["q"].shape[1]
        q = c["q"].view(torch.uint8)      # q's fp8 bits (the op accepts both): opcheck compares with math
        return ((q, c["kv"], c["w"], c["ctx"], c["bt"], None, c["S"], False), {},
                torch.empty((rows, c["S"]), dtype=torch.float32, device=device))
    if op == "moe":
        from capdispatch.backends.moe import reference as M
        hid = 128 if str(device).startswith("cuda") else 64     # FlashInfer's MoE: multiples of 128
        w = M.random_weights(4, hid, hid, gen=gen, device=device)
        tw, ids = M.random_routing(5, 2, 4, gen=gen, device=device, mask_frac=0.2)
        x = (torch.randn(5, hid, generator=gen)).bfloat16().to(device)
        return (x, w, tw, ids), {}, torch.empty((5, hid), dtype=torch.bfloat16, device=device)
    return _declared_case(op, gen, device)


def _declared_case(op, gen, device):
    """(args, {}, out) from OP's calibration case builder (Op.case) at the smallest size of its
    ladder, on the CPU profile; out: a buffer like the reference's first result."""
    from capdispatch.backends import builtin
    from capdispatch.calibrate import ladder
    spec = builtin().ops[op]
    c = spec.load_case()(spec.sizes[0], gen, device, ladder.PROFILES["small"])
    if spec.call().out is None:
        return c.args, {}, None
    first = builtin().backend(op, spec.reference).load()(*c.args)
    return c.args, {}, torch.empty_like(first[0] if isinstance(first, tuple) else first)

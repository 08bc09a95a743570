"""Inputs for decode_mla (canaries, tests, benchmarks).

Imports torch: import this module only where inputs are built."""
from __future__ import annotations

import torch

from ..kv_cache.inputs import v4_pool as make_pool


def make_case(gen, b, s_q, h, device, *, page_size=16, num_pages=8, topk=40, extra=None, lengths=False,
              sink=False, lonely=()):
    """q, main pool/indices, optional extra pool (page size, pages, topk), lengths and sink."""
    qscale = float(torch.empty(()).uniform_(0.5, 4.0, generator=gen))
    q = (torch.randn(b, s_q, h, 512, generator=gen) * qscale).bfloat16().to(device)
    pool, _ = make_pool(gen, num_pages, page_size, device)
    cap = num_pages * page_size

    def ids(cap, topk):
        if topk <= cap:
            x = torch.stack([torch.randperm(cap, generator=gen)[:topk] for _ in range(b * s_q)]).int()
        else:   # more entries than tokens: repeats (a token may be listed twice)
            x = torch.randint(0, cap, (b * s_q, topk), generator=gen, dtype=torch.int32)
        x[torch.rand(x.shape, generator=gen) < 0.2] = -1
        far = torch.rand(x.shape, generator=gen) < 0.05
        x[far] = cap + torch.randint(0, 5, (int(far.sum()),), generator=gen, dtype=torch.int32)
        x = x.view(b, s_q, topk)
        for i in lonely:
            x[i] = -1
        return x.to(device)

    kw = dict(topk_length=None, attn_sink=None)
    idx = ids(cap, topk)
    if lengths:
        kw["topk_length"] = torch.randint(0, topk + 1, (b,), generator=gen, dtype=torch.int32).to(device)
    if sink:
        kw["attn_sink"] = (torch.randn(h, generator=gen) * 2).to(device)
    if extra:
        eps, enp, etopk = extra
        kw["extra_pool"], _ = make_pool(gen, enp, eps, device)
        kw["extra_indices"] = ids(enp * eps, etopk)
        kw["extra_page_size"] = eps
        if lengths:
            kw["extra_topk_length"] = torch.randint(0, etopk + 1, (b,), generator=gen,
                                                    dtype=torch.int32).to(device)
    return q, pool, idx, page_size, kw

"""Inputs for sparse_prefill (canaries, tests, benchmarks).

Imports torch: import this module only where inputs are built."""
from __future__ import annotations

import torch

def make_case(gen, s, h, s_kv, topk, device, *, lengths=False, sink=False, lonely=(), junk=True):
    """Random bf16 q/kv (q scaled so logits are O(1..10)), indices with -1 holes,
    out-of-range ids (>= s_kv) and optionally per-query lengths and a sink."""
    qscale = float(torch.empty(()).uniform_(0.5, 4.0, generator=gen))
    q = (torch.randn(s, h, 512, generator=gen) * qscale).bfloat16()
    kv = torch.randn(s_kv, 1, 512, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(s_kv, generator=gen)[:topk] for _ in range(s)]).int()
    if junk:
        holes = torch.rand(s, topk, generator=gen) < 0.2
        idx[holes] = -1
        far = torch.rand(s, topk, generator=gen) < 0.05
        idx[far] = s_kv + torch.randint(0, 3, (int(far.sum()),), generator=gen, dtype=torch.int32)
    for i in lonely:
        idx[i] = -1
    tl = torch.randint(0, topk + 1, (s,), generator=gen, dtype=torch.int32) if lengths else None
    sk = (torch.randn(h, generator=gen) * 2).float() if sink else None
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return to(q), to(kv), to(idx.unsqueeze(1)), to(tl), to(sk)

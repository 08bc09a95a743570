"""sparse_prefill's calibration and benchmark case (Op.case)."""
from __future__ import annotations

from ..cases import HEADS, SCALE, Case, reference_case


def prefill_args(s, gen, device, s_kv, topk, heads=HEADS):
    import torch
    q = (torch.randn(s, heads, 512, generator=gen, device=device) * 2).bfloat16()
    kv = torch.randn(s_kv, 1, 512, generator=gen, device=device).bfloat16()
    idx = torch.randint(0, s_kv, (s, 1, topk), generator=gen, device=device, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=gen, device=device) < 0.05] = -1
    sink = torch.randn(heads, generator=gen, device=device)
    return (q, kv, idx, SCALE, 512, sink, None)


def sparse_prefill_case(s, gen, device, prof, batch=None, layer_state=None) -> Case:
    from . import reference as R
    args = prefill_args(s, gen, device, prof["prefill_kv"], prof["prefill_topk"], prof.get("heads", HEADS))
    return reference_case("sparse_prefill", s, args, R.sparse_prefill)

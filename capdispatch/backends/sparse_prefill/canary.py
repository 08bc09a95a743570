"""Canary of sparse_prefill: sparse attention over gathered top-k rows, small problem.

Cases: fresh random bf16 q/kv from the seed (DeepSeek-V4's 64 heads and 512-wide
rows), index lists with -1 holes and out-of-range ids, per-query top-k lengths
(short lists, zero included), a query with no valid index and an attention sink.
Judged by the op's comparison (Op.compare, cases.attention_compare: out relative 1e-2
and every element within 4e-2 of its row's largest value; max_logits and lse within 1e-3
absolute with identical infinities). out= is poisoned with NaN, so an element never
written fails. Imports torch: loaded only when verified.
"""
from __future__ import annotations

import torch

from ..canary_checks import Mismatch, compare_as_declared
from ..cases import ATTENTION_TOLERANCE
from . import reference as R
from .inputs import make_case

SCALE = 512 ** -0.5


def sparse_prefill(fn, device, seed: int, backend: str = "") -> dict:
    gen = torch.Generator().manual_seed(seed)
    s, h, s_kv, topk = 4, 64, 160, 128
    q, kv, idx, tl, sk = make_case(gen, s, h, s_kv, topk, device, lengths=True, sink=True, lonely=(1,))
    tl[2] = min(int(tl[2]), 5)        # a short list
    args = (q, kv, idx, SCALE, 512, sk, tl)
    want = R.sparse_prefill(*args)
    out = torch.full((s, h, 512), 0x7FC1, dtype=torch.int16, device=device).view(torch.bfloat16)
    got = fn(q, kv, idx, SCALE, 512, sk, tl, out=out)
    if not isinstance(got, (tuple, list)) or len(got) != 3 or got[0].data_ptr() != out.data_ptr():
        raise Mismatch("sparse_prefill(out=...) must return (out, max_logits, lse) with out itself",
                       where="return value", tolerance="the op's contract")
    compare_as_declared("sparse_prefill", got, want, args, "sparse_prefill")
    return {"tolerance": ATTENTION_TOLERANCE, "checked": out.numel()}

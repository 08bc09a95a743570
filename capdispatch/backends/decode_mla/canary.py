"""Canary of decode_mla: sparse MLA decode over the V4 fp8 pool, small problem.

Cases: a pool of kv_quant rows of fresh random data (UE8M0 scales varying per tile),
DeepSeek-V4's 64 heads (16 on the CPU), 256-token pages, index lists with -1 holes and out-of-range
token ids, per-batch top-k lengths (a short list forced), a batch entry with no valid
index and an attention sink. Judged by the op's comparison (Op.compare,
cases.attention_compare: out relative 1e-2 and every element within 4e-2 of its row's
largest value; lse within 1e-3 absolute with identical infinities); out= is poisoned with
NaN, so an element never written fails.
Imports torch: loaded only when a backend is verified.
"""
from __future__ import annotations

import torch

from ..canary_checks import Mismatch, compare_as_declared
from ..cases import ATTENTION_TOLERANCE
from . import reference as R
from .inputs import make_case

SCALE = 512 ** -0.5


def decode_mla(fn, device, seed: int, backend: str = "") -> dict:
    gen = torch.Generator().manual_seed(seed)
    # Fewer heads on the CPU, where Triton runs under its interpreter.
    b, s_q, h = 3, 1, (16 if torch.device(device).type == "cpu" else 64)
    q, pool, idx, ps, kw = make_case(gen, b, s_q, h, device, page_size=256, num_pages=2, topk=128,
                                     lengths=True, sink=True, lonely=(1,))
    kw["topk_length"][2] = min(int(kw["topk_length"][2]), 7)     # a short list
    want = R.decode_mla(q, pool, idx, ps, SCALE, **kw)
    args = (q, pool, idx, ps, SCALE, kw["topk_length"], kw["attn_sink"])
    out = torch.full((b, s_q, h, 512), 0x7FC1, dtype=torch.int16, device=device).view(torch.bfloat16)
    got = fn(q, pool, idx, ps, SCALE, **kw, out=out)
    if not isinstance(got, (tuple, list)) or len(got) != 2 or got[0].data_ptr() != out.data_ptr():
        raise Mismatch("decode_mla(out=...) must return (out, lse) with out itself",
                       where="return value", tolerance="the op's contract")
    compare_as_declared("decode_mla", got, want, args, "decode_mla")
    return {"tolerance": ATTENTION_TOLERANCE, "checked": out.numel()}

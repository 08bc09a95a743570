"""Canary of the indexer: fp8 paged MQA logits on a small canonical problem.

Cases: fresh random inputs from the seed, every finite e4m3 code in q and index-K
with power-of-two scales, 1-D and 2-D context lengths with rows of length <= 0 and
lengths past max_context_len, block-table entries past the needed pages that are
-1, far out of range or INT_MIN, and poisoned (NaN) pages nobody may read.
Judged by the op's comparison (Op.compare, calibration.indexer_compare): |err| <= 2**-10 * A,
where A = s * sum_h |w_h| * sum_d |q_hd k_d| bounds the rounding of any summation order
(fp8 tensor cores on cc >= 8.9 included); with clean_logits=True, positions at or past a
row's length exactly -inf. out= is poisoned with NaN, so an element never written fails.
Imports torch: loaded only when a backend is verified.
"""
from __future__ import annotations

import torch

from ..canary_checks import Mismatch, compare_as_declared
from . import reference as R
from .inputs import make_case

# next_n 1 and 2 (SGLang's decode and MTP), which every indexer kernel takes.
CASES = (
    dict(B=3, N=1, H=64, S=150, lens=[0, 70, 150], ctx_2d=False, kind="quant"),
    dict(B=2, N=2, H=64, S=130, lens=[[3, 65], [0, 500]], ctx_2d=True, kind="codes"),
)


def indexer(fn, device, seed: int, backend: str = "") -> dict:
    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for i, case in enumerate(CASES):
        c = make_case(gen, case["B"], case["N"], case["H"], case["S"], case["lens"],
                      ctx_2d=case["ctx_2d"], device=device, kind=case["kind"])
        args = (c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, c["S"], True)
        want = R.fp8_paged_mqa_logits(*args)
        out = torch.full_like(want, float("nan"))
        got = fn(*args, out=out)
        name = f"logits (case {i})"
        if got is None or got.data_ptr() != out.data_ptr():
            raise Mismatch(f"{name}: out= was not returned", where=name, tolerance="out= contract")
        compare_as_declared("indexer", out, want, args, name)
        checked += out.numel()
    return {"tolerance": "|err| <= 2**-10 * A; -inf past each row", "checked": checked}

"""Canary of the indexer: fp8 paged MQA logits on a small canonical problem.

Cases: fresh random inputs from the seed, every finite e4m3 code in q and index-K
with power-of-two scales, 1-D and 2-D context lengths with rows of length <= 0 and
lengths past max_context_len, block-table entries past the needed pages that are
-1, far out of range or INT_MIN, and poisoned (NaN) pages nobody may read.
Tolerance against the float32 torch reference: |err| <= 2**-10 * A, where
A = s * sum_h |w_h| * sum_d |q_hd k_d| bounds the rounding of any summation order
(fp8 tensor cores on cc >= 8.9 included); positions at or past a row's length must
be exactly -inf (clean_logits=True) and every element of a NaN-poisoned out is written.
Imports torch: loaded only when a backend is verified.
"""
from __future__ import annotations

import torch

from ..canary_checks import Mismatch, where_of
from . import reference as R
from .inputs import make_case

REL = 2.0 ** -10
# next_n 1 and 2 (SGLang's decode and MTP), which every indexer kernel takes.
CASES = (
    dict(B=3, N=1, H=64, S=150, lens=[0, 70, 150], ctx_2d=False, kind="quant"),
    dict(B=2, N=2, H=64, S=130, lens=[[3, 65], [0, 500]], ctx_2d=True, kind="codes"),
)


def _abs_codes(t):
    u8 = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return u8 & 0x7F


def _abs_bound(c):
    """A: the reference on |q|, |k|, |w| (sign bits cleared; NaN pages stay NaN)."""
    kv = c["kv"].clone()
    P = kv.shape[0]
    flat = kv.view(P, -1)
    flat[:, :64 * 128] = _abs_codes(flat[:, :64 * 128])
    q = _abs_codes(c["q"].contiguous()).view(torch.float8_e4m3fn)
    return R.fp8_paged_mqa_logits(q, kv, c["w"].abs(), c["ctx"], c["bt"], None, c["S"], True)


def indexer(fn, device, seed: int, backend: str = "") -> dict:
    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for i, case in enumerate(CASES):
        c = make_case(gen, case["B"], case["N"], case["H"], case["S"], case["lens"],
                      ctx_2d=case["ctx_2d"], device=device, kind=case["kind"])
        args = (c["q"], c["kv"], c["w"], c["ctx"], c["bt"], None, c["S"], True)
        want = R.fp8_paged_mqa_logits(*args).double().cpu()
        bound = _abs_bound(c).double().cpu()
        out = torch.full_like(want, float("nan"), dtype=torch.float32, device=device)
        got = fn(*args, out=out)
        name = f"logits (case {i})"
        if got is None or got.data_ptr() != out.data_ptr():
            raise Mismatch(f"{name}: out= was not returned", where=name, tolerance="out= contract")
        g = out.double().cpu()
        masked = ~torch.isfinite(want)
        not_inf = masked & (g != float("-inf"))
        if bool(not_inf.any()):
            raise Mismatch(f"{name}: {int(not_inf.sum())} positions at or past a row's length are not "
                           f"-inf", max_err=float("inf"), where=where_of(not_inf, name),
                           tolerance="exactly -inf past a row's length")
        err = torch.where(masked, torch.zeros_like(g), (g - want).abs().nan_to_num(float("inf")))
        over = err > REL * torch.where(masked, torch.ones_like(bound), bound) + 1e-30
        if bool(over.any()):
            ratio = (err / bound.clamp_min(1e-300)).masked_fill(masked, 0)
            raise Mismatch(f"{name}: {int(over.sum())} logits off by more than 2**-10 * A",
                           max_err=float(err.max()), where=where_of(ratio, name),
                           tolerance="|err| <= 2**-10 * A")
        checked += g.numel()
    return {"tolerance": "|err| <= 2**-10 * A; -inf past each row", "checked": checked}

"""decode_mla through FlashInfer's SM120 sparse MLA (distribution ``flashinfer-python``,
module ``flashinfer``). Converts our contract (reference.decode_mla) to the library call
and back; the argument chores it shares with the FlashMLA adapter are in library_args.py.
"""

from __future__ import annotations

import math

import torch

from .library_args import clean_ids, deliver, pad_heads, pool_view
from .reference import DIM, check_decode_args

__all__ = ["flashinfer_sparse_mla"]

_FI_HEADS = (8, 16, 32, 64, 128)
_wrappers: dict = {}


def _fi_wrapper(device):
    w = _wrappers.get(device)
    if w is None:
        from flashinfer.mla import SparseMLASm120Wrapper
        w = SparseMLASm120Wrapper(d_v=DIM, kv_scale_format="auto", kv_cache_format="fp8", device=device)
        _wrappers[device] = w
    return w


def flashinfer_sparse_mla(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None,
                          extra_pool=None, extra_indices=None, extra_page_size=None, extra_topk_length=None,
                          *, out=None, checks=True):
    """decode_mla via FlashInfer's public ``flashinfer.mla.SparseMLASm120Wrapper.run``
    (flashinfer-python >= 0.7.2; SM120/SM121). One persistent wrapper per device.

    The decode/extend split is FlashInfer's: calls of at most 64 query tokens may take
    its split-K decode kernels (scratch in grow-only arenas the wrapper owns, sized by
    that bound), larger calls its prefill kernels, which use no split-K scratch. This
    replaces SGLang 0.5.23's private ``_sparse_mla_sm120_paged_attention`` call and its
    256 -> 64 page split (0.7.x takes runtime page sizes and padded page strides).

    FlashInfer's LSE is base 2 by default and includes the sink (lse' = ln(e^lse +
    e^sink); an empty row with a sink gets lse' = sink): we ask for base e
    (``lse_scale = ln 2``) and take the sink back out, lse = lse' + log1p(-e^(sink - lse')),
    which is exact up to rounding unless the sink dominates the row; empty rows -> +inf.
    Contract: reference.decode_mla."""
    a = check_decode_args(q, pool, indices, page_size, sm_scale, topk_length, attn_sink,
                          extra_pool, extra_indices, extra_page_size, extra_topk_length, out, checks)
    b, s_q, h, _ = q.shape
    T = b * s_q
    qp, sink, _ = pad_heads(q.reshape(T, h, DIM), a.attn_sink, _FI_HEADS)
    hp = qp.shape[1]

    def per_token(lengths):
        if lengths is None:
            return None
        lengths = lengths.to(torch.int32)
        return lengths.repeat_interleave(s_q) if s_q > 1 else lengths.contiguous()

    kw = {}
    if a.extra_pool is not None:
        kw = dict(extra_kv_cache=pool_view(a.extra_pool, a.extra_page_size),
                  extra_indices=clean_ids(a.extra_idx.reshape(T, -1), a.extra_pool.shape[0] * a.extra_page_size,
                                         checks),
                  extra_topk_length=per_token(a.extra_topk_length))
    o = torch.empty((T, hp, DIM), dtype=torch.bfloat16, device=q.device)
    lse_e = torch.empty((T, hp), dtype=torch.float32, device=q.device)
    _fi_wrapper(q.device).run(
        qp, pool_view(a.pool, a.page_size),
        clean_ids(a.idx.reshape(T, -1), a.pool.shape[0] * a.page_size, checks),
        o, float(sm_scale),
        topk_length=per_token(a.topk_length), attn_sink=sink, out_lse=lse_e,
        return_lse=False, lse_scale=math.log(2.0), **kw)
    o, lse_e = o[:, :h], lse_e[:, :h]
    if a.attn_sink is not None:
        lse_e = lse_e + torch.log1p(-torch.exp(a.attn_sink[None, :] - lse_e))
    lse = torch.where(lse_e == float("-inf"), float("inf"), lse_e)
    lse = lse.view(b, s_q, h).permute(0, 2, 1).contiguous()
    o = o.reshape(b, s_q, h, DIM)
    return deliver(o, a.out), lse


# Custom ops (backends/torch_ops.py): what the registry binds. Defining them needs no
# library, so their schemas and fake implementations trace anywhere.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_flashinfer_sparse_mla = custom_op(OPS[0], "flashinfer_sparse_mla", flashinfer_sparse_mla)

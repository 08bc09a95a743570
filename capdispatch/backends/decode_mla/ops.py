"""decode_mla as torch custom ops (naming and rationale: backends/torch_ops.py).

``decode_mla_<backend>(q, pool, indices, page_size, sm_scale, ..., *, checks=True) ->
(out, lse)`` is functional; ``decode_mla_<backend>_out(..., *, out!, checks=True) -> lse``
writes the caller's ``out``. The bound function keeps the op contract's signature
(``*, out=None``).
"""
from __future__ import annotations

import torch

from ..torch_ops import CHECKS, define, op_name, pair_unchecked, named_bound, tracing

__all__ = ["decode_mla_op"]

DIM = 512

_ARGS = ("Tensor q, Tensor pool, Tensor indices, int page_size, float sm_scale, Tensor? topk_length=None, "
         "Tensor? attn_sink=None, Tensor? extra_pool=None, Tensor? extra_indices=None, "
         "int? extra_page_size=None, Tensor? extra_topk_length=None")


def _lse_fake(q):
    b, s_q, h, _ = q.shape
    return q.new_empty((b, h, s_q), dtype=torch.float32)


def _fake(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None, extra_pool=None,
          extra_indices=None, extra_page_size=None, extra_topk_length=None, *, checks=True):
    b, s_q, h, _ = q.shape
    return q.new_empty((b, s_q, h, DIM), dtype=torch.bfloat16), _lse_fake(q)


def _out_fake(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None, extra_pool=None,
              extra_indices=None, extra_page_size=None, extra_topk_length=None, *, out, checks=True):
    return _lse_fake(q)


def decode_mla_op(backend: str, impl):
    """The bound decode_mla for IMPL (the op contract's signature, reference.decode_mla,
    plus ``checks``)."""
    functional = define(op_name("decode_mla", backend), f"({_ARGS}, *, {CHECKS}) -> (Tensor, Tensor)",
                        impl, _fake)

    def _out_impl(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None, extra_pool=None,
                  extra_indices=None, extra_page_size=None, extra_topk_length=None, *, out, checks=True):
        return impl(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool, extra_indices,
                    extra_page_size, extra_topk_length, out=out, checks=checks)[1]

    with_out = define(op_name("decode_mla", backend, out=True),
                      f"({_ARGS}, *, Tensor(a!) out, {CHECKS}) -> Tensor", _out_impl, _out_fake)

    def bound(checks):
        def decode_mla(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None, extra_pool=None,
                       extra_indices=None, extra_page_size=None, extra_topk_length=None, *, out=None):
            if not tracing():
                return impl(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool,
                            extra_indices, extra_page_size, extra_topk_length, out=out, checks=checks)
            if out is None:
                return functional(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool,
                                  extra_indices, extra_page_size, extra_topk_length, checks=checks)
            lse = with_out(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool,
                           extra_indices, extra_page_size, extra_topk_length, out=out, checks=checks)
            return out, lse
        return named_bound(decode_mla, "decode_mla", backend, impl, functional, with_out)

    return pair_unchecked(bound(True), bound(False))

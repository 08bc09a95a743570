"""sparse_prefill as torch custom ops (naming and rationale: backends/torch_ops.py).

``sparse_prefill_<backend>(q, kv, indices, sm_scale, ..., *, use_legacy=True, checks=True)
-> (out, max_logits, lse)`` is functional; ``sparse_prefill_<backend>_out(..., out!,
checks=True) -> (max_logits, lse)`` writes the caller's ``out``. The bound function keeps
the op contract's signature.
"""
from __future__ import annotations

import torch

from ..torch_ops import CHECKS, define, op_name, pair_unchecked, named_bound, tracing

__all__ = ["sparse_prefill_op"]

_ARGS = ("Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v=512, Tensor? attn_sink=None, "
         "Tensor? topk_length=None, *, bool use_legacy=True")


def _stats_fake(q):
    s, h, _ = q.shape
    return q.new_empty((s, h), dtype=torch.float32), q.new_empty((s, h), dtype=torch.float32)


def _fake(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *, use_legacy=True,
          checks=True):
    s, h, _ = q.shape
    return (q.new_empty((s, h, d_v), dtype=torch.bfloat16),) + _stats_fake(q)


def _out_fake(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *, use_legacy=True,
              out, checks=True):
    return _stats_fake(q)


def sparse_prefill_op(backend: str, impl):
    """The bound sparse_prefill for IMPL (the op contract's signature, reference.sparse_prefill,
    plus ``checks``)."""
    functional = define(op_name("sparse_prefill", backend),
                        f"({_ARGS}, {CHECKS}) -> (Tensor, Tensor, Tensor)", impl, _fake)

    def _out_impl(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *, use_legacy=True,
                  out, checks=True):
        _, max_logits, lse = impl(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                  use_legacy=use_legacy, out=out, checks=checks)
        return max_logits, lse

    with_out = define(op_name("sparse_prefill", backend, out=True),
                      f"({_ARGS}, Tensor(a!) out, {CHECKS}) -> (Tensor, Tensor)", _out_impl, _out_fake)

    def bound(checks):
        def sparse_prefill(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *,
                           use_legacy=True, out=None):
            if not tracing():
                return impl(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, use_legacy=use_legacy,
                            out=out, checks=checks)
            if out is None:
                return functional(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                  use_legacy=use_legacy, checks=checks)
            max_logits, lse = with_out(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                       use_legacy=use_legacy, out=out, checks=checks)
            return out, max_logits, lse
        return named_bound(sparse_prefill, "sparse_prefill", backend, impl, functional, with_out)

    return pair_unchecked(bound(True), bound(False))

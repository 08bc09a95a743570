"""indexer as torch custom ops (naming and rationale: backends/torch_ops.py).

``indexer_<backend>(q, kv_cache, weights, context_lens, block_table, schedule_metadata,
max_context_len, clean_logits, *, checks=True) -> logits`` is functional;
``indexer_<backend>_out(..., *, out!, checks=True) -> ()`` writes the caller's ``out``.
The bound function keeps the op contract's signature.
"""
from __future__ import annotations

import torch

from ...errors import ArgumentTypeError
from ..torch_ops import CHECKS, define, op_name, pair_unchecked, named_bound, tracing

__all__ = ["indexer_op"]

_ARGS = ("Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_table, "
         "Tensor? schedule_metadata=None, int? max_context_len=None, bool clean_logits=False")


def _rows_cols(q, max_context_len):
    if max_context_len is None:
        raise ArgumentTypeError("max_context_len is required")
    return q.shape[0] * q.shape[1], max_context_len


def contiguous_fake(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None,
                    max_context_len=None, clean_logits=False, *, checks=True):
    rows, cols = _rows_cols(q, max_context_len)
    return q.new_empty((rows, cols), dtype=torch.float32)


def padded_fake(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None,
                max_context_len=None, clean_logits=False, *, checks=True):
    """DeepGEMM's logits: rows padded to a multiple of 256 floats (1024 bytes)."""
    rows, cols = _rows_cols(q, max_context_len)
    return torch.empty_strided((rows, cols), (-(-cols // 256) * 256, 1), dtype=torch.float32, device=q.device)


def _out_fake(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None, max_context_len=None,
              clean_logits=False, *, out, checks=True):
    _rows_cols(q, max_context_len)
    return None


def indexer_op(backend: str, impl, fake=contiguous_fake):
    """The bound indexer for IMPL (the op contract's signature, reference.fp8_paged_mqa_logits,
    plus ``checks``); FAKE gives the functional result's shape and strides."""
    functional = define(op_name("indexer", backend), f"({_ARGS}, *, {CHECKS}) -> Tensor", impl, fake)

    def _out_impl(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None, max_context_len=None,
                  clean_logits=False, *, out, checks=True):
        impl(q, kv_cache, weights, context_lens, block_table, schedule_metadata, max_context_len, clean_logits,
             out=out, checks=checks)

    with_out = define(op_name("indexer", backend, out=True), f"({_ARGS}, *, Tensor(a!) out, {CHECKS}) -> ()",
                      _out_impl, _out_fake)

    def bound(checks):
        def indexer(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None, max_context_len=None,
                    clean_logits=False, *, out=None):
            if not tracing():
                return impl(q, kv_cache, weights, context_lens, block_table, schedule_metadata, max_context_len,
                            clean_logits, out=out, checks=checks)
            if out is None:
                return functional(q, kv_cache, weights, context_lens, block_table, schedule_metadata,
                                  max_context_len, clean_logits, checks=checks)
            with_out(q, kv_cache, weights, context_lens, block_table, schedule_metadata, max_context_len,
                     clean_logits, out=out, checks=checks)
            return out
        return named_bound(indexer, "indexer", backend, impl, functional, with_out)

    return pair_unchecked(bound(True), bound(False))

"""kv_quant / kv_dequant as torch custom ops (naming and rationale: backends/torch_ops.py).

``kv_quant_<backend>(k, pool!, loc, page_size, *, checks=True) -> ()`` mutates the pool;
``kv_dequant_<backend>(pool, token_ids, page_size, *, checks=True) -> Tensor`` is
functional and ``kv_dequant_<backend>_out(..., out!, checks=True) -> ()`` writes ``out``.
The bound ``kv_dequant`` keeps the op contract's ``out=None`` and picks one of the two.
"""
from __future__ import annotations

import torch

from ..torch_ops import CHECKS, define, op_name, pair_unchecked, named_bound, tracing
from ..v4_layout import DIM

__all__ = ["kv_quant_op", "kv_dequant_op"]


def _quant_fake(k, pool, loc, page_size, *, checks=True):
    return None


def _dequant_fake(pool, token_ids, page_size, *, checks=True):
    return pool.new_empty((token_ids.shape[0], 1, DIM), dtype=torch.bfloat16)


def _dequant_out_fake(pool, token_ids, page_size, *, out, checks=True):
    return None


def kv_quant_op(backend: str, impl):
    """The bound kv_quant(k, pool, loc, page_size) for IMPL(k, pool, loc, page_size, *, checks);
    ``capdispatch::kv_quant_<backend>`` is its ``.functional`` (it mutates ``pool``)."""
    op = define(op_name("kv_quant", backend),
                f"(Tensor k, Tensor(a!) pool, Tensor loc, int page_size, *, {CHECKS}) -> ()",
                impl, _quant_fake)

    def bound(checks):
        def kv_quant(k, pool, loc, page_size):
            if not tracing():
                return impl(k, pool, loc, page_size, checks=checks)
            return op(k, pool, loc, page_size, checks=checks)
        return named_bound(kv_quant, "kv_quant", backend, impl, op, None)

    return pair_unchecked(bound(True), bound(False))


def kv_dequant_op(backend: str, impl):
    """The bound kv_dequant(pool, token_ids, page_size, out=None) for IMPL (same signature
    plus ``*, checks``)."""
    functional = define(op_name("kv_dequant", backend),
                        f"(Tensor pool, Tensor token_ids, int page_size, *, {CHECKS}) -> Tensor",
                        impl, _dequant_fake)

    def _out_impl(pool, token_ids, page_size, *, out, checks=True):
        impl(pool, token_ids, page_size, out, checks=checks)

    with_out = define(op_name("kv_dequant", backend, out=True),
                      f"(Tensor pool, Tensor token_ids, int page_size, *, Tensor(a!) out, {CHECKS}) -> ()",
                      _out_impl, _dequant_out_fake)

    def bound(checks):
        def kv_dequant(pool, token_ids, page_size, out=None):
            if not tracing():
                return impl(pool, token_ids, page_size, out, checks=checks)
            if out is None:
                return functional(pool, token_ids, page_size, checks=checks)
            with_out(pool, token_ids, page_size, out=out, checks=checks)
            return out
        return named_bound(kv_dequant, "kv_dequant", backend, impl, functional, with_out)

    return pair_unchecked(bound(True), bound(False))

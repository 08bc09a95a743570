"""moe as torch custom ops (naming and rationale: backends/torch_ops.py).

A custom op's schema takes tensors and scalars, not records, so the op takes the
``MoeWeights`` record's parts (``MoeWeights.parts()``: the four packed tensors, the
per-layer aux tensors and their names, the sizes, the clamp limit and the layout tag)
and its kernel rebuilds the record without re-checking it (``MoeWeights.from_parts``).
The bound function keeps the op contract, ``moe(x, weights, topk_weights, topk_ids,
out=None)``, and unpacks the record: under torch.compile that unpacking is traced
away (the sizes and layout become constants, the tensors graph inputs).

``moe_<backend>(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, ..., *,
checks=True) -> Tensor`` is functional; ``moe_<backend>_out(..., *, out!, checks=True)
-> ()`` writes the caller's ``out``.
"""
from __future__ import annotations

import torch

from ...errors import ArgumentTypeError
from ..torch_ops import CHECKS, define, op_name, pair_unchecked, named_bound, tracing
from .weights import MoeWeights

__all__ = ["moe_op"]

_ARGS = ("Tensor x, Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, Tensor topk_weights, "
         "Tensor topk_ids, int num_experts, int hidden, int intermediate, float? swiglu_limit, str layout, "
         "str[] aux_keys, Tensor[] aux")


def _fake(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, num_experts, hidden, intermediate,
          swiglu_limit, layout, aux_keys, aux, *, checks=True):
    return torch.empty_like(x, dtype=torch.bfloat16)


def _out_fake(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, num_experts, hidden, intermediate,
              swiglu_limit, layout, aux_keys, aux, *, out, checks=True):
    return None


def moe_op(backend: str, impl):
    """The bound moe for IMPL(x, weights, topk_weights, topk_ids, out=None, *, checks)."""

    def _impl(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, num_experts, hidden, intermediate,
              swiglu_limit, layout, aux_keys, aux, *, checks=True):
        w = MoeWeights.from_parts(w13, w13_scale, w2, w2_scale, num_experts, hidden, intermediate,
                                  swiglu_limit, layout, aux_keys, aux)
        return impl(x, w, topk_weights, topk_ids, checks=checks)

    def _out_impl(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, num_experts, hidden, intermediate,
                  swiglu_limit, layout, aux_keys, aux, *, out, checks=True):
        w = MoeWeights.from_parts(w13, w13_scale, w2, w2_scale, num_experts, hidden, intermediate,
                                  swiglu_limit, layout, aux_keys, aux)
        impl(x, w, topk_weights, topk_ids, out, checks=checks)

    functional = define(op_name("moe", backend), f"({_ARGS}, *, {CHECKS}) -> Tensor", _impl, _fake)
    with_out = define(op_name("moe", backend, out=True), f"({_ARGS}, *, Tensor(a!) out, {CHECKS}) -> ()",
                      _out_impl, _out_fake)

    def bound(checks):
        def moe(x, weights, topk_weights, topk_ids, out=None):
            if checks and not isinstance(weights, MoeWeights):
                raise ArgumentTypeError(f"weights must be a MoeWeights, got {type(weights).__name__}")
            if not tracing():
                return impl(x, weights, topk_weights, topk_ids, out, checks=checks)
            aux = weights.aux
            if out is None:
                return functional(x, weights.w13, weights.w13_scale, weights.w2, weights.w2_scale, topk_weights,
                                  topk_ids, weights.num_experts, weights.hidden, weights.intermediate,
                                  weights.swiglu_limit, weights.layout, list(aux), list(aux.values()),
                                  checks=checks)
            with_out(x, weights.w13, weights.w13_scale, weights.w2, weights.w2_scale, topk_weights, topk_ids,
                     weights.num_experts, weights.hidden, weights.intermediate, weights.swiglu_limit,
                     weights.layout, list(aux), list(aux.values()), out=out, checks=checks)
            return out
        return named_bound(moe, "moe", backend, impl, functional, with_out)

    return pair_unchecked(bound(True), bound(False))

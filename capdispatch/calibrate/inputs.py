"""Inputs for one op at one size, checked against the op's torch reference.

Each op names its case builder on its `Op` (`case="module:function"`, in the op's folder,
calibration.py): it draws fresh random inputs (never zeros) from the caller's generator at
a rank's shapes (a profile: ladder.PROFILES, or one made from a model's RankShape by
ladder.profile_of), computes the reference output once, and returns a `Case`:
`verify(fn)` runs a backend and compares it with the reference (the op's tolerances, as
its tests state them), `bind(fn)` the zero-argument call that is timed.

A builder given BATCH (the per-batch tensors of another layer's case, at the op's
`batch_args` positions) builds this layer's inputs around them, the way the layers of one
forward share the batch's valid counts, slot maps and block tables.

The builders' helpers are re-exported here for benchmarks/, which build the same inputs.
"""
from __future__ import annotations

from ..backends.cases import (HEADS, SCALE, Case, attention_close, attention_errors,  # noqa: F401
                              same_bf16)
from ..backends.decode_mla.calibration import C4_TOPK, SWA_TOPK, decode_args  # noqa: F401
from ..backends.indexer.calibration import (INDEXER_DIM, INDEXER_HEADS, INDEXER_PAGE,  # noqa: F401
                                            INDEXER_REL_TOL, indexer_abs_sum, indexer_decode_args,
                                            indexer_errors)
from ..backends.kv_cache.calibration import quantized_pool, rand_k  # noqa: F401
from ..backends.moe.calibration import copy_weights  # noqa: F401
from ..backends.sparse_prefill.calibration import prefill_args  # noqa: F401
from ..errors import CapdispatchError


class UndeclaredError(CapdispatchError, ValueError):
    """An op lacks a declaration that calibration or a benchmark needs."""


def undeclared(spec, sizes_given: bool = False) -> str:
    """What op SPEC (an Op) lacks to be calibrated, in words naming the field to declare;
    "" when nothing. SIZES_GIVEN: the sizes come from the caller (--sizes), not Op.sizes."""
    if not spec.case:
        return (f"op {spec.name!r} declares no calibration case: add case=\"module:function\" to "
                f"its Op (a builder(size, gen, device, profile, batch=None, layer_state=None) "
                f"returning a capdispatch.backends.cases.Case; see docs/contributing.md)")
    if not spec.sizes and not sizes_given:
        return (f"op {spec.name!r} declares no size ladder: add sizes=(...) to its Op (the sizes "
                f"`dispatch bench` times it at; see docs/contributing.md), or give --sizes")
    if spec.size is None:
        return (f"op {spec.name!r} declares no size argument: add size=SizeArg(key, index, name) "
                f"to its Op (the leading dimension calibration buckets on; see docs/contributing.md)")
    return ""


def builder_of(op: str, registry=None):
    """OP's case builder (its Op.case), or UndeclaredError naming the op and the field."""
    from ..backends import builtin
    spec = (registry or builtin()).ops[op]
    if not spec.case:
        raise UndeclaredError(undeclared(spec))
    return spec.load_case()


def case(op, size, gen, device, profile, batch=None, layer_state=None):
    """A case with the uniform interface `verify_backend(name, fn)` / `bind_backend(name, fn)`;
    BATCH: another layer's per-batch tensors (`batch_of`); LAYER_STATE: a dict the caller
    keeps per layer across sizes (what does not depend on the size: MoE weights)."""
    c = builder_of(op)(size, gen, device, profile, batch=batch, layer_state=layer_state)
    if isinstance(c, Case):
        return _Uniform(c)
    return c


def batch_of(c) -> tuple:
    """The per-batch tensors of case C, at its op's `batch_args` positions."""
    from ..backends import builtin
    return tuple(c.args[i] for i in builtin().ops[c.op].batch_args)


class _Uniform:
    def __init__(self, c: Case):
        self.c, self.op, self.size, self.args = c, c.op, c.size, c.args

    def verify_backend(self, backend, fn):
        return self.c.verify(fn)

    def bind_backend(self, backend, fn):
        return self.c.bind(fn)

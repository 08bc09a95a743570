"""The rehearsal's ops and the check of one call: the ops are the model's declaration
(capdispatch/models/calls.yaml), each op's reference its `Op.reference` backend and the
comparison its `Op.compare` (the tolerances the op's tests and calibration state)."""
from __future__ import annotations


def called_ops() -> tuple:
    """The ops the model calls, in its declaration's order."""
    from ..models import model_calls
    return model_calls().ops


def reference(op: str, registry=None):
    """The op's reference kernel (its `Op.reference` backend)."""
    if registry is None:
        from ..backends import builtin
        registry = builtin()
    return registry.backend(op, registry.ops[op].reference).load()


def call_checked(op: str, fn, args, fn_args=None, registry=None):
    """FN(*FN_ARGS or ARGS) and the reference on ARGS, compared by the op's `Op.compare`:
    (output, ok, detail). FN_ARGS: the backend's own form of the inputs (MoE weights laid
    out for it), when it differs from the reference's."""
    if registry is None:
        from ..backends import builtin
        registry = builtin()
    from ..backends.cases import compared
    done = compared(registry.ops[op], fn, args, ref=reference(op, registry), fn_args=fn_args)
    return done.out, done.comparison.ok, done.comparison.detail

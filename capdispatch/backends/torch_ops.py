"""Every backend of every op as a torch custom op in the ``capdispatch`` namespace.

Naming: ``capdispatch::<op>_<backend>`` is the functional form (returns new tensors)
and ``capdispatch::<op>_<backend>_out`` the form that writes a caller's ``out``
(declared ``Tensor(a!) out``, returns the remaining outputs). An op that writes an
argument by contract declares it the same way (``kv_quant`` mutates ``pool``).
E.g. ``torch.ops.capdispatch.decode_mla_triton_fp8.default``.

Every schema ends in ``*, bool checks=True`` (or ``, bool checks=True`` after other
keyword-only arguments): argument validation, which serving turns off at bind time
(``bind(..., checks=False)`` binds the variant recorded by ``pair_unchecked``).

Ops are defined with ``torch.library.Library.define`` + ``impl`` for the
CompositeExplicitAutograd key (one kernel for every device; no autograd formula: the
ops are inference kernels) and a fake implementation (``register_fake``) giving the
output shapes and dtypes, so a bound kernel traces under ``torch.compile(fullgraph=True)``,
is functionalised by Inductor (declared mutations, no "mutated inputs" CUDA-graph skip)
and captures in CUDA graphs. ``torch.library.custom_op`` would do the same with an
autograd layer that costs about 5x more host time per call.

Eager calls skip the dispatcher: a bound function runs the kernel function itself unless
something traces the call (``tracing()``: torch.compile, export, make_fx, fake tensors),
and then it calls the custom op, which runs the same kernel function. The dispatcher
costs several microseconds a call, which a decode step pays once per layer and op.

This module imports torch: only kernel modules import it, when a backend is bound,
so ``import capdispatch`` stays torch-free.
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["NAMESPACE", "op_name", "define", "defined", "CHECKS", "pair_unchecked", "without_checks",
           "named_bound", "tracing"]

NAMESPACE = "capdispatch"
# Every op's schema ends in this keyword: argument validation, on by default; bound
# kernels for serving pass False (bind(..., checks=False)).
CHECKS = "bool checks=True"

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")   # kept alive: registrations live with it
_ops: dict = {}
_schemas: dict = {}
_unchecked: dict = {}   # bound callable -> the same kernel with checks=False


def op_name(op: str, backend: str, out: bool = False) -> str:
    """The custom op's name for OP's BACKEND (``_out``: the variant that writes ``out``)."""
    return f"{op}_{backend}_out" if out else f"{op}_{backend}"


def define(name: str, schema: str, impl, fake):
    """Define ``capdispatch::NAME`` with SCHEMA (``"(Tensor x, int n) -> Tensor"``), IMPL
    for every device and FAKE for tracing; return its default OpOverload. Defining a
    name again (a kernel module imported anew) keeps the schema, which must be the same,
    and runs the new IMPL and FAKE."""
    have = _ops.get(name)
    if have is None:
        _lib.define(name + schema)
    elif _schemas[name] != schema:
        raise ValueError(f"capdispatch::{name} is defined with {_schemas[name]}, not {schema}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "overriding a previously registered kernel"
        _lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_lib)
    if have is None:
        _schemas[name] = schema
        have = _ops[name] = getattr(getattr(torch.ops, NAMESPACE), name).default
    return have


def tracing() -> bool:
    """Whether the current call is traced rather than run: under torch.compile (Dynamo
    folds this to True) or under any dispatch mode (fake tensors, make_fx, export)."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def defined() -> dict:
    """name -> OpOverload of every capdispatch op defined so far in this process."""
    return dict(_ops)


def named_bound(fn, op: str, backend: str, impl, functional, with_out):
    """FN, the bound function of OP=BACKEND with the contract's signature, named like
    its custom op, documented by IMPL and carrying both OpOverloads."""
    fn.__qualname__ = fn.__name__ = op_name(op, backend)
    fn.__doc__ = impl.__doc__
    fn.functional, fn.with_out = functional, with_out
    return fn


def pair_unchecked(bound, unchecked):
    """Record UNCHECKED as BOUND's variant that skips argument validation; return BOUND."""
    _unchecked[bound] = unchecked
    return bound


def without_checks(bound):
    """BOUND's variant without argument validation (BOUND itself when it has none)."""
    return _unchecked.get(bound, bound)

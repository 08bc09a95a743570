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

``custom_op(op, backend, impl)`` derives all of it from the op's one declaration (its
typed ``Op.signature`` and ``Op.outputs``, backends/signature.py): both schemas, both fake
implementations, and the bound function, generated with the contract's own parameters so
that an eager call costs what a hand-written one does.

This module imports torch: only kernel modules import it, when a backend is bound,
so ``import capdispatch`` stays torch-free.
"""
from __future__ import annotations

import importlib
import warnings
import ast

import torch

from ..errors import ArgumentTypeError
from .signature import dims_of

__all__ = ["NAMESPACE", "op_name", "define", "defined", "CHECKS", "pair_unchecked", "without_checks",
           "named_bound", "tracing", "custom_op"]

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
    its custom op, documented by IMPL and carrying both OpOverloads and IMPL (``kernel``)."""
    fn.__qualname__ = fn.__name__ = op_name(op, backend)
    fn.__module__ = impl.__module__                 # where the kernel lives (exec gives none)
    fn.__doc__ = impl.__doc__
    fn.functional, fn.with_out, fn.kernel = functional, with_out, impl
    return fn


def pair_unchecked(bound, unchecked):
    """Record UNCHECKED as BOUND's variant that skips argument validation; return BOUND."""
    _unchecked[bound] = unchecked
    return bound


def without_checks(bound):
    """BOUND's variant without argument validation (BOUND itself when it has none)."""
    return _unchecked.get(bound, bound)


def _load(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _part_names(parts: str) -> list:
    return [t.strip().rsplit(" ", 1)[1] for t in parts.split(",")]


def _default(text: str):
    """A schema default's value (the literals a signature may write: None, True, False, numbers, strings)."""
    return ast.literal_eval(text)


def _results(values: tuple):
    return None if not values else values[0] if len(values) == 1 else values


def custom_op(op, backend: str, impl, fake=None):
    """The bound function of OP (an ``Op`` with a typed signature and ``outputs``) for
    BACKEND's kernel function IMPL, which takes the contract's arguments plus ``out=`` (when
    the op has an output buffer) and ``*, checks``. FAKE replaces the functional form's fake
    implementation derived from ``Op.outputs`` (a backend whose result has other strides)."""
    if op.outputs is None:
        raise ValueError(f"op {op.name!r} declares no outputs=: it has no custom op (backends/signature.py)")
    call = op.call()
    classes = {t: _load(path) for t, path in (op.records or {}).items()}
    parts = {t: cls.PARTS for t, cls in classes.items()}
    contract = [p for p in call.params if p is not call.out]
    positional = [p for p in contract if not p.kw_only]
    widths = {p.name: len(_part_names(parts[p.type])) for p in positional if p.type in parts}
    flat = [n for p in positional for n in (_part_names(parts[p.type]) if p.type in parts else [p.name])]
    defaults = {p.name: _default(p.default) for p in contract if p.default is not None and p.type not in parts}
    # The generated bound function's own names (_bound_source) cannot be parameters.
    taken = sorted({p.name for p in call.params} & ({"impl", "functional", "with_out", "tracing", "rest",
                                                     "ArgumentTypeError", op.name} | set(classes)))
    if taken:
        raise ValueError(f"op {op.name!r}: parameter name(s) {', '.join(taken)} are taken by the bound "
                         f"function's own names; rename them")
    # The results live where the first tensor argument does.
    like = next((p.name for p in contract if p.type.startswith("Tensor") and p.type != "Tensor[]"), None)
    if like is None and op.outputs:
        raise ValueError(f"op {op.name!r}: its results need a tensor argument to take their device from")

    def contract_args(args):
        # The dispatcher may leave out trailing arguments at their defaults: IMPL's apply.
        out, i = [], 0
        for p in positional:
            if i >= len(args):
                break
            w = widths.get(p.name)
            out.append(args[i] if w is None else classes[p.type].from_parts(*args[i:i + w]))
            i += 1 if w is None else w
        return out

    def new_outputs(args, kwargs):
        values = dict(defaults, **dict(zip(flat, args)), **kwargs)
        base = values[like]
        made = []
        for o in op.outputs:
            shape = [dims_of(d, values) for d in o.shape]
            dtype = values[o.dtype].dtype if o.dtype in values else getattr(torch, o.dtype)
            made.append(base.new_empty(shape, dtype=dtype))
        return tuple(made)

    def functional_impl(*args, checks=True, **kwargs):
        return impl(*contract_args(args), checks=checks, **kwargs)

    def functional_fake(*args, checks=True, **kwargs):
        return _results(new_outputs(args, kwargs))

    name = op_name(op.name, backend)
    functional = define(name, call.schema(parts, with_out=False), functional_impl, fake or functional_fake)
    with_out = None
    if call.out is not None:
        def out_impl(*args, out, checks=True, **kwargs):
            got = impl(*contract_args(args), out=out, checks=checks, **kwargs)
            return _results(tuple(got[1:])) if len(call.returns) > 1 else None

        def out_fake(*args, out, checks=True, **kwargs):
            return _results(new_outputs(args, kwargs)[1:])

        with_out = define(op_name(op.name, backend, out=True), call.schema(parts, with_out=True), out_impl,
                          out_fake)

    env = dict(impl=impl, functional=functional, with_out=with_out, tracing=tracing,
               ArgumentTypeError=ArgumentTypeError, **classes)

    def bound(checks: bool):
        scope = dict(env)
        exec(_bound_source(op.name, call, parts, checks), scope)    # the contract's own parameters
        return named_bound(scope[op.name], op.name, backend, impl, functional, with_out)

    return pair_unchecked(bound(True), bound(False))


def _bound_source(name: str, call, parts: dict, checks: bool) -> str:
    """The bound function's source: eager calls run IMPL itself, traced calls the custom op."""
    sig, star = [], False
    for p in call.params:
        if p.kw_only and not star:
            sig.append("*")
            star = True
        sig.append(p.name if p.default is None else f"{p.name}={p.default}")
    contract = [p for p in call.params if p is not call.out]
    kw = [f"{p.name}={p.name}" for p in contract if p.kw_only]
    eager = [p.name for p in contract if not p.kw_only]
    traced = [f"*{p.name}.parts()" if p.type in parts else p.name for p in contract if not p.kw_only]

    def args(*groups) -> str:
        return ", ".join(a for g in groups for a in g)
    lines = [f"def {name}({', '.join(sig)}):"]
    if checks:
        for p in contract:
            if p.type in parts:
                lines += [f"    if not isinstance({p.name}, {p.type}):",
                          f"        raise ArgumentTypeError(f'{p.name} must be a {p.type}, got "
                          f"{{type({p.name}).__name__}}')"]
    check = [f"checks={checks}"]
    give_out = ["out=out"] if call.out is not None else []
    lines += ["    if not tracing():",
              f"        return impl({args(eager, kw, give_out, check)})"]
    if call.out is None:
        lines.append(f"    return functional({args(traced, kw, check)})")
    else:
        rest = {1: "", 2: ", rest"}.get(len(call.returns), ", *rest")
        lines += ["    if out is None:",
                  f"        return functional({args(traced, kw, check)})",
                  f"    rest = with_out({args(traced, kw, give_out, check)})",
                  f"    return {'out' if len(call.returns) == 1 else f'(out{rest})'}"]
    return "\n".join(lines) + "\n"

"""An op's call, written once on its Op: the typed signature and the shapes of its results.

``Op.signature`` is the op contract in torch.library's schema language, with the caller's
optional output buffer as ``Tensor(a!)? out=None`` (in the position the contract gives it)::

    kv_dequant(Tensor pool, Tensor token_ids, int page_size, Tensor(a!)? out=None) -> Tensor

and ``Op.outputs`` says each result's shape and dtype (``Out``), from the arguments. From
these two, torch_ops.custom_op derives the custom ops' schemas (the functional form and the
form that writes ``out``, each ending in ``checks``), their fake implementations and the
bound function with the contract's own parameters. A record argument (``MoeWeights
weights``) is declared in ``Op.records`` and travels through the custom op as its parts.

Pure Python (no torch): the registry parses a declaration when it is made, so a malformed
one is refused by name before any kernel is bound.
"""
from __future__ import annotations

import re
from typing import Optional, Union

import attrs

__all__ = ["Out", "Param", "Call", "parse", "dims_of"]

# The schema types a parameter may have; a record's type name is declared in Op.records.
TYPES = ("Tensor", "Tensor?", "Tensor(a!)", "Tensor(a!)?", "Tensor[]", "int", "int?", "float", "float?",
         "bool", "str", "str[]", "str?")
_PARAM = re.compile(r"(?P<type>[A-Za-z_][\w\[\]]*(?:\(a!\))?\??) (?P<name>[A-Za-z_]\w*)(?:=(?P<default>.+))?")
_CALL = re.compile(r"(?P<name>[A-Za-z_]\w*)\((?P<params>.*)\) -> (?P<returns>.+)")
_DIM = re.compile(r"[A-Za-z_]\w*(?:\.\d+)?|\d+")


@attrs.frozen
class Out:
    """One result: its SHAPE, each entry an int, ``"name.k"`` (dimension k of tensor
    argument NAME), ``"name"`` (int argument NAME, which must be given) or a product of
    these (``"q.0*q.1"``); and its DTYPE, a torch dtype's name (``"bfloat16"``) or a
    tensor argument's name (that argument's dtype). It lives on the first tensor
    argument's device, contiguous."""
    shape: tuple = attrs.field(converter=tuple)
    dtype: str = "bfloat16"

    def __attrs_post_init__(self):
        for d in self.shape:
            if not isinstance(d, int) and not (isinstance(d, str) and all(
                    _DIM.fullmatch(f.strip()) for f in d.split("*"))):
                raise ValueError(f"Out shape entry {d!r} is neither an int, 'arg', 'arg.k' nor a product of them")


@attrs.frozen
class Param:
    name: str
    type: str
    default: Optional[str] = None     # the schema's default text, None: required
    kw_only: bool = False

    @property
    def text(self) -> str:
        return f"{self.type} {self.name}" + (f"={self.default}" if self.default is not None else "")


@attrs.frozen
class Call:
    """A parsed Op.signature."""
    name: str
    params: tuple            # Param..., the contract's own (a record as one)
    returns: tuple           # the result types, () for none
    out: Optional[Param]     # the caller's output buffer (the first result), None: the op has none

    def schema(self, records: dict, *, with_out: bool) -> str:
        """The custom op's schema: the functional form (no ``out``) or the form that writes
        ``out`` (keyword-only, declared mutated; it returns the results after the first)."""
        pos, kw = [], []
        for p in self.params:
            if p is self.out:
                continue
            texts = [p.text] if p.type not in records else [t.strip() for t in records[p.type].split(",")]
            (kw if p.kw_only else pos).extend(texts)
        if with_out:
            kw.append("Tensor(a!) out")
        kw.append("bool checks=True")
        returns = self.returns[1:] if with_out else self.returns
        ret = returns[0] if len(returns) == 1 else "(" + ", ".join(returns) + ")"
        return "(" + ", ".join(pos + ["*"] + kw) + ") -> " + ret


def _split(text: str) -> list:
    return [t.strip() for t in text.split(",") if t.strip()] if text.strip() else []


def parse(signature: str, records=()) -> Call:
    """SIGNATURE parsed; ValueError naming what is wrong. RECORDS: the record type names
    the op declares."""
    m = _CALL.fullmatch(signature.strip())
    if not m:
        raise ValueError(f"signature {signature!r} is not NAME(TYPE ARG, ...) -> RESULT")
    params, kw_only, out = [], False, None
    for text in _split(m["params"]):
        if text == "*":
            kw_only = True
            continue
        p = _PARAM.fullmatch(text)
        if not p:
            raise ValueError(f"signature {signature!r}: parameter {text!r} is not 'TYPE NAME[=DEFAULT]'")
        if p["type"] not in TYPES and p["type"] not in records:
            raise ValueError(f"signature {signature!r}: parameter {text!r} has type {p['type']!r} "
                             f"(valid: {', '.join(TYPES)}, or a record named in Op.records)")
        param = Param(p["name"], p["type"], p["default"], kw_only)
        if param.name == "out":
            if param.type != "Tensor(a!)?" or param.default != "None":
                raise ValueError(f"signature {signature!r}: the output buffer is written 'Tensor(a!)? out=None'")
            out = param
        params.append(param)
    ret = m["returns"].strip()
    returns = tuple(_split(ret[1:-1])) if ret.startswith("(") else (ret,)
    if any(r != "Tensor" for r in returns):
        raise ValueError(f"signature {signature!r}: results are Tensor, (Tensor, ...) or ()")
    if out is not None and not returns:
        raise ValueError(f"signature {signature!r}: an op with an output buffer returns it first")
    return Call(m["name"], tuple(params), returns, out)


def dims_of(entry: Union[int, str], args: dict):
    """One Out shape entry's value for the call's ARGS (name -> value)."""
    if isinstance(entry, int):
        return entry
    value = 1
    for factor in entry.split("*"):
        name, _, k = factor.strip().partition(".")
        if name.isdigit():
            value *= int(name)
            continue
        arg = args[name]
        if k:
            value *= arg.shape[int(k)]
        elif arg is None:
            from ..errors import ArgumentTypeError
            raise ArgumentTypeError(f"{name} is required")
        else:
            value *= arg
    return value

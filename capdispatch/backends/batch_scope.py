"""One forward batch's shared library work: ``capdispatch.batch()``, and the caller's
own per-batch values: ``capdispatch.given()``.

A model calls decode attention once per layer with the same batch: the same query
shape and the same per-query valid counts (``topk_length``). Work a library does once
per batch, such as FlashMLA's decode schedule (its metadata kernel), can then be shared
by the layers' calls, the way SGLang computes it once per batch and passes it to every
layer. Outside a ``batch()`` block every call does its own, which is always correct;
inside one, the caller promises that the values of the per-batch tensors the calls
receive (``topk_length``, ``extra_topk_length``) do not change, and calls whose shapes
and per-batch tensors are the same objects share the work.

Inside a CUDA-graph capture the first call of the block captures the shared work and
the later calls read its results, so every replay recomputes it once, from the graph's
static inputs. Blocks nest: an inner block shares nothing with the outer one. The state
is a context variable: it never reaches another thread or task.

A caller that already holds the per-batch value (a serving engine that computed the
library's schedule itself) hands it in instead, without changing any op's arguments:

    with capdispatch.given("flashmla_decode", sched):        # or batch(given={...})
        out, lse = decode(q, pool, ...)

Inside, every call that would compute a value of that KIND uses VALUE as it is (the
caller vouches that it fits the call: the same batch, shapes and valid counts). Kinds:

  ``flashmla_decode``    decode_mla=flashmla: FlashMLA's ``tile_scheduler_metadata``
                         (a ``FlashMLASchedMeta``, filled by its first use)
  ``deepgemm_indexer``   indexer=deepgemm: DeepGEMM's paged-MQA-logits schedule
                         (``get_paged_mqa_logits_metadata``'s tensor)

A backend that has no per-batch value of a given kind ignores it. ``given`` blocks
nest (the inner value of a kind wins, the others stay) and live in a context variable
like ``batch()``'s. ``given(kind, None)`` hands in nothing for KIND.
"""
from __future__ import annotations

import contextvars
from typing import Callable, Optional

__all__ = ["batch", "given", "shared", "KINDS"]

KINDS = ("flashmla_decode", "deepgemm_indexer")

_scope: contextvars.ContextVar = contextvars.ContextVar("capdispatch_batch_scope", default=None)
_given: contextvars.ContextVar = contextvars.ContextVar("capdispatch_batch_given", default=None)


def _check_kinds(values: dict) -> dict:
    from ..errors import ArgumentError
    for kind in values:
        if kind not in KINDS:
            raise ArgumentError(f"capdispatch.given: unknown kind {kind!r}; valid: {', '.join(KINDS)}")
    return values


class _Block:
    """A context manager setting one context variable for its block (a class, not a
    generator: serving enters one per routed call)."""
    __slots__ = ("_var", "_value", "_token")

    def __init__(self, var, value):
        self._var, self._value, self._token = var, value, None

    def __enter__(self):
        self._token = self._var.set(self._value)
        return self

    def __exit__(self, *exc):
        self._var.reset(self._token)
        return False


class _Batch:
    """``batch()``'s block: a fresh sharing scope, plus the values GIVEN hands in."""
    __slots__ = ("_given", "_tokens")

    def __init__(self, given):
        self._given, self._tokens = given, None

    def __enter__(self):
        t = [_scope.set({})]
        if self._given:
            t.append(_given.set({**(_given.get() or {}), **self._given}))
        self._tokens = t
        return self

    def __exit__(self, *exc):
        if len(self._tokens) > 1:
            _given.reset(self._tokens[1])
        _scope.reset(self._tokens[0])
        return False


def batch(given: Optional[dict] = None):
    """A block of calls of one forward batch (see the module docstring). GIVEN:
    {kind: value} the caller computed itself, used instead of computing them."""
    return _Batch(_check_kinds(dict(given)) if given else None)


def given(kind: str, value):
    """A block in which calls needing the per-batch value of KIND use VALUE (the
    module docstring lists the kinds); VALUE None hands in nothing."""
    _check_kinds({kind: value})
    if value is None:
        current = _given.get()
        if not current or kind not in current:
            return _Block(_given, current)
        rest = {k: v for k, v in current.items() if k != kind}
        return _Block(_given, rest or None)
    return _Block(_given, {**(_given.get() or {}), kind: value})


def shared(key_of: Callable, make: Callable, kind: Optional[str] = None):
    """The value of KIND the caller handed in (``given``), if any. Else, inside a
    ``batch()`` block: the value ``make()`` gave earlier in the block for the key of
    ``key_of()``, else ``make()``'s value, kept for the block. Outside a block: ``make()``,
    every call (``key_of`` is not called). ``key_of()`` returns (key, keep): KEEP holds the
    objects whose identity is part of KEY (their ``id``), so no other object takes their ids
    while the block lasts."""
    if kind is not None:
        handed = _given.get()
        if handed is not None:
            value = handed.get(kind)
            if value is not None:
                return value
    cache = _scope.get()
    if cache is None:
        return make()
    key, keep = key_of()
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = (make(), keep)
    return hit[0]

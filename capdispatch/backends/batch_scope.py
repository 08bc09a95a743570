"""One forward batch's shared library work: ``capdispatch.batch()``.

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
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

__all__ = ["batch", "shared"]

_scope: contextvars.ContextVar = contextvars.ContextVar("capdispatch_batch_scope", default=None)


@contextlib.contextmanager
def batch():
    """A block of calls of one forward batch (see the module docstring)."""
    token = _scope.set({})
    try:
        yield
    finally:
        _scope.reset(token)


def shared(key_of: Callable, make: Callable):
    """Inside a ``batch()`` block: the value ``make()`` gave earlier in the block for the key
    of ``key_of()``, else ``make()``'s value, kept for the block. Outside a block: ``make()``,
    every call (``key_of`` is not called). ``key_of()`` returns (key, keep): KEEP holds the
    objects whose identity is part of KEY (their ``id``), so no other object takes their ids
    while the block lasts."""
    cache = _scope.get()
    if cache is None:
        return make()
    key, keep = key_of()
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = (make(), keep)
    return hit[0]

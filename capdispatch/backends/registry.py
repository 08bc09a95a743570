"""The op and backend registry: tiny, explicit, traceable.

Built-in op packages declare their backends in a `register(registry)` function
that imports no kernel code; kernels are imported when a backend is bound.
"""
from __future__ import annotations

import importlib

from ..errors import CapdispatchError
from .base import Backend, Op

BUILTIN_OP_PACKAGES = (
    "capdispatch.backends.kv_cache",
    "capdispatch.backends.indexer",
    "capdispatch.backends.sparse_prefill",
    "capdispatch.backends.decode_mla",
    "capdispatch.backends.moe",
)


class RegistryError(CapdispatchError, ValueError):
    pass


class Registry:
    def __init__(self):
        self.ops: dict = {}
        self._backends: dict = {}     # op -> {name: Backend}, in registration (default) order

    def add_op(self, op: Op) -> None:
        if op.name in self.ops:
            raise RegistryError(f"op {op.name!r} registered twice")
        self.ops[op.name] = op
        self._backends[op.name] = {}

    def add_backend(self, backend: Backend) -> None:
        if backend.op not in self.ops:
            raise RegistryError(f"backend {backend.name!r} names unknown op {backend.op!r}")
        if backend.name in self._backends[backend.op]:
            raise RegistryError(f"backend {backend.op}/{backend.name} registered twice")
        self._backends[backend.op][backend.name] = backend

    def backends(self, op: str) -> list:
        return list(self._backends[op].values())

    def backend(self, op: str, name: str) -> Backend:
        return self._backends[op][name]

    def has_backend(self, op: str, name: str) -> bool:
        return name in self._backends.get(op, {})


_builtin = None


def builtin() -> Registry:
    """The registry of capdispatch's own ops (declarations only, no kernels)."""
    global _builtin
    if _builtin is None:
        reg = Registry()
        for pkg in BUILTIN_OP_PACKAGES:
            importlib.import_module(pkg).register(reg)
        _builtin = reg
    return _builtin

"""The op and backend registry: tiny, explicit, traceable.

Built-in op packages declare their backends in a `register(registry)` function
that imports no kernel code; kernels are imported when a backend is bound. Other
packages add backends through the `capdispatch.backends` entry-point group
(plugins.py), read when the registry is built.

The registry says what exists, never what is preferred: it lists an op's backends
by name, so the order in which they were registered is not observable. The
preference order is the built-in policy's (policies/default.yaml).
"""
from __future__ import annotations

import importlib
import threading

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
        self._backends: dict = {}     # op -> {name: Backend}
        self.plugins: list = []       # PluginInfo of every entry point read, loaded or skipped

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

    def add_all(self, ops=(), backends=()) -> None:
        """add_op for each of OPS, then add_backend for each of BACKENDS (a package's
        declarations, checked one by one as above)."""
        for op in ops:
            self.add_op(op)
        for backend in backends:
            self.add_backend(backend)

    def backends(self, op: str) -> list:
        """OP's backends, sorted by name (the preference order is the policy's)."""
        return [self._backends[op][n] for n in sorted(self._backends[op])]

    def backend(self, op: str, name: str) -> Backend:
        return self._backends[op][name]

    def has_backend(self, op: str, name: str) -> bool:
        return name in self._backends.get(op, {})


_builtin = None
_builtin_lock = threading.Lock()


def build(*, plugins: bool = True, entry_points=None) -> Registry:
    """A new registry: the built-in op packages, then (PLUGINS) the installed plugins
    or the given ENTRY_POINTS (declarations only, no kernels)."""
    from . import plugins as _plugins
    reg = Registry()
    for pkg in BUILTIN_OP_PACKAGES:
        importlib.import_module(pkg).register(reg)
    if plugins:
        reg.plugins = _plugins.load(reg, entry_points)
    return reg


def builtin() -> Registry:
    """The registry of this process: capdispatch's own ops and the installed plugins."""
    global _builtin
    if _builtin is None:
        with _builtin_lock:         # concurrent first calls build it once
            if _builtin is None:
                _builtin = build()
    return _builtin

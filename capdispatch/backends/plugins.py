"""Backends from other packages: the `capdispatch.backends` entry-point group.

Each entry point names a `register(registry)` function, exactly like a built-in op
package's. A plugin registers into a staging area first; only when everything it
declared checks out (known op, new name, `module:function` implementation, the
requirement types of `capdispatch.backends`, known feature names) is it added, so a
broken plugin is reported by name and skipped whole, and the built-ins never break.
Plugins are read when the registry is built, never at import of capdispatch.
"""
from __future__ import annotations

import logging
import re
from importlib import metadata

import attrs

from . import base

log = logging.getLogger("capdispatch")

GROUP = "capdispatch.backends"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_IMPL = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
REQUIREMENT_TYPES = (base.Feature, base.AnyFeature, base.Platform, base.TritonTarget,
                     base.ComputeCapability, base.Library, base.ShapeRange)


@attrs.frozen
class PluginInfo:
    name: str            # the entry point's name
    value: str           # "module:function"
    dist: str            # the distribution that declares it ("" when unknown)
    ok: bool
    message: str = ""    # why it was skipped
    backends: tuple = () # "op/name" it added

    def to_dict(self) -> dict:
        return attrs.asdict(self)


class _Staging:
    """What one plugin declares, checked before anything reaches the registry."""

    def __init__(self, registry):
        self._registry = registry
        self.ops: list = []
        self.backends: list = []

    # The registry's declaration interface, as a plugin sees it.
    def add_op(self, op) -> None:
        self.ops.append(op)

    def add_backend(self, backend) -> None:
        self.backends.append(backend)

    def add_all(self, ops=(), backends=()) -> None:
        self.ops.extend(ops)
        self.backends.extend(backends)

    @property
    def op_names(self):
        return list(self._registry.ops) + [getattr(o, "name", None) for o in self.ops]

    def problems(self) -> list:
        from ..capabilities import features
        out = []
        for op in self.ops:
            if not isinstance(op, base.Op):
                out.append(f"add_op got {type(op).__name__}, need capdispatch.backends.Op")
            elif op.name in self._registry.ops:
                out.append(f"op {op.name!r} is already registered")
        seen = set()
        for b in self.backends:
            if not isinstance(b, base.Backend):
                out.append(f"add_backend got {type(b).__name__}, need capdispatch.backends.Backend")
                continue
            who = f"backend {b.op}/{b.name}"
            if b.op not in self.op_names:
                out.append(f"{who}: unknown op {b.op!r} (valid: {', '.join(self._registry.ops)})")
                continue
            if not isinstance(b.name, str) or not _NAME.fullmatch(b.name):
                out.append(f"{who}: name must match {_NAME.pattern}")
            if (b.op, b.name) in seen or self._registry.has_backend(b.op, b.name):
                out.append(f"{who}: name already registered")
            seen.add((b.op, b.name))
            if not isinstance(b.impl, str) or not _IMPL.fullmatch(b.impl):
                out.append(f"{who}: impl {b.impl!r} must be 'package.module:function'")
            for r in b.requires:
                if not isinstance(r, REQUIREMENT_TYPES):
                    out.append(f"{who}: requirement {r!r} is not one of "
                               f"{', '.join(t.__name__ for t in REQUIREMENT_TYPES)}")
                    continue
                names = [r.name] if isinstance(r, base.Feature) else \
                    list(r.names) if isinstance(r, base.AnyFeature) else []
                for n in names:
                    if n not in features.rules():
                        out.append(f"{who}: unknown feature {n!r} (valid: {', '.join(sorted(features.rules()))})")
        return out

    def commit(self) -> tuple:
        for op in self.ops:
            self._registry.add_op(op)
        for b in self.backends:
            self._registry.add_backend(b)
        return tuple(f"{b.op}/{b.name}" for b in self.backends)


def _dist_of(ep) -> str:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", "") or "" if dist is not None else ""


def load(registry, entry_points=None) -> list:
    """Add every plugin's backends to REGISTRY; returns a PluginInfo per entry point.
    ENTRY_POINTS: the entry points to read (default: the installed `capdispatch.backends` group)."""
    eps = metadata.entry_points(group=GROUP) if entry_points is None else entry_points
    infos = []
    for ep in sorted(eps, key=lambda e: e.name):
        dist = _dist_of(ep)
        where = f"plugin {ep.name!r} ({ep.value}{', from ' + dist if dist else ''})"
        try:
            fn = ep.load()
        except Exception as exc:   # noqa: BLE001 - any failure of a plugin's import is its own
            infos.append(PluginInfo(ep.name, ep.value, dist, False,
                                    f"import failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
        else:
            staging = _Staging(registry)
            try:
                if not callable(fn):
                    raise TypeError(f"{ep.value} is a {type(fn).__name__}, need a register(registry) function")
                fn(staging)
                problems = staging.problems()
            except Exception as exc:   # noqa: BLE001
                problems = [f"register() raised {type(exc).__name__}: {exc}"]
            if problems:
                infos.append(PluginInfo(ep.name, ep.value, dist, False, "; ".join(problems)))
            else:
                infos.append(PluginInfo(ep.name, ep.value, dist, True, backends=staging.commit()))
        if not infos[-1].ok:
            log.warning("%s skipped: %s", where, infos[-1].message)
    return infos

"""Backends from other packages: the `capdispatch.backends` entry-point group.

Each entry point names a `register(registry)` function, exactly like a built-in op
package's. A plugin registers into a staging area first; only when everything it
declared checks out (known op, new name, `module:function` implementation, the
requirement types of `capdispatch.backends`, known feature names) is it added, so a
broken plugin is reported by name and skipped whole, and the built-ins never break.
Each plugin loads on a thread of its own within a time bound, its output captured and
every exception (SystemExit included) caught, and os._exit / os.abort called on its
thread raise instead of ending the process; its requirements are evaluated once on a
CPU and simulated cards before they are accepted. Plugins are read when the registry is
built, never at import of capdispatch.

A plugin still runs in this process with its full trust: what ends a process below
Python (a signal, a crash in a C extension, exit() from C, os._exit on a thread of its
own) cannot be caught here, and ends the command with the plugin's status
(docs/plugins.md, "What capdispatch cannot contain").
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading
from importlib import metadata

import attrs

from . import base

log = logging.getLogger("capdispatch")

GROUP = "capdispatch.backends"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_IMPL = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
PLUGIN_TIMEOUT_S = 20.0     # seconds one plugin's import and register() may take
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
    output: str = ""     # what it printed while loading (captured, not shown)

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
            if not isinstance(b.requires, tuple):
                out.append(f"{who}: requires must be a tuple, not {type(b.requires).__name__}")
                continue
            for r in b.requires:
                if type(r) not in REQUIREMENT_TYPES:     # a subclass could evaluate anything
                    out.append(f"{who}: requirement {r!r} is not one of "
                               f"{', '.join(t.__name__ for t in REQUIREMENT_TYPES)}")
                    continue
                names = [r.name] if isinstance(r, base.Feature) else \
                    list(r.names) if isinstance(r, base.AnyFeature) else []
                for n in names:
                    if n not in features.rules():
                        out.append(f"{who}: unknown feature {n!r} (valid: {', '.join(sorted(features.rules()))})")
            if not out:
                out += _trial(who, b)
        return out

    def commit(self) -> tuple:
        for op in self.ops:
            self._registry.add_op(op)
        for b in self.backends:
            self._registry.add_backend(b)
        return tuple(f"{b.op}/{b.name}" for b in self.backends)


def _trial(who: str, backend) -> list:
    """Evaluate BACKEND's requirements on a CPU and on simulated cards (nothing imported):
    a declaration that cannot be evaluated is refused now, not at every decision."""
    from ..capabilities import Inventory, derive_features, probe
    out = []
    for dev in ("cpu", "sim:h200", "sim:rtx-3080"):
        spec = probe(dev)
        facts = base.Facts(spec, derive_features(spec), Inventory(), {}, check_imports=False)
        for r in backend.requires:
            try:
                r.evaluate(facts)
            except Exception as exc:   # noqa: BLE001
                out.append(f"{who}: requirement {r!r} cannot be evaluated on {dev} "
                           f"({type(exc).__name__}: {exc})"[:300])
                return out
    return out


def _dist_of(ep) -> str:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", "") or "" if dist is not None else ""


def _timeout(env) -> float:
    """CAPDISPATCH_IMPORT_TIMEOUT when set (checked as for libraries), else PLUGIN_TIMEOUT_S."""
    from ..capabilities.libraries import import_timeout
    if not str(env.get("CAPDISPATCH_IMPORT_TIMEOUT", "")).strip():
        return PLUGIN_TIMEOUT_S
    return import_timeout(env)


class PluginExit(BaseException):
    """Raised in place of os._exit / os.abort called on a plugin's loader thread."""


_guard_lock = threading.Lock()
_guarded = 0        # load() calls under way: the hard exits stay guarded while any is
_real = {}          # name -> the os function guarded
_guard_pid = 0      # the process whose loader threads are guarded


def _guard(name):
    real = _real[name]

    def guarded(*args):
        # Only a plugin's loader thread of this process is stopped: any other thread, and
        # a child forked from a loader thread, exits as it asked.
        if isinstance(threading.current_thread(), _Loader) and os.getpid() == _guard_pid:
            raise PluginExit(f"called os.{name}({', '.join(map(repr, args))}), which would end the "
                             f"process")
        return real(*args)
    guarded.__wrapped__ = real
    return guarded


@contextlib.contextmanager
def _no_hard_exit():
    """While plugins load, os._exit and os.abort (the exits no exception handler sees)
    raise PluginExit on a loader thread instead of ending the process."""
    global _guarded, _guard_pid
    names = [n for n in ("_exit", "abort") if hasattr(os, n)]
    with _guard_lock:
        if _guarded == 0:
            _guard_pid = os.getpid()
            for n in names:
                _real[n] = getattr(os, n)
                setattr(os, n, _guard(n))
        _guarded += 1
    try:
        yield
    finally:
        with _guard_lock:
            _guarded -= 1
            if _guarded == 0:
                for n in names:
                    setattr(os, n, _real.pop(n))


class _Captured(io.StringIO):
    """What a plugin prints while it loads (it must not reach the command's output)."""

    def write(self, text):
        return super().write(text) if self.tell() < 64 * 1024 else len(text)


class _Loader(threading.Thread):
    """Imports one entry point and calls its register(staging) on a daemon thread; a
    hung one is left parked (it cannot be stopped) and its plugin is skipped."""

    def __init__(self, ep, staging):
        super().__init__(name=f"capdispatch-plugin-{ep.name}", daemon=True)
        self.ep, self.staging = ep, staging
        self.stage, self.error = "import", None

    def run(self):
        try:
            fn = self.ep.load()
            self.stage = "register"
            if not callable(fn):
                raise TypeError(f"{self.ep.value} is a {type(fn).__name__}, need a register(registry) function")
            fn(self.staging)
            self.stage = "check"
        except BaseException as exc:   # noqa: BLE001 - SystemExit and all: the plugin's own failure
            self.error = exc


def _named(exc: BaseException) -> str:
    if isinstance(exc, PluginExit):
        return str(exc)[:300]
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, SystemExit):
        text = f"code {exc.code!r}"
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def load(registry, entry_points=None, *, timeout=None, env=None) -> list:
    """Add every plugin's backends to REGISTRY; returns a PluginInfo per entry point.
    ENTRY_POINTS: the entry points to read (default: the installed `capdispatch.backends` group).

    Each plugin is imported and registered on a thread of its own within TIMEOUT seconds
    (CAPDISPATCH_IMPORT_TIMEOUT, else PLUGIN_TIMEOUT_S); what it prints meanwhile is
    captured (Python-level sys.stdout / sys.stderr); any exception, SystemExit and
    KeyboardInterrupt included, skips that plugin, named; so does os._exit or os.abort
    called on its thread. A plugin that hangs is skipped and its thread stays parked: it
    holds the import lock of its module."""
    env = os.environ if env is None else env
    limit = _timeout(env) if timeout is None else timeout
    eps = metadata.entry_points(group=GROUP) if entry_points is None else entry_points
    with _no_hard_exit():
        return _load(registry, eps, limit)


def _load(registry, eps, limit) -> list:
    infos = []
    for ep in sorted(eps, key=lambda e: e.name):
        dist = _dist_of(ep)
        where = f"plugin {ep.name!r} ({ep.value}{', from ' + dist if dist else ''})"
        staging = _Staging(registry)
        worker = _Loader(ep, staging)
        out = _Captured()
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = out
        try:
            worker.start()
            worker.join(limit)
        finally:
            sys.stdout, sys.stderr = saved
        printed = out.getvalue()
        if worker.is_alive():
            msg = (f"{'import' if worker.stage == 'import' else 'register()'} did not finish within "
                   f"{limit:g} s (left parked; CAPDISPATCH_IMPORT_TIMEOUT sets the limit)")
        elif worker.error is not None:
            msg = (f"import failed: {_named(worker.error)}" if worker.stage == "import"
                   else f"register() raised {_named(worker.error)}")
        else:
            try:
                problems = staging.problems()
            except Exception as exc:   # noqa: BLE001 - a declaration that breaks the checks
                problems = [f"its declarations cannot be checked: {_named(exc)}"]
            msg = "; ".join(problems)
        if msg:
            infos.append(PluginInfo(ep.name, ep.value, dist, False, msg, output=printed[:2000]))
            log.warning("%s skipped: %s", where, msg)
        else:
            infos.append(PluginInfo(ep.name, ep.value, dist, True, backends=staging.commit(),
                                    output=printed[:2000]))
    return infos

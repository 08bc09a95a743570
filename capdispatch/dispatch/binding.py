"""Binding: the chosen backend's callable itself, for the hot path."""
from __future__ import annotations

from . import sized
from ..errors import ArgumentTypeError
from .errors import Unsatisfiable
from .resolver import as_spec, context, log, resolve_in


class BackendLoadError(Unsatisfiable):
    pass


class HostedKernelError(Unsatisfiable):
    """A decision that would need capdispatch to run a kernel the host engine runs itself
    (resolver.Hosted): capdispatch never binds it."""


def bind(op: str, device, backend=None, *, policy=None, selections=None, strict: bool = False,
         env=None, registry=None, checks: bool = True, shapes=None):
    """Return the kernel that runs OP on DEVICE: no wrapper, no lookup at call time.

    With BACKEND given the choice is explicit and strict: if it cannot run here,
    this raises with the reasons instead of handing back something else.
    ``checks=False`` binds the kernel without its argument validation (serving, where
    the caller's shapes are known good): bad input is then undefined behaviour.

    Where the policy gives OP size buckets whose winners differ, the result is a
    dispatcher (see `sized.py`) whose only work is the bucket test on the leading
    dimension of the op's size argument; where every bucket picks one kernel, the
    kernel itself. SHAPES (a RankShape) checks the backends' shape ranges at this rank's
    shapes: a backend outside its range is not bound (an explicit one raises).
    """
    sel = dict(selections or {})
    if backend is not None:
        sel[op] = backend
    ctx = context(policy=policy, selections=sel or None, strict=strict or backend is not None,
                  env=env, registry=registry, selection_origin="bind(backend=...)" if backend else "selections=",
                  shapes=shapes)
    res = resolve_in(ctx, op, as_spec(device))
    for w in res.warnings:
        log.warning(w)
    return bind_resolution(res, checks=checks, registry=ctx.registry)


def bind_resolution(res, *, checks: bool = True, native=None, registry=None):
    """The kernel (or size dispatcher) for a decision already made: RES, a Resolution
    (`resolve`, `plan`, `agree`), bound as `bind` binds it, without resolving again.

    NATIVE names the backend the caller runs itself (an engine's own kernel at the
    call site it lends): the buckets it wins are None entries of the dispatcher
    (`fn.pick(n)` is None for their sizes; see `sized.py`), and where it wins every
    size the result is None. REGISTRY: the registry RES was resolved with (default:
    the built-in one with its plugins). A backend the host runs itself (Resolution.host_of)
    is bound only as NATIVE; anywhere else binding it raises HostedKernelError."""
    if registry is None:
        from ..backends import builtin
        registry = builtin()
    op = res.op
    loaded = {}

    def load(name):
        if name == native:
            return None
        host = res.host_of(name)
        if host is not None:
            raise HostedKernelError(
                f"{op}={name} on {res.device.id} is {host}, judged by the host's statement, not by "
                f"capdispatch's {name} adapter: capdispatch cannot run it in the host's place")
        if name not in loaded:
            b = registry.backend(op, name)
            try:
                fn = b.load()
            except Exception as exc:
                raise BackendLoadError(f"{op}={name} on {res.device.id}: loading {b.impl} failed: "
                                       f"{type(exc).__name__}: {exc}") from exc
            loaded[name] = fn if checks else _without_checks(fn)
        return loaded[name]

    if not res.buckets or len({b.backend for b in res.buckets}) == 1:
        return load(res.backend)
    bounds, default, names = sized.table(res.buckets, load)
    return sized.dispatcher(op, registry.ops[op].size, bounds, default, names)


def _without_checks(fn):
    from ..backends.torch_ops import without_checks   # imports torch: only when asked for
    return without_checks(fn)


class OpHandle:
    """Call OP on whatever device its first tensor argument lives on.

    Binds once per device (type, index) and keeps the kernel; never answers
    for one device with another's choice.
    """

    def __init__(self, op: str, **bind_kwargs):
        self.op = op
        self._kw = bind_kwargs
        self._by_device = {}

    def _device_of(self, args, kwargs):
        for a in list(args) + list(kwargs.values()):
            dev = getattr(a, "device", None)
            if dev is not None:
                return dev
        raise ArgumentTypeError(f"{self.op}: no tensor argument to take the device from")

    def __call__(self, *args, **kwargs):
        dev = self._device_of(args, kwargs)
        key = (dev.type, dev.index)
        fn = self._by_device.get(key)
        if fn is None:
            name = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
            fn = self._by_device[key] = bind(self.op, name, **self._kw)
        return fn(*args, **kwargs)

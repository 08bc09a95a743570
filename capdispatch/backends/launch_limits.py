"""Launch as another card would: the tiles and the shared-memory limit of a card of a
given compute capability, forced on the Triton launches inside a ``with`` block.

    from capdispatch.backends import launch_limits as LL
    with LL.tiles_as(LL.card_target("sm_86")) as scope:
        out = op(...)                 # launch-table lookups answer for cc 8.6
    scope.launches                    # what ran: kernel, entry, shared bytes, registers

Inside the block every launch-table lookup keyed by compute capability answers for the
target's capability, and every capdispatch Triton launch is compiled first and checked
against the target's shared memory per block: a kernel that needs more raises Triton's
``OutOfResources`` before it launches, as it would on that card, so a table with
fallback entries moves to the next one and a single-entry table fails as the card does.
Outside a block nothing changes (one context-variable read per launch). The scope is
a context variable: it ends with the block and never reaches another thread's calls.
With ``check=False`` the capability is forced but launches are not compiled first
(timing loops after a checked call: no extra host work per launch).

An emulated card (``device_facts.emulate``) is the same check made process-wide for one
device index: every launch on that device, from any thread, answers the card's launch
tables and is admitted under the card's shared memory per block (each kernel and
configuration compiled and checked once, then launched directly). A ``tiles_as`` block
inside it still forces its own target.

What it does not model: the card's occupancy (two programs may share an SM here that
cannot there) and its compiler target (the kernel is compiled for this GPU; the offline
compile matrix covers the card's own compile). Split counts read the SM count from
``device_facts``, the card's own where one is emulated.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import attrs

__all__ = ["TileTarget", "Launch", "TileScope", "tiles_as", "active", "capability_for", "plan_key",
           "launch", "card_target", "set_device_targets", "device_scope"]


@attrs.frozen
class TileTarget:
    """The card to launch as: its compute capability and opt-in shared memory per block."""
    capability: tuple = attrs.field(converter=tuple)      # (major, minor)
    shared_bytes: int
    label: str = ""


@attrs.frozen
class Launch:
    """One checked launch: the kernel, its launch-table entry (constexprs, warps, stages),
    the compiled kernel's shared memory, registers and spills (None where this Triton
    or the interpreter does not say), and whether it fits the target."""
    kernel: str
    config: dict = attrs.field(eq=False)
    shared: Optional[int]
    registers: Optional[int]
    spills: Optional[int]
    fits: bool


@attrs.define
class TileScope:
    """The active target of a ``tiles_as`` block and the launches checked inside it."""
    target: TileTarget
    check: bool = True
    launches: list = attrs.Factory(list)
    # A process-wide scope (an emulated card) records each kernel and configuration once
    # and admits it once: ``admitted`` holds those that fit.
    once: bool = False
    admitted: set = attrs.Factory(set)

    def admit(self, kernel: str, config: dict, compiled) -> Launch:
        """Record COMPILED (a Triton CompiledKernel, or None under the interpreter) and
        raise Triton's OutOfResources when it needs more shared memory than the target."""
        shared, regs, spills = compiled_facts(compiled)
        fits = shared is None or shared <= self.target.shared_bytes
        rec = Launch(kernel=kernel, config=dict(config), shared=shared, registers=regs, spills=spills, fits=fits)
        if not self.once or not any(r.kernel == kernel and r.config == rec.config for r in self.launches):
            self.launches.append(rec)
        if not fits:
            raise _out_of_resources(shared, self.target.shared_bytes)
        return rec


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("capdispatch_tile_scope", default=None)
_DEVICE: dict = {}        # CUDA device index -> the process-wide TileScope of the card emulated there
_DEVICE_KEY: tuple = ()   # what every plan key adds while a card is emulated (see plan_key)


def set_device_targets(emulated: dict) -> None:
    """Install process-wide scopes: EMULATED maps a CUDA device index to the DeviceFacts of
    the card emulated on it (device_facts.emulate calls this; {} removes them)."""
    global _DEVICE_KEY
    _DEVICE.clear()
    for index, f in emulated.items():
        _DEVICE[index] = TileScope(target=TileTarget(capability=tuple(f.cc), shared_bytes=int(f.smem_optin_per_block),
                                                     label=f.label), once=True)
    _DEVICE_KEY = tuple(sorted((i, s.target.capability, s.target.shared_bytes) for i, s in _DEVICE.items()))


def device_scope(index: int) -> Optional[TileScope]:
    """The process-wide TileScope of the card emulated on device INDEX, or None."""
    return _DEVICE.get(index)


@contextlib.contextmanager
def tiles_as(target: TileTarget, *, check: bool = True):
    """Force TARGET's tiles and shared-memory limit on the launches inside the block;
    yields the TileScope that records them."""
    if not isinstance(target, TileTarget):
        raise TypeError(f"tiles_as needs a TileTarget, got {type(target).__name__}: {target!r}")
    scope = TileScope(target=target, check=check)
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)


def active() -> Optional[TileScope]:
    """The TileScope of the innermost ``tiles_as`` block, or None."""
    return _ACTIVE.get()


def capability_for(cc) -> tuple:
    """The compute capability a launch-table lookup uses: the forced target's inside a
    ``tiles_as`` block, else CC (the device's own)."""
    scope = _ACTIVE.get()
    return tuple(cc) if scope is None else scope.target.capability


def plan_key() -> tuple:
    """What a cached launch plan must add to its key: () outside a block, the target's
    (capability, shared bytes) inside one (a plan never answers for another target)."""
    scope = _ACTIVE.get()
    return _DEVICE_KEY if scope is None else (scope.target.capability, scope.target.shared_bytes) + _DEVICE_KEY


def launch(fn, grid):
    """``fn[grid]`` for a Triton kernel FN: inside a checking block, a launcher that
    compiles first (``fn.warmup``), admits the compiled kernel (see TileScope.admit) and
    then launches."""
    scope = _ACTIVE.get()
    if scope is None and _DEVICE:
        scope = _current_device_scope()
    if scope is None or not scope.check:
        return fn[grid]
    if scope.once:
        return _admitted_once(scope, fn, grid)

    def checked(*args, **kwargs):
        compiled = None if _interpreted(fn) else fn.warmup(*args, grid=grid, **kwargs)
        scope.admit(_name(fn), _config(fn, args, kwargs), compiled)
        return fn[grid](*args, **kwargs)
    return checked


def _current_device_scope():
    """The emulated card's scope of the current CUDA device (launches run inside
    device_scope.on_device, so the current device is the tensors')."""
    return _DEVICE.get(_current_device())


def _current_device() -> int:
    import torch
    return torch._C._cuda_getDevice()


def _admitted_once(scope, fn, grid):
    def checked(*args, **kwargs):
        config = _config(fn, args, kwargs)
        key = (_name(fn), repr(sorted(config.items())))
        if key not in scope.admitted:
            compiled = None if _interpreted(fn) else fn.warmup(*args, grid=grid, **kwargs)
            scope.admit(key[0], config, compiled)       # raises when it does not fit
            scope.admitted.add(key)
        return fn[grid](*args, **kwargs)
    return checked


def card_target(key: str, label: str = "") -> TileTarget:
    """The TileTarget of catalog architecture KEY (e.g. "sm_86"): its compute capability
    and opt-in shared memory per block."""
    from ..capabilities import catalog
    spec = catalog.simulate(key)
    if spec.smem_optin_per_block is None:
        raise ValueError(f"catalog entry {key!r} has no smem_optin_per_block; a TileTarget needs it")
    return TileTarget(capability=tuple(spec.cc), shared_bytes=int(spec.smem_optin_per_block), label=label or key)


def compiled_facts(compiled) -> tuple:
    """(shared bytes, registers, spills) of a Triton CompiledKernel; None for what it
    does not carry. Registers and spills are read when the kernel is loaded."""
    if compiled is None:
        return None, None, None
    meta = getattr(compiled, "metadata", None)
    shared = getattr(meta, "shared", None)
    if getattr(compiled, "n_regs", None) is None and hasattr(compiled, "_init_handles"):
        try:
            compiled._init_handles()    # loads the binary: what sets n_regs / n_spills
        except Exception:   # noqa: BLE001 - e.g. over this GPU's own limit; the launch says so
            pass
    regs, spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
    return (None if shared is None else int(shared), None if regs is None else int(regs),
            None if spills is None else int(spills))


def _out_of_resources(required: int, limit: int) -> Exception:
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:     # a Triton without it: what its launches raise instead
        return RuntimeError(f"out of resource: shared memory, Required: {required}, Hardware limit: {limit}")
    return OutOfResources(required, limit, "shared memory")


def _interpreted(fn) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(fn, InterpretedFunction)


def _name(fn) -> str:
    inner = getattr(fn, "fn", None)
    return getattr(inner, "__name__", None) or getattr(fn, "__name__", None) or repr(fn)


def _config(fn, args: tuple, kwargs: dict) -> dict:
    """The launch's constexprs and warps / stages: its launch-table entry (constexprs
    passed by position or by keyword)."""
    names_in_order = getattr(fn, "arg_names", None)
    if names_in_order:
        kwargs = dict(zip(names_in_order, args), **kwargs)
    params = getattr(fn, "params", None)
    names = {p.name for p in params if getattr(p, "is_constexpr", False)} if params else None
    keep = ("num_warps", "num_stages")
    return {k: v for k, v in kwargs.items()
            if k in keep or (names is not None and k in names) or (names is None and k.isupper())}

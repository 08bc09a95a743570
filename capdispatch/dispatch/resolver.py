"""The resolver: capabilities x requirements x policies -> a decision with its trace."""
from __future__ import annotations

import logging
import os
from typing import Optional

import attrs

from .. import policies as _policies
from ..backends import Facts, builtin
from ..capabilities import DeviceSpec, Inventory, derive_features, probe
from ..capabilities import catalog as _catalog
from .errors import BadInput, NoBackendError, StrictFallbackError

log = logging.getLogger("capdispatch")


@attrs.frozen
class Candidate:
    backend: str
    ok: bool
    checks: tuple
    preferred: bool          # named by the layer that spoke (not an implicit fallback)

    def to_dict(self) -> dict:
        return {"backend": self.backend, "ok": self.ok,
                "checks": [c.to_dict() for c in self.checks]}


@attrs.frozen
class Resolution:
    op: str
    device: DeviceSpec
    backend: str
    source: str              # which layer of which file made the choice
    fallback: bool           # the winner is not the first preference of that layer
    downgraded_from: Optional[str]   # the explicit / user choice that could not run
    candidates: tuple
    wanted: str              # first preference of the layer that spoke
    warnings: tuple = ()

    def to_dict(self) -> dict:
        return {"backend": self.backend, "source": self.source, "fallback": self.fallback,
                "downgraded_from": self.downgraded_from,
                "candidates": [c.to_dict() for c in self.candidates]}


@attrs.frozen
class Context:
    """Everything one decision reads, gathered once: registry, policy stack, libraries, env."""
    registry: object
    stack: _policies.PolicyStack
    inventory: Inventory
    env: dict
    strict: bool

    @property
    def strict_effective(self) -> bool:
        return self.strict or self.stack.setting("on_unsupported").value == "error" \
            or self.env.get("CAPDISPATCH_STRICT", "") not in ("", "0")


def known_device_names() -> tuple:
    names = set()
    for key in _catalog.names():
        entry = _catalog.lookup(key)
        names.add(key)
        names.add(str(entry.get("name", "")).lower())
        names.update(str(a).lower() for a in entry.get("aliases") or ())
    return tuple(sorted(n for n in names if n))


def library_names(registry) -> set:
    """Every distribution some registered backend declares."""
    return {r.dist for op in registry.ops for b in registry.backends(op)
            for r in b.requires if hasattr(r, "dist")}


def library_modules(registry) -> dict:
    """Canonical import name (and distribution name) -> distribution, for every library
    a registered backend declares: flash_mla -> sgl-flash-mla."""
    from packaging.utils import canonicalize_name
    out = {}
    for op in registry.ops:
        for b in registry.backends(op):
            for r in b.requires:
                if hasattr(r, "dist"):
                    out[r.dist] = r.dist
                    if getattr(r, "module", None):
                        out.setdefault(canonicalize_name(r.module.split(".")[0]), r.dist)
    return out


def context(*, policy=None, selections=None, assume_libs=None, strict=False, registry=None,
            env=None, selection_origin="selections=", libs=None, settings=None,
            settings_origin="settings=") -> Context:
    """Read the environment and policies now, for the decisions about to be made.
    LIBS: a library profile naming the target's software (None: this machine's)."""
    from ..capabilities.libraries import AssumeLibError
    env = dict(os.environ if env is None else env)
    registry = registry or builtin()
    try:
        inventory = Inventory.with_assumptions(assume_libs, libs=libs, known=library_modules(registry))
    except AssumeLibError as exc:
        raise BadInput(str(exc)) from None
    try:
        stack = _policies.build(registry, policy=policy, selections=selections, env=env,
                                known_devices=known_device_names(),
                                selection_origin=selection_origin, settings=settings,
                                settings_origin=settings_origin)
    except _policies.SelectionError as exc:
        raise BadInput(str(exc)) from None
    return Context(registry, stack, inventory, env, strict)


def _check_op(ctx: Context, op: str) -> None:
    if op not in ctx.registry.ops:
        from ..policies.loader import _did_you_mean
        raise BadInput(f"unknown op {op!r}{_did_you_mean(op, ctx.registry.ops)} "
                       f"(valid: {', '.join(ctx.registry.ops)})")


def order(ctx: Context, op: str, device: DeviceSpec):
    """(preference, candidate names): the speaking layer's list, then implicit fallbacks."""
    pref = ctx.stack.preference(op, device)
    registered = [b.name for b in ctx.registry.backends(op)]
    default_list = list(ctx.stack.default.ops[op].value) if op in ctx.stack.default.ops else []
    if pref is None:
        pref = _policies.Preference(tuple(registered), "registration order", "default", False)
    names = list(pref.backends)
    for n in default_list + registered:
        if n not in names:
            names.append(n)
    return pref, names


def evaluate(ctx: Context, op: str, device: DeviceSpec, names, preferred) -> list:
    feats = derive_features(device)
    cheap = Facts(device, feats, ctx.inventory, ctx.env, check_imports=False)
    out = []
    for name in names:
        backend = ctx.registry.backend(op, name)
        checks = backend.evaluate(cheap)
        # Importing is the costly proof: only for a real device, only when all else holds.
        if all(c.ok for c in checks) and not device.simulated:
            checks = backend.evaluate(attrs.evolve(cheap, check_imports=True))
        out.append(Candidate(name, all(c.ok for c in checks), tuple(checks), name in preferred))
    return out


def resolve_in(ctx: Context, op: str, device: DeviceSpec) -> Resolution:
    """One op on one device. Logs nothing: warnings ride in the result."""
    _check_op(ctx, op)
    pref, names = order(ctx, op, device)
    candidates = evaluate(ctx, op, device, names, pref.backends)
    winner = next((c for c in candidates if c.ok), None)
    if winner is None:
        raise NoBackendError(op, device.id, candidates)
    wanted = pref.backends[0]
    fallback = winner.backend != wanted
    source = pref.origin if winner.preferred else f"implicit fallback after {pref.origin}"
    downgraded, warnings = None, ()
    if fallback and pref.user:
        downgraded = wanted
        why = "; ".join(ch.message or f"{ch.code}: need {ch.need}, found {ch.found}"
                        for ch in candidates[0].checks if not ch.ok)
        text = (f"{device.id} ({device.name}): {op}={wanted} was asked for ({pref.origin}) "
                f"but cannot run: {why}; running {winner.backend} instead")
        if ctx.strict_effective:
            raise StrictFallbackError(f"strict: {text.replace('; running', '; would run')}")
        warnings = (text,)
    return Resolution(op, device, winner.backend, source, fallback, downgraded,
                      tuple(candidates), wanted, warnings)


def as_spec(device, *, via="auto", assume_cuda=None) -> DeviceSpec:
    from ..capabilities import UnknownDeviceError
    try:
        return probe(device, via=via, assume_cuda=assume_cuda)
    except UnknownDeviceError as exc:
        raise BadInput(str(exc)) from None


def resolve(op: str, device, *, policy=None, selections=None, assume_libs=None,
            strict: bool = False, registry=None, env=None, via: str = "auto",
            assume_cuda: Optional[str] = None, libs=None) -> Resolution:
    """Decide which backend runs OP on DEVICE, with the whole trace."""
    ctx = context(policy=policy, selections=selections, assume_libs=assume_libs,
                  strict=strict, registry=registry, env=env, libs=libs)
    res = resolve_in(ctx, op, as_spec(device, via=via, assume_cuda=assume_cuda))
    for w in res.warnings:
        log.warning(w)
    return res

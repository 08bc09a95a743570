"""Group decisions (a TP group): resolve each device on its own facts, then compare."""
from __future__ import annotations

import collections
import logging
from typing import Optional

import attrs

from ..capabilities.probing import AssumeCudaError, check_assume_cuda
from .errors import BadInput, GroupDivergenceError, Unsatisfiable
from .inputs import api_devices, device_list
from .notices import ids_text
from .resolver import BucketResolution, Context, Resolution, as_spec, context, resolve_in

log = logging.getLogger("capdispatch")


@attrs.frozen
class GroupResolution:
    op: str
    per_device: dict          # device id -> Resolution, in group order
    uniform: bool             # every device runs one backend
    mode: str                 # mixed_group in force
    warnings: tuple = ()
    divergence: str = ""      # the mixed_group: warn warning among WARNINGS ("": none)
    origin: str = ""          # where mixed_group was set (file:line, --mixed-group)

    def to_dict(self) -> dict:
        return {"per_device": {d: r.to_dict() for d, r in self.per_device.items()},
                "uniform": self.uniform}


def unique_ids(specs) -> list:
    """A group may hold the same card more than once: every copy of a repeated id
    becomes ID@N, N its position in the group (its TP rank), so each copy keeps the
    same name whatever else is in the group. A policy's `id: ID` still matches every
    copy; `id: ID@N` the copy at position N."""
    specs = list(specs)
    counts = collections.Counter(s.id for s in specs)
    return [s.with_id(f"{s.id}@{i}") if counts[s.id] > 1 else s for i, s in enumerate(specs)]


def _bounds(per_device) -> list:
    """Every finite bucket bound any device uses, ascending, then None (the catch-all)."""
    return sorted({b.upper for r in per_device.values() for b in r.buckets if b.upper is not None}) + [None]


def _bucket_at(r, upper):
    """The bucket of R covering the sizes up to UPPER (a bound of the union): the first
    whose own bound reaches it, the catch-all for None."""
    for b in r.buckets:
        if b.upper is None or (upper is not None and upper <= b.upper):
            return b
    return None     # no buckets: the whole resolution speaks


def _pick(r, upper):
    b = _bucket_at(r, upper)
    return (b.backend, b.candidates, b.wanted) if b is not None else (r.backend, r.candidates, r.wanted)


def _label(upper, lower, key) -> str:
    if upper is not None:
        return f"{key} <= {upper}"
    return f"{key} > {lower}" if lower is not None else ""


SUMMARY_FROM = 4   # devices of one card deciding alike: from this many, one entry names them all


def _row(per_device, upper) -> str:
    """Each device -> its backend; identical cards deciding alike summarised in one entry
    (their ids as ranges, N x card) once there are SUMMARY_FROM of them."""
    groups = {}
    for i, (d, r) in enumerate(per_device.items()):
        groups.setdefault((r.device.name, r.device.cc_str, _pick(r, upper)[0]), []).append((i, d))
    parts = []
    for (name, cc, backend), members in groups.items():
        if len(members) < SUMMARY_FROM:
            parts += [f"{d} ({name}, cc {cc}) -> {backend}" for _, d in members]
        else:
            parts.append(f"{ids_text([d for _, d in members])} ({len(members)} x {name}, cc {cc}) "
                         f"-> {backend}")
    return "; ".join(parts)


def _table(per_device, bounds=(None,), key=None) -> str:
    parts = []
    lower = None
    for upper in bounds:
        row = _row(per_device, upper)
        label = _label(upper, lower, key)
        parts.append(f"[{label}] {row}" if label else row)
        lower = upper
    return " | ".join(parts)


def _divergent(per_device, bounds) -> list:
    return [u for u in bounds if len({_pick(r, u)[0] for r in per_device.values()}) > 1]


def resolve_group_in(ctx: Context, op: str, specs) -> GroupResolution:
    ctx = ctx.for_devices(specs)     # whose libraries: the group's, not each device's
    per = {s.id: resolve_in(ctx, op, s) for s in specs}
    warnings = [w for r in per.values() for w in r.warnings]
    mode_setting = ctx.stack.setting("mixed_group")
    mode = mode_setting.value
    size = ctx.registry.ops[op].size
    key = size.key if size is not None else None
    bounds = _bounds(per)
    # A group agrees when, at every size, every device runs one backend.
    diverging = _divergent(per, bounds)
    if not diverging or mode == "allow":
        return GroupResolution(op, per, not diverging, mode, tuple(warnings))
    table = _table(per, bounds, key)
    if mode == "error":
        raise GroupDivergenceError(
            f"{op}: the group's devices choose different backends ({table}) and "
            f"mixed_group is error ({mode_setting.origin})")
    if mode == "warn":
        text = (f"{op}: the group's devices choose different backends: {table} "
                f"(mixed_group: warn, {mode_setting.origin}; --mixed-group uniform, or mixed_group: uniform "
                f"in a policy, runs one kernel everywhere)")
        return GroupResolution(op, per, False, mode, tuple(warnings) + (text,), text, mode_setting.origin)
    # uniform: per bucket, the first backend in the first device's order that every device can run.
    first = next(iter(per.values()))
    common = {}
    lower = None
    for upper in bounds:
        runnable = [{c.backend for c in _pick(r, upper)[1] if c.ok} for r in per.values()]
        pick = next((c.backend for c in _pick(first, upper)[1]
                     if all(c.backend in ok for ok in runnable)), None)
        if pick is None:
            where = _label(upper, lower, key)
            raise Unsatisfiable(f"{op}: mixed_group is uniform ({mode_setting.origin}) but no backend "
                                f"runs on every device{' for ' + where if where else ''}: {table}")
        common[upper] = pick
        lower = upper
    common = _unsplit_hosts(ctx, op, per, first, bounds, common)
    out = {d: _uniform(r, bounds, common, mode_setting.origin, key) for d, r in per.items()}
    return GroupResolution(op, out, True, mode, tuple(w for r in out.values() for w in r.warnings),
                           "", mode_setting.origin)


def _unsplit_hosts(ctx, op, per, first, bounds, common) -> dict:
    """COMMON without a host-run backend that may not be split across sizes (resolver.Hosted)
    where it wins some bounds only: those take the next backend every device can run."""
    for name in dict.fromkeys(common.values()):
        hosted = ctx.hosted.get((op, name))
        if hosted is None or hosted.split or len(set(common.values())) == 1:
            continue
        for upper in bounds:
            if common[upper] != name:
                continue
            runnable = [{c.backend for c in _pick(r, upper)[1] if c.ok} for r in per.values()]
            pick = next((c.backend for c in _pick(first, upper)[1]
                         if c.backend != name and all(c.backend in ok for ok in runnable)), None)
            if pick is None:
                raise Unsatisfiable(f"{op}: mixed_group is uniform but no backend other than {name} (the "
                                    f"host's own kernel, which runs for every size or none) runs on every device")
            common[upper] = pick
    return common


def _note(origin, alone) -> str:
    return f"mixed_group: uniform ({origin}); alone it would run {alone}"


def _retold(r, bounds, common, origin, key) -> tuple:
    """R's warnings saying what runs under mixed_group: uniform: a warning that ends
    "running X instead" for a bucket (or the catch-all) now run by another backend names it."""
    catch_all = next((b for b in r.buckets if b.upper is None), None)   # None: no buckets
    scopes = [("", catch_all)] + [(f"[{key} <= {b.upper}]", b) for b in r.buckets if b.upper is not None]
    out = []
    for w in r.warnings:
        for where, own in scopes:
            if not w.startswith(f"{r.device.id} ({r.device.name}): {r.op}{where}="):
                continue
            alone = own.backend if own is not None else r.backend
            picks = list(dict.fromkeys(common[u] for u in bounds if _bucket_at(r, u) is own))
            tail = f"; running {alone} instead"
            if w.endswith(tail) and picks != [alone]:
                w = w[:-len(tail)] + f"; running {' / '.join(picks)} instead ({_note(origin, alone)})"
            break
        out.append(w)
    return tuple(out)


def _uniform(r, bounds, common, origin, key=None):
    """R with every bucket running COMMON's backend for it (the union of the group's bounds),
    its warnings naming what runs."""
    r = attrs.evolve(r, warnings=_retold(r, bounds, common, origin, key))
    main = common[None]
    if main == r.backend:
        r2 = r
    else:
        r2 = attrs.evolve(r, backend=main, fallback=main != r.wanted, source=_note(origin, r.backend))
    if len(bounds) == 1:
        return r2
    buckets, lower = [], None
    for upper in bounds:
        alone, cands, wanted = _pick(r, upper)
        b = _bucket_at(r, upper)
        pick = common[upper]
        if b is None:
            b = BucketResolution(None, None, r.backend, r.source, r.fallback, r.downgraded_from,
                                 r.candidates, r.wanted)
        b = attrs.evolve(b, lower=lower, upper=upper)
        if pick != alone:
            b = attrs.evolve(b, backend=pick, fallback=pick != wanted, source=_note(origin, alone))
        buckets.append(b)
        lower = upper
    return attrs.evolve(r2, buckets=tuple(buckets))


def resolve_group(op: str, devices, *, policy=None, selections=None, assume_libs=None,
                  strict: bool = False, registry=None, env=None, via: str = "auto",
                  assume_cuda: Optional[str] = None, libs=None, shapes=None) -> GroupResolution:
    ctx = context(policy=policy, selections=selections, assume_libs=assume_libs,
                  strict=strict, registry=registry, env=env, libs=libs, shapes=shapes)
    specs = unique_ids([as_spec(d, via=via, assume_cuda=assume_cuda) for d in api_devices(devices)])
    g = resolve_group_in(ctx, op, specs)
    for w in g.warnings:
        log.warning(w)
    return g


def device_specs(values, source: str, *, via: str = "auto", assume_cuda=None) -> list:
    """device_list(VALUES), each read (probed or simulated) as one group; an unknown device
    names SOURCE. Empty: [] (the caller's default, e.g. the local devices)."""
    try:
        check_assume_cuda(assume_cuda)      # its own flag's error, not the device list's
    except AssumeCudaError as exc:
        raise BadInput(str(exc)) from None
    specs = []
    for dev in device_list(values, source):
        try:
            specs.append(as_spec(dev, via=via, assume_cuda=assume_cuda))
        except BadInput as exc:
            raise BadInput(f"{source}: {exc}") from None
    return unique_ids(specs) if specs else []

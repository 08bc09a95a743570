"""Group decisions (a TP group): resolve each device on its own facts, then compare."""
from __future__ import annotations

import logging
from typing import Optional

import attrs

from .errors import GroupDivergenceError, Unsatisfiable
from .resolver import Context, Resolution, as_spec, context, resolve_in

log = logging.getLogger("capdispatch")


@attrs.frozen
class GroupResolution:
    op: str
    per_device: dict          # device id -> Resolution, in group order
    uniform: bool             # every device runs one backend
    mode: str                 # mixed_group in force
    warnings: tuple = ()

    def to_dict(self) -> dict:
        return {"per_device": {d: r.to_dict() for d, r in self.per_device.items()},
                "uniform": self.uniform}


def unique_ids(specs) -> list:
    """A group may hold the same card twice; give later copies '#<position>'."""
    seen, out = set(), []
    for i, s in enumerate(specs):
        out.append(s if s.id not in seen else s.with_id(f"{s.id}#{i}"))
        seen.add(s.id)
    return out


def _table(per_device) -> str:
    return "; ".join(f"{d} ({r.device.name}, cc {r.device.cc_str}) -> {r.backend}"
                     for d, r in per_device.items())


def resolve_group_in(ctx: Context, op: str, specs) -> GroupResolution:
    per = {s.id: resolve_in(ctx, op, s) for s in specs}
    warnings = [w for r in per.values() for w in r.warnings]
    mode_setting = ctx.stack.setting("mixed_group")
    mode = mode_setting.value
    chosen = {r.backend for r in per.values()}
    if len(chosen) <= 1 or mode == "allow":
        return GroupResolution(op, per, len(chosen) <= 1, mode, tuple(warnings))
    if mode == "error":
        raise GroupDivergenceError(
            f"{op}: the group's devices choose different backends ({_table(per)}) and "
            f"mixed_group is error ({mode_setting.origin})")
    if mode == "warn":
        warnings.append(
            f"{op}: the group's devices choose different backends: {_table(per)} "
            f"(mixed_group: warn, {mode_setting.origin}; --mixed-group uniform, or mixed_group: uniform "
            f"in a policy, runs one kernel everywhere)")
        return GroupResolution(op, per, False, mode, tuple(warnings))
    # uniform: the first backend, in the first device's order, that every device can run.
    first = next(iter(per.values()))
    runnable = [{c.backend for c in r.candidates if c.ok} for r in per.values()]
    common = next((c.backend for c in first.candidates if all(c.backend in ok for ok in runnable)), None)
    if common is None:
        raise Unsatisfiable(f"{op}: mixed_group is uniform ({mode_setting.origin}) but no backend "
                            f"runs on every device: {_table(per)}")
    out = {}
    for d, r in per.items():
        if r.backend == common:
            out[d] = r
        else:
            out[d] = attrs.evolve(
                r, backend=common, fallback=common != r.wanted,
                source=f"mixed_group: uniform ({mode_setting.origin}); alone it would run {r.backend}")
    return GroupResolution(op, out, True, mode, tuple(warnings))


def resolve_group(op: str, devices, *, policy=None, selections=None, assume_libs=None,
                  strict: bool = False, registry=None, env=None, via: str = "auto",
                  assume_cuda: Optional[str] = None, libs=None) -> GroupResolution:
    ctx = context(policy=policy, selections=selections, assume_libs=assume_libs,
                  strict=strict, registry=registry, env=env, libs=libs)
    specs = unique_ids([as_spec(d, via=via, assume_cuda=assume_cuda) for d in devices])
    g = resolve_group_in(ctx, op, specs)
    for w in g.warnings:
        log.warning(w)
    return g

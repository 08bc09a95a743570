"""Explain: a plan for a group of devices and ops, as text for people and as JSON."""
from __future__ import annotations

import logging
from typing import Optional

import attrs

from ..capabilities import derive_features
from .group import GroupResolution, resolve_group_in, unique_ids
from .resolver import as_spec, context

log = logging.getLogger("capdispatch")

SCHEMA = 1


@attrs.frozen
class Plan:
    devices: tuple
    ops: dict                 # op -> GroupResolution
    warnings: tuple
    libraries: dict           # dist -> description, as the decision saw them
    inventory: object = attrs.field(default=None, eq=False)   # the Inventory the decision read
    registry: object = attrs.field(default=None, eq=False)    # the registry it decided from

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "devices": [_device_dict(d, self.libraries) for d in self.devices],
            "ops": {op: g.to_dict() for op, g in self.ops.items()},
            "warnings": list(self.warnings),
        }


def _device_dict(d, libraries) -> dict:
    return {"id": d.id, "name": d.name, "cc": d.cc_str, "features": sorted(derive_features(d)),
            "libraries": libraries, "platform": d.platform, "sm_count": d.sm_count,
            "smem_optin_per_block": d.smem_optin_per_block, "memory": d.memory,
            "cuda": d.cuda, "probe": d.probe, "notes": list(d.notes)}


def plan(devices, ops=None, *, policy=None, selections=None, assume_libs=None,
         strict: bool = False, env=None, via: str = "auto", assume_cuda: Optional[str] = None,
         registry=None, selection_origin: str = "selections=", log_warnings: bool = True) -> Plan:
    """Resolve OPS (default: all) over DEVICES as one group; log its warnings once
    (LOG_WARNINGS=False: the caller logs them, e.g. rank 0 of a distributed group)."""
    ctx = context(policy=policy, selections=selections, assume_libs=assume_libs, strict=strict,
                  env=env, registry=registry, selection_origin=selection_origin)
    return plan_in(ctx, devices, ops, via=via, assume_cuda=assume_cuda, log_warnings=log_warnings)


def plan_in(ctx, devices, ops=None, *, via: str = "auto", assume_cuda: Optional[str] = None,
            log_warnings: bool = True) -> Plan:
    """`plan` with an already built Context (`capdispatch.context(...)`): every op
    of the plan reads the same policy stack, selections and library inventory."""
    specs = unique_ids([as_spec(d, via=via, assume_cuda=assume_cuda) for d in devices])
    names = list(ops) if ops else list(ctx.registry.ops)
    groups = {op: resolve_group_in(ctx, op, specs) for op in names}
    warnings = tuple(w for g in groups.values() for w in g.warnings)
    if log_warnings:
        for w in warnings:
            log.warning(w)
    dists = sorted({r.dist for op in names for b in ctx.registry.backends(op)
                    for r in b.requires if hasattr(r, "dist")})
    libs = {d: ctx.inventory.get(d).describe() for d in dists}
    return Plan(tuple(specs), groups, warnings, libs, ctx.inventory, ctx.registry)


def _gib(n):
    return f"{n / 2**30:.1f} GiB" if n else "?"


def device_line(d) -> str:
    if d.platform != "cuda":
        return f"{d.id}  {d.name}  (probed: {d.probe})"
    smem = f"{d.smem_optin_per_block // 1024} KiB opt-in smem" if d.smem_optin_per_block else "opt-in smem ?"
    sms = f"{d.sm_count} SMs" if d.sm_count else "SMs ?"
    cuda = f"CUDA {d.cuda}" if d.cuda else "CUDA ?"
    return (f"{d.id}  {d.name}  cc {d.cc_str}, {sms}, {smem}, {_gib(d.memory)}, {cuda}  "
            f"(probed: {d.probe})")


def _bucket_lines(r) -> list:
    if not r.buckets:
        return []
    rows = []
    for b in r.buckets:
        flag = ""
        if b.downgraded_from:
            flag = f"  (downgraded from {b.downgraded_from})"
        elif b.fallback:
            flag = f"  (fallback from {b.wanted})"
        rows.append((f"{r.size_key} {b.label(r.size_key)}", f"{b.backend}{flag}", b.source))
    w1, w2 = max(len(a) for a, _, _ in rows), max(len(b) for _, b, _ in rows)
    return ["      buckets:"] + [f"        {a:<{w1}} -> {b:<{w2}}  # {c}" for a, b, c in rows]


def render_text(p: Plan) -> str:
    out = []
    for d in p.devices:
        out.append(device_line(d))
        feats = sorted(derive_features(d))
        out.append(f"  features: {', '.join(feats) if feats else '(none)'}")
        for n in d.notes:
            out.append(f"  note: {n}")
    out.append("  libraries: " + ", ".join(f"{k} {v}" for k, v in p.libraries.items()))
    for op, g in p.ops.items():
        out.append("")
        tag = "" if len(p.devices) == 1 else ("  [uniform]" if g.uniform else "  [DIVERGES]")
        out.append(f"{op}{tag}")
        for did, r in g.per_device.items():
            flags = []
            if r.downgraded_from:
                flags.append(f"downgraded from {r.downgraded_from}")
            elif r.fallback:
                flags.append(f"fallback from {r.wanted}")
            flag = f"  ({'; '.join(flags)})" if flags else ""
            out.append(f"  {did} -> {r.backend}{flag}")
            out.append(f"      source: {r.source}")
            out += _bucket_lines(r)
            for c in r.candidates:
                mark = "✓" if c.ok else "✗"
                bad = [ch for ch in c.checks if not ch.ok]
                tag = f"  [{c.verification}]" if c.verification else ""
                if c.ok:
                    out.append(f"      {mark} {c.backend}{tag}")
                else:
                    why = "; ".join(f"{ch.code}: need {ch.need}, found {ch.found}" for ch in bad)
                    out.append(f"      {mark} {c.backend}: {why}{tag}")
    if p.warnings:
        out.append("")
        out.append(f"{len(p.warnings)} warning(s): see above on stderr")
    return "\n".join(out)

"""Agreement across processes: every rank learns every rank's DeviceSpec, so every
rank computes the same group decision; no rank answers for another rank's card.

Works over any torch.distributed process group (inside SGLang: its TP CPU group;
standalone: the default group). Only facts travel — each rank resolves the whole
group itself, deterministically, so the results are identical by construction,
and a digest exchange proves it.
"""
from __future__ import annotations

import hashlib
import json
import logging

from ..capabilities import DeviceSpec
from .errors import Unsatisfiable
from .explain import Plan, plan, plan_in

log = logging.getLogger("capdispatch")


class AgreementError(Unsatisfiable):
    pass


def gather_specs(local: DeviceSpec, group=None) -> list:
    """All ranks' DeviceSpecs in rank order (a collective: every rank must call it)."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    out = [None] * world
    dist.all_gather_object(out, local.to_dict(), group=group)
    specs = []
    for rank, d in enumerate(out):
        s = DeviceSpec.from_dict(d)
        # Ranks may share an id ("cuda:0" on every node): name them by rank.
        specs.append(s.with_id(f"rank{rank}:{s.id}"))
    return specs


def digest(p: Plan) -> str:
    # Size buckets are part of the decision: ranks must agree on them too.
    body = {op: {d: r.backend if not r.buckets else [r.backend, [[b.upper, b.backend] for b in r.buckets]]
                 for d, r in g.per_device.items()} for op, g in p.ops.items()}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def agree(local: DeviceSpec, ops=None, *, group=None, log_warnings: bool = None, context=None,
          **plan_kwargs) -> Plan:
    """Gather facts, resolve the group on every rank, check all ranks agree.

    A `mixed_group: error` divergence raises the same AgreementError on every rank.
    Warnings are logged by rank 0 only (one WARNING per divergent op for the group).
    CONTEXT: an already built `capdispatch.context(...)` (then PLAN_KWARGS name no policy).
    """
    import torch.distributed as dist
    specs = gather_specs(local, group)
    rank = dist.get_rank(group)
    error = None
    try:
        p = (plan_in(context, specs, ops, log_warnings=False, **plan_kwargs) if context is not None
             else plan(specs, ops, log_warnings=False, **plan_kwargs))
    except Unsatisfiable as exc:
        p, error = None, str(exc)
    # Everyone learns whether anyone failed, so all ranks stop together with one message.
    results = [None] * dist.get_world_size(group)
    dist.all_gather_object(results, {"error": error, "digest": digest(p) if p else None}, group=group)
    errors = sorted({r["error"] for r in results if r["error"]})
    if errors:
        raise AgreementError(errors[0])
    digests = {r["digest"] for r in results}
    if len(digests) != 1:
        raise AgreementError(f"ranks computed different group decisions ({len(digests)} variants): "
                             f"their capdispatch versions or policies differ")
    if (rank == 0) if log_warnings is None else log_warnings:
        for w in p.warnings:
            log.warning(w)
    return p

"""Per rank, before the model loads: prove the decided kernels on this rank's card.

Each backend this rank decided is verified by its canary (in a child process) unless
the verification cache already has a verdict for this card and software; a failure
makes the rank decide again (the new decision reads the cache, so the failed kernel
is rejected and the next candidate wins). At most VERIFY_BUDGET_S seconds are spent;
what did not run by then stays unverified (and under `verify: required` cannot run).
"""
from __future__ import annotations

import logging

log = logging.getLogger("capdispatch.sglang")

VERIFY_BUDGET_S = 120.0


def _decided(decision, spec) -> dict:
    out = {}
    for op, row in decision.choices.items():
        c = row.get(spec.id)
        if c is not None and c.backend is not None:
            out[op] = c.backend
    return out


def verified(decision, spec, redecide, *, env=None, budget_s: float = VERIFY_BUDGET_S):
    """(decision, log text): DECISION, or REDECIDE() when a decided backend failed."""
    import capdispatch as cd
    chosen = _decided(decision, spec)
    if not chosen:
        return decision, None
    v = cd.verify_decisions(spec, chosen, budget_s=budget_s, env=env)
    replaced = {}
    if v.failed:
        decision = redecide()
        after = _decided(decision, spec)
        replaced = {r.job.op: after.get(r.job.op) for r in v.failed}
        for r in v.failed:
            log.warning("capdispatch: %s: %s=%s failed its canary on this card (%s); running %s instead",
                        spec.id, r.job.op, r.job.backend, r.verdict.describe(), replaced[r.job.op])
    return decision, v.describe(replaced)

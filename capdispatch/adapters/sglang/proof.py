"""Per rank, before the model loads: prove the decided kernels on this rank's card.

Each backend this rank decides is verified by its canary (in a child process) unless
the verification cache already has a verdict for this card and software. A failure
makes the rank decide again (the new decision reads the cache, so the failed kernel
is rejected and the next candidate wins), and the new choice is verified in turn. At
most VERIFY_BUDGET_S seconds are spent; what did not run by then stays unverified
(and under `verify: required` cannot run). While verifying, decisions are made as
under `verify: warn`, so that `required` can reach candidates nobody verified yet;
the final decision is made with the policy as it is.

A kept op whose kernel is SGLang's own by the release's statement (knobs.yaml `needs`:
the candidate is judged by what SGLang's kernel needs, not by capdispatch's adapter of that
backend) has no capdispatch canary: it is not verified, and the line says so ("SGLang's own
kernel, not verified by capdispatch"). Under `verify: required` it cannot run: its op's next
candidates are verified in order until one passes, and the final decision takes that one.
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("capdispatch.sglang")

VERIFY_BUDGET_S = 120.0


def _decided(decision, spec) -> dict:
    """op -> the backend capdispatch verifies for it: its decision, unless SGLang's own kernel
    runs it by the release's statement (hosted)."""
    return {op: b for op, b in _backends(decision, spec).items() if op not in hosted(decision, spec)}


def _backends(decision, spec) -> dict:
    out = {}
    for op, row in decision.choices.items():
        c = row.get(spec.id)
        if c is not None and c.backend is not None:
            out[op] = c.backend
    return out


def hosted(decision, spec) -> dict:
    """op -> the label of SGLang's own kernel, for the ops whose decision on SPEC is a kernel
    SGLang runs itself by the release's statement (Resolution.host_of): capdispatch's canary
    is of its own adapter, not of that kernel."""
    out = {}
    for op, row in decision.choices.items():
        c = row.get(spec.id)
        host = c.resolution.host_of(c.backend) if c is not None and c.resolution is not None else None
        if host is not None:
            out[op] = host
    return out


def verified(spec, decide, *, env=None, budget_s: float = VERIFY_BUDGET_S):
    """(decision, log text or None). DECIDE(env) makes this rank's decision."""
    import capdispatch as cd
    if spec.simulated:               # nothing to prove on a simulated card
        d = decide(env)
        own = hosted(d, spec)
        return d, (_describe(spec, {}, [], env, own) if own else None)
    base = dict(os.environ if env is None else env)
    trial = env if base.get("CAPDISPATCH_VERIFY") else dict(base, CAPDISPATCH_VERIFY="warn")
    t0 = time.monotonic()
    decision = decide(trial)
    failed, checked = [], set()
    while True:
        chosen = {op: b for op, b in _decided(decision, spec).items() if (op, b) not in checked}
        if not chosen:
            break
        left = max(0.0, budget_s - (time.monotonic() - t0))
        v = cd.verify_decisions(spec, chosen, budget_s=left, env=base)
        if v.mode == "off":
            d = decide(env)
            own = hosted(d, spec)
            return d, (_describe(spec, {}, [], base, own) if own else None)
        checked.update((r.job.op, r.job.backend) for r in v.results)
        failed += v.failed
        if not v.failed:
            break
        decision = decide(trial)     # the cache now rejects what failed
    if cd.context(env=base).verify_mode == "required":
        failed += _verify_next(spec, decision, checked, budget_s - (time.monotonic() - t0), base)
    if trial is not env or failed:
        decision = decide(env)
    final = _backends(decision, spec)
    own = hosted(decision, spec)
    for r in failed:
        log.warning("capdispatch: %s: %s=%s failed its canary on this card (%s); running %s instead",
                    spec.id, r.job.op, r.job.backend, r.verdict.describe(), final.get(r.job.op))
    return decision, _describe(spec, {op: b for op, b in final.items() if op not in own}, failed, base, own)


def _verify_next(spec, decision, checked: set, left: float, env) -> list:
    """Under `verify: required` SGLang's own kernel (hosted) cannot run, having no capdispatch
    canary: for each op the trial kept that way, verify its next candidates in order of
    preference until one passes, so that the final decision has a verified kernel to take.
    Returns the failed results."""
    import capdispatch as cd
    t0, failed = time.monotonic(), []
    for op in hosted(decision, spec):
        res = decision.choices[op][spec.id].resolution
        for cand in res.candidates:
            if cand.host is not None or not cand.ok or (op, cand.backend) in checked:
                continue
            v = cd.verify_decisions(spec, {op: cand.backend}, budget_s=max(0.0, left - (time.monotonic() - t0)),
                                    env=env)
            checked.update((r.job.op, r.job.backend) for r in v.results)
            failed += v.failed
            if v.results and not v.failed and not v.unverified:
                break
    return failed


def _describe(spec, final: dict, failed: list, env, own=None) -> str:
    """'verified on this card: ...', what failed and what replaced it, what is unverified, and
    which kept ops run SGLang's own kernel (OWN: op -> its label), not verified by capdispatch."""
    import capdispatch as cd
    from capdispatch import extend
    ok, unverified = [], []
    for op, b in final.items():
        v = cd.proof.lookup(spec, op, b, env=env)
        (ok if v is not None and v.passed else unverified).append(f"{op}={b}")
    parts = ["verified on this card: " + ", ".join(ok)] if ok else []
    parts += [f"{r.job.op}={r.job.backend} failed its canary on this card ({r.verdict.describe()}), "
              f"replaced by {final.get(r.job.op)}" for r in failed]
    if unverified:
        parts.append("not verified within the time budget: " + ", ".join(unverified))
    if own:
        parts.append(f"SGLang's own kernel, {extend.HOST_NOT_VERIFIED}: "
                     + ", ".join(f"{op} ({label})" for op, label in own.items()))
    return "; ".join(parts) if parts else "nothing to verify"

"""Verification: run canaries for decisions or candidates, record the verdicts, and
say what they change.

`verify_decisions` is what a serving process calls before it loads a model: for each
backend it decided, a cached verdict is used when there is one for this card and
software; otherwise the canary runs in a child process, within a time budget, and its
verdict is cached. The caller then decides again (a fresh decision reads the cache, so
a failed backend is rejected and the next one wins).
"""
from __future__ import annotations

import math
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Optional
from concurrent.futures import ThreadPoolExecutor

import attrs

from ..capabilities import DeviceSpec
from .errors import BadInput
from .resolver import Context, evaluate, order, resolve_in

if TYPE_CHECKING:
    from ..proof.verdict import Verdict

DEFAULT_BUDGET_S = 120.0


@attrs.frozen
class Job:
    device: DeviceSpec
    op: str
    backend: str


@attrs.frozen
class Result:
    job: Job
    verdict: Optional[Verdict]    # None when the budget ran out before it ran
    cached: bool = False          # the verdict came from the cache, nothing ran

    def to_dict(self) -> dict:
        d = {"device": self.job.device.id, "op": self.job.op, "backend": self.job.backend,
             "cached": self.cached}
        d["verdict"] = None if self.verdict is None else self.verdict.to_dict()
        return d


def runnable_device(spec) -> None:
    if spec.simulated:
        raise BadInput(f"{spec.id} is simulated: a canary needs the card itself "
                       f"(valid: cuda:N or cpu)")


def jobs(ctx: Context, specs, ops, *, backend: Optional[str] = None, every: bool = False) -> list:
    """What to verify: per device and op, the chosen backend; BACKEND only; or (EVERY)
    every candidate whose declared requirements hold (a cached canary failure aside)."""
    out = []
    if backend is not None and not any(ctx.registry.has_backend(op, backend) for op in ops):
        raise BadInput(f"no op among {', '.join(ops)} has a backend {backend!r}")
    for spec in specs:
        runnable_device(spec)
        for op in ops:
            if backend is not None:
                if ctx.registry.has_backend(op, backend):
                    out.append(Job(spec, op, backend))
            elif every:
                pref, names = order(ctx, op, spec)
                for c in evaluate(ctx, op, spec, names, pref.backends):
                    if all(ch.ok for ch in c.checks if ch.code != "canary"):
                        out.append(Job(spec, op, c.backend))
            else:
                out.append(Job(spec, op, resolve_in(ctx, op, spec).backend))
    return out


def run(ctx: Context, todo, *, timeout: float, budget_s: Optional[float] = None, use_cache: bool = False,
        workers: int = 1, on_start=None, on_done=None) -> list:
    """Run each job's canary in a child process and cache its verdict; results in job
    order. USE_CACHE: a job with a cached verdict does not run. BUDGET_S: jobs that
    would start after it are left unverified (verdict None). WORKERS: children at once.

    Only a verdict the kernel caused is cached: one with a fault (the budget ran out,
    the child was killed from outside or never started) is returned, not recorded. An
    interrupt (KeyboardInterrupt, or any exception in the calling thread) makes every
    running child of this call kill its process group within runner.POLL_S, starts
    nothing more, records nothing more, and propagates."""
    from ..proof.runner import run_canary
    check_timeout(timeout, "timeout")
    t0 = time.monotonic()
    cancel = threading.Event()
    for job in todo:
        _card(ctx, job.device)        # read each device's cache once, before any thread runs

    def check(job):
        card = _card(ctx, job.device)
        b = ctx.registry.backend(job.op, job.backend)
        cached = card.get(b) if use_cache else None
        if cached is not None:
            return Result(job, cached, cached=True)
        left = None if budget_s is None else budget_s - (time.monotonic() - t0)
        if (left is not None and left <= 0) or cancel.is_set():
            return Result(job, None)
        if on_start:
            on_start(job)
        cut = left is not None and left < timeout - 1.0    # it gets less than its own limit
        verdict = run_canary(job.op, job.backend, torch_device(job.device),
                             timeout=timeout if not cut else max(1.0, left), budget_cut=cut,
                             env=ctx.env, cancel=cancel)
        if not verdict.fault and not cancel.is_set():
            card.put(b, verdict)
        return Result(job, verdict)

    def one(job):
        r = check(job)
        if on_done and not cancel.is_set():
            on_done(r)
        return r

    if workers <= 1 or len(todo) <= 1:
        try:
            return [one(job) for job in todo]
        except BaseException:
            cancel.set()
            raise
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="capdispatch-verify")
    try:
        futures = [pool.submit(one, job) for job in todo]
        return [f.result() for f in futures]
    except BaseException:
        cancel.set()           # the workers' waits see it within runner.POLL_S and kill
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def torch_device(spec) -> str:
    """The device the child runs on: SPEC's id without a group copy's position (cpu@1 -> cpu)."""
    return re.sub(r"@\d+$", "", spec.id.split("#")[0])


# The shortest canary limit taken: below it no child can even start, so its timeout
# would be the limit's, not the kernel's, and the cached verdict would reject a sound
# backend until the cache is cleared.
MIN_TIMEOUT_S = 1.0


def check_timeout(value, what: str = "--timeout") -> float:
    """VALUE as seconds: a finite number >= MIN_TIMEOUT_S, else BadInput naming WHAT."""
    try:
        ok = not isinstance(value, bool) and float(value) >= MIN_TIMEOUT_S and math.isfinite(float(value))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise BadInput(f"{what}: {value!r} is not a time limit (valid: seconds, a finite number "
                       f">= {MIN_TIMEOUT_S:g})")
    return float(value)


def _card(ctx: Context, spec):
    """The device's verdicts, shared with the context's decisions (read once), whatever
    the policy's verify setting: verifying always records."""
    if ctx.cards.get(spec.id) is None:
        from ..proof import open_card
        ctx.cards[spec.id] = open_card(spec, inventory=ctx.inventory, env=ctx.env)
    return ctx.cards[spec.id]


@attrs.frozen
class Verification:
    """What `verify_decisions` found for one device."""
    device: DeviceSpec
    results: tuple
    mode: str                     # the policy's verify setting
    seconds: float = 0.0

    @property
    def failed(self) -> tuple:
        """The kernels that failed their canary (a run cut short by the budget or killed
        from outside is unverified, not failed)."""
        return tuple(r for r in self.results if r.verdict is not None and not r.verdict.passed
                     and not r.verdict.fault)

    @property
    def unverified(self) -> tuple:
        return tuple(r for r in self.results if r.verdict is None or r.verdict.fault)

    def describe(self, replaced: Optional[dict] = None) -> str:
        """One log line: 'verified on this card', or what failed and what replaced it."""
        replaced = replaced or {}
        if self.mode == "off":
            return "not verified (verify: off)"
        if self.mode == "simulated":
            return "not verified (a simulated device has no card)"
        if not self.results:
            return "nothing to verify"
        parts = []
        ok = [r for r in self.results if r.verdict is not None and r.verdict.passed]
        if ok:
            parts.append("verified on this card: " + ", ".join(
                f"{r.job.op}={r.job.backend}{' (cached)' if r.cached else ''}" for r in ok))
        for r in self.failed:
            after = replaced.get(r.job.op)
            parts.append(f"{r.job.op}={r.job.backend} failed its canary on this card ({r.verdict.describe()})"
                         + (f", replaced by {after}" if after else ""))
        late = [r for r in self.unverified if r.verdict is None]
        if late:
            parts.append("not verified within the time budget: " + ", ".join(
                f"{r.job.op}={r.job.backend}" for r in late))
        for r in self.unverified:
            if r.verdict is not None:
                parts.append(f"{r.job.op}={r.job.backend} not verified ({r.verdict.describe()})")
        return "; ".join(parts)


def verify_decisions(spec, resolutions, *, budget_s: float = DEFAULT_BUDGET_S, timeout_s: Optional[float] = None,
                     policy=None, env=None, registry=None) -> Verification:
    """Verify, on SPEC's card, the backends decided for it. RESOLUTIONS: Resolutions or
    a mapping op -> Resolution or backend name. A backend with a cached verdict for this
    card and software does not run again; the others run (each in a child process, each
    within TIMEOUT_S, default 120 s) until BUDGET_S seconds have passed; a canary the
    budget cuts short is unverified, not failed, and not cached. Nothing runs for a
    simulated device or under `verify: off`. Decide again afterwards: the new decision reads the verdicts."""
    from .resolver import context
    env = dict(os.environ if env is None else env)
    ctx = context(policy=policy, env=env, registry=registry)
    mode = ctx.verify_mode
    if isinstance(resolutions, dict):
        pairs = [(op, r if isinstance(r, str) else r.backend) for op, r in resolutions.items()]
    else:
        pairs = [(r.op, r.backend) for r in resolutions]
    if mode == "off" or spec.simulated:
        return Verification(spec, (), "off" if mode == "off" else "simulated")
    t0 = time.monotonic()
    todo = [Job(spec, op, b) for op, b in pairs if b is not None]
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or budget_s != budget_s \
            or budget_s < 0:
        raise BadInput(f"budget_s: {budget_s!r} is not a time budget (valid: seconds >= 0)")
    from ..proof.runner import DEFAULT_TIMEOUT_S
    # The canary's own limit; the budget only cuts it short (and a cut is not the kernel's).
    timeout = check_timeout(timeout_s, "timeout_s") if timeout_s is not None else DEFAULT_TIMEOUT_S
    results = run(ctx, todo, timeout=timeout, budget_s=budget_s, use_cache=True)
    return Verification(spec, tuple(results), mode, time.monotonic() - t0)

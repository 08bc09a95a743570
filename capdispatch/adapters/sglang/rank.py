"""Per rank (each SGLang scheduler process): decide on the rank's own GPU,
correct SGLang's architecture facts to it, route the KV call sites where
SGLang's own kernel cannot run; then agree with the other ranks of the TP group.

Hooks (HookRegistry, AFTER; knobs.yaml `hooks`): configure_scheduler_process(server_args,
gpu_id, ...) runs before CUDA, the process groups and the model; the group hook
(init_parallel_runtime, 0.5.17: init_torch_distributed) is the first point where the TP
CPU group exists.
"""
from __future__ import annotations

import logging
import pkgutil
import hashlib
import json
import os
import attrs

log = logging.getLogger("capdispatch.sglang")

_RANKS: dict = {}     # gpu_id -> RankState of this process's rank (never another GPU's)
_ARGS: dict = {}      # gpu_id -> that rank's ServerArgs record, for the checks after agreement


def device_key(spec, gpu_id: int, emu=None):
    # A simulated card's kernels run where the test tensors are: the CPU; an emulated
    # card's on the device that is there (the CPU where that device is simulated too).
    if emu is not None:
        return ("cuda", gpu_id) if emu.on_cuda else ("cpu", None)
    return ("cpu", None) if spec.simulated else ("cuda", gpu_id)


def _release():
    from . import knobs, versions
    return knobs.load().release(versions.installed() or "")


def _inputs(server_args, release):
    """The launcher's LaunchInputs, or (its plugin was not loaded there) the record's own."""
    from . import compat, launch
    inputs = launch.stashed(server_args)
    if inputs is not None:
        return inputs
    api = compat.of(release)
    return launch.record_inputs(server_args, release, lambda f: api.resolved(server_args, f),
                                user_env=None)


def kernel_for(route, c):
    """The served form of choice C at ROUTE: C's Resolution bound as decided (every size
    bucket: a size dispatcher), without argument checks (SGLang's shapes are its own).
    Where the route's `original` is SGLang's own kernel (no environment switch takes
    SGLang elsewhere), the buckets SGLang's kernel wins are None entries: the route
    calls `original` for those sizes."""
    import capdispatch as cd
    native = route.native if not route.env and route.native_by is None else None
    return cd.bind_resolution(c.resolution, checks=False, native=native)


def apply_routes(release, choices: dict, spec, key, environ=None, user_env=None) -> dict:
    """Install or remove this device's routes. Returns CHOICES as carried out, each with
    how its install went (`OpChoice.install`): an op whose call site cannot be hooked in
    this process (its SGLang module fails to import, its kernel fails to load) is no
    longer `routed` but reported, with why. A route's environment switches go into
    ENVIRON, this rank's own process environment. Where SGLang's own kernel is kept,
    switches the user did not set (USER_ENV) -- set by SGLang's launcher from device
    0's view -- go back to SGLang's defaults."""

    import capdispatch as cd

    from . import routes
    environ = os.environ if environ is None else environ
    out = dict(choices)
    for op, c in choices.items():
        route = release.route(op, spec)
        if route is None:
            continue
        if c.routed:
            try:
                fn = kernel_for(route, c)
                failed = None if fn is not None else "every size is SGLang's own"
            except cd.Unsatisfiable as exc:      # the backend's library fails to load here
                fn, failed = None, str(exc)
            if failed is None:
                failed = routes.install(route, fn, key, backend=c.backend)
            if failed is None:
                out[op] = attrs.evolve(c, install=f"installed at {route.target}")
                changed = routes.switch_env(route, environ)
                if changed:
                    log.info("capdispatch: %s routed on %s: set %s in this rank's process",
                             op, spec.id, ", ".join(changed))
                continue
            routes.remove(op, key)
            routes.restore_env(route, environ)
            out[op] = attrs.evolve(c, action="reported", install=f"failed: {failed}", runs=route.native or "sglang",
                                   buckets=(), why=(
                f"NOT routed: capdispatch {c.backend} was decided ({c.why}), but {failed}; "
                f"SGLang's own {route.site} stays"))
        else:
            had = routes.kernel(op, key) is not None
            routes.remove(op, key)
            if had:
                out[op] = attrs.evolve(c, install="removed")
            restored = routes.restore_env(route, environ)
            if restored:
                log.info("capdispatch: %s on %s is SGLang's own again: restored %s",
                         op, spec.id, ", ".join(restored))
            if c.backend is not None and c.backend == route.native:
                cleared = routes.clear_env(route, environ, keep=user_env or {})
                if cleared:
                    log.info("capdispatch: %s on %s keeps SGLang's %s: unset %s (SGLang's launcher "
                             "set them for device 0's card; the user did not)",
                             op, spec.id, route.native, ", ".join(cleared))
    return out


def user_env(release, inputs, environ=None) -> dict:
    """The route switches the user set: recorded by the launcher before SGLang's own
    defaults ran; without its record, whatever this process inherited counts."""
    if inputs.user_env is not None:
        return dict(inputs.user_env)
    environ = os.environ if environ is None else environ
    return {n: environ[n] for n in release.route_env_names() if n in environ}


def check_lock(d, env=None) -> tuple:
    """This rank's decisions against the lock in CAPDISPATCH_LOCK (read now), if any: one
    WARNING per difference; under CAPDISPATCH_STRICT=1 a difference refuses the launch
    (capdispatch.LockDriftError)."""
    import capdispatch as cd
    if d.plan is None:
        return ()
    return cd.lock.check(d.plan, partial=True, env=env)


def configure(server_args, gpu_id: int, *, env=None):
    """Everything a rank does before its model exists. Returns its RankState."""

    import capdispatch as cd

    from . import sglang_facts, decide, moe_plan, proof, render, gpus
    from .records import RankState
    release = _release()
    if release is None:
        return None
    emu = gpus.emulation(gpu_id, env=env, via="auto")
    spec = gpus.device(gpu_id, env=env, via="auto") if emu is None else emu.spec
    # An emulated rank decides as its card; SGLang's own facts stay the device's (emulate.py).
    changes = sglang_facts.correct(spec if emu is None else emu.real, release.arch)
    inputs = _inputs(server_args, release)
    inputs = attrs.evolve(inputs, user_env=user_env(release, inputs, env))
    moe_launch = moe_plan.record_value(server_args, release, inputs.explicit_fields)

    def decide_now(env):
        return decide.decide_launch([spec], release, inputs, env=env, moe_launch=moe_launch)
    d, proof_text = proof.verified(spec, decide_now, env=env)
    for w in d.warnings:
        log.warning("capdispatch: %s", w)
    check_lock(d, env)
    emulated = None
    if emu is not None:
        from . import emulate
        refused = emulate.problems(release, {op: row[spec.id] for op, row in d.choices.items()}, emu,
                                   _tp_rank(release, server_args, gpu_id))
        if refused:
            raise cd.Unsatisfiable(f"capdispatch: {refused[0]}")
        emulated = emulate.install(emu, gpu_id)
    key = device_key(spec, gpu_id, emu)
    mine = apply_routes(release, {op: row[spec.id] for op, row in d.choices.items()}, spec, key, env,
                        inputs.user_env)
    _ARGS[gpu_id] = server_args
    _refuse_global_ids(release, server_args, mine, spec)
    d = attrs.evolve(d, choices={op: {spec.id: c} for op, c in mine.items()})
    state = RankState(gpu_id, spec, key, inputs, release, d.resolved, mine, tuple(changes), env,
                      moe_launch=moe_launch, proof=proof_text, emulated=emulated)
    facts = ", ".join(f"{n} {b!r} -> {a!r}" for n, b, a in changes) or "already this card's"
    if emu is not None:
        facts = f"the {emu.real.name}'s (the device that is there): {facts}"
    what = render.summary(d, settings=False) if inputs.ops else f"no op to decide ({inputs.reason})"
    log.info("capdispatch: rank on %s (gpu_id %d): %s; SGLang's architecture facts: %s%s",
             gpus.describe(spec, emu), gpu_id, what, facts, f"; {proof_text}" if proof_text else "")
    state = _report(state)
    _RANKS[gpu_id] = state
    return state


def _refuse_global_ids(release, server_args, mine: dict, spec) -> None:
    """Refuse this rank where its routed MoE layers would get global expert ids (moe_method)."""
    import capdispatch as cd

    from . import compat
    from .moe_method import global_ids_refusal
    c = mine.get("moe")
    if c is None or not c.routed or server_args is None:
        return
    api = compat.of(release)
    refused = global_ids_refusal(api, lambda f: api.resolved(server_args, f), [spec.id])
    if refused:
        raise cd.Unsatisfiable(refused)


def _tp_rank(release, server_args, gpu_id: int) -> int:
    """The rank GPU_ID is in the launch's order (its position among the launch's GPUs)."""
    from . import compat, launch
    api = compat.of(release)
    try:
        return launch.gpu_ids_of(api.view(server_args), api).index(gpu_id)
    except Exception:        # a record the launcher did not resolve: the GPU id stands for it
        return gpu_id


def _report(state):
    """Write STATE's report (report.py) and log its one-line summary; STATE with the path."""

    from . import report
    path = report.write(state, proof=state.proof, agreement=state.agreement)
    log.info("%s", report.summary_line(state, path, state.agreement))
    return attrs.evolve(state, report=None if path is None else str(path))


def outcome(c) -> str:
    """How choice C was carried out on its rank: "installed" (its route runs capdispatch's
    kernel), "failed: <why>" (decided routed, not installed), else its action."""
    if c.install is not None and c.install.startswith("installed"):
        return "installed"
    if c.install is not None and c.install.startswith("failed"):
        return c.install
    return c.action


def carried_out(plan, choices: dict, outcomes: list) -> list:
    """What the group decided (CHOICES: op -> {device id: OpChoice}) and a rank did not
    carry out (OUTCOMES: per rank, op -> outcome): one line each."""
    out = []
    for dev, mine in zip(plan.devices, outcomes):
        for op, row in choices.items():
            want, got = row[dev.id], mine.get(op)
            if want.routed and got != "installed":
                out.append(f"{op} on {dev.id}: capdispatch {want.backend} was decided (routed), but its route "
                           f"was not installed ({got})")
    return out


def install_digest(plan_digest: str, outcomes: list) -> str:
    """The agreement digest with every rank's route-install outcomes in it."""
    body = json.dumps({"plan": plan_digest, "installs": outcomes}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def agree(state, group):
    """Gather every rank's card over GROUP, resolve the group on every rank (one
    Context, the rank's own inputs), and re-route this rank if the group decision
    differs (mixed_group: uniform). A mixed_group: error divergence raises the same
    AgreementError on every rank. Then every rank learns how every rank's route
    installs went: they enter the agreement digest (install_digest), and a rank that
    did not install a route the group decided is said once (rank 0's WARNING), or,
    under strict, raises the same AgreementError on every rank. The rank's report is
    rewritten with the group's record. Returns the group Plan."""
    import capdispatch as cd
    import torch.distributed as dist

    from . import decide
    from .records import Agreement
    release, inputs = state.release, state.inputs
    ops = list(state.resolved)      # the same on every rank: derived from settings, not cards
    ctx = decide.context_of(release, inputs, state.env, here=True)
    # SGLang's own MoE kernel is judged under the launch's value as SGLang resolved it (the
    # rank's record), as the rank's own decision judged it.
    ctx = decide.with_launch(ctx, release, decide.moe_launch_of(
        release, (), explicit_fields=inputs.explicit_fields, field_values=inputs.field_values,
        moe_launch=state.moe_launch))
    plan = cd.agree(state.spec, ops, group=group, log_warnings=False, context=ctx)
    rank = dist.get_rank(group)
    me = plan.devices[rank]
    launch = decide.moe_launch_of(release, plan.devices, explicit_fields=inputs.explicit_fields,
                                  field_values=inputs.field_values, moe_launch=state.moe_launch)
    choices = decide.choices_for(plan, release, ops, plan.devices, user_env=inputs.user_env,
                                 moe_launch=launch, strict=ctx.strict_effective)
    if rank == 0:   # each rank logged its own downgrades; the group's divergences once
        for g in plan.ops.values():
            own = {w for r in g.per_device.values() for w in r.warnings}
            for w in g.warnings:
                if w not in own:
                    log.warning("capdispatch: %s", w)
    mine, changed = dict(state.choices), False
    for op, row in choices.items():
        c = attrs.evolve(row[me.id], device=state.spec.id)
        old = state.choices.get(op)
        if old is not None and _shape(old) == _shape(c):
            c = attrs.evolve(c, install=old.install)     # what runs is what the rank installed
        else:
            changed = True
        mine[op] = c
    before = {op: (c.backend, c.action) for op, c in state.choices.items()}
    if changed and state.emulated is not None:       # the group's decision, on the device that is there
        from . import emulate, gpus
        refused = emulate.problems(release, mine, gpus.emulation(state.gpu_id, env=state.env, via="auto"), rank)
        if refused:
            raise cd.Unsatisfiable(f"capdispatch: {refused[0]}")
    if changed:
        mine = apply_routes(release, mine, state.spec, state.key, state.env, inputs.user_env)
        _refuse_global_ids(release, _ARGS.get(state.gpu_id), mine, state.spec)
    after = {op: (c.backend, c.action) for op, c in mine.items()}
    if before != after:
        log.info("capdispatch: rank %s after agreement with %d rank(s): %s", me.id,
                 len(plan.devices), "; ".join(f"{op}: {before[op][0]} -> {c.backend} ({c.why})"
                                              for op, c in mine.items() if before[op] != after[op]))
    # Route installs enter the agreement: every rank learns how every rank's went.
    outcomes = [None] * len(plan.devices)
    dist.all_gather_object(outcomes, {op: outcome(c) for op, c in mine.items()}, group=group)
    missed = carried_out(plan, choices, outcomes)
    digest = cd.agreement.digest(plan)
    from .rehearsal import check as rehearsal_check      # CAPDISPATCH_REQUIRE_REHEARSAL: a refusal
    rehearsal, refusal = rehearsal_check(plan, ops, inputs.model, state.env)
    agreement = Agreement(tuple(d.id for d in plan.devices), rank, digest, install_digest(digest, outcomes),
                          tuple(outcomes), tuple(missed), rehearsal)
    state = attrs.evolve(state, choices=mine, agreed=plan, agreement=agreement)
    _RANKS[state.gpu_id] = state = _report(state)
    if refusal is not None:        # after the report, which records why
        raise refusal
    if missed:
        text = "the ranks did not carry out the group decision alike: " + "; ".join(missed)
        if ctx.strict_effective:
            raise cd.AgreementError(f"strict: {text}")
        if rank == 0:
            log.warning("capdispatch: %s", text)
    return plan


def _shape(c) -> tuple:
    """What a choice runs, for comparing the rank's with the group's."""
    return (c.backend, c.action, c.buckets)


def after_configure(result, server_args, gpu_id, *args, **kwargs):
    """AFTER configure_scheduler_process(server_args, gpu_id, ...): returns None, so
    SGLang's own result (0.5.17: dp_rank) stands."""
    configure(server_args, gpu_id)


def after_parallel_ready(result, *args, **kwargs):
    """AFTER the release's group hook (knobs.yaml hooks.group): 0.5.23's
    init_parallel_runtime(*, server_args, device, dist_port), 0.5.17's
    init_torch_distributed(*, ..., ps, is_draft_worker, ...)."""
    from . import compat
    release = _release()
    if release is None:
        return
    gpu_id = compat.of(release).group_gpu_id(kwargs)
    if gpu_id is None:
        return
    state = _RANKS.get(gpu_id)
    if state is None or not state.resolved:
        return
    group = pkgutil.resolve_name(state.release.hooks.tp_group)()
    agree(state, group.cpu_group)

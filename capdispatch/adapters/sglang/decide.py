"""The adapter's decisions, without SGLang: which ops a launch runs, what runs on
each device and how (kept: SGLang's own kernel; routed: capdispatch's kernel at
SGLang's call site; reported: neither exists), which launch settings fire, and
which SGLang settings each device's choice needs.

One pass: every op of the model is resolved once, with one capdispatch Context
(one policy stack, one selection list, one library inventory), and everything
the plan shows is derived from those resolutions. Launch, rank and the command
line all decide through `decide`."""
from __future__ import annotations

import os
from typing import Optional

import attrs

from capdispatch import extend

from .records import BucketChoice, Decision, GroupSetting, OpChoice

SOURCE = "capdispatch"
ACTIONS = ("routed", "kept", "reported")


def applicable_ops(release, model_arch: Optional[str], kv_cache_dtype: Optional[str]):
    """(ops, reason): the capdispatch ops this model runs with this KV-cache dtype (outside the
    knob map's kv_cache_dtypes, only those the model declaration does not mark `kv_pool`:
    capdispatch/models/calls.yaml), then the plugins' ops no model lists (decided and
    reported: the knob map says what to add)."""
    if not model_arch:
        return (), "the model architecture is unknown"
    model = release.models.get(model_arch)
    if model is None:
        return (), f"{model_arch} runs no capdispatch op"
    dtype = kv_cache_dtype or "auto"
    unlisted = tuple(dict.fromkeys(u.op for u in release.unmapped if u.op not in model.ops))
    if dtype not in model.kv_cache_dtypes:
        ops = tuple(op for op in model.ops if op in model.any_kv_cache_dtype) + unlisted
        return ops, (f"kv_cache_dtype={dtype}: {model_arch}'s KV and attention ops run with "
                     f"{' or '.join(model.kv_cache_dtypes)} only"
                     + (f"; {', '.join(ops)} run{'s' if len(ops) == 1 else ''} with any" if ops else ""))
    return tuple(model.ops) + unlisted, f"{model_arch} with kv_cache_dtype={dtype}"


def _flag(s) -> str:
    return f"--{s.field.replace('_', '-')} {s.value}"


def flag_selections(release, explicit: dict):
    """Selections made by SGLang flags the user set whose value names one backend
    on every device: (['op=backend', ...], origin). A value that means a
    different backend per device family goes through flag_policy instead."""
    picked, flags = [], []
    for s in release.selects:
        if s.backend and s.field in explicit and str(explicit[s.field]) == s.value:
            picked.append(f"{s.op}={s.backend}")
            flags.append(_flag(s))
    origin = f"sglang {', '.join(flags)}" if flags else "sglang command line"
    return picked, origin


def flag_policy(release, explicit: dict) -> list:
    """The explicit selections of SGLang flags whose value means a different backend
    per device family (e.g. --moe-runner-backend flashinfer_mxfp4), as in-memory user
    policies (`capdispatch.policy_from_dict`)."""
    import capdispatch as cd
    return [cd.policy_from_dict(s.policy(), f"sglang {_flag(s)}") for s in release.selects
            if not s.backend and s.field in explicit and str(explicit[s.field]) == s.value]


def context_for(release, *, selections=None, selection_origin="selections=", policy=(),
                field_values=None, assume_libs=(), strict=False, env=None, libs=None):
    """The one capdispatch Context a decision reads: the policy files given, the
    policies of SGLang flags, the selections given plus those of SGLang flags, the
    library inventory (LIBS: a profile instead of this machine's) with ASSUME_LIBS,
    ENV (CAPDISPATCH_POLICY/SET/STRICT), and the release's statements of SGLang's own
    kernels (Release.hosted: those candidates are judged by them and never bound)."""
    import capdispatch as cd
    field_values = field_values or {}
    flags, forigin = flag_selections(release, field_values)
    sels = list(selections or [])
    origin = selection_origin
    for f in flags:
        if f not in sels:
            sels.append(f)
            origin = forigin if not selections else f"{selection_origin}, {forigin}"
    given = [] if not policy else ([policy] if isinstance(policy, (str, os.PathLike)) else list(policy))
    pols = given + flag_policy(release, field_values)
    # The release's statements of what SGLang's own kernels need, where they are not the
    # libraries capdispatch's adapters call (knobs.yaml `needs`): the decision judges them so.
    # One that depends on the launch's moe_runner_backend runs nowhere here (the value is
    # unknown); decide_in judges it under the launch's value (with_launch).
    return cd.context(policy=pols or None, selections=sels or None, selection_origin=origin,
                      assume_libs=list(assume_libs or ()) or None, libs=libs, strict=strict, env=env,
                      hosted=release.hosted())


def with_launch(ctx, release, launch):
    """CTX with the release's statements of SGLang's own MoE kernel judged under LAUNCH (the
    launch's moe_runner_backend, an SglangSetting; None: unknown): SGLang runs that kernel only
    where the launch's value builds its method on the card's family (knobs.Release.hosted)."""
    stated = release.launch_hosted(launch)
    return attrs.evolve(ctx, hosted={**ctx.hosted, **stated}) if stated else ctx


def context_of(release, inputs, env=None, *, here: bool = False):
    """context_for from a LaunchInputs record. HERE: the kernels bind in this process (a
    launch, a rank), so with no library named they are this machine's, simulated GPUs
    included; else the devices choose (cd.target_libs), as every planning command does."""
    o = inputs.options
    libs = "local" if here and o.libs is None and not o.assume_libs else o.libs
    return context_for(release, selections=o.selections, selection_origin=o.selection_origin,
                       policy=o.policy, field_values=inputs.field_values,
                       assume_libs=o.assume_libs, strict=o.strict, env=env, libs=libs)


def _same(a: str, b: str) -> bool:
    """Environment values as SGLang's EnvBool reads them (true/1/yes/y, false/0/no/n)."""
    truth = {"true": "1", "1": "1", "yes": "1", "y": "1", "false": "0", "0": "0", "no": "0", "n": "0"}
    a, b = str(a).strip().lower(), str(b).strip().lower()
    return truth.get(a, a) == truth.get(b, b)


def user_env_conflicts(route, user_env) -> list:
    """The names ROUTE must set that the user set to another value: [(name, user value, needed)]."""
    return [(n, user_env[n], v) for n, v in route.env if n in (user_env or {}) and not _same(user_env[n], v)]


def _bucket_rows(res):
    """(lower, upper, backend) per size bucket of RES; one row (None, None, backend) without buckets."""
    if not res.buckets:
        return ((None, None, res.backend),)
    return tuple((b.lower, b.upper, b.backend) for b in res.buckets)


def _sizes(rows, key) -> str:
    """The sizes ROWS ((lower, upper, backend), ...) cover, for people: "tokens <=2, >64"."""
    labels = ", ".join(BucketChoice(lo, up, "", "", "").label() for lo, up, _ in rows)
    return f"{key} {labels}" if key else labels


def bucket_choices(route, res, routed: bool) -> tuple:
    """BucketChoice per size bucket of RES at ROUTE: where the route keeps per size
    (no environment switch: its `original` is SGLang's own kernel), a bucket won by
    route.native is kept; under a switch every bucket of a routed op is routed (SGLang's
    native kernel then runs as capdispatch's adapter of it)."""
    if not res.buckets:
        return ()
    native = route.native if route is not None else None
    out = []
    for lo, up, b in _bucket_rows(res):
        if not routed:
            out.append(BucketChoice(lo, up, b, "kept", native or "sglang"))
        elif b == native and not route.env:
            out.append(BucketChoice(lo, up, b, "kept", native))
        else:
            out.append(BucketChoice(lo, up, b, "routed", b))
    return tuple(out)


def route_by_native(route, op: str, res, user_env=None):
    """(routed, why, warning) for OP at ROUTE (the site SGLang calls on the device RES
    was resolved for), by the kernel SGLang calls there (route.native); WARNING is None
    unless a user switch keeps a kernel that cannot run. The moe route, whose kernel is
    the method SGLang builds for the launch's value, is decided by moe_plan.route_by_method.

    Decided per size bucket: where every bucket's winner is SGLang's own kernel
    (route.native), SGLang's call stays, whoever named it (a user policy that names the
    native backend is no reason to route). Where some buckets are SGLang's own and the
    site has no environment switch, the op is routed and SGLang's call stays for those
    sizes (bucket_choices)."""
    site = route.site
    native = next((c for c in res.candidates if c.backend == route.native), None) if route.native else None
    # SGLang's own kernel by the release's statement (knobs.yaml `needs`), not capdispatch's adapter.
    stated = f" ({_kernel_of(native.host)})" if native is not None and native.host else ""
    conflicts = user_env_conflicts(route, user_env)
    if conflicts:
        said = ", ".join(f"{n}={u}" for n, u, _ in conflicts)
        cannot = native is not None and not native.ok
        why = f"the user set {said}: SGLang's own {op} choice kept" + (
            f"; SGLang's default {site}{stated} cannot run there ({native.why_not(exact=True)}), and capdispatch "
            f"would run {res.backend}" if cannot else "")
        return False, why, why if cannot else None
    rows = _bucket_rows(res)
    own = [r for r in rows if route.native is not None and r[2] == route.native]
    if route.native is not None and len(own) == len(rows):
        picked = f"the decision is {route.native}" if not res.user else f"{route.native} is chosen ({res.source})"
        if stated:
            return False, (f"SGLang's own {site} kept ({picked}: {native.host}, judged by the knob map's "
                           f"statement of what it needs; {extend.HOST_NOT_VERIFIED})"), None
        return False, f"SGLang's own {site} kept ({picked}, the kernel SGLang runs there)", None
    tail, what = "", f"capdispatch {res.backend}"
    if own:
        mine = [r for r in rows if r not in own]
        what = f"capdispatch {', '.join(dict.fromkeys(b for _, _, b in mine))} for {_sizes(mine, res.size_key)}"
        where = _sizes(own, res.size_key)
        tail = (f"; for {where} the decision is {route.native}, SGLang's own{stated}, so SGLang's call stays there"
                if not route.env else
                f"; for {where} capdispatch's {route.native} adapter runs (the switch takes SGLang off its "
                f"{route.native} call for every size)")
    if res.user and res.downgraded_from:
        return True, (f"the explicit choice {res.downgraded_from} cannot run there (see the warning); "
                      f"{what} runs at {site} instead{tail}"), None
    if res.user:
        return True, f"explicit choice ({res.source}): {what} runs at {site}{tail}", None
    if route.native is None:
        return False, f"SGLang's own {site} kept ({route.why})", None
    if native is not None and not native.ok and route.env:
        # The site is a function SGLang takes only under the switches the rank sets.
        return True, (f"SGLang's default{stated} cannot run there ({route.why}): {native.why_not(exact=True)}; "
                      f"capdispatch {res.backend} runs at {site}, which this rank switches on"), None
    if native is not None and not native.ok:
        return True, f"SGLang's own {site}{stated} cannot run there: {native.why_not(exact=True)}", None
    # SGLang's kernel could run, but the decision (a size bucket, mixed_group: uniform) is another one.
    return True, f"{what} runs at {site} ({res.source}){tail}", None


def _kernel_of(label: str) -> str:
    """"sglang-kernel 0.4.5 sgl_kernel.flash_mla" of a host label "SGLang's own kernel (...)"."""
    head, _, rest = label.partition(" (")
    return rest[:-1] if rest.endswith(")") else head


def _cannot_carry_out(op: str, res, spec, strict: bool) -> Optional[str]:
    """The warning for an explicit choice RES of OP that this rank cannot carry out (SGLang
    calls no routable site of OP on SPEC, so SGLang's own kernel runs); under STRICT the
    refusal (capdispatch.Unsatisfiable). None where RES is not the user's."""
    import capdispatch as cd
    if not res.user:
        return None
    what = res.downgraded_from or res.backend
    text = (f"the explicit choice {what} ({res.source}) cannot be carried out: SGLang calls no {op} "
            f"site on this card ({spec.name}) that capdispatch can route, so SGLang's own kernel runs")
    if strict:
        raise cd.Unsatisfiable(f"strict: {op} on {spec.id}: {text}")
    return text


def _no_site_why(entry, res) -> tuple:
    """(action, why) for an op with no call site SGLang calls on this card."""
    if entry is not None and entry.kind == "sglang":
        labels = ", ".join(s.label for s in entry.settings) or "its defaults"
        text = f"SGLang runs it itself under {labels} ({entry.why})"
        action = "kept"
    else:
        why = entry.why if entry is not None else "the knob map has no entry for it"
        text = f"no SGLang setting runs capdispatch {res.backend} and no call site of it is routed: {why}"
        action = "reported"
    if res.downgraded_from:
        text = f"the explicit choice {res.downgraded_from} cannot run there (see the warning); {text}"
    elif res.user:
        text = f"explicit choice ({res.source}); {text}"
    return action, text


def choose(release, op: str, res, spec, user_env=None, moe_launch=None, strict=False) -> OpChoice:
    """How the resolution RES of OP on SPEC is carried out inside SGLang. MOE_LAUNCH
    (an SglangSetting): the launch's moe_runner_backend, which picks SGLang's MoE
    method on each card; STRICT: a user value that cannot run there is refused, and so
    is an explicit choice SGLang gives no routable site for on this card."""
    entry = release.entry(op, res.backend)
    unmapped = release.unmapped_of(op, res.backend) if entry is None else None
    if unmapped is not None:        # a plugin's backend the knob map does not say how to run
        return OpChoice(op, spec.id, res, "reported", unmapped.message, (), None, None, ())
    setting = entry.settings if entry is not None and entry.kind == "sglang" else ()
    route = release.route(op, spec)
    warning, buckets = None, ()
    if route is not None and route.native_by is not None:
        from . import moe_plan
        routed, why, warning = moe_plan.route_by_method(route, res, spec, moe_launch, strict)
        action = "routed" if routed else "kept"
        # SGLang's method runs one kernel for every size: kept keeps it whole.
        runs = res.backend
    elif route is not None:
        routed, why, warning = route_by_native(route, op, res, user_env)
        action = "routed" if routed else "kept"
        conflict = bool(user_env_conflicts(route, user_env))
        buckets = bucket_choices(route, res, routed) if not conflict else ()
        if routed:
            runs = "/".join(dict.fromkeys(b.runs for b in buckets)) if buckets else res.backend
        else:
            runs = "sglang" if conflict or route.native is None else route.native
    elif release.routes_for(op):
        action, why, runs = "kept", f"SGLang calls no routable {op} site on this card", "sglang"
        warning = _cannot_carry_out(op, res, spec, strict)
        if warning:
            why = f"{why}: the explicit choice {res.downgraded_from or res.backend} is not carried out (see the warning)"
    else:
        action, why = _no_site_why(entry, res)
        runs = res.backend if action == "kept" else None
    return OpChoice(op, spec.id, res, action, why, setting, warning, runs, buckets)


def _user_names(ctx, op: str) -> bool:
    """Does a user layer (a selection, or a policy file globally or for some
    device) speak for OP? The same answer on every device."""
    st = ctx.stack
    if any(sel.op == op for sel in st.selections):
        return True
    return any(op in pf.ops or any(op in e.ops for e in pf.devices) for pf in st.files)


def resolved_ops(release, ops, ctx) -> tuple:
    """The ops whose capdispatch decision changes what runs: every op but one whose
    call sites all keep an SGLang kernel that runs everywhere (`native: null`),
    unless the user asked for a capdispatch backend of it (a site whose SGLang kernel
    depends on a launch setting, `native_by`, is decided). Device-independent, so
    every rank of a group derives the same list."""
    out = []
    for op in ops:
        routes = release.routes_for(op)
        if not routes or any(r.native is not None or r.native_by is not None for r in routes) \
                or _user_names(ctx, op):
            out.append(op)
    return tuple(out)


def choices_for(plan, release, ops, specs, *, ids=None, user_env=None, moe_launch=None,
                strict=False) -> dict:
    """op -> {device id: OpChoice} from PLAN; IDS maps plan ids to reported ids;
    USER_ENV: the route environment names the user set (they keep SGLang's choice);
    MOE_LAUNCH, STRICT: as for choose."""
    out = {}
    for op in ops:
        row = {}
        for spec, (pid, res) in zip(specs, plan.ops[op].per_device.items()):
            c = choose(release, op, res, spec, user_env, moe_launch, strict)
            did = (ids or {}).get(pid, pid)
            row[did] = attrs.evolve(c, device=did)
        out[op] = row
    return out


def kept_choices(release, op: str, specs) -> dict:
    """An op capdispatch was not asked to decide: SGLang's own kernel everywhere."""
    def why(spec):
        route = release.route(op, spec)
        site = route.site if route else op
        return f"SGLang's own {site} kept ({route.why if route else 'no call site to route'})"
    return {s.id: OpChoice(op, s.id, None, "kept", why(s), runs="sglang") for s in specs}


def settings_for(release, choices: dict, *, explicit_fields=(), env=None, field_values=None):
    """The launch settings that fire (the knob map's rules), and whether the user's value
    stands. Returns (GroupSetting..., warnings)."""
    env = os.environ if env is None else env
    field_values = field_values or {}
    out, warnings = [], []
    for s in release.settings:
        hits = [c for op in s.ops for c in choices.get(op, {}).values()
                if (s.backends is None or c.backend in s.backends) and (c.routed or not s.routed)]
        if not hits:
            continue
        devices = tuple(dict.fromkeys(c.device for c in hits))
        user = (s.name in explicit_fields) if s.kind == "field" else (s.name in env)
        common = dict(why=s.why, ops=s.ops, wants={s.value: devices}, rule=s)
        if not user:
            out.append(GroupSetting(s.kind, s.name, "set", **common))
            continue
        value = str(field_values.get(s.name)) if s.kind == "field" else env[s.name]
        out.append(GroupSetting(s.kind, s.name, "kept", user=value, **common))
        if value.lower() != s.value.lower():
            warnings.append(f"{s.name}={value} was set by the user and is kept, but "
                            f"{', '.join(devices)} need {s.name}={s.value} ({s.why})")
    return tuple(out), warnings


def _need(ds) -> str:
    return f"{', '.join(ds)} need{'s' if len(ds) == 1 else ''}"


def sglang_settings(release, choices: dict, *, explicit_fields=(), env=None, field_values=None):
    """Per SGLang name the entries of the decided ops use: the value each device's
    choice needs, and whether the user set it. Returns (GroupSetting..., warnings)."""
    env = os.environ if env is None else env
    field_values = field_values or {}
    out, warnings = [], []
    for kind, name in release.sglang_names(tuple(choices)):
        rops = tuple(op for op in choices
                     if any(s.kind == kind and s.name == name for (o, _), e in release.entries.items()
                            if o == op for s in e.settings))
        wants, without, routed = {}, [], {}
        for op in rops:
            for c in choices[op].values():
                if c.resolution is None:
                    continue
                if c.routed:
                    # The rank's route runs capdispatch's kernel at SGLang's call site.
                    routed.setdefault(c.device, c.routed_backends)
                elif not c.setting and c.action == "reported":
                    without.append(c.device)
                for s in c.setting:
                    if (s.kind, s.name) == (kind, name):
                        wants.setdefault(s.value, []).append(c.device)
        wants = {v: tuple(dict.fromkeys(d)) for v, d in wants.items()}
        without = tuple(d for d in dict.fromkeys(without) if d not in routed)
        user = None
        if kind == "field" and name in explicit_fields:
            user = str(field_values.get(name))
        elif kind == "env" and name in env:
            user = env[name]
        if user is not None:
            action = "kept"
            if any(v.lower() != user.lower() for v in wants):
                text = "; ".join(f"{_need(ds)} {name}={v}" for v, ds in wants.items() if v.lower() != user.lower())
                warnings.append(f"{name}={user} was set by the user and is kept, but {text}")
        elif not wants:
            action = "none"
        elif len(wants) == 1 and not without:
            action = "agree"
        else:
            action = "split"
        by_backend = {}
        for dev, b in routed.items():
            by_backend.setdefault(b, []).append(dev)
        tail = [f"{', '.join(ds)} {'is' if len(ds) == 1 else 'are'} routed to capdispatch {b}"
                for b, ds in by_backend.items()]
        if without:
            tail.append(f"{', '.join(without)} run{'s' if len(without) == 1 else ''} capdispatch "
                        f"kernels that no SGLang setting runs and no call site routes (reported)")
        if action == "none":
            why = "; ".join([f"no device runs a backend SGLang selects with {name}"] + tail)
        elif action == "split":
            why = "; ".join(["SGLang takes one value per launch"]
                            + [f"{_need(ds)} {v}" for v, ds in wants.items()] + tail)
        else:
            why = "; ".join([f"{_need(ds)} {v}" for v, ds in wants.items()] + tail)
        out.append(GroupSetting(kind, name, action, why, rops, wants, user, without, routed))
    return tuple(out), warnings


def moe_launch_of(release, specs, *, explicit_fields=(), field_values=None, moe_launch=None):
    """The launch's moe_runner_backend (an SglangSetting): MOE_LAUNCH where the
    caller has SGLang's resolved value (a rank), else the user's, else SGLang's
    DeepSeek-V4 default for device 0 of SPECS."""
    from . import moe_plan
    if moe_launch is not None:
        return moe_launch
    return moe_plan.launch_value(release, specs, explicit_fields=explicit_fields, field_values=field_values)


def decide_in(ctx, specs, ops, release, *, env=None, explicit_fields=(), field_values=None,
              user_env=None, moe_launch=None) -> Decision:
    """Resolve OPS over SPECS as one group with the Context CTX, once, and derive
    from those resolutions what runs where, the launch settings and the SGLang
    settings. MOE_LAUNCH: SGLang's resolved moe_runner_backend, where known (see
    moe_launch_of). Raises capdispatch.Unsatisfiable (strict downgrade, nothing
    runnable, mixed_group: error, strict refusal of a user moe_runner_backend that
    cannot run on a card) and capdispatch.BadInput."""
    import capdispatch as cd
    specs = tuple(specs)
    ops = tuple(ops)
    ctx = ctx.for_devices(specs)
    active = resolved_ops(release, ops, ctx)
    plan, choices = None, {}
    if active:
        launch = moe_launch_of(release, specs, explicit_fields=explicit_fields, field_values=field_values,
                               moe_launch=moe_launch)
        ctx = with_launch(ctx, release, launch)
        # Warnings ride in the plan; the caller logs them once, where it should.
        plan = cd.plan_in(ctx, list(specs), list(active), log_warnings=False)
        choices = choices_for(plan, release, active, specs,
                              ids={p.id: s.id for p, s in zip(plan.devices, specs)}, user_env=user_env,
                              moe_launch=launch, strict=ctx.strict_effective)
    choices = {op: choices[op] if op in active else kept_choices(release, op, specs) for op in ops}
    kw = dict(explicit_fields=explicit_fields, env=ctx.env if env is None else env, field_values=field_values)
    settings, w1 = settings_for(release, choices, **kw)
    names, w2 = sglang_settings(release, choices, **kw)
    warnings = list(w1) + list(w2) + [f"{c.op} on {c.device}: {c.warning}" for row in choices.values()
                                      for c in row.values() if c.warning]
    return Decision(ops, active, specs, plan, choices, settings, names,
                    tuple(dict.fromkeys(tuple(plan.warnings if plan else ()) + tuple(warnings))))


def decide(specs, ops, release, *, selections=None, selection_origin="selections=", policy=(),
           strict: bool = False, env=None, explicit_fields=(), field_values=None,
           user_env=None, assume_libs=(), moe_launch=None) -> Decision:
    """decide_in with the Context built here (context_for) from the same inputs."""
    ctx = context_for(release, selections=selections, selection_origin=selection_origin, policy=policy,
                      field_values=field_values, assume_libs=assume_libs, strict=strict, env=env)
    return decide_in(ctx, specs, ops, release, env=env, explicit_fields=explicit_fields,
                     field_values=field_values, user_env=user_env, moe_launch=moe_launch)


def decide_launch(specs, release, inputs, *, env=None, moe_launch=None) -> Decision:
    """decide for a LaunchInputs record, in the process that binds the kernels (MOE_LAUNCH:
    as for decide_in)."""
    return decide_in(context_of(release, inputs, env, here=True), specs, inputs.ops, release, env=env,
                     explicit_fields=inputs.explicit_fields, field_values=inputs.field_values,
                     user_env=inputs.user_env, moe_launch=moe_launch)

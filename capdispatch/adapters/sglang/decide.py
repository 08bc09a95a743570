"""The adapter's decisions, without SGLang: which ops a launch runs, what runs
on each device, which SGLang call sites are routed, which launch settings fire.
Launch, rank and the command line all decide through here."""
from __future__ import annotations

from typing import Optional

import attrs

SOURCE = "capdispatch"


@attrs.frozen
class OpChoice:
    op: str
    device: str
    resolution: object       # capdispatch Resolution
    routed: bool             # a capdispatch kernel replaces SGLang's own at the call site
    why: str
    warning: Optional[str] = None   # to log: SGLang's kernel kept where it cannot run (a user switch)

    @property
    def backend(self):
        """capdispatch's backend, or None where no decision was needed (SGLang's own runs)."""
        return None if self.resolution is None else self.resolution.backend


@attrs.frozen
class SettingChoice:
    setting: object          # knobs.Setting
    action: str              # "set" | "kept" (the user set it)
    value: str               # what is in force
    devices: tuple           # the devices that made the row fire


@attrs.frozen
class Decision:
    ops: tuple
    resolved: tuple          # the ops capdispatch decided (see resolved_ops)
    devices: tuple           # DeviceSpecs in group order
    plan: object             # capdispatch Plan over `resolved` (None when empty)
    choices: dict            # op -> {device id: OpChoice}
    settings: tuple
    warnings: tuple          # to log: downgrades, divergences, user settings kept against a need


def applicable_ops(release, model_arch: Optional[str], kv_cache_dtype: Optional[str]):
    """(ops, reason): the capdispatch ops this model runs with this KV-cache dtype."""
    if not model_arch:
        return (), "the model architecture is unknown"
    model = release.models.get(model_arch)
    if model is None:
        return (), f"{model_arch} runs no capdispatch op"
    dtype = kv_cache_dtype or "auto"
    if dtype not in model.kv_cache_dtypes:
        return (), (f"kv_cache_dtype={dtype}: {model_arch}'s capdispatch ops run with "
                    f"{' or '.join(model.kv_cache_dtypes)} only")
    return tuple(model.ops), f"{model_arch} with kv_cache_dtype={dtype}"


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


def flag_policy(release, explicit: dict):
    """The explicit selections of SGLang flags whose value means a different
    backend per device family (e.g. --moe-runner-backend flashinfer_mxfp4), as
    in-memory user policy files: per family its backend, elsewhere the first
    listed (which cannot run there: downgraded loudly, refused under strict)."""
    from capdispatch.policies.loader import DeviceEntry, Marked, PolicyFile
    out = []
    for s in release.selects:
        if s.backend or s.field not in explicit or str(explicit[s.field]) != s.value:
            continue
        entries = tuple(DeviceEntry({"cc": f">={fam[2:-1]}.0,<{int(fam[2:-1]) + 1}.0"},
                                    {s.op: Marked((b,), 0)}, 0) for fam, b in s.backends)
        out.append(PolicyFile(f"sglang {_flag(s)}", ops={s.op: Marked((s.backends[0][1],), 0)},
                              devices=entries))
    return out


def _failed(candidate) -> str:
    return "; ".join(f"needs {ch.need}, has {ch.found}" for ch in candidate.checks if not ch.ok)


def _same(a: str, b: str) -> bool:
    """Environment values as SGLang's EnvBool reads them (true/1/yes/y, false/0/no/n)."""
    truth = {"true": "1", "1": "1", "yes": "1", "y": "1", "false": "0", "0": "0", "no": "0", "n": "0"}
    a, b = str(a).strip().lower(), str(b).strip().lower()
    return truth.get(a, a) == truth.get(b, b)


def user_env_conflicts(route, user_env) -> list:
    """The names ROUTE must set that the user set to another value: [(name, user value, needed)]."""
    return [(n, user_env[n], v) for n, v in route.env if n in (user_env or {}) and not _same(user_env[n], v)]


def route_choice(release, op: str, res, user_spoke: bool, spec=None, user_env=None, moe_launch=None,
                 strict=False):
    """(routed, why, warning) for OP on the device RES was resolved for (SPEC: which site
    SGLang calls there); WARNING is None unless a user switch keeps a kernel that cannot run."""
    route = release.route(op, spec)
    # --- moe: SGLang's method depends on the launch's moe_runner_backend (moe_plan.py) ---
    if route is not None and route.native_by is not None:
        from . import moe_plan
        return moe_plan.route_choice(route, res, spec, moe_launch, strict)
    # --- end moe ---
    if route is None:
        if release.routes_for(op):
            return False, f"SGLang calls no routable {op} site on this card", None
        return False, "no SGLang call site to route", None
    site = route.target.rsplit(".", 1)[-1]
    conflicts = user_env_conflicts(route, user_env)
    if conflicts:
        said = ", ".join(f"{n}={u}" for n, u, _ in conflicts)
        native = next((c for c in res.candidates if c.backend == route.native), None)
        cannot = native is not None and not native.ok
        why = f"the user set {said}: SGLang's own {op} choice kept" + (
            f"; SGLang's default {site} cannot run there ({_failed(native)}), and capdispatch "
            f"would run {res.backend}" if cannot else "")
        return False, why, why if cannot else None
    if user_spoke and res.downgraded_from:
        return True, (f"the explicit choice {res.downgraded_from} cannot run there (see the warning); "
                      f"capdispatch {res.backend} runs at {site} instead"), None
    if user_spoke:
        return True, f"explicit choice ({res.source}): capdispatch {res.backend} runs at {site}", None
    if route.native is None:
        return False, f"SGLang's own {site} kept ({route.why})", None
    if res.backend == route.native:
        return False, f"SGLang's own {site} kept (it needs what {route.native} needs, and has it)", None
    native = next((c for c in res.candidates if c.backend == route.native), None)
    if native is not None and not native.ok and route.env:
        # The site is a function SGLang takes only under the switches the rank sets.
        return True, (f"SGLang's default cannot run there ({route.why}): {_failed(native)}; capdispatch "
                      f"{res.backend} runs at {site}, which this rank switches on"), None
    if native is not None and not native.ok:
        return True, f"SGLang's own {site} cannot run there: {_failed(native)}", None
    # SGLang's kernel could run, but the decision (e.g. mixed_group: uniform) is another one.
    return True, f"capdispatch {res.backend} runs at {site} ({res.source})", None


def _user_spoke(ctx, op: str, spec) -> bool:
    from capdispatch.dispatch.resolver import order
    return order(ctx, op, spec)[0].user


def _user_names(ctx, op: str) -> bool:
    """Does a user layer (a selection, or a policy file globally or for some
    device) speak for OP? The same answer on every device."""
    st = ctx.stack
    if any(sel.op == op for sel in st.selections):
        return True
    return any(op in pf.ops or any(op in e.ops for e in pf.devices) for pf in st.files)


def resolved_ops(release, ops, ctx) -> tuple:
    """The ops whose capdispatch decision changes what runs: a routable site
    whose SGLang kernel has requirements (`native`) always, one whose SGLang
    kernel runs everywhere only when the user asked for a capdispatch backend.
    Device-independent, so every rank of a group derives the same list."""
    out = []
    for op in ops:
        routes = release.routes_for(op)
        if not routes or any(r.native is not None or r.native_by is not None for r in routes) \
                or _user_names(ctx, op):
            out.append(op)
    return tuple(out)


def _context(*, policy=None, selections=None, selection_origin="selections=", env=None):
    from capdispatch.dispatch.resolver import context
    return context(policy=policy, selections=selections or None, env=env,
                   selection_origin=selection_origin)


def choices_for(plan, release, ops, specs, *, selections=None, selection_origin="selections=",
                policy=None, env=None, ids=None, user_env=None, moe_launch=None, strict=False) -> dict:
    """op -> {device id: OpChoice} from PLAN; IDS maps plan ids to reported ids;
    USER_ENV: the route environment names the user set (they keep SGLang's choice)."""
    ctx = _context(policy=policy, selections=selections, selection_origin=selection_origin, env=env)
    out = {}
    for op in ops:
        g = plan.ops[op]
        row = {}
        for spec, (pid, res) in zip(specs, g.per_device.items()):
            routed, why, warning = route_choice(release, op, res, _user_spoke(ctx, op, spec), spec, user_env,
                                                moe_launch, strict or ctx.strict_effective)
            did = (ids or {}).get(pid, pid)
            row[did] = OpChoice(op, did, res, routed, why, warning)
        out[op] = row
    return out


def kept_choices(release, op: str, specs) -> dict:
    """An op capdispatch was not asked to decide: SGLang's own kernel everywhere."""
    def why(spec):
        route = release.route(op, spec)
        site = route.target.rsplit(".", 1)[-1] if route else op
        return f"SGLang's own {site} kept ({route.why if route else 'no call site to route'})"
    return {s.id: OpChoice(op, s.id, None, False, why(s)) for s in specs}


def settings_for(release, choices: dict, *, explicit_fields=(), env=None, field_values=None):
    """The launch settings that fire, and whether the user's value stands. Returns
    (SettingChoice..., warnings)."""
    import os
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
        if not user:
            out.append(SettingChoice(s, "set", s.value, devices))
            continue
        value = str(field_values.get(s.name)) if s.kind == "field" else env[s.name]
        out.append(SettingChoice(s, "kept", value, devices))
        if value.lower() != s.value.lower():
            warnings.append(f"{s.name}={value} was set by the user and is kept, but "
                            f"{', '.join(devices)} need {s.name}={s.value} ({s.why})")
    return tuple(out), warnings


def decide(specs, ops, release, *, selections=None, selection_origin="selections=", policy=None,
           strict: bool = False, env=None, explicit_fields=(), field_values=None,
           user_env=None, sglang_values=None) -> Decision:
    """Resolve OPS over SPECS as one group and derive routes and launch settings.
    Raises capdispatch.Unsatisfiable (strict downgrade, nothing runnable,
    mixed_group: error) and capdispatch.BadInput."""
    import capdispatch as cd
    specs = tuple(specs)
    ctx = _context(policy=policy, selections=selections, selection_origin=selection_origin, env=env)
    active = resolved_ops(release, ops, ctx)
    # moe: the launch's moe_runner_backend (SGLANG_VALUES: a rank's resolved record).
    from .moe_plan import launch_value
    moe_launch = launch_value(release, specs, explicit_fields=explicit_fields, field_values=field_values,
                              sglang_values=sglang_values)
    plan, choices = None, {}
    if active:
        # Warnings ride in the plan; the caller logs them once, where it should.
        plan = cd.plan(list(specs), list(active), policy=policy, selections=selections or None,
                       selection_origin=selection_origin, strict=strict, env=env, log_warnings=False)
        choices = choices_for(plan, release, active, specs, selections=selections,
                              selection_origin=selection_origin, policy=policy, env=env,
                              ids={p.id: s.id for p, s in zip(plan.devices, specs)}, user_env=user_env,
                              moe_launch=moe_launch, strict=strict)
    choices = {op: choices[op] if op in active else kept_choices(release, op, specs) for op in ops}
    settings, warnings = settings_for(release, choices, explicit_fields=explicit_fields, env=env,
                                      field_values=field_values)
    warnings = list(warnings) + [f"{c.op} on {c.device}: {c.warning}" for row in choices.values()
                                 for c in row.values() if c.warning]
    return Decision(tuple(ops), active, specs, plan, choices, settings,
                    tuple(plan.warnings if plan else ()) + tuple(warnings))


def summary(d: Decision, *, settings: bool = True) -> str:
    """One paragraph for a log line: per op, which devices run what and why
    (and, for a launch, the settings)."""
    parts = []
    for op, row in d.choices.items():
        kept = [c.device for c in row.values() if not c.routed]
        text = [f"SGLang's own kernel on {', '.join(kept)}"] if kept else []
        by = {}
        for c in row.values():
            if c.routed:
                by.setdefault(c.backend, []).append(c)
        for backend, cs in by.items():
            text.append(f"capdispatch {backend} on {', '.join(c.device for c in cs)} ({cs[0].why})")
        parts.append(f"{op}: {'; '.join(text)}")
    for s in d.settings if settings else ():
        if s.action == "kept":
            parts.append(f"kept the user's {s.setting.name}={s.value}")
        elif s.setting.routed:
            parts.append(f"set {s.setting.label} for {', '.join(s.devices)} ({s.setting.why})")
        else:
            parts.append(f"set {s.setting.label} ({s.setting.why})")
    return "; ".join(parts)


# --------------------------------------------------------------------------- knob ops

@attrs.frozen
class KnobChoice:
    op: str
    device: str
    resolution: object       # capdispatch Resolution
    knob: object             # knobs.Knob: the SGLang settings that run it, or sets=None
    why: str

    @property
    def backend(self):
        return self.resolution.backend


@attrs.frozen
class KnobSetting:
    """One SGLang name over the group: the value each device's backend needs."""
    kind: str                # "field" | "env"
    name: str
    ops: tuple
    wants: dict              # value -> (device, ...)
    without: tuple           # devices running one of `ops` where SGLang has no setting for it
    user: Optional[str]      # the user's value, when the user set it
    action: str              # "agree" | "split" | "none" | "kept"
    why: str


@attrs.frozen
class KnobDecision:
    ops: tuple
    devices: tuple
    plan: object
    choices: dict            # op -> {device id: KnobChoice}
    settings: tuple          # KnobSetting...
    warnings: tuple


def knob_ops(release, model_arch: Optional[str]) -> tuple:
    model = release.models.get(model_arch or "")
    return tuple(model.knob_ops) if model else ()


def _knob_why(knob, res, route=None) -> str:
    if knob is None:
        return "the knob map has no row for it"
    if knob.sets is None:
        how = (f"the rank routes SGLang's {route.target.rsplit('.', 1)[-1]} to it" if route is not None
               else "and no call site of it is routed on this card")
        text = f"no SGLang setting runs capdispatch {res.backend}; {how}: {knob.why}"
    else:
        text = f"SGLang runs it under {', '.join(s.label for s in knob.sets)} ({knob.why})"
    if res.downgraded_from:
        text = f"the explicit choice {res.downgraded_from} cannot run there (see the warning); {text}"
    elif res.source and res.source.startswith("sglang --"):
        text = f"explicit choice ({res.source}); {text}"
    return text


def decide_knobs(specs, ops, release, *, selections=None, selection_origin="selections=", policy=None,
                 strict: bool = False, env=None, explicit_fields=(), field_values=None,
                 assume_libs=None) -> KnobDecision:
    """Resolve the knob ops over SPECS as one group and say, per device, which
    SGLang settings run the chosen backend (or that none does), and per SGLang
    name what the group needs. Reported, not set. An SGLang flag the user set
    whose value names a backend is an explicit selection (FIELD_VALUES)."""
    import os

    import capdispatch as cd
    env = os.environ if env is None else env
    field_values = field_values or {}
    specs = tuple(specs)
    ops = tuple(ops)
    if not ops:
        return KnobDecision((), specs, None, {}, (), ())
    given = [] if policy is None else ([policy] if isinstance(policy, (str, os.PathLike)) else list(policy))
    flags, forigin = flag_selections(release, field_values)
    sels = list(selections or [])
    origin = selection_origin
    for f in flags:
        if f not in sels:
            sels.append(f)
            origin = forigin if not selections else f"{selection_origin}, {forigin}"
    pol = given + flag_policy(release, field_values)
    plan = cd.plan(list(specs), list(ops), policy=pol or None, selections=sels or None,
                   selection_origin=origin, strict=strict, env=env, assume_libs=assume_libs, log_warnings=False)
    ids = {p.id: s.id for p, s in zip(plan.devices, specs)}
    choices = {}
    for op in ops:
        row = {}
        for spec, (pid, res) in zip(specs, plan.ops[op].per_device.items()):
            knob = release.knob(op, res.backend)
            did = ids.get(pid, pid)
            row[did] = KnobChoice(op, did, res, knob, _knob_why(knob, res, release.route(op, spec)))
        choices[op] = row
    settings, warnings = [], []
    names = {}
    for k in release.knobs:
        if k.op in ops:
            for s in k.sets or ():
                names.setdefault((s.kind, s.name), []).append(k)
    for (kind, name), rows in names.items():
        rops = tuple(dict.fromkeys(k.op for k in rows))
        wants, without = {}, []
        for op in rops:
            for c in choices[op].values():
                if c.knob is None or c.knob.sets is None:
                    without.append(c.device)
                    continue
                for s in c.knob.sets:
                    if (s.kind, s.name) == (kind, name):
                        wants.setdefault(s.value, []).append(c.device)
        wants = {v: tuple(dict.fromkeys(d)) for v, d in wants.items()}
        without = tuple(dict.fromkeys(without))
        user = None
        if kind == "field" and name in explicit_fields:
            user = str(field_values.get(name))
        elif kind == "env" and name in env:
            user = env[name]
        if user is not None:
            action = "kept"
            others = [d for v, ds in wants.items() if v.lower() != user.lower() for d in ds]
            if others:
                text = "; ".join(f"{', '.join(ds)} need{'s' if len(ds) == 1 else ''} {name}={v}"
                                 for v, ds in wants.items() if v.lower() != user.lower())
                warnings.append(f"{name}={user} was set by the user and is kept, but {text}")
        elif not wants:
            action = "none"
        elif len(wants) == 1 and not without:
            action = "agree"
        else:
            action = "split"
        def need(ds):
            return f"{', '.join(ds)} need{'s' if len(ds) == 1 else ''}"
        if action == "none":
            why = f"no device runs a backend SGLang selects with {name}"
        elif action == "split":
            why = ("SGLang takes one value per launch; "
                   + "; ".join(f"{need(ds)} {v}" for v, ds in wants.items())
                   + (f"; {need(without)} a capdispatch kernel no SGLang setting runs"
                      if without else ""))
        else:
            why = "; ".join(f"{need(ds)} {v}" for v, ds in wants.items())
        settings.append(KnobSetting(kind, name, rops, wants, without, user, action, why))
    return KnobDecision(ops, specs, plan, choices, tuple(settings), tuple(plan.warnings) + tuple(warnings))

"""What `dispatch sglang plan` shows, as data: one decision (decide.decide_in with
one Context: the plan's policies, selections and library inventory) for the launch's GPUs, in the plan JSON schema (docs/sglang.md). No rendering here."""
from __future__ import annotations

SCHEMA = 2
PLATFORM_FACTS = ("is_sm90", "is_sm100", "is_sm120", "is_blackwell", "device_sm")


def newest(k) -> str:
    """No SGLang here: plan with the knob map's newest tested release."""
    from packaging.version import Version
    return str(max(Version(s.version) for r in k.releases for s in r.spec if s.operator in (">=", "==")))


def _devices(ids, env):
    import capdispatch as cd

    from . import rig
    try:
        return rig.devices(ids, env=env, via="nvml")
    except cd.ProbeError as exc:
        hint = exc.hint or "simulate them with --device sim:NAME[,sim:NAME...]"
        raise cd.BadInput(f"cannot read the launch's GPUs ({', '.join(f'cuda:{g}' for g in ids)}) "
                          f"without initialising CUDA: {exc.reason}; {hint}") from None


def inventory(options, env, specs=None):
    """The library inventory of OPTIONS.libs (a profile) with OPTIONS.assume_libs on
    top, or None for this machine's; a bad name is refused now, before SGLang runs.
    SPECS all simulated and nothing said of libraries: the default profile
    (cd.target_libs, as `dispatch explain` plans them)."""
    import capdispatch as cd
    libs = cd.target_libs(specs or (), options.libs, options.assume_libs)
    if libs is None:
        return None
    return cd.context(libs=libs, assume_libs=list(options.assume_libs) or None, env=env).inventory


def decision(specs, release, inputs, *, libs, env, shapes=None):
    """decide.decide_launch, with LIBS (an Inventory, or None: this machine's) in
    the one Context every op, rank and settings row of the plan reads."""
    import attrs

    from . import decide
    ctx = decide.context_of(release, inputs, env)
    if libs is not None:
        ctx = attrs.evolve(ctx, inventory=libs)
    if shapes is not None:
        ctx = attrs.evolve(ctx, shapes=shapes)
    return decide.decide_in(ctx, specs, inputs.ops, release, env=env,
                            explicit_fields=inputs.explicit_fields, field_values=inputs.field_values,
                            user_env=inputs.user_env), ctx


def inventory_dict(d, ctx) -> dict:
    """Whose libraries the decision used, as `dispatch explain --format json` says it."""
    if d.plan is not None:
        return dict(d.plan.whose)
    return dict(ctx.inventory.to_dict(), note="")


def kind(res) -> str:
    """How the matrix marks a resolution (capdispatch.dispatch.render.KINDS): first
    preference, fallback, downgraded explicit choice, or changed by mixed_group: uniform."""
    if res is None:
        return "first"
    if res.downgraded_from:
        return "downgraded"
    if res.source.startswith("mixed_group: uniform"):
        return "uniform"
    return "fallback" if res.fallback else "first"


def cell_kind(c) -> str:
    """The matrix's mark for choice C: its resolution's (kind), except where SGLang's own
    kernel runs in place of the decision (a kept op with no routable site): that cell
    names SGLang's kernel, marked only as downgraded when an explicit choice was not
    carried out (C's warning says so)."""
    if c.action == "kept" and c.resolution is not None and c.runs != c.backend:
        return "downgraded" if c.warning else "first"
    return kind(c.resolution)


def bucket_rows(c) -> list:
    """The size buckets of choice C, each with what runs there and how: C's own per-bucket
    choices (a route keeps SGLang's call for some sizes), else the resolution's buckets
    carried out as the whole op is. Empty without buckets."""
    res = c.resolution
    if res is None or not res.buckets:
        return []
    key = res.size_key or "size"
    if c.buckets:
        rows = [(b.label(), b.lower, b.upper, b.backend, b.action, b.runs) for b in c.buckets]
    else:
        rows = [(b.label(key), b.lower, b.upper, b.backend, c.action,
                 b.backend if c.action == "routed" else c.runs) for b in res.buckets]
    return [{key: label, "lower": lower, "upper": upper, "backend": backend, "action": action, "runs": runs}
            for label, lower, upper, backend, action, runs in rows]


def op_dict(c) -> dict:
    """One op on one rank: what runs, how, and why. `backend` is capdispatch's decision
    (the catch-all bucket's), `runs` the kernel that runs (SGLang's own where kept),
    `buckets` the size buckets with kept / routed per bucket."""
    res = c.resolution
    return {"backend": c.backend, "runs": c.runs, "action": c.action, "routed": c.routed, "why": c.why,
            "kind": cell_kind(c),
            "setting": [s.label for s in c.setting] if c.setting else None,
            "source": res.source if res else None,
            "downgraded_from": res.downgraded_from if res else None,
            "size_key": res.size_key if res is not None and res.buckets else None,
            "buckets": bucket_rows(c)}


def rank_dict(i, gpu_id, spec, d, release) -> dict:
    from . import archfacts
    facts = archfacts.facts(spec, release.arch)
    platform = {f: facts[src] for f, src in release.arch["platform"].items() if f in PLATFORM_FACTS}
    return {"rank": i, "gpu_id": gpu_id, "device": spec.to_dict(),
            "ops": {op: op_dict(row[spec.id]) for op, row in d.choices.items()}, "arch": platform}


def rank_shapes(model, tp_size):
    """The RankShape of MODEL ({"name", "ep", "dp_attention", "next_n"}) at TP_SIZE, or None."""
    import capdispatch as cd
    if model is None:
        return None
    return cd.load_model(model["name"]).for_rank(tp_size, model["ep"], model["dp_attention"],
                                                 next_n=model["next_n"])


def shape_rejections(d) -> list:
    """Every backend a rank's shapes put outside its declared range: rank device, op,
    backend, and the check's need and found."""
    out = []
    for op, row in d.choices.items():
        for did, c in row.items():
            res = c.resolution
            for cand in (res.candidates if res is not None else ()):
                for ch in cand.checks:
                    if ch.code.startswith("shape:") and not ch.ok:
                        out.append({"device": did, "op": op, "backend": cand.backend, "code": ch.code,
                                    "need": ch.need, "found": ch.found, "wording": ch.wording})
    return out


def build(*, tp=None, sglang_args=None, options, env: dict, model=None) -> dict:
    """The plan for a launch. OPTIONS: records.PlanOptions; ENV: the environment a
    launch would see (CAPDISPATCH_POLICY, CAPDISPATCH_STRICT, the simulated rig); MODEL:
    {"name", "ep", "dp_attention", "next_n"} to check the kernels' shape ranges at each
    rank's shapes (None: not checked)."""
    import capdispatch as cd

    from . import decide, knobs, rig, versions
    from .records import LaunchInputs
    if tp is not None and tp < 1:
        raise cd.BadInput(f"--tp {tp}: expected an integer >= 1")
    libs = inventory(options, env)
    k = knobs.load()
    installed = versions.installed()
    if sglang_args is not None and installed is None:
        raise cd.BadInput("SGLang arguments were given after `--` but SGLang is not installed; "
                          "install it, or plan without `-- ...` (a DeepSeek-V4 launch with defaults)")
    version = installed or newest(k)
    verdict = versions.check(version, knobs=k)
    out = {"schema": SCHEMA, "sglang": {"version": version, "installed": installed is not None,
                                        "tested": verdict.tested, "in_range": verdict.ok}}
    if not verdict.ok:
        out.update(note=verdict.message, launch=[], ranks=[], sglang_settings=[], warnings=[])
        return out
    release = k.release(version)
    fields = None
    if sglang_args is not None:
        from . import sglang_run
        run = sglang_run.run(sglang_args, release, env, options, tp=tp)
        inputs, tp_size, layout, fields = run.inputs, run.tp_size, run.layout, run.fields
        assumed = False
    else:
        arch = next(iter(release.models))
        ops, reason = decide.applicable_ops(release, arch, "auto")
        inputs = LaunchInputs(arch, "auto", ops, reason, frozenset(), {},
                              {n: env[n] for n in release.route_env_names() if n in env},
                              options.selections, options.selection_origin, options.policy,
                              options.assume_libs, options.strict)
        found = rig.simulated_rig(env)
        tp_size, layout, assumed = tp or (len(found) if found else 1), {}, True
    ids = rig.gpu_ids(tp_size=tp_size, **layout)
    shapes = rank_shapes(model, tp_size)
    specs = _devices(ids, env)
    libs = inventory(options, env, specs)
    d, ctx = decision(specs, release, inputs, libs=libs, env=env, shapes=shapes)
    out.update(
        inventory=inventory_dict(d, ctx),
        model={"architecture": inputs.model, "assumed": assumed, "kv_cache_dtype": inputs.kv_cache_dtype},
        ops=list(inputs.ops), reason=inputs.reason, gpu_ids=ids,
        launch=[{"kind": s.setting.kind, "name": s.setting.name, "value": s.value,
                 "wants": s.setting.value, "action": s.action, "why": s.setting.why,
                 "devices": list(s.devices)} for s in d.settings],
        ranks=[rank_dict(i, g, spec, d, release) for i, (g, spec) in enumerate(zip(ids, specs))],
        sglang_settings=[{"kind": s.kind, "name": s.name, "ops": list(s.ops), "action": s.action,
                          "user": s.user, "wants": {v: list(ds) for v, ds in s.wants.items()},
                          "without": list(s.without), "routed": dict(s.routed), "why": s.why} for s in d.sglang],
        warnings=list(d.warnings),
        shapes=shapes.to_dict() if shapes is not None else None,
        shape_rejections=shape_rejections(d) if shapes is not None else [])
    if fields is not None:
        out["sglang_resolved"] = fields
    return out

"""`dispatch sglang plan`: what the SGLang adapter would set for a launch, per
rank, without launching. Exit codes: 0 decided; 2 bad input; 3 unsatisfiable."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

EXIT_OK, EXIT_BAD_INPUT, EXIT_UNSAT = 0, 2, 3
PROG = "dispatch sglang"
PLATFORM_FACTS = ("is_sm90", "is_sm100", "is_sm120", "is_blackwell", "device_sm")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _parser():
    p = _Parser(prog=PROG, description="What capdispatch's SGLang plugin does for a launch.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    plan = sub.add_parser(
        "plan", help="what the plugin would set for a launch, per rank, without launching",
        usage=f"{PROG} plan [--tp N] [--device DEV[,DEV...]] [options] [-- SGLANG ARGS...]",
        description="Everything after `--` is passed to SGLang's own argument parsing and "
                    "resolution (as `python -m sglang.launch_server` would get it); without it, "
                    "a DeepSeek-V4 launch with SGLang's defaults is assumed.")
    plan.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size (SGLang's --tp-size)")
    plan.add_argument("--device", action="append", default=[], metavar="DEV[,DEV...]",
                      help="the node's GPUs as CUDA numbers them (entry N is cuda:N): cuda:N or "
                           "sim:NAME, e.g. sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 (default: "
                           "$CAPDISPATCH_SGLANG_DEVICES, else the local GPUs via NVML)")
    plan.add_argument("--policy", action="append", default=[], metavar="FILE",
                      help="a capdispatch policy file, as the plugin's CAPDISPATCH_POLICY; repeat for more")
    plan.add_argument("--set", action="append", default=[], metavar="OP=BACKEND", dest="set_",
                      help="an explicit capdispatch choice, as CAPDISPATCH_SET (commas for several)")
    plan.add_argument("--strict", action="store_true",
                      help="an explicit choice that cannot run is an error (exit 3)")
    plan.add_argument("--assume-lib", action="append", default=[], metavar="NAME[==VERSION]",
                      help="treat a library as installed when deciding the attention and MoE ops "
                           "(e.g. flashinfer-python, sgl-flash-mla); an unknown name is refused")
    plan.add_argument("--libs", metavar="PROFILE",
                      help="the target's libraries for those decisions from a profile (e.g. "
                           "sglang-0.5.23: what SGLang 0.5.23 installs) instead of this machine's")
    plan.add_argument("--format", choices=("text", "json"), default="text",
                      help="text for people (default) or JSON for programs")
    return p


def main(argv=None) -> int:
    from capdispatch.capabilities import ProbeError, UnknownDeviceError
    from capdispatch.dispatch.errors import BadInput, Unsatisfiable
    from capdispatch.policies import PolicyError

    from .knobs import KnobsError
    argv = list(sys.argv[1:] if argv is None else argv)
    sglang_args = None
    if "--" in argv:
        i = argv.index("--")
        argv, sglang_args = argv[:i], argv[i + 1:]
    args = _parser().parse_args(argv)
    try:
        return _plan(args, sglang_args)
    except (BadInput, PolicyError, UnknownDeviceError, ProbeError, KnobsError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Unsatisfiable as exc:
        print(f"{PROG}: unsatisfiable: {exc}", file=sys.stderr)
        return EXIT_UNSAT


def _env_for(args, *, with_set: bool) -> dict:
    """This process's environment plus the capdispatch flags, as a launch would
    see it (--set goes in only for SGLang's in-process resolution; the plan
    passes it as a selection, so it is named --set)."""
    env = dict(os.environ)
    if args.policy:
        given = [p for p in [env.get("CAPDISPATCH_POLICY")] if p]
        env["CAPDISPATCH_POLICY"] = os.pathsep.join(given + args.policy)
    if args.set_ and with_set:
        env["CAPDISPATCH_SET"] = ",".join([s for s in [env.get("CAPDISPATCH_SET")] if s] + args.set_)
    if args.strict:
        env["CAPDISPATCH_STRICT"] = "1"
    devices = [x.strip() for v in args.device for x in v.split(",") if x.strip()]
    if devices:
        from .rig import SIM_ENV
        env[SIM_ENV] = ",".join(devices)
    return env


def _plan(args, sglang_args) -> int:
    import capdispatch as cd

    from . import decide, knobs, rig, versions
    if args.tp is not None and args.tp < 1:
        raise cd.BadInput(f"--tp {args.tp}: expected an integer >= 1")
    k = knobs.load()
    installed = versions.installed()
    if sglang_args is not None and installed is None:
        raise cd.BadInput("SGLang arguments were given after `--` but SGLang is not installed; "
                          "install it, or plan without `-- ...` (a DeepSeek-V4 launch with defaults)")
    version = installed or _newest(k)
    verdict = versions.check(version, knobs=k)
    out = {"schema": 1, "sglang": {"version": version, "installed": installed is not None,
                                   "tested": verdict.tested, "in_range": verdict.ok}}
    if not verdict.ok:
        out.update(note=verdict.message, launch=[], ranks=[], warnings=[])
        _emit(args, out)
        return EXIT_OK
    release = k.release(version)
    env = _env_for(args, with_set=False)
    if sglang_args is not None:
        facts = _from_sglang(args, sglang_args, release, _env_for(args, with_set=True))
    else:
        arch = next(iter(release.models))
        facts = {"model": arch, "assumed": True, "kv_cache_dtype": "auto", "explicit": set(),
                 "values": {}, "tp_size": args.tp or _rig_size(env) or 1, "fields": None,
                 "cfg": {}}
    ops, reason = decide.applicable_ops(release, facts["model"], facts["kv_cache_dtype"])
    sels, origin = decide.flag_selections(release, facts["values"])
    if args.set_:
        origin = "--set" if not sels else f"{origin}, --set"
        sels = sels + list(args.set_)
    ids = rig.gpu_ids(tp_size=facts["tp_size"], **facts["cfg"])
    specs = _devices(ids, env)
    d = decide.decide(specs, ops, release, selections=sels, selection_origin=origin, env=env,
                      explicit_fields=facts["explicit"], field_values=facts["values"],
                      user_env={n: env[n] for n in release.route_env_names() if n in env})
    # The knob rows (SGLang's own settings per op) are reported, not acted on: the
    # launch goes ahead whatever they resolve to, so neither does the plan stop on them.
    knob_ops = decide.knob_ops(release, facts["model"])
    try:
        kd = decide.decide_knobs(specs, knob_ops, release, selections=sels, selection_origin=origin,
                                 env=env, explicit_fields=facts["explicit"],
                                 field_values=facts["values"], assume_libs=args.assume_lib or None,
                                 libs=args.libs)
    except cd.Unsatisfiable as exc:
        kd = decide.KnobDecision((), tuple(specs), None, {}, (),
                                 (f"{', '.join(knob_ops)} (reported only, not decided): {exc}",))
    out.update(
        model={"architecture": facts["model"], "assumed": facts["assumed"],
               "kv_cache_dtype": facts["kv_cache_dtype"]},
        ops=list(ops), reason=reason, gpu_ids=ids,
        launch=[{"kind": s.setting.kind, "name": s.setting.name, "value": s.value,
                 "wants": s.setting.value, "action": s.action, "why": s.setting.why,
                 "devices": list(s.devices)}
                for s in d.settings],
        ranks=[_rank(i, g, spec, d, release, kd) for i, (g, spec) in enumerate(zip(ids, specs))],
        knob_ops=list(kd.ops),
        libraries=kd.plan.whose if kd.plan is not None else None,
        knobs=[{"kind": s.kind, "name": s.name, "ops": list(s.ops), "action": s.action,
                "user": s.user, "wants": {v: list(ds) for v, ds in s.wants.items()},
                "without": list(s.without), "why": s.why} for s in kd.settings],
        warnings=list(dict.fromkeys(list(d.warnings) + list(kd.warnings))))
    if facts["fields"] is not None:
        out["sglang_resolved"] = facts["fields"]
    _emit(args, out)
    return EXIT_OK


def _newest(k) -> str:
    # No SGLang here: plan with the knob map's newest tested release.
    from packaging.version import Version
    return str(max(Version(s.version) for r in k.releases for s in r.spec if s.operator in (">=", "==")))


def _rig_size(env):
    from . import rig
    found = rig.simulated_rig(env)
    return len(found) if found else None


def _devices(ids, env):
    import capdispatch as cd
    from capdispatch.capabilities import ProbeError

    from . import rig
    try:
        return rig.devices(ids, env=env, via="nvml")
    except ProbeError as exc:
        raise cd.BadInput(f"cannot read the launch's GPUs ({', '.join(f'cuda:{g}' for g in ids)}) "
                          f"without initialising CUDA: {getattr(exc, 'reason', exc)}; simulate them with --device "
                          f"sim:NAME[,sim:NAME...]") from None


def _rank(i, gpu_id, spec, d, release, kd=None) -> dict:
    from . import archfacts
    facts = archfacts.facts(spec, release.arch)
    platform = {f: facts[src] for f, src in release.arch["platform"].items() if f in PLATFORM_FACTS}
    ops = {}
    for op, row in d.choices.items():
        c = row[spec.id]
        res = c.resolution
        ops[op] = {"backend": c.backend, "routed": c.routed, "why": c.why,
                   "source": res.source if res else None,
                   "downgraded_from": res.downgraded_from if res else None}
    knob_ops = {}
    for op, row in (kd.choices if kd else {}).items():
        c = row[spec.id]
        res = c.resolution
        sets = c.knob.sets if c.knob else None
        knob_ops[op] = {"backend": c.backend, "sglang": [s.label for s in sets] if sets else None,
                        "why": c.why, "source": res.source, "downgraded_from": res.downgraded_from}
    return {"rank": i, "gpu_id": gpu_id, "device": spec.to_dict(), "ops": ops, "knob_ops": knob_ops,
            "arch": platform}


def _from_sglang(args, sglang_args, release, env) -> dict:
    """Run SGLang's own argument preparation and resolution, with the plugin's
    launch step, in this process (the environment it sets stays here)."""
    import capdispatch as cd
    from sglang.srt.arg_groups.overrides import resolution_result

    from . import launch, register
    argv = list(sglang_args)
    given = launch.cli_fields(argv)
    if args.tp is not None:
        if "tp_size" in given:
            from sglang.srt.server_args import prepare_server_args
            if prepare_server_args(argv).tp_size != args.tp:
                raise cd.BadInput(f"--tp {args.tp} disagrees with SGLang's --tp-size in the SGLang arguments")
        else:
            argv += ["--tp-size", str(args.tp)]
    if "log_level" not in given:
        argv += ["--log-level", "warning"]
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    logging.getLogger("capdispatch.sglang").setLevel(logging.ERROR)   # the plan says it all
    register()
    from sglang.srt.server_args import prepare_server_args
    try:
        sa = prepare_server_args(argv)
    except SystemExit as exc:
        raise cd.BadInput(f"SGLang rejected the arguments {' '.join(sglang_args)!r} "
                          f"(argparse exit {exc.code})") from None
    try:
        sa.resolve_once()
    except (cd.BadInput, cd.Unsatisfiable):
        raise
    except Exception as exc:
        raise cd.BadInput(f"SGLang's argument resolution failed: {type(exc).__name__}: {exc}") from None
    stash = getattr(sa, launch.STASH, None) or {}
    explicit = launch.explicit_fields(sa.launch_command)
    read = {f: resolution_result(sa, f) for f in explicit}
    names = {s.name for s in release.settings if s.kind == "field"} | {"kv_cache_dtype", "tp_size"}
    fields = {f: resolution_result(sa, f) for f in sorted(names)}
    fields.update({s.name: os.environ.get(s.name) for s in release.settings if s.kind == "env"})
    os.environ.clear()
    os.environ.update(before)
    dtype = resolution_result(sa, "kv_cache_dtype")
    return {"model": stash.get("model") or launch.model_arch(sa), "assumed": False,
            "kv_cache_dtype": dtype, "explicit": explicit, "values": read,
            "tp_size": resolution_result(sa, "tp_size"), "fields": fields,
            "cfg": {f: resolution_result(sa, f) for f in ("pp_size", "nnodes", "node_rank",
                                                          "base_gpu_id", "gpu_id_step", "dp_size")}
            | {"dp_attention": bool(resolution_result(sa, "enable_dp_attention"))
               or resolution_result(sa, "attn_dp_size") > 1}}


def _emit(args, out) -> None:
    if args.format == "json":
        print(json.dumps(out, indent=2, default=str))
    else:
        print(_text(out))


def _text(out) -> str:
    s = out["sglang"]
    head = f"SGLang {s['version']}"
    if not s["installed"]:
        head += " (not installed: planning with its knob map)"
    lines = [f"{head}; tested range {s['tested']}"]
    if not s["in_range"]:
        lines.append(out["note"])
        return "\n".join(lines)
    m = out["model"]
    lines.append(f"model: {m['architecture']}" + (" (assumed; pass `-- SGLANG ARGS` to plan a real launch)"
                                                   if m["assumed"] else "")
                 + f"; capdispatch ops: {', '.join(out['ops']) or 'none'} ({out['reason']})")
    lines.append(f"GPUs: {', '.join(f'cuda:{g}' for g in out['gpu_ids'])}")
    inv = out.get("libraries")
    if inv:
        lines.append(f"libraries for the {', '.join(out['knob_ops'])} decisions: {inv['whose']}"
                     + (f" (note: {inv['note']})" if inv.get("note") else ""))
    lines.append("")
    lines.append("launch (main process; every rank inherits it):")
    if not out["launch"]:
        lines.append("  nothing to set")
    for x in out["launch"]:
        label = f"{x['name']}={x['value']}" if x["kind"] == "field" else f"env {x['name']}={x['value']}"
        if x["action"] == "kept" and x["value"] == x["wants"]:
            lines.append(f"  kept  {label}  (set by the user; capdispatch wants the same)")
        elif x["action"] == "kept":
            lines.append(f"  kept  {label}  (set by the user; capdispatch wants {x['wants']} for "
                         f"{', '.join(x['devices'])}: {x['why']})")
        else:
            lines.append(f"  set   {label}  ({x['why']})")
    for r in out["ranks"]:
        dev = r["device"]
        how = "simulated" if dev["probe"] == "sim" else f"probed: {dev['probe']}"
        lines.append("")
        lines.append(f"rank {r['rank']}: cuda:{r['gpu_id']} {dev['name']}, cc {dev['cc']} ({how})")
        width = max((len(op) for op in r["ops"]), default=0)
        bwidth = max([10] + [len(c["backend"] or "-") for c in r["ops"].values()])
        for op, c in r["ops"].items():
            mark = "routed" if c["routed"] else "kept  "
            lines.append(f"  {op:<{width}}  {c['backend'] or '-':<{bwidth}}  {mark}  {c['why']}")
        # Knob rows of ops the launch does not decide (an op above already says what runs).
        kops = {op: c for op, c in r.get("knob_ops", {}).items() if op not in r["ops"]}
        kw = max([width] + [len(op) for op in kops])
        bw = max([bwidth] + [len(c["backend"]) for c in kops.values()])
        for op, c in kops.items():
            # sglang: SGLang runs this backend under the settings named; no-knob: it has none.
            mark = "sglang " if c["sglang"] else "no-knob"
            lines.append(f"  {op:<{kw}}  {c['backend']:<{bw}}  {mark}  {c['why']}")
        facts = " ".join(f"{k}={v}" for k, v in r["arch"].items())
        lines.append(f"  architecture facts set for this rank: {facts}")
    if out.get("knobs"):
        lines.append("")
        lines.append("SGLang settings for " + ", ".join(out["knob_ops"])
                     + " (reported, not set; SGLang takes one value per launch):")
        for x in out["knobs"]:
            label = x["name"] if x["kind"] == "field" else f"env {x['name']}"
            if x["action"] == "kept":
                head = f"kept   {label}={x['user']}  (set by the user)"
            elif x["action"] == "agree":
                head = f"agree  {label}={next(iter(x['wants']))}"
            elif x["action"] == "split":
                head = f"split  {label}"
            else:
                head = f"none   {label}"
            lines.append(f"  {head}  ({x['why']})")
    if out.get("sglang_resolved"):
        lines.append("")
        lines.append("SGLang resolved: " + ", ".join(f"{k}={v}" for k, v in out["sglang_resolved"].items()))
    if out["warnings"]:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  {w}" for w in out["warnings"]]
    return "\n".join(lines)

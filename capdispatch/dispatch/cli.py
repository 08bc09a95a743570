"""The `dispatch` command. Exit codes: 0 decided; 2 bad input; 3 unsatisfiable."""
from __future__ import annotations

import argparse
import json
import logging
import sys

EXIT_OK, EXIT_BAD_INPUT, EXIT_UNSAT = 0, 2, 3

# Subcommands that live with an adapter, named by module so that the core never
# imports an adapter: `dispatch NAME ARGS...` runs `MODULE.main(ARGS)`.
EXTENSIONS = {
    "sglang": ("capdispatch.adapters.sglang.cli", "what the SGLang adapter would set for a launch"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"dispatch: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dispatch", description="Which kernel runs each op on each GPU, and why.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def fmt(sp):
        sp.add_argument("--format", choices=("text", "json"), default="text")

    def probe_opts(sp):
        sp.add_argument("--probe", choices=("auto", "torch", "nvml"), default="auto",
                        help="how to read a cuda:N device (auto: NVML unless CUDA is already initialised)")
        sp.add_argument("--assume-cuda", metavar="VER",
                        help="CUDA toolkit version to assume for simulated devices")

    d = sub.add_parser("devices", help="the devices and their facts and features")
    d.add_argument("--device", action="append", default=[], metavar="DEV[,DEV...]")
    fmt(d); probe_opts(d)

    e = sub.add_parser("explain", help="decide every op for a group of devices, with the trace")
    e.add_argument("--device", action="append", default=[], metavar="DEV[,DEV...]",
                   help="cuda:N, cpu or sim:NAME; all given devices form one group "
                        "(default: every local CUDA device, else cpu)")
    e.add_argument("--op", action="append", default=[], metavar="OP")
    e.add_argument("--policy", action="append", default=[], metavar="FILE")
    e.add_argument("--set", action="append", default=[], metavar="OP=BACKEND", dest="set_")
    e.add_argument("--assume-lib", action="append", default=[], metavar="NAME[==VERSION]")
    e.add_argument("--strict", action="store_true",
                   help="an explicit choice that cannot run is an error (exit 3), not a downgrade")
    e.add_argument("--lock", metavar="FILE", help="compare with this lock file (default: $CAPDISPATCH_LOCK)")
    fmt(e); probe_opts(e)

    from . import lock_cmd
    lock_cmd.add_parser(sub)

    o = sub.add_parser("ops", help="the ops and their backends with what each needs")
    fmt(o)

    from . import verify_cmd
    verify_cmd.add_parser(sub)

    for name, (_, help_) in EXTENSIONS.items():
        x = sub.add_parser(name, help=help_, add_help=False)
        x.add_argument("rest", nargs=argparse.REMAINDER)

    from . import bench_cmd
    bench_cmd.add_parser(sub)

    pol = sub.add_parser("policy", help="check or show policy files")
    psub = pol.add_subparsers(dest="policy_cmd", required=True, parser_class=_Parser)
    v = psub.add_parser("validate", help="check policy files; exit 2 on the first error")
    v.add_argument("files", nargs="+", metavar="FILE")
    s = psub.add_parser("show", help="the merged policy, with where each value came from")
    s.add_argument("--policy", action="append", default=[], metavar="FILE")
    fmt(s)
    return p


def _devices_arg(values) -> list:
    return [x.strip() for v in values for x in v.split(",") if x.strip()]


def _setup_logging():
    log = logging.getLogger("capdispatch")
    if not any(getattr(h, "_capdispatch", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s capdispatch: %(message)s"))
        h._capdispatch = True
        log.addHandler(h)
        log.propagate = False
    log.setLevel(logging.INFO)


def main(argv=None) -> int:
    from ..capabilities import ProbeError, UnknownDeviceError
    from ..policies import PolicyError
    from .errors import BadInput, Unsatisfiable

    args = _parser().parse_args(argv)
    _setup_logging()
    try:
        return _run(args)
    except (BadInput, PolicyError, UnknownDeviceError, ProbeError) as exc:
        print(f"dispatch: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Unsatisfiable as exc:
        print(f"dispatch: unsatisfiable: {exc}", file=sys.stderr)
        return EXIT_UNSAT


def _emit(args, obj, text):
    if args.format == "json":
        print(json.dumps(obj, indent=2, sort_keys=False))
    else:
        print(text)


def _run(args) -> int:
    if args.cmd == "devices":
        return _cmd_devices(args)
    if args.cmd == "explain":
        return _cmd_explain(args)
    if args.cmd == "ops":
        return _cmd_ops(args)
    if args.cmd == "verify":
        from . import verify_cmd
        return verify_cmd.run(args)
    if args.cmd == "lock":
        from . import lock_cmd
        return lock_cmd.run(args)
    if args.cmd in EXTENSIONS:
        import importlib
        return importlib.import_module(EXTENSIONS[args.cmd][0]).main(args.rest)
    if args.cmd == "bench":
        from . import bench_cmd
        return bench_cmd.run(args)
    if args.cmd == "policy":
        return _cmd_policy_validate(args) if args.policy_cmd == "validate" else _cmd_policy_show(args)
    raise AssertionError(args.cmd)


def _specs(args):
    from ..capabilities import local_devices
    from .group import unique_ids
    from .resolver import as_spec
    devs = _devices_arg(args.device)
    if not devs:
        return local_devices(via=args.probe)
    return unique_ids([as_spec(d, via=args.probe, assume_cuda=args.assume_cuda) for d in devs])


def _cmd_devices(args) -> int:
    from ..capabilities import derive_features
    from .explain import _device_dict, device_line
    specs = _specs(args)
    text = []
    for d in specs:
        text.append(device_line(d))
        text.append(f"  features: {', '.join(sorted(derive_features(d))) or '(none)'}")
        for n in d.notes:
            text.append(f"  note: {n}")
    _emit(args, {"schema": 1, "devices": [
        {k: v for k, v in _device_dict(d, None).items() if k != "libraries"} for d in specs]},
        "\n".join(text))
    return EXIT_OK


def _cmd_explain(args) -> int:
    from .explain import plan, render_text
    specs = _specs(args)
    p = plan(specs, args.op or None, policy=args.policy or None, selections=args.set_ or None,
             assume_libs=args.assume_lib, strict=args.strict, selection_origin="--set")
    from .lock import check
    drifts = check(p, args.lock, strict=args.strict, partial=bool(args.op or args.device))
    obj = p.to_dict()
    obj["warnings"] += [str(d) for d in drifts]
    _emit(args, obj, render_text(p))
    return EXIT_OK


def _cmd_ops(args) -> int:
    from ..backends import builtin
    reg = builtin()
    rows, obj = [], {"schema": 1, "ops": {}}
    for op in reg.ops.values():
        rows.append(f"{op.name}: {op.signature}")
        rows.append(f"  {op.summary}")
        obj["ops"][op.name] = {"signature": op.signature, "summary": op.summary,
                               "reference": op.reference, "backends": []}
        for b in reg.backends(op.name):
            needs = [_describe_req(r) for r in b.requires]
            rows.append(f"  - {b.name}: {b.summary}")
            rows.append(f"      needs: {'; '.join(needs)}")
            obj["ops"][op.name]["backends"].append({"name": b.name, "summary": b.summary,
                                                    "impl": b.impl, "needs": needs})
    obj["plugins"] = [p.to_dict() for p in reg.plugins]
    for p in reg.plugins:
        rows.append(f"plugin {p.name} ({p.value}): " + (f"added {', '.join(p.backends)}" if p.ok
                                                        else f"SKIPPED: {p.message}"))
    _emit(args, obj, "\n".join(rows))
    return EXIT_OK


def _describe_req(r) -> str:
    from ..backends import base
    if isinstance(r, base.Feature):
        return f"feature {r.name}"
    if isinstance(r, base.AnyFeature):
        return "feature " + " or ".join(r.names)
    if isinstance(r, base.Library):
        return f"{r.dist}{r.spec}"
    if isinstance(r, base.ComputeCapability):
        return f"cc {r.spec}"
    if isinstance(r, base.TritonTarget):
        return f"Triton target (CUDA cc >= {r.min_cc}, or cpu with TRITON_INTERPRET=1)"
    if isinstance(r, base.Platform):
        return f"{r.kind} device"
    return repr(r)


def _cmd_policy_validate(args) -> int:
    from ..backends import builtin
    from ..policies import load_file
    from .resolver import known_device_names
    for f in args.files:
        load_file(f, builtin(), known_devices=known_device_names())
        print(f"{f}: ok")
    return EXIT_OK


def _op_obj(reg, op, pf, m) -> dict:
    key = reg.ops[op].size.key if reg.ops[op].size else None
    return {"backends": list(m.value), "from": f"{pf.path}:{m.line}",
            "buckets": [{key: f"<={b.upper}" if b.upper is not None else "any", "upper": b.upper,
                         "backends": list(b.backends), "from": f"{pf.path}:{b.line}"}
                        for b in m.buckets]}


def _op_lines(reg, op, pf, m, indent) -> list:
    if not m.buckets:
        return [f"{indent}{op}: [{', '.join(m.value)}]    # {pf.path}:{m.line}"]
    key = reg.ops[op].size.key
    out = [f"{indent}{op}:"]
    for b in m.buckets:
        bound = f"{key}: \"<={b.upper}\", " if b.upper is not None else ""
        out.append(f"{indent}  - {{{bound}prefer: [{', '.join(b.backends)}]}}    # {pf.path}:{b.line}")
    return out


def _cmd_policy_show(args) -> int:
    from ..backends import builtin
    from ..policies import build
    from .resolver import known_device_names
    reg = builtin()
    stack = build(reg, policy=args.policy or None, known_devices=known_device_names())
    obj = {"schema": 1, "settings": {}, "ops": {}, "devices": [], "selections": []}
    lines = []
    for key in ("mixed_group", "on_unsupported", "verify"):
        s = stack.setting(key)
        obj["settings"][key] = {"value": s.value, "from": s.origin}
        lines.append(f"{key}: {s.value}    # {s.origin}")
    lines.append("ops:")
    for op in reg.ops:
        for pf in reversed(stack.layers):
            if op in pf.ops:
                m = pf.ops[op]
                obj["ops"][op] = _op_obj(reg, op, pf, m)
                lines += _op_lines(reg, op, pf, m, "  ")
                break
    entries = [(pf, e) for pf in stack.layers for e in pf.devices]
    if entries:
        lines.append("devices:    # later entries win")
    for pf, e in entries:
        obj["devices"].append({"match": e.match, "from": f"{pf.path}:{e.line}",
                               "ops": {op: list(m.value) for op, m in e.ops.items()},
                               "buckets": {op: _op_obj(reg, op, pf, m)["buckets"]
                                           for op, m in e.ops.items() if m.buckets}})
        lines.append(f"  - match: {e.match}    # {pf.path}:{e.line}")
        for op, m in e.ops.items():
            lines += _op_lines(reg, op, pf, m, "      ")
    for s in stack.selections:
        obj["selections"].append({"op": s.op, "backend": s.backend, "from": s.origin})
        lines.append(f"selection: {s.op}={s.backend}    # {s.origin}")
    _emit(args, obj, "\n".join(lines))
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())

# PYTHON_ARGCOMPLETE_OK
"""The `dispatch` command. Exit codes: errors.ExitCode, the one table."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from . import command
from .errors import ExitCode
from .options import LAYOUT, Parser, check_layout, version

# Subcommands that live with an adapter, named by module so that the core never
# imports an adapter: `dispatch NAME ARGS...` runs `MODULE.main(ARGS)`.
EXTENSIONS = {
    "sglang": ("capdispatch.adapters.sglang.cli", "what the SGLang adapter would set for a launch"),
}

# Subcommands in their own modules (capdispatch/dispatch/NAME_cmd.py, imported in _parser):
# each has add_parser(subparsers) and run(args) -> int, and imports nothing of this module.

EPILOG = """\
examples:
  dispatch explain --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 --brief
  dispatch explain --device sim:rtx-5090,sim:h200 --libs sglang-0.5.23
  dispatch devices                      this machine's GPUs (NVML: CUDA stays uninitialised)
  dispatch catalog                      the GPUs that sim:NAME can simulate
  dispatch env                          a report to paste into a bug report
  dispatch model deepseek-v4-flash --tp 8   a model's facts and one rank's shapes
  dispatch checkpoint --model deepseek-v4-flash --layers 2 --out ./ckpt   random weights SGLang loads
  dispatch sglang plan --device sim:rtx-5090,sim:rtx-3080 --libs sglang-0.5.23

exit codes (every command; docs/cli.md#exit-codes): 0 decided; 2 bad input (unknown
device, op, backend, library, bad policy file); 3 unsatisfiable (under --strict an
explicit choice that cannot run, no runnable backend, a mixed_group: error divergence);
4 a check failed (bench); 1 only a bug in capdispatch; 130 interrupted.
shell completion: eval "$(register-python-argcomplete dispatch)" (pip install 'capdispatch[completion]')
"""

EXPLAIN_EPILOG = """\
examples:
  dispatch explain --device sim:rtx-3080 --op kv_dequant
      one op on one card: triton_u8, and why not triton_fp8 (fp8 needs cc 8.9)
  dispatch explain --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080
      a mixed rig: the op x device matrix, then each op's trace
  dispatch explain --device sim:rtx-5090,sim:rtx-3080 --mixed-group uniform --brief
      one kernel on every card of the group, matrix only
  dispatch explain --device sim:rtx-5090,sim:h200,sim:rtx-3080 --libs sglang-0.5.23
      plan for a machine with SGLang 0.5.23's libraries, not this one's
  dispatch explain --device sim:rtx-3080 --set kv_dequant=triton_fp8 --strict
      an explicit choice that cannot run: exit 3 with the reason
  dispatch explain --device sim:h200 --libs sglang-0.5.23 --model deepseek-v4-pro --tp 16 --dp-attention
      with a model and layout: each kernel's shape ranges checked at the rank's shapes

matrix marks: * fallback (the first preference cannot run), ! downgraded (an explicit
choice cannot run), = changed by mixed_group: uniform, and an op whose devices differ
is flagged. Colour on a terminal; plain when piped or NO_COLOR is set.
"""

DEVICES_EPILOG = """\
examples:
  dispatch devices                                 every local GPU (NVML), else cpu and why
  dispatch devices --probe nvml                    NVML only: exit 2, with the reason, if it cannot
  dispatch devices --device sim:rtx-5090,sim:h200 --format json
"""


def _parser() -> argparse.ArgumentParser:
    from . import (bench_cmd, catalog_cmd, checkpoint_cmd, env_cmd, lock_cmd, model_cmd, plan_cmd,
                   rehearse_cmd, verify_cmd)
    from .options import add
    p = Parser(prog="dispatch", description="Which kernel runs each op on each GPU, and why.",
               epilog=EPILOG)
    p.add_argument("-V", "--version", action="version", version=f"capdispatch {version()}",
                   help="print capdispatch's version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    d = sub.add_parser("devices", help="the devices and their facts and features",
                       description="The devices and their facts, features and how they were read.",
                       epilog=DEVICES_EPILOG)
    add(d, "device")
    add(d, "format", "probe", "assume_cuda", "libs", "assume_lib")

    e = sub.add_parser("explain", help="decide every op for a group of devices, with the trace",
                       description="Decide every op for a group of devices: the op x device matrix, "
                                   "then each op's trace (every candidate, every check).",
                       epilog=EXPLAIN_EPILOG)
    add(e, "device", help="the group's devices")
    add(e, "op", "policy", "set", "assume_lib", "libs")
    e.add_argument("--mixed-group", choices=("allow", "warn", "uniform", "error"),
                   help="what a group whose devices choose different backends does, above every "
                        "policy file: allow, warn (default), uniform (one kernel every device can "
                        "run), error (exit 3)")
    add(e, "strict")
    add(e, "brief", help="the op x device matrix, without the traces")
    e.add_argument("-v", "--verbose", action="store_true",
                   help="with --brief, every mixed-group warning in full, not one summary line")
    add(e, "lock")
    add(e, "model", help="the model whose rank shapes under --tp/--ep are checked against the "
        "kernels' shape ranges")
    add(e, "tp", default=None, unset="one rank per device, as dispatch plan")
    add(e, *LAYOUT[2:])
    add(e, "format", "probe", "assume_cuda")

    o = sub.add_parser("ops", help="the ops and their backends with what each needs",
                       description="The ops and their backends in the built-in policy's order, with what each needs.",
                       epilog="examples:\n  dispatch ops\n  dispatch ops --format json\n"
                              "  dispatch explain --op kv_dequant --device sim:rtx-3080   (an op from the list)\n")
    add(o, "format")

    for name, (module, help_) in EXTENSIONS.items():
        # `dispatch NAME ...` goes straight to the extension's own parser (see main); for
        # completion, the extension's commands are mirrored here.
        ext = sub.add_parser(name, help=help_ + f" (`dispatch {name} --help`)", add_help=False)
        if "_ARGCOMPLETE" in os.environ:
            importlib.import_module(module).add_commands(ext)

    for m in (bench_cmd, catalog_cmd, checkpoint_cmd, env_cmd, lock_cmd, model_cmd, plan_cmd, rehearse_cmd,
              verify_cmd):
        m.add_parser(sub).set_defaults(run=m.run)

    pol = sub.add_parser("policy", help="check or show policy files",
                         description="Check or show policy files.",
                         epilog="examples:\n  dispatch policy validate my-rig.yaml\n"
                                "  dispatch policy show --policy my-rig.yaml\n")
    psub = pol.add_subparsers(dest="policy_cmd", required=True)
    v = psub.add_parser("validate", help="check policy files; exit 2 on the first error",
                        epilog="examples:\n  dispatch policy validate my-rig.yaml\n"
                               "  dispatch policy validate a.yaml b.yaml    each file alone\n")
    v.add_argument("files", nargs="+", metavar="FILE", help="policy files to check")
    s = psub.add_parser("show", help="the merged policy, with where each value came from",
                        epilog="examples:\n  dispatch policy show\n"
                               "  dispatch policy show --policy my-rig.yaml --format json\n")
    add(s, "policy", "format")
    return p


def main(argv=None) -> int:
    command.safe_streams()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in EXTENSIONS:
        # The extension's main runs under the same handler (command.run), as its own prog.
        return importlib.import_module(EXTENSIONS[argv[0]][0]).main(argv[1:])
    parser = _parser()
    if "_ARGCOMPLETE" in os.environ:
        from . import completion
        completion.autocomplete(parser)
    if not argv:      # `dispatch` alone: what it does and how, not only "arguments are required"
        parser.print_help()
        return ExitCode.BAD_INPUT
    return command.run("dispatch", parser, argv, _run)


def _emit(args, obj, text):
    if args.format == "json":
        print(json.dumps(obj, indent=2, sort_keys=False))
    else:
        print(text)


def _run(args) -> int:
    if getattr(args, "run", None) is not None:
        return args.run(args)
    if args.cmd == "devices":
        return _cmd_devices(args)
    if args.cmd == "explain":
        return _cmd_explain(args)
    if args.cmd == "ops":
        return _cmd_ops(args)
    if args.cmd == "policy":
        return _cmd_policy_validate(args) if args.policy_cmd == "validate" else _cmd_policy_show(args)
    raise AssertionError(args.cmd)


def _specs(args):
    from ..capabilities import local_devices
    from .group import device_specs
    specs = device_specs(args.device, "--device", via=args.probe, assume_cuda=args.assume_cuda)
    return specs or local_devices(via=args.probe)


def _cmd_devices(args) -> int:
    from ..backends import builtin
    from ..capabilities import Inventory, derive_features
    from ..capabilities.lib_profiles import target_libs
    from .explain import device_dict, device_line, libraries_lines, whose_dict
    from .render import wrap
    from .resolver import library_modules, library_names
    specs = _specs(args)
    text = []
    for d in specs:
        text += wrap(device_line(d), "")
        text += wrap(f"features: {', '.join(sorted(derive_features(d))) or '(none)'}", "  ")
        for n in d.notes:
            text += wrap(f"note: {n}", "  ")
    inv = Inventory.with_assumptions(args.assume_lib, libs=target_libs(specs, args.libs, args.assume_lib),
                                     known=library_modules(builtin()))
    inventory = whose_dict(specs, inv, sorted(library_names(builtin())))
    text += libraries_lines(inventory["versions"], inventory)
    _emit(args, {"schema": 1, "devices": [
        {k: v for k, v in device_dict(d, None).items() if k != "libraries"} for d in specs],
        "inventory": inventory}, "\n".join(text))
    return ExitCode.OK


def _cmd_explain(args) -> int:
    from ..backends import builtin
    from .explain import plan, render_text
    from .inputs import op_list
    ops = op_list(args.op, "--op", builtin())
    from .model_cmd import shapes_from_args
    from .rigplan import group_tp
    check_layout(args)
    specs = _specs(args)
    # The group's ranks are its devices, as `dispatch plan` counts them (one device with --tp N: N such cards).
    _, shapes = shapes_from_args(args, tp=group_tp(args.tp, len(specs)))
    p = plan(specs, ops or None, policy=args.policy or None, shapes=shapes,
             selections=args.set_ or None, assume_libs=args.assume_lib, strict=args.strict,
             selection_origin="--set", libs=args.libs,
             settings={"mixed_group": args.mixed_group} if args.mixed_group else None,
             settings_origin="--mixed-group", log_warnings=False)
    from .lock import check
    drifts = check(p, args.lock, strict=args.strict, partial=bool(args.op or args.device))
    obj = p.to_dict()
    obj["warnings"] += [str(d) for d in drifts]
    if args.format == "json":
        _emit(args, obj, "")
    else:
        print(render_text(p, brief=args.brief, summarised=args.brief and not args.verbose), flush=True)
    # After the output, so that on a terminal the matrix is the first screen.
    from .notices import log_plan
    log_plan(p, brief=args.brief and not args.verbose)
    return ExitCode.OK


def _cmd_ops(args) -> int:
    from ..backends import builtin
    from ..policies import default_order, load_default
    reg = builtin()
    default = load_default(reg)
    rows, obj = [], {"schema": 1, "ops": {}}
    from .render import wrap
    for op in reg.ops.values():
        rows += wrap(f"{op.name}: {op.signature}", "", hang="    ")
        rows += wrap(op.summary, "  ")
        obj["ops"][op.name] = {"signature": op.signature, "summary": op.summary,
                               "reference": op.reference, "backends": []}
        for b in (reg.backend(op.name, n) for n in default_order(default, reg, op.name)):
            needs = [_describe_req(r) for r in b.requires]
            rows += wrap(f"- {b.name}: {b.summary}", "  ")
            rows += wrap(f"needs: {'; '.join(needs)}", "      ")
            obj["ops"][op.name]["backends"].append({"name": b.name, "summary": b.summary,
                                                    "impl": b.impl, "needs": needs})
    obj["plugins"] = [p.to_dict() for p in reg.plugins]
    for p in reg.plugins:
        rows.append(f"plugin {p.name} ({p.value}): " + (f"added {', '.join(p.backends)}" if p.ok
                                                        else f"SKIPPED: {p.message}"))
    _emit(args, obj, "\n".join(rows))
    return ExitCode.OK


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
    if isinstance(r, base.ShapeRange):
        return f"shape {r.need}"
    return repr(r)


def _cmd_policy_validate(args) -> int:
    from ..backends import builtin
    from ..policies import load_file
    from .resolver import known_device_names
    for f in args.files:
        pf = load_file(f, builtin(), known_devices=known_device_names())
        print(f"{pf.path}: ok")
    return ExitCode.OK


def _cmd_policy_show(args) -> int:
    from ..backends import builtin
    from ..policies import build
    from ..policies.show import merged
    from .resolver import known_device_names
    reg = builtin()
    stack = build(reg, policy=args.policy or None, known_devices=known_device_names())
    obj, text = merged(stack, reg)
    _emit(args, obj, text)
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())

# PYTHON_ARGCOMPLETE_OK
"""The `dispatch` command. Exit codes: 0 decided; 2 bad input; 3 unsatisfiable."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

EXIT_OK, EXIT_BAD_INPUT, EXIT_UNSAT = 0, 2, 3

# Subcommands that live with an adapter, named by module so that the core never
# imports an adapter: `dispatch NAME ARGS...` runs `MODULE.main(ARGS)`.
EXTENSIONS = {
    "sglang": ("capdispatch.adapters.sglang.cli", "what the SGLang adapter would set for a launch"),
}

# Subcommands in their own modules (capdispatch/dispatch/NAME.py): each has
# add_parser(subparsers) and run(args) -> int.
COMMANDS = ("bench_cmd", "catalog_cmd", "env_cmd", "lock_cmd", "model_cmd", "plan_cmd", "rehearse_cmd", "verify_cmd")

EPILOG = """\
examples:
  dispatch explain --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 --assume-lib triton --brief
  dispatch explain --device sim:rtx-5090,sim:h200 --libs sglang-0.5.23
  dispatch devices                      this machine's GPUs (NVML: CUDA stays uninitialised)
  dispatch catalog                      the GPUs that sim:NAME can simulate
  dispatch env                          a report to paste into a bug report
  dispatch model deepseek-v4-flash --tp 8   a model's facts and one rank's shapes
  dispatch sglang plan --device sim:rtx-5090,sim:rtx-3080 --libs sglang-0.5.23

exit codes: 0 decided; 2 bad input (unknown device, op, backend, library, bad policy
file); 3 unsatisfiable (under --strict an explicit choice that cannot run, no runnable
backend, a mixed_group: error divergence).
shell completion: eval "$(register-python-argcomplete dispatch)" (pip install 'capdispatch[completion]')
"""

EXPLAIN_EPILOG = """\
examples:
  dispatch explain --device sim:rtx-3080 --assume-lib triton --op kv_dequant
      one op on one card: triton_u8, and why not triton_fp8 (fp8 needs cc 8.9)
  dispatch explain --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 --assume-lib triton
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


class _Parser(argparse.ArgumentParser):
    def __init__(self, *a, **kw):
        # Raw: the epilogs' examples keep their lines; a one-line description is filled here.
        kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        desc = kw.get("description")
        if desc and "\n" not in desc:
            import textwrap
            kw["description"] = textwrap.fill(desc, 88)
        super().__init__(*a, **kw)

    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"dispatch: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def version() -> str:
    """capdispatch's version: the installed distribution's, else the package's own."""
    from importlib import metadata
    try:
        return metadata.version("capdispatch")
    except metadata.PackageNotFoundError:
        from .. import __version__
        return __version__


DEVICE_HELP = ("cuda:N, cpu or sim:NAME (NAME from `dispatch catalog`, or sm_86, sm_90, ...); "
               "repeat the flag or use commas; all given devices form one group")


def _parser() -> argparse.ArgumentParser:
    from . import completion
    p = _Parser(prog="dispatch", description="Which kernel runs each op on each GPU, and why.",
                epilog=EPILOG)
    p.add_argument("-V", "--version", action="version", version=f"capdispatch {version()}",
                   help="print capdispatch's version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="COMMAND")

    def fmt(sp):
        sp.add_argument("--format", choices=("text", "json"), default="text",
                        help="text for people (default) or JSON for programs")

    def probe_opts(sp):
        sp.add_argument("--probe", choices=("auto", "torch", "nvml"), default="auto",
                        help="how to read a cuda:N device (auto: NVML unless CUDA is already "
                             "initialised; nvml / torch: only that way, exit 2 if it cannot)")
        sp.add_argument("--assume-cuda", metavar="VER",
                        help="CUDA toolkit version to assume for simulated devices, e.g. 12.8")

    d = sub.add_parser("devices", help="the devices and their facts and features",
                       description="The devices and their facts, features and how they were read.",
                       epilog=DEVICES_EPILOG)
    completion.devices(d.add_argument("--device", action="append", default=[], metavar="DEV[,DEV...]",
                                      help=DEVICE_HELP + " (default: every local CUDA device, else cpu)"))
    fmt(d); probe_opts(d)

    e = sub.add_parser("explain", help="decide every op for a group of devices, with the trace",
                       description="Decide every op for a group of devices: the op x device matrix, "
                                   "then each op's trace (every candidate, every check).",
                       epilog=EXPLAIN_EPILOG)
    completion.devices(e.add_argument("--device", action="append", default=[], metavar="DEV[,DEV...]",
                                      help=DEVICE_HELP + " (default: every local CUDA device, else cpu)"))
    completion.ops(e.add_argument("--op", action="append", default=[], metavar="OP[,OP...]",
                                  help="decide only these ops (default: all; `dispatch ops` lists them)"))
    e.add_argument("--policy", action="append", default=[], metavar="FILE",
                   help="a policy file, layered above the built-in default and $CAPDISPATCH_POLICY; "
                        "repeat for more (later wins)")
    completion.selections(e.add_argument(
        "--set", action="append", default=[], metavar="OP=BACKEND", dest="set_",
        help="an explicit choice, above every policy (commas for several)"))
    completion.libraries(e.add_argument(
        "--assume-lib", action="append", default=[], metavar="NAME[==VERSION]",
        help="treat a library as installed on the target (at VERSION), e.g. triton or "
             "flashinfer-python==0.7.2; an unknown name is refused"))
    completion.profiles(e.add_argument(
        "--libs", metavar="PROFILE",
        help="the target's whole library inventory from a profile (e.g. sglang-0.5.23: the "
             "versions SGLang 0.5.23 installs) instead of this machine's; --assume-lib adds to it; "
             "`local`: this machine's. Default: the default profile when every device is "
             "simulated and no --assume-lib is given, else this machine's"))
    e.add_argument("--mixed-group", choices=("allow", "warn", "uniform", "error"),
                   help="what a group whose devices choose different backends does, above every "
                        "policy file: allow, warn (default), uniform (one kernel every device can "
                        "run), error (exit 3)")
    e.add_argument("--strict", action="store_true",
                   help="an explicit choice that cannot run is an error (exit 3), not a downgrade")
    e.add_argument("--brief", action="store_true",
                   help="print the op x device matrix only, without the traces")
    e.add_argument("--lock", metavar="FILE", help="compare with this lock file (default: $CAPDISPATCH_LOCK)")
    from .model_cmd import add_layout_options
    add_layout_options(e)   # --model and a layout: kernels' shape ranges are checked per rank
    fmt(e); probe_opts(e)

    o = sub.add_parser("ops", help="the ops and their backends with what each needs",
                       description="The ops and their backends in the built-in policy's order, with what each needs.",
                       epilog="examples:\n  dispatch ops\n  dispatch ops --format json\n"
                              "  dispatch explain --op kv_dequant --device sim:rtx-3080   (an op from the list)\n")
    fmt(o)

    for name, (module, help_) in EXTENSIONS.items():
        # `dispatch NAME ...` goes straight to the extension's own parser (see main); for
        # completion, the extension's commands are mirrored here.
        ext = sub.add_parser(name, help=help_ + f" (`dispatch {name} --help`)", add_help=False)
        if "_ARGCOMPLETE" in os.environ:
            importlib.import_module(module).add_commands(ext)

    for mod in COMMANDS:
        m = importlib.import_module(f"{__package__}.{mod}")
        m.add_parser(sub).set_defaults(run=m.run)

    pol = sub.add_parser("policy", help="check or show policy files",
                         description="Check or show policy files.",
                         epilog="examples:\n  dispatch policy validate my-rig.yaml\n"
                                "  dispatch policy show --policy my-rig.yaml\n")
    psub = pol.add_subparsers(dest="policy_cmd", required=True, parser_class=_Parser)
    v = psub.add_parser("validate", help="check policy files; exit 2 on the first error",
                        epilog="examples:\n  dispatch policy validate my-rig.yaml\n"
                               "  dispatch policy validate a.yaml b.yaml    each file alone\n")
    v.add_argument("files", nargs="+", metavar="FILE", help="policy files to check")
    s = psub.add_parser("show", help="the merged policy, with where each value came from",
                        epilog="examples:\n  dispatch policy show\n"
                               "  dispatch policy show --policy my-rig.yaml --format json\n")
    s.add_argument("--policy", action="append", default=[], metavar="FILE",
                   help="a policy file to layer above the default; repeat for more")
    fmt(s)
    return p


def _devices_arg(values, source: str = "--device") -> list:
    from .inputs import device_list
    return device_list(values, source)


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record is emitted, not as it was when the
    handler was made (main() may run many times in one process, stderr replaced between)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _setup_logging():
    log = logging.getLogger("capdispatch")
    if not any(getattr(h, "_capdispatch", False) for h in log.handlers):
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(levelname)s capdispatch: %(message)s"))
        h._capdispatch = True
        log.addHandler(h)
        log.propagate = False
    log.setLevel(logging.INFO)


def _safe_streams():
    # A character the output's encoding lacks (PYTHONIOENCODING=ascii) is escaped, not a crash.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass


def main(argv=None) -> int:
    from .errors import run_guarded

    _safe_streams()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in EXTENSIONS:
        import importlib
        return importlib.import_module(EXTENSIONS[argv[0]][0]).main(argv[1:])
    parser = _parser()
    if "_ARGCOMPLETE" in os.environ:
        from . import completion
        completion.autocomplete(parser)
    if not argv:      # `dispatch` alone: what it does and how, not only "arguments are required"
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:    # --help, or a usage error already printed: return its code
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    _setup_logging()
    return run_guarded("dispatch", lambda: _run(args))


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
    from .inputs import device_specs
    specs = device_specs(args.device, "--device", via=args.probe, assume_cuda=args.assume_cuda)
    return specs or local_devices(via=args.probe)


def _cmd_devices(args) -> int:
    from ..backends import builtin
    from ..capabilities import Inventory, derive_features
    from .explain import device_dict, device_line, libraries_lines
    from .render import wrap
    from .resolver import library_names
    specs = _specs(args)
    text = []
    for d in specs:
        text += wrap(device_line(d), "")
        text += wrap(f"features: {', '.join(sorted(derive_features(d))) or '(none)'}", "  ")
        for n in d.notes:
            text += wrap(f"note: {n}", "  ")
    inv = Inventory()
    inventory = inv.to_dict(sorted(library_names(builtin())))
    text += libraries_lines(inventory["versions"], inventory)
    _emit(args, {"schema": 1, "devices": [
        {k: v for k, v in device_dict(d, None).items() if k != "libraries"} for d in specs],
        "inventory": inventory}, "\n".join(text))
    return EXIT_OK


def _cmd_explain(args) -> int:
    from ..backends import builtin
    from .errors import BadInput
    from .explain import plan, render_text, target_libs
    from .inputs import op_list
    ops = op_list(args.op, "--op", builtin())
    from .model_cmd import shapes_from_args
    _, shapes = shapes_from_args(args)
    if shapes is None and (args.tp != 1 or args.ep != 1 or args.dp_attention or args.next_n is not None):
        raise BadInput("--tp/--ep/--dp-attention/--next-n describe a model's layout: give --model "
                       "NAME|PATH with them (`dispatch model` lists the built-ins)")
    specs = _specs(args)
    p = plan(specs, ops or None, policy=args.policy or None, shapes=shapes,
             selections=args.set_ or None, assume_libs=args.assume_lib, strict=args.strict,
             selection_origin="--set", libs=target_libs(specs, args.libs, args.assume_lib),
             settings={"mixed_group": args.mixed_group} if args.mixed_group else None,
             settings_origin="--mixed-group", log_warnings=False)
    from .lock import check
    drifts = check(p, args.lock, strict=args.strict, partial=bool(args.op or args.device))
    obj = p.to_dict()
    obj["warnings"] += [str(d) for d in drifts]
    if args.format == "json":
        _emit(args, obj, "")
    else:
        print(render_text(p, brief=args.brief), flush=True)
    # After the output, so that on a terminal the matrix is the first screen.
    for w in p.warnings:
        logging.getLogger("capdispatch").warning(w)
    return EXIT_OK


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
    return EXIT_OK


def _cmd_policy_show(args) -> int:
    from ..backends import builtin
    from ..policies import build
    from ..policies.show import merged
    from .resolver import known_device_names
    reg = builtin()
    stack = build(reg, policy=args.policy or None, known_devices=known_device_names())
    obj, text = merged(stack, reg)
    _emit(args, obj, text)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())

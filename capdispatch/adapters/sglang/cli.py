"""`dispatch sglang plan`: the argparse front. What the SGLang adapter would set
for a launch, per rank, without launching (plan.build decides, render.text
writes). Exit codes: 0 decided; 2 bad input; 3 unsatisfiable."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

EXIT_OK, EXIT_BAD_INPUT, EXIT_UNSAT = 0, 2, 3
PROG = "dispatch sglang"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def _parser():
    p = _Parser(prog=PROG, description="What capdispatch's SGLang plugin does for a launch.",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="examples:\n"
                       "  dispatch sglang plan --device sim:rtx-5090,sim:rtx-3080 --tp 2\n"
                       "  dispatch sglang plan -- --model-path deepseek-ai/DeepSeek-V4-Flash --tp 2\n")
    add_commands(p)
    return p


def add_commands(p):
    """The subcommands of `dispatch sglang` on parser P (`dispatch` mirrors them for completion)."""
    import capdispatch as cd
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    plan = sub.add_parser(
        "plan", help="what the plugin would set for a launch, per rank, without launching",
        usage=f"{PROG} plan [--tp N] [--device DEV[,DEV...]] [options] [-- SGLANG ARGS...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Everything after `--` is passed to SGLang's own argument parsing and "
                    "resolution (as `python -m sglang.launch_server` would get it); without it, "
                    "a DeepSeek-V4 launch with SGLang's defaults is assumed.",
        epilog="examples:\n"
               "  dispatch sglang plan --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 --tp 3\n"
               "  dispatch sglang plan --device sim:h200 --libs sglang-0.5.23 --brief\n"
               "  dispatch sglang plan --tp 2 -- --model-path deepseek-ai/DeepSeek-V4-Flash\n")
    plan.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size (SGLang's --tp-size)")
    cd.complete_devices(plan.add_argument(
        "--device", action="append", default=[], metavar="DEV[,DEV...]",
        help="the node's GPUs as CUDA numbers them (entry N is cuda:N): cuda:N or "
             "sim:NAME, e.g. sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 (default: "
             "$CAPDISPATCH_SGLANG_DEVICES, else the local GPUs via NVML)"))
    plan.add_argument("--policy", action="append", default=[], metavar="FILE",
                      help="a capdispatch policy file, as the plugin's CAPDISPATCH_POLICY; repeat for more")
    cd.complete_selections(plan.add_argument(
        "--set", action="append", default=[], metavar="OP=BACKEND", dest="set_",
        help="an explicit capdispatch choice, as CAPDISPATCH_SET (commas for several)"))
    plan.add_argument("--strict", action="store_true",
                      help="an explicit choice that cannot run is an error (exit 3)")
    cd.complete_libraries(plan.add_argument(
        "--assume-lib", action="append", default=[], metavar="NAME[==VERSION]",
        help="treat a library as installed when deciding the attention and MoE ops "
             "(e.g. flashinfer-python, sgl-flash-mla)"))
    cd.complete_profiles(plan.add_argument(
        "--libs", metavar="PROFILE",
        help="the target's whole library inventory from a profile (e.g. "
             "sglang-0.5.23: the versions SGLang 0.5.23 installs) instead of this "
             "machine's; --assume-lib adds to it; `local`: this machine's (default: "
             "the default profile when every device is simulated and no "
             "--assume-lib is given)"))
    plan.add_argument("--model", metavar="NAME|PATH",
                      help="a built-in model (`dispatch model` lists them) or a config.json: each "
                           "rank's shapes under --tp/--ep are checked against the kernels' shape "
                           "ranges (a layout SGLang would refuse is an error naming the layouts "
                           "that would work)")
    plan.add_argument("--ep", type=int, default=1, metavar="N",
                      help="expert-parallel size with --model, as SGLang's --ep (default 1)")
    plan.add_argument("--dp-attention", action="store_true",
                      help="with --model: attention data parallel over all --tp ranks")
    plan.add_argument("--next-n", type=int, metavar="N",
                      help="with --model: query tokens per request per decode step (default 1 + MTP)")
    plan.add_argument("--brief", action="store_true",
                      help="print the op x rank matrix alone")
    plan.add_argument("--format", choices=("text", "json"), default="text",
                      help="text for people (default) or JSON for programs")
    return sub


def main(argv=None) -> int:
    import capdispatch as cd
    argv = list(sys.argv[1:] if argv is None else argv)
    sglang_args = None
    if "--" in argv:
        i = argv.index("--")
        argv, sglang_args = argv[:i], argv[i + 1:]
    args = _parser().parse_args(argv)
    try:
        return _plan(args, sglang_args)
    except cd.Unsatisfiable as exc:
        print(f"{PROG}: unsatisfiable: {exc}", file=sys.stderr)
        return EXIT_UNSAT
    except cd.CapdispatchError as exc:   # bad input of any kind (KnobsError included)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _env_for(args) -> dict:
    """This process's environment plus the capdispatch flags a launch reads from
    it (--strict, --device); --policy, --set, --assume-lib and --libs travel as
    records.PlanOptions, so every part of the plan gets them the same way and an
    error names the flag, not a variable. --device is read as `dispatch explain`
    reads it, and each device is checked here so that an unknown one names --device."""
    import capdispatch as cd
    env = dict(os.environ)
    if args.strict:
        env["CAPDISPATCH_STRICT"] = "1"
    devices = cd.device_list(args.device, "--device")
    for dev in devices:
        if re.fullmatch(r"cuda:\d+", dev, re.ASCII):
            continue        # a real GPU is read by the launch's own probe (NVML)
        try:
            cd.probe(dev)
        except cd.UnknownDeviceError as exc:
            raise cd.BadInput(f"--device: {exc}") from None
    if devices:
        from .gpus import SIM_ENV
        env[SIM_ENV] = ",".join(devices)
    return env


def _plan(args, sglang_args) -> int:
    import capdispatch as cd
    from . import plan, render
    from .records import PlanOptions
    cd.env_flag(os.environ, "CAPDISPATCH_DEBUG")   # read as `dispatch` reads it
    options = PlanOptions(selections=tuple(args.set_), selection_origin="--set",
                          policy=tuple(args.policy), assume_libs=tuple(args.assume_lib),
                          strict=args.strict, libs=args.libs)
    if args.model is None and (args.ep != 1 or args.dp_attention or args.next_n is not None):
        import capdispatch as cd
        raise cd.BadInput("--ep/--dp-attention/--next-n describe a model's layout: give --model "
                          "NAME|PATH with them (`dispatch model` lists the built-ins)")
    model = None
    if args.model is not None:
        model = {"name": args.model, "ep": args.ep, "dp_attention": args.dp_attention,
                 "next_n": args.next_n}
    out = plan.build(tp=args.tp, sglang_args=sglang_args, options=options, env=_env_for(args),
                     model=model)
    if args.format == "json":
        print(json.dumps(out.to_dict(), indent=2, default=str))
    else:
        print(render.text(out, brief=args.brief))
    return EXIT_OK

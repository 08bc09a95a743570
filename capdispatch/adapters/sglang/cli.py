"""`dispatch sglang plan`: the argparse front. What the SGLang adapter would set
for a launch, per rank, without launching (plan.build decides, render.text
writes). Exit codes: cd.ExitCode, as every capdispatch command."""
from __future__ import annotations

import json
import os
import re
import sys

PROG = "dispatch sglang"


def _parser():
    import capdispatch as cd
    from capdispatch import extend
    p = extend.options.Parser(prog=PROG, description="What capdispatch's SGLang plugin does for a launch.",
                         epilog="examples:\n"
                                "  dispatch sglang plan --device sim:rtx-5090,sim:rtx-3080 --tp 2\n"
                                "  dispatch sglang plan -- --model-path deepseek-ai/DeepSeek-V4-Flash --tp 2\n")
    add_commands(p)
    return p


def add_commands(p):
    """The subcommands of `dispatch sglang` on parser P (`dispatch` mirrors them for completion).
    Every option is one of capdispatch's shared ones (extend.options.add)."""
    import capdispatch as cd
    from capdispatch import extend
    add = extend.options.add
    sub = p.add_subparsers(dest="cmd", required=True)
    plan = sub.add_parser(
        "plan", help="what the plugin would set for a launch, per rank, without launching",
        usage=f"{PROG} plan [--tp N] [--device DEV[,DEV...]] [options] [-- SGLANG ARGS...]",
        description="Everything after `--` is passed to SGLang's own argument parsing and "
                    "resolution (as `python -m sglang.launch_server` would get it); without it, "
                    "a DeepSeek-V4 launch with SGLang's defaults is assumed.",
        epilog="examples:\n"
               "  dispatch sglang plan --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 --tp 3\n"
               "  dispatch sglang plan --device sim:h200 --libs sglang-0.5.23 --brief\n"
               "  dispatch sglang plan --tp 2 -- --model-path deepseek-ai/DeepSeek-V4-Flash\n")
    add(plan, "tp", default=None, unset="SGLang's --tp-size after `--`; without `--`, one rank "
        "per simulated device, else 1")
    add(plan, "device", help="the node's GPUs as CUDA numbers them (entry N is cuda:N; one "
        "simulated device with --tp N stands for N such cards)",
        unset="$CAPDISPATCH_SGLANG_DEVICES, else the local GPUs via NVML")
    add(plan, "policy", "set", "strict", "assume_lib", "libs")
    add(plan, "model", help="the model whose rank shapes under --tp/--ep are checked against the "
        "kernels' shape ranges (a layout SGLang would refuse is an error naming the layouts that "
        "would work)")
    add(plan, *LAYOUT_WITHOUT_TP)
    add(plan, "brief", help="the op x rank matrix and the warnings, the mixed-group divergences as one line")
    add(plan, "format")
    return sub


# The model's layout but --tp, which is the launch's own (SGLang's --tp-size).
LAYOUT_WITHOUT_TP = ("ep", "dp_attention", "next_n")


def main(argv=None) -> int:
    """`dispatch sglang ...`: under capdispatch's one command handler (a CapdispatchError
    is one line and exit 2 or 3, never a traceback)."""
    import capdispatch as cd
    from capdispatch import extend
    argv = list(sys.argv[1:] if argv is None else argv)
    sglang_args = None
    if "--" in argv:
        i = argv.index("--")
        argv, sglang_args = argv[:i], argv[i + 1:]
    return extend.command.run(PROG, _parser(), argv, lambda args: _plan(args, sglang_args))


def _env_for(args) -> dict:
    """This process's environment plus the capdispatch flags a launch reads from
    it (--strict, --device); --policy, --set, --assume-lib and --libs travel as
    records.PlanOptions, so every part of the plan gets them the same way and an
    error names the flag, not a variable. --device is read as `dispatch explain`
    reads it, and each device is checked here so that an unknown one names --device."""
    import capdispatch as cd
    from capdispatch import extend
    env = dict(os.environ)
    if args.strict:
        env["CAPDISPATCH_STRICT"] = "1"
    devices = extend.device_list(args.device, "--device")
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
    from capdispatch import extend
    from . import plan, render
    from .records import PlanOptions
    options = PlanOptions(selections=tuple(args.set_), selection_origin="--set",
                          policy=tuple(args.policy), assume_libs=tuple(args.assume_lib),
                          strict=args.strict, libs=args.libs)
    extend.options.check_layout(args, LAYOUT_WITHOUT_TP)
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
    return cd.ExitCode.OK

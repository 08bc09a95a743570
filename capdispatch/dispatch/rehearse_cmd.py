"""`dispatch rehearse`: one process per rank, each running its own decisions on a small
model with the target model's layer structure and per-rank shapes, with the group's
all-reduces, against a single-process reference of the same model. Exit codes: 0 the group
matched the reference; 2 bad input (device, layout the model cannot take, sizes); 3 a rank
failed, hung or differed."""
from __future__ import annotations

import argparse
import json

EPILOG = """\
examples:
  dispatch rehearse --device emu:rtx-5090@cpu,emu:rtx-3080@cpu --model deepseek-v4-flash
      the mixed rig's cards (an RTX 5090 beside two RTX 3080s), two ranks, on this CPU: each rank's decisions, what ran, the check
  dispatch rehearse --device emu:rtx-5090@cpu,emu:rtx-3080@cpu,emu:rtx-3080@cpu --model ./config.json
      three ranks of a model whose heads divide over 3
  dispatch rehearse --device cuda:0,cuda:1 --model deepseek-v4-flash --layers 4 --format json
  dispatch rehearse --engine sglang --model ./v4-flash-4l --device cuda:0 --out ./engine-run
      SGLang itself on a `dispatch checkpoint` folder, with the plugin and without: tokens, memory, TPOT

devices: cpu, cuda:N, or emu:NAME@DEV: decide as the catalog card NAME, run on DEV (cpu or
cuda:N; on cuda:N under the card's launch tables, shared memory, SM count, fp8 support and
memory); a kernel the card chose that cannot run on DEV is replaced by the card's next
runnable preference and marked. One device with --tp N stands for N ranks on it.
The verdict is recorded for SGLang launches on the same cards, software and decisions
(CAPDISPATCH_REQUIRE_REHEARSAL=1 there requires a passed one).
--engine sglang: SGLang's launcher on the checkpoint folder, plugin on then off, the same greedy
requests; after -- come SGLang's own arguments (docs/rehearse.md, Engine rehearsal). There
emu:NAME@cuda:N decides as the card inside SGLang, its routes' kernels on cuda:N.
exit codes: 0 every rank matched the reference (engine: the plugin-off run); 2 bad input; 3 a rank
failed, hung or differed.
"""

SMALL = {"layers": 2, "hidden": 256, "vocab": 512, "intermediate": 64, "prompt": 8, "steps": 3,
         "timeout": 60.0, "start_timeout": 120.0, "ep": 1}
ENGINE = {"prompt": 256, "steps": 16, "timeout": 120.0, "start_timeout": 1800.0}
# The small model's flags, refused with --engine sglang (the checkpoint fixes what they size).
SMALL_ONLY = ("layers", "hidden", "vocab", "experts", "intermediate", "ep", "libs")


def add_parser(sub):
    from .options import add
    p = sub.add_parser("rehearse", help="run the group's chosen kernels together on a small model, "
                                        "against a reference",
                       description="One process per rank, each running its own decisions on a small model "
                                   "with the target model's layer structure and per-rank shapes, with the "
                                   "group's all-reduces, against a single-process reference.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import completion
    completion.rehearse_devices(p.add_argument(
        "--device", action="append", default=[], metavar="DEV[,DEV...]", required=True,
        help="one device per rank, in rank order: cpu, cuda:N or emu:NAME@DEV"))
    p.add_argument("--engine", choices=("capdispatch", "sglang"), default="capdispatch",
                   help="capdispatch: its own small model of the target's structure (default); sglang: SGLang's "
                        "launcher on a checkpoint folder, with the plugin and without")
    add(p, "model", required=True, help="with --engine sglang, a checkpoint folder (`dispatch checkpoint`)")
    add(p, "tp", default=None, unset="one rank per device")
    add(p, "ep", default=None)
    add(p, "dp_attention", help="each rank serves its own sequence with the whole attention; the MoE runs "
        "over every rank's rows, gathered")
    p.add_argument("--layers", type=int, default=None, metavar="N", help="layers of the small model (default 2)")
    p.add_argument("--hidden", type=int, default=None, metavar="N", help="its hidden size (default 256)")
    p.add_argument("--vocab", type=int, default=None, metavar="N", help="its vocabulary (default 512)")
    p.add_argument("--experts", type=int, default=None, metavar="N",
                   help="its routed experts in all, split by --ep (default: the smallest count from "
                        f"{MIN_EXPERTS} up that --ep divides: {MIN_EXPERTS}, or 9 for --ep 3)")
    p.add_argument("--intermediate", type=int, default=None, metavar="N",
                   help="each expert's intermediate size per rank (default 64)")
    p.add_argument("--prompt", type=int, default=None, metavar="TOKENS",
                   help="prefill tokens (default 8; --engine sglang: 256 per request)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="decode steps, at least 1: decode_mla and the indexer run only there (default 3; "
                        "--engine sglang: output tokens per request, at least 2, default 16)")
    p.add_argument("--requests", type=int, default=None, metavar="N",
                   help="--engine sglang: greedy requests, one at a time (default 4)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="weights, tokens and routes (default 0; --engine sglang: the prompts "
                        "and SGLang's random seed)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds a rank may go without progress (an op or all-reduce beginning), and "
                        "each all-reduce may wait; then every rank still running is killed (default 60; "
                        "--engine sglang: seconds each request may take, default 120)")
    p.add_argument("--start-timeout", type=float, default=None, metavar="S",
                   help="seconds a rank may take to start: imports, device, joining (default 120; "
                        "--engine sglang: until SGLang answers /health, default 1800)")
    p.add_argument("--port", type=int, default=None, metavar="P",
                   help="--engine sglang: SGLang's HTTP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="--engine sglang: also write the report (text and JSON), SGLang's logs and the "
                        "rank reports into DIR")
    p.add_argument("--off-from", default=None, metavar="FILE",
                   help="--engine sglang: compare against the plugin-off run of an earlier rehearsal's "
                        "engine-rehearsal.json instead of starting one; refused unless it was the same "
                        "launch (SGLang, its arguments, the checkpoint's files, the requests, the environment "
                        "but capdispatch's variables, the cards)")
    add(p, "libs", help="what the ranks decide for (kernels run with this machine's libraries; a "
        "chosen kernel missing here is a marked substitution)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", default=None,
                   help="run every call eagerly on CUDA ranks (default: decode steps' calls replayed from "
                        "CUDA graphs within SGLang's capture bound, as served)")
    add(p, "format")
    p.add_argument("sglang_args", nargs="*", metavar="-- SGLANG ARGS",
                   help="--engine sglang: arguments for SGLang's launcher, after --")
    return p


def run(args) -> int:
    if args.engine == "sglang":
        return run_engine(args)
    from .errors import BadInput
    for flag in ("requests", "port", "out", "off_from"):
        if getattr(args, flag) is not None:
            raise BadInput(f"--{flag.replace('_', '-')} is for --engine sglang (the small model takes none)")
    if args.sglang_args:
        raise BadInput(f"{' '.join(args.sglang_args)}: arguments after -- go to SGLang, with --engine sglang")
    for k, v in SMALL.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.graphs is None:
        args.graphs = True
    from ..rehearse import devices, runner
    from .errors import ExitCode
    from .inputs import needs_torch
    devs = devices.parse_list(args.device)
    if len(devs) == 1 and args.tp is not None and args.tp > 1:
        devs = devs * args.tp
    needs_torch("dispatch rehearse runs the group's kernels")
    runner.check_before_start(devs, args.libs)
    inventory = planned(devs, args.libs).whose
    from .progress import RanksWatch
    r = runner.rehearse(devs, args.model, tp=args.tp, ep=args.ep, layers=args.layers, hidden=args.hidden,
                        vocab=args.vocab, experts=default_experts(args.ep) if args.experts is None else args.experts,
                        intermediate=args.intermediate,
                        prompt=args.prompt, steps=args.steps, seed=args.seed, timeout=args.timeout,
                        libs=args.libs, start_timeout=args.start_timeout, graphs=args.graphs,
                        dp_attention=args.dp_attention, on_progress=RanksWatch(args.steps))
    if args.format == "json":
        print(json.dumps(dict(r.to_dict(), inventory=inventory), indent=2))
    else:
        print(render(r, inventory))
    return ExitCode.OK if r.ok else ExitCode.UNSATISFIABLE


def run_engine(args) -> int:
    """`--engine sglang`: rehearse/engine/runner.py."""

    from ..rehearse.engine import render, runner
    from .errors import BadInput, ExitCode
    for k in SMALL_ONLY:
        if getattr(args, k) is not None:
            raise BadInput(f"--{k.replace('_', '-')} sizes the small model; --engine sglang serves the "
                           f"checkpoint as it is (SGLang's own flags go after --)")
    if args.dp_attention or args.graphs is False:
        flag = "--dp-attention" if args.dp_attention else "--no-graphs"
        raise BadInput(f"{flag} is the small model's; with --engine sglang give SGLang's own flag after --")
    for k, v in ENGINE.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    r = runner.rehearse(args.model, args.device, tp=args.tp, prompt=args.prompt, steps=args.steps,
                        requests=4 if args.requests is None else args.requests, seed=args.seed,
                        timeout=args.timeout, start_timeout=args.start_timeout, port=args.port, out=args.out,
                        sglang_args=args.sglang_args, off_from=args.off_from, say=runner.stderr_say)
    print(json.dumps(r.to_dict(), indent=2) if args.format == "json" else render.render(r))
    return ExitCode.OK if r.ok else ExitCode.UNSATISFIABLE


MIN_EXPERTS = 8


def default_experts(ep) -> int:
    """The small model's experts when --experts is not given: the smallest count >= MIN_EXPERTS
    that EP divides, so that every --ep has a layout (an explicit count EP does not divide is
    refused)."""
    ep = ep or 1
    return -(-MIN_EXPERTS // ep) * ep


def planned(devs, libs=None, shapes=None):
    """The group decision every rank of DEVS (rehearse.devices.RankDevice...) makes, made here
    without starting a rank: each rank probes the card it decides as (an emulated one under
    its emu: id) and agrees on cd.plan of them all (rehearse/rank.py), with LIBS by the one
    rule of whose libraries (cd.target_libs)."""
    import capdispatch as cd
    specs = [cd.probe(d.decide).with_id(d.text) if d.emulated else cd.probe(d.decide) for d in devs]
    return cd.plan(specs, libs=libs, shapes=shapes, log_warnings=False)


def render(r, inventory=None) -> str:
    """R (runner.Rehearsal) for people; INVENTORY: whose libraries the ranks decided with."""
    from .explain import whose_lines
    d = r.dims
    dp = ", dp-attention" if r.dp_attention else ""
    lines = [f"rehearsal of {r.model}: tp {r.tp}, ep {r.ep}{dp}, {r.backend}; small model: {d['layers']} layers, "
             f"hidden {d['hidden']}, vocab {d['vocab']}, {d['heads']} heads/rank x 512, "
             f"{d['experts']}/{d['experts_total']} experts/rank (topk {d['topk']}, intermediate "
             f"{d['intermediate']}/rank); prefill + {r.steps} decode steps; {r.wall_s:.1f} s"]
    lines += (whose_lines(inventory) if inventory else []) + [""]
    subs, notes = [], {}
    for k in r.ranks:
        err = "-" if k.max_rel_err is None else f"{k.max_rel_err:.1e}"
        lines.append(f"rank {k.rank}  {k.device}  ({'ok' if k.ok else 'FAILED'}; logits rel err {err})")
        if k.facts.get("emulated"):
            lines.append("  " + facts_line(k.facts))
        if k.graphs and k.run != "cpu":
            lines.append(f"  graphs: {k.graphs}")
        for o in k.ops:
            mark = "*" if o.substituted else " "
            check = "-" if o.ok is None else ("ok" if o.ok else "DIFFERS")
            graphed = f" ({o.graphed} graphed)" if o.graphed else ""
            lines.append(f"  {o.op:<15} {o.decided:<24}{mark} ran {str(o.ran):<14} {o.calls:>3} calls{graphed} "
                         f"{o.time_s * 1e3:>8.1f} ms  {check}")
            if o.substituted:
                subs.append((o.op, o.substituted, k.rank))
            if o.ok is False:
                lines.append(f"    {o.detail}")
            if o.not_emulated:
                notes.setdefault((o.ran, o.not_emulated), []).append(str(k.rank))
        if k.error:
            lines.append(f"  error: {k.error}")
    lines.append("")
    if subs:
        lines.append("* substituted (the decided kernel cannot run where the rank runs):")
        seen = {}
        for op, why, rank in subs:          # one line per op and reason, naming its ranks
            seen.setdefault((op, why), []).append(str(rank))
        for (op, why), ranks in seen.items():
            lines.append(f"  {op} (rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}): {why}")
        lines.append("")
    if notes:
        lines.append("not emulated (the emulated cards' limits a kernel that ran does not take):")
        for (ran, what), ranks in notes.items():
            lines.append(f"  {ran} (rank{'s' if len(ranks) > 1 else ''} {', '.join(dict.fromkeys(ranks))}): {what}")
        lines.append("")
    cpu = [str(k.rank) for k in r.ranks if k.run == "cpu"]
    if cpu:
        lines.append(f"CUDA graphs: none on the CPU (rank{'s' if len(cpu) > 1 else ''} {', '.join(cpu)}): "
                     f"every call eager")
    for op, why in r.not_called.items():
        lines.append(f"not rehearsed: {op}: {why}")
    if r.reference:
        lines.append(f"no comparison: {r.reference}")
    if r.recorded:
        lines.append(f"verdict recorded for these cards, software and decisions: {r.recorded}")
    if r.cause:
        lines.append(f"first failure: {r.cause}")
    verdict = "PASSED" if r.ok else "FAILED"
    lines.append(f"{verdict}: each call checked against its op's reference on the same inputs; the group's "
                 f"logits against a single-process reference (relative error <= {r.tolerance:.0e} per step)")
    return "\n".join(lines)


def facts_line(f: dict) -> str:
    """One line: the emulated card's facts the rank's kernels launched by."""
    if f.get("note"):
        return f"as {f['card']}: {f['note']}"
    smem = f"{f['smem_optin_per_block'] // 1024} KB smem" if f.get("smem_optin_per_block") else "smem ?"
    mem = f"memory capped at {f['memory_cap'] / 2 ** 30:.0f} GiB" if f.get("memory_cap") else "memory not capped"
    text = (f"as {f['card']} on {f['device']}: launch tables of cc {f['cc']}, {smem}, {f['sm_count']} SMs, "
            f"{'fp8' if f['fp8'] else 'no fp8 (uint8 decode)'}, {mem}")
    launches = f.get("launches")
    if launches:
        fit = [x["shared"] for x in launches if x["fits"] and x["shared"] is not None]
        over = sum(1 for x in launches if not x["fits"])
        text += (f"; {len(launches)} Triton kernel configurations checked against its shared memory"
                 + (f" (largest admitted {max(fit) / 1024:.0f} KB)" if fit else "")
                 + (f", {over} over it moved to a smaller tile" if over else ""))
    return text

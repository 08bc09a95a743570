"""`dispatch bench`: time every runnable backend of each op over a ladder of sizes on one
device and, with --write-policy, write the device-scoped size-bucketed policy that picks
the fastest (the measured times as comments)."""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys

EXIT_OK, EXIT_BAD_INPUT, EXIT_CHECK_FAILED = 0, 2, 1


def add_parser(subparsers):
    from . import completion
    b = subparsers.add_parser(
        "bench", help="time the runnable backends over a size ladder; write a calibrated policy",
        description="Time every runnable backend of each op over a ladder of sizes on one device "
                    "(needs torch); with --write-policy, write the size-bucketed policy that picks "
                    "the fastest per size.",
        epilog="examples:\n"
               "  dispatch bench --device cuda:0 --op kv_dequant\n"
               "  dispatch bench --device cuda:0 --write-policy my-card.yaml\n"
               "  dispatch bench --device cpu --op moe --sizes 1,16,256 --format json\n")
    completion.devices(b.add_argument(
        "--device", default=None, metavar="DEV",
        help="cuda:N or cpu (default: cuda:0 when a CUDA device is visible, else cpu)"))
    completion.ops(b.add_argument("--op", action="append", default=[], metavar="OP[,OP...]",
                                  help="the ops to time (repeat the flag or use commas; default: all)"))
    b.add_argument("--sizes", default=None, metavar="N,N,...",
                   help="sizes of the ops' leading dimension (default: each op's ladder)")
    b.add_argument("--write-policy", default=None, metavar="FILE",
                   help="write (or update) the calibrated policy for this card there")
    b.add_argument("--noise", type=float, default=5.0, metavar="PCT",
                   help="a backend replaces the one FILE already names for a size only when faster "
                        "by more than PCT percent (default 5)")
    b.add_argument("--profile", choices=("full", "small"), default=None,
                   help="problem dimensions besides the size: DeepSeek-V4's (full; the default on CUDA) "
                        "or small ones for the CPU (the default there)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    b.add_argument("--warmup", type=float, default=25.0, help="CUDA: do_bench warm-up, ms")
    b.add_argument("--rep", type=float, default=100.0, help="CUDA: do_bench measuring time, ms")
    b.add_argument("--format", choices=("text", "json"), default="text",
                   help="text for people (default) or JSON for programs")
    return b


def run(args, *, timer=None) -> int:
    """TIMER: `timer(fn, graph) -> ms` in place of the device's own (tests inject one)."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        from .errors import BadInput
        raise BadInput("dispatch bench times kernels, which need torch: torch is not installed "
                       "(pip install 'capdispatch[torch]', or your own CUDA build of torch)")
    from ..calibrate import choose, ladder, measure, timing, writer
    from ..policies import PolicyError, load_file
    from .binding import bind
    from .errors import BadInput
    from .resolver import as_spec, context, evaluate, known_device_names, order

    if not 0 <= args.noise < 100:
        raise BadInput(f"--noise: {args.noise!r} is not a percentage (valid: 0 <= PCT < 100)")
    from .inputs import device_list
    if args.device is not None:
        devs = device_list(args.device, "--device")
        if len(devs) != 1:
            raise BadInput(f"--device {args.device!r}: bench times one device (valid: cuda:N or cpu)")
    device = devs[0] if args.device is not None else _default_device()
    spec = as_spec(device)
    if spec.simulated:
        raise BadInput(f"--device {device}: a simulated device cannot be timed (valid: cuda:N, cpu)")
    ctx = context()
    from .inputs import op_list
    ops = op_list(args.op, "--op", ctx.registry) or list(ctx.registry.ops)
    try:
        sizes = ladder.parse_sizes(args.sizes) if args.sizes else None
    except ladder.SizesError as exc:
        raise BadInput(str(exc)) from None
    profile_name = args.profile or ("full" if spec.platform == "cuda" else "small")
    profile = ladder.PROFILES[profile_name]
    if timer is None:
        timer = timing.cuda_timer(args.warmup, args.rep) if spec.platform == "cuda" else timing.cpu_timer()

    known = known_device_names()
    match = writer.device_match(spec, known)
    previous, kept_ops = {}, {}
    if args.write_policy and os.path.exists(args.write_policy):
        pf = load_file(args.write_policy, ctx.registry, known_devices=known)
        previous, others, mine = writer.incumbents(pf, match)
        if others:
            raise BadInput(f"{args.write_policy}: holds a calibration for another card "
                           f"({others[0].describe()}, line {others[0].line}); this run is for "
                           f"{', '.join(f'{k} {v}' for k, v in match.items())}: write to another file")
        if pf.ops:
            raise BadInput(f"{args.write_policy}: has top-level ops; a calibrated policy holds one "
                           f"devices: entry only: write to another file")
        if mine is not None:
            with open(args.write_policy, encoding="utf-8") as fh:
                blocks = writer.op_blocks(fh.read())
            kept_ops = {op: blocks.get(op, m) for op, m in mine.ops.items() if op not in ops}

    import torch
    dev = spec.id.split("#")[0] if spec.platform == "cuda" else "cpu"
    if spec.platform == "cuda":
        torch.cuda.set_device(torch.device(dev))
    gen = torch.Generator(device=dev).manual_seed(args.seed)

    plan = []
    excluded = {}
    for op in ops:
        _, names = order(ctx, op, spec)
        cands = evaluate(ctx, op, spec, names, ())
        fns, skipped = {}, {}
        for c in cands:
            if not c.ok:
                skipped[c.backend] = "; ".join(ch.message or ch.code for ch in c.checks if not ch.ok)
                continue
            fns[c.backend] = bind(op, dev, backend=c.backend)
        plan.append((op, fns, skipped, sizes or ladder.DEFAULT_SIZES[op]))

    total = sum(len(f) * len(s) for _, f, _, s in plan)
    results = {}
    with _progress(total) as step:
        for op, fns, skipped, op_sizes in plan:
            rows = measure.measure(op, op_sizes, fns, device=dev, platform=spec.platform,
                                   profile=profile, gen=gen, timer=timer, step=step)
            results[op] = (rows, skipped)

    noise = args.noise / 100.0
    per_op, obj_ops, failed = {}, {}, False
    for op, (rows, skipped) in results.items():
        key = ctx.registry.ops[op].size.key
        by_size = measure.times_by_size(rows)
        bad = {r.backend: f"{key} {r.size}: {r.detail}" for r in rows if not r.ok}
        failed |= bool(bad)
        if any(not t for t in by_size.values()):
            raise_at = next(s for s, t in by_size.items() if not t)
            print(f"dispatch: error: {op} at {key} {raise_at}: no backend passed its check", file=sys.stderr)
            return EXIT_CHECK_FAILED
        incumbent = previous.get(op, lambda s: None)
        other_layout = {}
        layouts = ctx.registry.ops[op].layouts
        if layouts:   # one call site holds one input layout: the catch-all's (the largest size's)
            top = max(by_size)
            need = layouts.get(choose.choose({top: by_size[top]}, noise, incumbent)[0].winner)
            for size, t in by_size.items():
                for b in [b for b in t if layouts.get(b) != need]:
                    del t[b]
                    other_layout.setdefault(b, f"its inputs are in layout {layouts.get(b)}, the "
                                               f"catch-all's in {need}: one call site holds one layout")
        choices = choose.choose(by_size, noise, incumbent)
        runs = choose.merge(choices)
        per_op[op] = runs
        excluded[op] = {b: f"left out at {why}" for b, why in bad.items()}
        excluded[op].update(other_layout)
        excluded[op].update({b: f"cannot run here: {why}" for b, why in skipped.items()})
        obj_ops[op] = {"key": key, "skipped": skipped,
                       "rows": [r.to_dict() for r in rows],
                       "buckets": [{key: f"<={r.upper}" if r.upper is not None else "any",
                                    "upper": r.upper, "prefer": list(r.order)} for r in runs]}

    header = _header(spec, timer, args.noise, profile_name)
    text = writer.render_policy(match, per_op, key_of=lambda o: ctx.registry.ops[o].size.key,
                                header=header, kept_ops=kept_ops, excluded=excluded,
                                graphed={op: {r.size for r in rows if r.graph}
                                         for op, (rows, _) in results.items()})
    if args.write_policy:
        try:
            with open(args.write_policy, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            raise BadInput(f"--write-policy {args.write_policy}: cannot write: {exc.strerror}") from None
        try:   # what was written must load like any policy
            load_file(args.write_policy, ctx.registry, known_devices=known)
        except PolicyError as exc:
            raise AssertionError(f"dispatch bench wrote a policy the loader refuses: {exc}") from exc

    if args.format == "json":
        print(json.dumps({"schema": 1, "device": {"id": spec.id, "name": spec.name, "cc": spec.cc_str},
                          "match": match, "noise_pct": args.noise, "profile": profile_name,
                          "timer": timer_description(timer), "ops": obj_ops,
                          "policy": args.write_policy}, indent=2))
    else:
        print(_table(results, per_op, ctx))
        if args.write_policy:
            print(f"\nwrote {args.write_policy}")
        else:
            print("\n" + text)
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def _default_device() -> str:
    from ..capabilities import local_devices
    devs = local_devices()
    cuda = [d for d in devs if d.platform == "cuda"]
    return cuda[0].id if cuda else "cpu"


def timer_description(timer) -> str:
    return getattr(timer, "describe", "an injected timer")


def _header(spec, timer, noise, profile) -> list:
    import platform as _pf

    from ..calibrate import writer
    from .. import __version__
    from ..capabilities import Inventory
    inv = Inventory.with_assumptions(None)
    libs = ", ".join(f"{d} {inv.get(d).describe()}" for d in ("torch", "triton"))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    card = spec.name if spec.platform == "cuda" else f"the CPU ({spec.name})"
    cc = f" (cc {spec.cc_str})" if spec.cc_str else ""
    return [f"{writer.MARK[2:]} on {card}{cc}, {stamp}.",
            f"capdispatch {__version__}, Python {_pf.python_version()}, {libs}; profile {profile}.",
            f"Timer: {timer_description(timer)}.",
            f"Noise band {noise:g}%: re-running keeps a size's backend unless another is faster "
            f"by more than the band.",
            "Each bucket takes the sizes above the previous bound; a size between two measured "
            "ones goes with the larger.", ""]


def _table(results, per_op, ctx) -> str:
    from ..calibrate.writer import fmt_ms
    out = []
    for op, (rows, skipped) in results.items():
        key = ctx.registry.ops[op].size.key
        names = list(dict.fromkeys(r.backend for r in rows))
        winners = {c.size: c.winner for run in per_op[op] for c in run.choices}
        out.append(f"{op} (by {key})")
        head = [key, "graph"] + names + ["chosen"]
        body = []
        for size in sorted({r.size for r in rows}):
            cells = {r.backend: (fmt_ms(r.ms) if r.ms is not None else "FAILED") for r in rows if r.size == size}
            g = any(r.graph for r in rows if r.size == size)
            body.append([str(size), "yes" if g else "no"] + [cells.get(n, "") for n in names]
                        + [winners.get(size, "")])
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        out.append("  " + "  ".join(h.rjust(w) for h, w in zip(head, widths)))
        out += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in body]
        for r in rows:
            if not r.ok:
                out.append(f"  {r.backend} at {key} {r.size}: left out: {r.detail}")
        for b, why in skipped.items():
            out.append(f"  {b}: not runnable here: {why}")
        buckets = "; ".join((f"<={r.upper}" if r.upper is not None else "rest") + f": {r.winner}"
                            for r in per_op[op])
        out.append(f"  buckets: {buckets}")
        out.append("")
    return "\n".join(out).rstrip()


class _progress:
    """A rich progress bar on stderr when stderr is a terminal; otherwise nothing."""

    def __init__(self, total):
        self.total, self._p = total, None

    def __enter__(self):
        if not sys.stderr.isatty():
            return lambda text: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
        self._p = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)
        self._p.__enter__()
        task = self._p.add_task("dispatch bench", total=self.total)
        return lambda text: self._p.update(task, advance=1, description=f"dispatch bench: {text}")

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)
        return False

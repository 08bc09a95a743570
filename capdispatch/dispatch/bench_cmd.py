"""`dispatch bench`: time every runnable backend of each op over a ladder of sizes on one
device, in the served form (calibrate/served.py), and, with --write-policy, write the
device-scoped size-bucketed policy that picks the fastest (the measured times as comments);
with --check POLICY, the regret of policies: per op and size the backend each picks against
the fastest, exit 4 above --threshold."""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys

from .errors import ExitCode
DEFAULT_THRESHOLD = 1.05


def add_parser(subparsers):
    from .options import LAYOUT, add
    b = subparsers.add_parser(
        "bench", help="time the runnable backends over a size ladder; write a calibrated policy",
        description="Time every runnable backend of each op over a ladder of sizes on one device "
                    "(needs torch); with --write-policy, write the size-bucketed policy that picks "
                    "the fastest per size.",
        epilog="examples:\n"
               "  dispatch bench --device cuda:0 --op kv_dequant\n"
               "  dispatch bench --device cuda:0 --write-policy my-card.yaml\n"
               "  dispatch bench --device cpu --op moe --sizes 1,16,256 --format json\n")
    add(b, "device", help="the one device to time, not simulated", repeat=False,
        unset="cuda:0 when a CUDA device is visible, else cpu")
    add(b, "op")
    b.add_argument("--sizes", default=None, metavar="N,N,...",
                   help="sizes of the ops' leading dimension (default: each op's ladder)")
    b.add_argument("--write-policy", default=None, metavar="FILE",
                   help="write (or update) the calibrated policy for this card there: a regular "
                        "file, replaced atomically (- : standard output)")
    b.add_argument("--noise", type=float, default=5.0, metavar="PCT",
                   help="a backend replaces the one FILE already names for a size only when faster "
                        "by more than PCT percent (default 5)")
    b.add_argument("--profile", choices=("full", "small"), default=None,
                   help="problem dimensions besides the size: DeepSeek-V4's (full; the default on CUDA) "
                        "or small ones for the CPU (the default there)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    b.add_argument("--warmup", type=float, default=25.0, help="CUDA: do_bench warm-up, ms")
    b.add_argument("--rep", type=float, default=100.0, help="CUDA: do_bench measuring time, ms")
    add(b, "format")
    s = b.add_argument_group("served shapes and form (--model: time at one rank's shapes of a model; "
                             "without it DeepSeek-V4's at 64 heads and 64 experts per rank)")
    add(s, *LAYOUT)
    s.add_argument("--layers", type=int, default=None, metavar="N",
                   help="layers of one forward the per-batch work is shared by (default: the model's, else 1)")
    s.add_argument("--cuda-graph-max-bs", type=int, default=None, metavar="N",
                   help="decode batches SGLang replays from CUDA graphs (default: SGLang's for this card's "
                        "memory and --tp)")
    c = b.add_argument_group("regret check")
    c.add_argument("--check", action="append", default=[], metavar="POLICY",
                   help="report, per op and size, the backend POLICY picks against the fastest measured "
                        "(repeatable; 'default' is the built-in policy); exit 4 above --threshold")
    c.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, metavar="X",
                   help=f"the largest picked / fastest ratio --check accepts (default {DEFAULT_THRESHOLD})")
    return b


def run(args, *, timer=None) -> int:
    """TIMER: `timer(fn, graph) -> ms` in place of the device's own (tests inject one)."""
    import importlib.util
    import math
    if importlib.util.find_spec("torch") is None:
        from .errors import BadInput
        raise BadInput("dispatch bench times kernels, which need torch: torch is not installed "
                       "(pip install 'capdispatch[torch]', or your own CUDA build of torch)")
    from ..calibrate import choose, ladder, measure, served, timing, writer
    from ..policies import PolicyError, load_file
    from .binding import bind
    from .errors import BadInput
    from .resolver import as_spec, context, evaluate, known_device_names, order

    if not 0 <= args.noise < 100:
        raise BadInput(f"--noise: {args.noise!r} is not a percentage (valid: 0 <= PCT < 100)")
    for flag, value, low in (("--warmup", args.warmup, 0.0), ("--rep", args.rep, None)):
        if not (value == value and value != float("inf") and (value >= low if low is not None else value > 0)
                and value <= 60_000):
            raise BadInput(f"{flag}: {value!r} is not a time in ms (valid: "
                           f"{'0' if low is not None else 'more than 0'} to 60000)")
    if not (math.isfinite(args.threshold) and args.threshold >= 1.0):
        raise BadInput(f"--threshold: {args.threshold!r} is not a ratio (valid: a number >= 1, e.g. 1.05)")
    for flag, value, low in (("--layers", args.layers, 1), ("--cuda-graph-max-bs", args.cuda_graph_max_bs, 0)):
        if value is not None and value < low:
            raise BadInput(f"{flag}: {value} is out of range (valid: a whole number >= {low})")
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
    # What an op must declare to be timed, checked before anything runs: an op named by
    # --op is refused without it; with no --op, it is left out and said so.
    ladders, named = {}, bool(args.op)
    for op in list(ops):
        from ..calibrate.inputs import undeclared
        why = undeclared(ctx.registry.ops[op], sizes is not None)
        if why and named:
            raise BadInput(f"--op {op}: {why}")
        if why:
            print(f"dispatch bench: {op} left out: {why}", file=sys.stderr)
            ops.remove(op)
            continue
        ladders[op] = sizes or ctx.registry.ops[op].sizes
    for op in ops if sizes else ():
        top = ladder.max_size(op, ctx.registry, spec.platform)
        if sizes[-1] > top:
            cpu = spec.platform == "cpu"
            why = (("its ladder's largest, on the CPU" if cpu else "16 times its ladder's largest")
                   if ctx.registry.ops[op].sizes else "the bound for an op without a ladder"
                   + (", on the CPU" if cpu else ""))
            raise BadInput(f"--sizes: {sizes[-1]} is larger than {op} is timed at (valid: up to {top} "
                           f"{ctx.registry.ops[op].size.key}, {why})")
    known = known_device_names()
    checked = _checked_policies(args.check, ctx, known)
    profile_name = args.profile or ("full" if spec.platform == "cuda" else "small")
    profile = ladder.PROFILES[profile_name]
    layers, next_n, shapes = args.layers or profile["layers"], 1, "DeepSeek-V4's (64 heads, 64 experts per rank, 43 layers)"
    from .model_cmd import shapes_from_args
    _, rank = shapes_from_args(args)          # ModelError (bad input) for a refused layout
    if rank is not None:
        profile = ladder.profile_of(rank, base=profile_name)
        layers, next_n = args.layers or rank.layers, rank.next_n
        shapes = (f"{rank.model} at tp {rank.tp}, ep {rank.ep}{', dp-attention' if rank.dp_attention else ''}: "
                  f"{rank.heads} heads, {rank.experts} of "
                  f"{rank.experts_total} experts, next_n {rank.next_n}, {rank.layers} layers")
    form = served.form_for(spec, layers=layers, next_n=next_n, tp=args.tp,
                           capture_max_bs_=args.cuda_graph_max_bs)
    if timer is None:
        timer = timing.cuda_timer(args.warmup, args.rep) if spec.platform == "cuda" else timing.cpu_timer()

    match = writer.device_match(spec, known)
    previous, kept_ops, settings = {}, {}, {}
    to_stdout = args.write_policy == "-"
    if args.write_policy is not None and not to_stdout:
        from ..safe_io import FileError, target_of
        if not args.write_policy.strip():
            raise BadInput("--write-policy: an empty file name (give a policy file path, or - "
                           "for standard output)")
        try:     # a directory, FIFO or device is refused before anything is measured
            target_of(args.write_policy)
        except FileError as exc:
            raise BadInput(f"--write-policy {exc.path}: {exc.reason}") from None
    if args.write_policy and not to_stdout and os.path.exists(args.write_policy):
        pf = load_file(args.write_policy, ctx.registry, known_devices=known)
        previous, others, mine = writer.incumbents(pf, match)
        settings = {k: getattr(pf, k).value for k in ("mixed_group", "on_unsupported", "verify")
                    if getattr(pf, k) is not None}       # kept as the file says them
        if others:
            raise BadInput(f"{args.write_policy}: holds a calibration for another card "
                           f"({others[0].describe()}, line {others[0].line}); this run is for "
                           f"{', '.join(f'{k} {v}' for k, v in match.items())}: write to another file")
        if pf.ops:
            raise BadInput(f"{args.write_policy}: has top-level ops; a calibrated policy holds one "
                           f"devices: entry only: write to another file")
        if mine is not None:
            from ..policies.loader import read_text
            blocks = writer.op_blocks(read_text(args.write_policy))
            kept_ops = {op: blocks.get(op, m) for op, m in mine.ops.items() if op not in ops}

    try:
        import torch
    except ImportError:
        raise BadInput("dispatch bench runs kernels and needs torch, which is not installed here "
                       "(pip install 'capdispatch[torch]', or your own CUDA build of torch)") from None
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
            # The served form: what serving binds, without argument checks.
            fns[c.backend] = bind(op, dev, backend=c.backend, checks=False)
        plan.append((op, fns, skipped, ladders[op]))

    total = sum(len(f) * len(s) for _, f, _, s in plan)
    results = {}
    # Libraries print while they compile (TileLang's log goes to stdout): with JSON out,
    # anything written while measuring goes to stderr, so stdout holds the document alone.
    quiet = _stdout_to_stderr() if args.format == "json" else contextlib.nullcontext()
    with quiet, _progress(total) as step:
        for op, fns, skipped, op_sizes in plan:
            rows = measure.measure(op, op_sizes, fns, device=dev, platform=spec.platform,
                                   profile=profile, gen=gen, timer=timer, step=step, form=form)
            results[op] = (rows, skipped)

    noise = args.noise / 100.0
    per_op, obj_ops, failed, unmeasured = {}, {}, False, {}
    for op, (rows, skipped) in results.items():
        key = ctx.registry.ops[op].size.key
        by_size = measure.times_by_size(rows)
        bad = {r.backend: f"{key} {r.size}: {r.detail}" for r in rows if not r.ok}
        failed |= bool(bad)
        if any(not t for t in by_size.values()):
            raise_at = next(s for s, t in by_size.items() if not t)
            print(f"dispatch: error: {op} at {key} {raise_at}: no backend passed its check", file=sys.stderr)
            return ExitCode.CHECK_FAILED
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
        choices = choose.smooth(choose.choose(by_size, noise, incumbent), noise)
        runs = choose.merge(choices)
        per_op[op] = runs
        # A backend this card cannot run keeps its default place, marked unmeasured: on a card
        # (or an install) where it runs, the policy does not demote it behind what was timed here.
        unmeasured[op] = tuple(skipped)
        excluded[op] = {b: f"left out at {why}" for b, why in bad.items()}
        excluded[op].update(other_layout)
        excluded[op].update({b: f"unmeasured, kept at its default place: cannot run here: {why}"
                             for b, why in skipped.items()})
        obj_ops[op] = {"key": key, "skipped": skipped, "unmeasured": list(skipped),
                       "rows": [r.to_dict() for r in rows],
                       "buckets": [{key: f"<={r.upper}" if r.upper is not None else "any",
                                    "upper": r.upper, "prefer": list(r.order)} for r in runs]}

    header = _header(spec, timer, args.noise, profile_name, form, shapes)
    text = writer.render_policy(match, per_op, key_of=lambda o: ctx.registry.ops[o].size.key,
                                header=header, kept_ops=kept_ops, excluded=excluded, settings=settings,
                                graphed={op: {r.size for r in rows if r.graph}
                                         for op, (rows, _) in results.items()},
                                unmeasured=unmeasured, measured_with=_inventory(ctx))
    if args.write_policy:
        from ..policies import parse
        try:   # what is written must load like any policy: checked before the file is touched
            parse(text, args.write_policy, ctx.registry, known_devices=known)
        except PolicyError as exc:
            raise AssertionError(f"dispatch bench made a policy the loader refuses: {exc}") from exc
    if args.write_policy and not to_stdout:
        from ..safe_io import FileError, write_atomic
        try:
            write_atomic(args.write_policy, text)
        except FileError as exc:
            raise BadInput(f"--write-policy {exc.path}: {exc.reason}") from None

    regret = [_regret(p, label, results, spec, ctx) for p, label in checked]
    over = [r for rows in regret for r in rows if not r["ratio"] <= args.threshold]

    if args.format == "json":
        print(json.dumps({"schema": 2, "device": {"id": spec.id, "name": spec.name, "cc": spec.cc_str},
                          "match": match, "noise_pct": args.noise, "profile": profile_name,
                          "shapes": shapes, "served_form": form.describe(),
                          "timer": timer_description(timer), "ops": obj_ops,
                          "policy": args.write_policy,
                          "check": {"threshold": args.threshold,
                                    "policies": [label for _, label in checked],
                                    "rows": [dict(r, ratio=r["ratio"] if r["ratio"] != float("inf") else None)
                                             for rows in regret for r in rows]} if checked else None,
                          **({"policy_text": text} if to_stdout else {})}, indent=2))
    else:
        print(_table(results, per_op, ctx))
        for (_, label), rows in zip(checked, regret):
            print("\n" + _regret_table(label, rows, args.threshold))
        if args.write_policy and not to_stdout:
            print(f"\nwrote {args.write_policy}")
        elif not checked:
            print("\n" + text)
    if over:
        worst = max(over, key=lambda r: r["ratio"])
        print(f"dispatch: regret above {args.threshold:g}: {len(over)} size(s); the worst: {worst['policy']} "
              f"picks {worst['picked']} for {worst['op']} at {worst['key']} {worst['size']}, "
              f"{worst['ratio']:.2f}x {worst['fastest']}", file=sys.stderr)
    return ExitCode.CHECK_FAILED if (failed or over) else ExitCode.OK


@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 (and sys.stdout) onto stderr for the block: a library's handler that
    holds the original stdout object writes to stderr too."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _checked_policies(values, ctx, known) -> list:
    """--check values -> [(policy for context(), label)]; 'default' is the built-in policy.
    Each file is loaded now, so a bad one is refused before anything is timed."""
    from ..policies import load_file
    out = []
    for v in values:
        if v == "default":
            out.append((None, "default"))
            continue
        load_file(v, ctx.registry, known_devices=known)
        out.append(([v], v))
    return out


def _regret(policy, label, results, spec, ctx) -> list:
    """Per op and size: the backend POLICY picks on SPEC, the fastest measured, and
    picked / fastest (inf where the pick failed its check or was not timed)."""
    from .resolver import context, resolve_in
    env = {k: v for k, v in ctx.env.items() if k not in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET")}
    pctx = context(policy=policy, env=env)
    out = []
    from ..calibrate import measure
    for op, (rows, _) in results.items():
        res = resolve_in(pctx, op, spec)
        key = ctx.registry.ops[op].size.key
        graph = {r.size: r.graph for r in rows}
        for size, t in sorted(measure.times_by_size(rows).items()):
            pick = res.backend_for(size)
            fastest = min(t, key=lambda b: (t[b], b))
            # A pick that failed its check (or cannot run at all) has no time: no finite ratio.
            ratio = (t[pick] / t[fastest] if t[fastest] > 0 else 1.0) if pick in t else float("inf")
            out.append({"policy": label, "op": op, "key": key, "size": size, "graph": graph.get(size, False),
                        "picked": pick, "picked_ms": t.get(pick), "fastest": fastest,
                        "fastest_ms": t[fastest], "ratio": ratio})
    return out


def _regret_table(label, rows, threshold) -> str:
    from ..calibrate.writer import fmt_ms
    head = ["op", "size", "graph", "picked", "ms", "fastest", "ms", "ratio", ""]
    body = [[r["op"], f"{r['key']} {r['size']}", "yes" if r["graph"] else "no", r["picked"],
             fmt_ms(r["picked_ms"]) if r["picked_ms"] is not None else "not timed", r["fastest"],
             fmt_ms(r["fastest_ms"]), f"{r['ratio']:.2f}", "" if r["ratio"] <= threshold else "OVER"]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
    worst = max((r["ratio"] for r in rows), default=1.0)
    out = [f"regret of {label} (picked / fastest, served form; threshold {threshold:g}): worst {worst:.2f}"]
    out.append("  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    out += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
    return "\n".join(out)


def _inventory(ctx) -> dict:
    """The libraries the runnable backends of this run were measured with: name -> version."""
    names = sorted({r.dist for op in ctx.registry.ops for b in ctx.registry.backends(op)
                    for r in b.requires if getattr(r, "dist", None)})
    out = {}
    for n in names:
        lib = ctx.inventory.get(n)
        out[n] = lib.version if lib.installed and lib.version else "absent"
    return out


def _default_device() -> str:
    from ..capabilities import local_devices
    devs = local_devices()
    cuda = [d for d in devs if d.platform == "cuda"]
    return cuda[0].id if cuda else "cpu"


def timer_description(timer) -> str:
    return getattr(timer, "describe", "an injected timer")


def _header(spec, timer, noise, profile, form, shapes) -> list:
    import platform as _pf

    from ..calibrate import writer
    from ..version import __version__
    from ..capabilities import Inventory
    inv = Inventory.with_assumptions(None)
    libs = ", ".join(f"{d} {inv.get(d).describe()}" for d in ("torch", "triton"))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    card = spec.name if spec.platform == "cuda" else f"the CPU ({spec.name})"
    cc = f" (cc {spec.cc_str})" if spec.cc_str else ""
    return [f"{writer.MARK[2:]} on {card}{cc}, {stamp}.",
            f"capdispatch {__version__}, Python {_pf.python_version()}, {libs}; profile {profile}.",
            f"Timer: {timer_description(timer)}.",
            f"Served form: {form.describe()}.",
            f"Shapes: {shapes}.",
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

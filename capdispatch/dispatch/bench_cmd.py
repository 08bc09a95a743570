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

from typing import Optional
import importlib.util
import platform as _pf

import attrs

from .errors import BadInput, ExitCode

DEFAULT_THRESHOLD = 1.05
# The longest --warmup and --rep, in ms: a minute of one backend at one size.
MAX_MS = 60_000
# The largest seed a torch.Generator takes (64 bits; a larger one overflows there).
MAX_SEED = 2**64 - 1


def add_parser(subparsers):
    from .options import LAYOUT, add, flagged, number, whole
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
    b.add_argument("--noise", type=flagged("--noise", number("a percentage from 0 to below 100", 0, 100,
                                                             below=True)),
                   default=5.0, metavar="PCT",
                   help="a backend replaces the one FILE already names for a size only when faster "
                        "by more than PCT percent (default 5)")
    b.add_argument("--profile", choices=("full", "small"), default=None,
                   help="problem dimensions besides the size: DeepSeek-V4's (full; the default on CUDA) "
                        "or small ones for the CPU (the default there)")
    b.add_argument("--seed", type=flagged("--seed", whole(0, MAX_SEED)), default=0,
                   help="seed of the random inputs (default 0)")
    b.add_argument("--warmup", type=flagged("--warmup", number(f"a time in ms from 0 to {MAX_MS}", 0, MAX_MS)),
                   default=25.0, help="CUDA: do_bench warm-up, ms")
    b.add_argument("--rep", type=flagged("--rep", number(f"a time in ms above 0, at most {MAX_MS}", 0, MAX_MS,
                                                         above=True)),
                   default=100.0, help="CUDA: do_bench measuring time, ms")
    add(b, "format")
    s = b.add_argument_group("served shapes and form (--model: time at one rank's shapes of a model; "
                             "without it DeepSeek-V4's at 64 heads and 64 experts per rank)")
    add(s, *LAYOUT)
    s.add_argument("--layers", type=flagged("--layers", whole(1)), default=None, metavar="N",
                   help="layers of one forward the per-batch work is shared by (default: the model's, else 1)")
    s.add_argument("--cuda-graph-max-bs", type=flagged("--cuda-graph-max-bs", whole(0)), default=None,
                   metavar="N", help="decode batches SGLang replays from CUDA graphs (default: SGLang's for "
                                     "this card's memory and --tp)")
    c = b.add_argument_group("regret check")
    c.add_argument("--check", action="append", default=[], metavar="POLICY",
                   help="report, per op and size, the backend POLICY picks against the fastest measured "
                        "(repeatable; 'default' is the built-in policy); exit 4 above --threshold")
    c.add_argument("--threshold", type=flagged("--threshold", number("a ratio >= 1, e.g. 1.05", 1)),
                   default=DEFAULT_THRESHOLD, metavar="X",
                   help=f"the largest picked / fastest ratio --check accepts (default {DEFAULT_THRESHOLD})")
    return b


@attrs.frozen
class _Served:
    """The shapes and served form a run times at."""
    profile_name: str
    profile: dict
    form: object           # calibrate.served's form
    shapes: str            # what the shapes are, for the header and the JSON


@attrs.frozen
class _Incumbent:
    """What --write-policy's existing file holds for this card: its per-op choices (the
    noise band keeps them), the op blocks this run does not time, and its settings."""
    previous: dict = attrs.field(factory=dict)
    kept_ops: dict = attrs.field(factory=dict)
    settings: dict = attrs.field(factory=dict)


@attrs.frozen
class _Chosen:
    """The buckets chosen per op from the measured rows, with what each op left out."""
    per_op: dict
    obj_ops: dict
    excluded: dict
    unmeasured: dict
    failed: bool


def run(args, *, timer=None) -> int:
    """TIMER: `timer(fn, graph) -> ms` in place of the device's own (tests inject one)."""
    from ..calibrate import timing, writer
    from .resolver import context, known_device_names
    _need_torch()
    spec = _device(args)
    ctx = context()
    ops, ladders = _ops(args, ctx, spec)
    known = known_device_names()
    checked = _checked_policies(args.check, ctx, known)
    served = _served(args, spec)
    if timer is None:
        timer = timing.cuda_timer(args.warmup, args.rep) if spec.platform == "cuda" else timing.cpu_timer()
    match = writer.device_match(spec, known)
    to_stdout = args.write_policy == "-"
    incumbent = _incumbent(args.write_policy, ctx, match, ops, known)

    dev, gen = _torch_device(spec, args.seed)
    results = _measure(_plan(ctx, ops, spec, dev, ladders), args.format, dev, spec, served, gen, timer)
    chosen = _choose(results, ctx, args.noise / 100.0, incumbent.previous)
    if chosen is None:
        return ExitCode.CHECK_FAILED
    text = writer.render_policy(match, chosen.per_op, key_of=lambda o: ctx.registry.ops[o].size.key,
                                header=_header(spec, timer, args.noise, served),
                                kept_ops=incumbent.kept_ops, excluded=chosen.excluded,
                                settings=incumbent.settings,
                                graphed={op: {r.size for r in rows if r.graph}
                                         for op, (rows, _) in results.items()},
                                unmeasured=chosen.unmeasured, measured_with=_inventory(ctx))
    if args.write_policy:
        _write(args.write_policy, text, ctx, known, to_stdout)

    regret = [_regret(p, label, results, spec, ctx) for p, label in checked]
    over = [r for rows in regret for r in rows if not r["ratio"] <= args.threshold]
    if args.format == "json":
        _print_json(args, spec, match, served, timer, chosen, checked, regret, text if to_stdout else None)
    else:
        print(_table(results, chosen.per_op, ctx))
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
    return ExitCode.CHECK_FAILED if (chosen.failed or over) else ExitCode.OK


def _need_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        raise BadInput("dispatch bench times kernels, which need torch: torch is not installed "
                       "(pip install 'capdispatch[torch]', or your own CUDA build of torch)")


def _device(args):
    """The one device --device names (else the default), as a spec that can be timed."""
    from .inputs import device_list
    from .resolver import as_spec
    if args.device is not None:
        devs = device_list(args.device, "--device")
        if len(devs) != 1:
            raise BadInput(f"--device {args.device!r}: bench times one device (valid: cuda:N or cpu)")
        device = devs[0]
    else:
        device = _default_device()
    spec = as_spec(device)
    if spec.simulated:
        raise BadInput(f"--device {device}: a simulated device cannot be timed (valid: cuda:N, cpu)")
    return spec


def _ops(args, ctx, spec):
    """The ops to time and each one's sizes: [op], {op: (size, ...)}. What an op must declare
    to be timed is checked before anything runs: an op named by --op is refused without it;
    with no --op, it is left out and said so."""
    from ..calibrate import ladder
    from ..calibrate.inputs import undeclared
    from .inputs import op_list
    ops = op_list(args.op, "--op", ctx.registry) or list(ctx.registry.ops)
    try:
        sizes = ladder.parse_sizes(args.sizes) if args.sizes is not None else None
    except ladder.SizesError as exc:
        raise BadInput(str(exc)) from None
    ladders = {}
    for op in list(ops):
        why = undeclared(ctx.registry.ops[op], sizes is not None)
        if why and args.op:
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
    return ops, ladders


def _served(args, spec) -> _Served:
    """The profile, shapes and served form: --model's rank's, else DeepSeek-V4's."""
    from ..calibrate import ladder, served
    from .model_cmd import shapes_from_args
    profile_name = args.profile or ("full" if spec.platform == "cuda" else "small")
    profile = ladder.PROFILES[profile_name]
    layers, next_n, shapes = args.layers or profile["layers"], 1, "DeepSeek-V4's (64 heads, 64 experts per rank, 43 layers)"
    _, rank = shapes_from_args(args)          # ModelError (bad input) for a refused layout
    if rank is not None:
        profile = ladder.profile_of(rank, base=profile_name)
        layers, next_n = args.layers or rank.layers, rank.next_n
        shapes = (f"{rank.model} at tp {rank.tp}, ep {rank.ep}{', dp-attention' if rank.dp_attention else ''}: "
                  f"{rank.heads} heads, {rank.experts} of "
                  f"{rank.experts_total} experts, next_n {rank.next_n}, {rank.layers} layers")
    form = served.form_for(spec, layers=layers, next_n=next_n, tp=args.tp,
                           capture_max_bs_=args.cuda_graph_max_bs)
    return _Served(profile_name, profile, form, shapes)


def _incumbent(path, ctx, match, ops, known) -> _Incumbent:
    """What the policy file PATH (--write-policy) already holds, after refusing a target that
    cannot be written or holds what this run must not replace: before anything is measured."""
    from ..calibrate import writer
    from ..policies import load_file
    from ..safe_io import FileError, target_of
    if path is None or path == "-":
        return _Incumbent()
    if not path.strip():
        raise BadInput("--write-policy: an empty file name (give a policy file path, or - "
                       "for standard output)")
    try:     # a directory, FIFO or device is refused before anything is measured
        target_of(path)
    except FileError as exc:
        raise BadInput(f"--write-policy {exc.path}: {exc.reason}") from None
    if not os.path.exists(path):
        return _Incumbent()
    pf = load_file(path, ctx.registry, known_devices=known)
    previous, others, mine = writer.incumbents(pf, match)
    settings = {k: getattr(pf, k).value for k in ("mixed_group", "on_unsupported", "verify")
                if getattr(pf, k) is not None}       # kept as the file says them
    if others:
        raise BadInput(f"{path}: holds a calibration for another card "
                       f"({others[0].describe()}, line {others[0].line}); this run is for "
                       f"{', '.join(f'{k} {v}' for k, v in match.items())}: write to another file")
    if pf.ops:
        raise BadInput(f"{path}: has top-level ops; a calibrated policy holds one "
                       f"devices: entry only: write to another file")
    kept_ops = {}
    if mine is not None:
        from ..policies.loader import read_text
        blocks = writer.op_blocks(read_text(path))
        kept_ops = {op: blocks.get(op, m) for op, m in mine.ops.items() if op not in ops}
    return _Incumbent(previous, kept_ops, settings)


def _torch_device(spec, seed):
    """The torch device name of SPEC (made current on CUDA) and the seeded generator."""
    try:
        import torch
    except ImportError:
        raise BadInput("dispatch bench runs kernels and needs torch, which is not installed here "
                       "(pip install 'capdispatch[torch]', or your own CUDA build of torch)") from None
    dev = spec.id.split("#")[0] if spec.platform == "cuda" else "cpu"
    if spec.platform == "cuda":
        torch.cuda.set_device(torch.device(dev))
    return dev, torch.Generator(device=dev).manual_seed(seed)


def _plan(ctx, ops, spec, dev, ladders) -> list:
    """[(op, {backend: served function}, {backend: why it cannot run}, sizes)] per op."""
    from .binding import bind
    from .resolver import evaluate, order
    plan = []
    for op in ops:
        _, names = order(ctx, op, spec)
        fns, skipped = {}, {}
        for c in evaluate(ctx, op, spec, names, ()):
            if not c.ok:
                skipped[c.backend] = "; ".join(ch.message or ch.code for ch in c.checks if not ch.ok)
                continue
            # The served form: what serving binds, without argument checks.
            fns[c.backend] = bind(op, dev, backend=c.backend, checks=False)
        plan.append((op, fns, skipped, ladders[op]))
    return plan


def _measure(plan, fmt, dev, spec, served_: _Served, gen, timer) -> dict:
    """{op: (rows, skipped)}: every runnable backend timed at each of its op's sizes."""
    from ..calibrate import measure
    total = sum(len(f) * len(s) for _, f, _, s in plan)
    results = {}
    # Libraries print while they compile (TileLang's log goes to stdout): with JSON out,
    # anything written while measuring goes to stderr, so stdout holds the document alone.
    quiet = _stdout_to_stderr() if fmt == "json" else contextlib.nullcontext()
    with quiet, _progress(total) as step:
        for op, fns, skipped, op_sizes in plan:
            rows = measure.measure(op, op_sizes, fns, device=dev, platform=spec.platform,
                                   profile=served_.profile, gen=gen, timer=timer, step=step,
                                   form=served_.form)
            results[op] = (rows, skipped)
    return results


def _choose(results, ctx, noise, previous) -> Optional[_Chosen]:
    """The buckets per op from the measured rows (NOISE: the band, a fraction; PREVIOUS: the
    incumbent file's choices); None, said on stderr, where no backend passed at some size."""
    from ..calibrate import choose, measure
    per_op, obj_ops, excluded, unmeasured, failed = {}, {}, {}, {}, False
    for op, (rows, skipped) in results.items():
        key = ctx.registry.ops[op].size.key
        by_size = measure.times_by_size(rows)
        bad = {r.backend: f"{key} {r.size}: {r.detail}" for r in rows if not r.ok}
        failed |= bool(bad)
        if any(not t for t in by_size.values()):
            raise_at = next(s for s, t in by_size.items() if not t)
            print(f"dispatch: error: {op} at {key} {raise_at}: no backend passed its check", file=sys.stderr)
            return None
        incumbent = previous.get(op, lambda s: None)
        other_layout = _one_layout(ctx.registry.ops[op].layouts, by_size, noise, incumbent)
        runs = choose.merge(choose.smooth(choose.choose(by_size, noise, incumbent), noise))
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
    return _Chosen(per_op, obj_ops, excluded, unmeasured, failed)


def _one_layout(layouts, by_size, noise, incumbent) -> dict:
    """Drop from BY_SIZE the backends whose input layout is not the catch-all's (the largest
    size's winner's): one call site holds one input layout. {backend: why} for those dropped."""
    from ..calibrate import choose
    if not layouts:
        return {}
    top = max(by_size)
    need = layouts.get(choose.choose({top: by_size[top]}, noise, incumbent)[0].winner)
    out = {}
    for t in by_size.values():
        for b in [b for b in t if layouts.get(b) != need]:
            del t[b]
            out.setdefault(b, f"its inputs are in layout {layouts.get(b)}, the "
                              f"catch-all's in {need}: one call site holds one layout")
    return out


def _write(path, text, ctx, known, to_stdout) -> None:
    """Check that TEXT loads like any policy, then write it to PATH (unless standard output)."""
    from ..policies import PolicyError, parse
    from ..safe_io import FileError, write_atomic
    try:   # what is written must load like any policy: checked before the file is touched
        parse(text, path, ctx.registry, known_devices=known)
    except PolicyError as exc:
        raise AssertionError(f"dispatch bench made a policy the loader refuses: {exc}") from exc
    if to_stdout:
        return
    try:
        write_atomic(path, text)
    except FileError as exc:
        raise BadInput(f"--write-policy {exc.path}: {exc.reason}") from None


def _print_json(args, spec, match, served_: _Served, timer, chosen: _Chosen, checked, regret, policy_text) -> None:
    print(json.dumps({"schema": 2, "device": {"id": spec.id, "name": spec.name, "cc": spec.cc_str},
                      "match": match, "noise_pct": args.noise, "profile": served_.profile_name,
                      "shapes": served_.shapes, "served_form": served_.form.describe(),
                      "timer": timer_description(timer), "ops": chosen.obj_ops,
                      "policy": args.write_policy,
                      "check": {"threshold": args.threshold,
                                "policies": [label for _, label in checked],
                                "rows": [dict(r, ratio=r["ratio"] if r["ratio"] != float("inf") else None)
                                         for rows in regret for r in rows]} if checked else None,
                      **({"policy_text": policy_text} if policy_text is not None else {})}, indent=2))


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


def _header(spec, timer, noise, served_: _Served) -> list:

    from ..calibrate import writer
    from ..version import __version__
    from ..capabilities import Inventory
    inv = Inventory.with_assumptions(None)
    libs = ", ".join(f"{d} {inv.get(d).describe()}" for d in ("torch", "triton"))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    card = spec.name if spec.platform == "cuda" else f"the CPU ({spec.name})"
    cc = f" (cc {spec.cc_str})" if spec.cc_str else ""
    return [f"{writer.MARK[2:]} on {card}{cc}, {stamp}.",
            f"capdispatch {__version__}, Python {_pf.python_version()}, {libs}; profile {served_.profile_name}.",
            f"Timer: {timer_description(timer)}.",
            f"Served form: {served_.form.describe()}.",
            f"Shapes: {served_.shapes}.",
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

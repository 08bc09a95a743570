"""`dispatch plan`: plan a rig from a model before anything is loaded: whether SGLang would
load the layout, each rank's memory (weights in their stored formats, the V4 KV pools for
--context x --batch, workspaces) against its card, the largest context that fits, and what
change would fit. Exit codes: 0 every rank fits; 2 bad input; 3 the layout is refused or a
rank does not fit (the plan is printed either way)."""
from __future__ import annotations

import argparse
import json
from typing import NamedTuple, Optional

EPILOG = """\
examples:
  dispatch plan --model deepseek-v4-flash --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 --tp 3
      the mixed rig (an RTX 5090 beside two RTX 3080s): the layout SGLang refuses, the weights against the cards, layouts that would load
  dispatch plan --model deepseek-v4-flash --device sim:h200 --tp 4 --context 131072 --batch 8
      one card kind, four ranks: memory per rank and the largest context that fits
  dispatch plan --model ./DeepSeek-V4-Pro/config.json --device sim:b200 --tp 8 --ep 8 --format json
  dispatch plan --model deepseek-v4-flash --device sim:h200 --tp 4 --ep 4 --dp-attention --speed --libs sglang-0.5.23
      with the predicted step per rank and op, and tokens per second

exit codes: 0 every rank fits; 2 bad input (unknown model or device, bad numbers);
3 the layout is one SGLang would refuse, or a rank's memory does not fit its card.
"""


def add_parser(sub):
    from .options import LAYOUT, add
    p = sub.add_parser("plan", help="plan a rig from a model: layout, memory per rank, what would fit",
                       description="Plan a rig from a model before anything is downloaded or loaded: "
                                   "whether SGLang would load the layout, each rank's memory against "
                                   "its card, the largest context that fits, and what change would fit.",
                       epilog=EPILOG, formatter_class=_raw())
    add(p, "device", required=True, help="one card per rank, in rank order (one device with --tp N "
        "stands for N such cards)")
    add(p, "model")
    add(p, "tp", default=None, unset="one rank per device")
    add(p, *LAYOUT[2:])
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help="tokens per request the KV pools must hold (default 8192)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="requests served at once at that context (default 1)")
    add(p, "libs", help="for the kernel decisions --speed times")
    p.add_argument("--calibration", action="append", default=[], metavar="FILE",
                   help="a calibrated policy or `dispatch bench` JSON whose measured times predict "
                        "the step (default: the calibrations shipped in policies/examples)")
    p.add_argument("--prefill", type=int, default=None, metavar="TOKENS",
                   help="the prompt length the prefill prediction times (default 4096)")
    p.add_argument("--speed", action="store_true",
                   help="also predict the step time per rank and op (decode at batch 1, 8, 32 and a "
                        "prefill) from calibrated times, and the group's tokens per second")
    add(p, "brief", help="one screen: the verdict, the ranks and what would fit")
    add(p, "format")
    return p


def _raw():
    return argparse.RawDescriptionHelpFormatter


def run(args) -> int:
    from ..models import load_model
    from . import rigplan
    from .errors import BadInput, ExitCode
    from .group import device_specs
    from .inputs import device_list
    if not args.model:
        raise BadInput("--model NAME|PATH is required (`dispatch model` lists the built-ins)")
    model = load_model(args.model)
    if args.prefill is not None:
        _check_prefill(args, model)
    ids = device_list(args.device, "--device")
    if not ids:
        raise BadInput("--device names no device (valid: sim:NAME or cuda:N, commas for several)")
    tp = args.tp if args.tp is not None else len(ids)     # --tp is checked when parsed
    if len(ids) == 1 and tp > 1:
        ids = ids * tp
    specs = device_specs(ids, "--device")
    p = rigplan.build(model, specs, tp=tp, ep=args.ep, dp_attention=args.dp_attention, next_n=args.next_n,
                      context=rigplan.DEFAULT_CONTEXT if args.context is None else args.context,
                      batch=rigplan.DEFAULT_BATCH if args.batch is None else args.batch)
    speeds = None
    if args.speed and p.shapes is not None:
        speeds = _speeds(args, p)
    # A refused layout has no rank shapes to time: --speed says it was skipped, and why.
    skipped = SPEED_SKIPPED if args.speed and p.shapes is None else None
    if args.format == "json":
        obj = p.to_dict()
        obj["speed"] = _speed_dict(speeds) if speeds is not None else (
            {"skipped": skipped} if skipped else None)
        print(json.dumps(obj, indent=2))
    else:
        print(text(p, brief=args.brief, speeds=speeds))
        if skipped:
            from .render import wrap
            print("\n".join(["", *wrap(f"predicted step: skipped: {skipped}", "")]))
    # Exit 3 when the kernels asked for (--speed) cannot be decided, after printing the rest.
    return ExitCode.OK if p.fits and not (speeds and speeds.failed) else ExitCode.UNSATISFIABLE


def _check_prefill(args, model) -> None:
    """--prefill sizes the --speed prediction: refused without it, and above the model's context."""
    from .errors import BadInput
    from .rigplan import context_limit
    if not args.speed:
        raise BadInput(f"--prefill {args.prefill}: it sets the prompt length --speed times; add --speed "
                       f"or leave --prefill out")
    longest = context_limit(model)
    if not 1 <= args.prefill <= longest:
        raise BadInput(f"--prefill {args.prefill} is not valid; valid: 1..{longest} (tokens: at most "
                       f"{model.name}'s max_position_embeddings)")


SPEED_SKIPPED = ("SGLang refuses this layout, so no rank has shapes to time; --speed predicts a "
                 "layout it would load (see above)")


def _speeds(args, p):
    from . import speed
    from .errors import BadInput, Unsatisfiable
    from .explain import plan
    prefill = speed.DEFAULT_PREFILL if args.prefill is None else args.prefill
    try:
        cals = speed.merged([speed.load(f) for f in args.calibration] or speed.default_calibrations())
    except speed.SpeedError as exc:
        raise BadInput(str(exc)) from None
    try:
        decided = plan(list(p.devices), shapes=p.shapes, libs=args.libs, log_warnings=False)
    except Unsatisfiable as exc:
        # The memory plan stands without the kernels; the prediction says why it is missing.
        return Speeds((), cals, None, str(exc))
    decisions = {op: g.per_device for op, g in decided.ops.items()}
    rows = speed.predict(p.model, p.shapes, list(p.devices), decisions, cals, prefill=prefill)
    return Speeds(rows, cals, decided.whose)


class Speeds(NamedTuple):
    rows: tuple                 # speed.RankSpeed...
    cals: list                  # the calibrations the times came from
    inventory: Optional[dict]   # whose libraries decided the kernels (explain.whose_dict)
    failed: str = ""            # why no kernel was decided: nothing predicted


def _speed_rows(rows):
    """{(phase, size): [RankSpeed per rank]}"""
    out = {}
    for r in rows:
        out.setdefault((r.phase, r.size), []).append(r)
    return out


def _speed_dict(speeds) -> dict:
    from . import speed
    rows, cals = speeds.rows, speeds.cals
    steps = []
    for (phase, size), ranks in _speed_rows(rows).items():
        known = [r for r in ranks if r.total is not None]
        slow = max(known, key=lambda r: r.total) if len(known) == len(ranks) else None
        step = slow.total if slow else None
        steps.append({"phase": phase, "size": size, "step_ms": step,
                      "slowest_rank": slow.rank if slow else None,
                      "slowest_op": slow.slowest_op().op if slow and slow.slowest_op() else None,
                      "tokens_per_s": (size / step * 1e3) if step else None,
                      "ranks": [r.to_dict() for r in ranks]})
    return {"calibrations": [c.source for c in cals], "steps": steps, "cards": speed.CARDS_SOURCE,
            "ignores": speed.__doc__.split("What it ignores, and says so: ")[1].strip(),
            "inventory": speeds.inventory, "not_predicted": speeds.failed or None}


def _speed_lines(speeds, brief) -> list:
    from .render import wrap
    from .explain import whose_lines
    d = _speed_dict(speeds)
    out = ["", "predicted step (ms per step; decode: one token per request, MTP acceptance ignored):"]
    if speeds.failed:
        return out + wrap(f"not predicted: no kernel decided: {speeds.failed}", "  ", hang="    ")
    for s in d["steps"]:
        label = f"decode batch {s['size']}" if s["phase"] == "decode" else f"prefill {s['size']} tokens"
        if s["step_ms"] is None:
            missing = next(o["how"] for r in s["ranks"] for o in r["ops"] if o["ms"] is None)
            out += wrap(f"{label}: {missing}", "  ", hang="    ")
            continue
        out += wrap(f"{label}: {s['step_ms']:.2f} ms, {s['tokens_per_s']:.0f} tokens/s; slowest: rank "
                    f"{s['slowest_rank']} ({s['ranks'][s['slowest_rank']]['device']}), its largest op "
                    f"{s['slowest_op']}", "  ", hang="    ")
    if not brief:
        for s in d["steps"]:
            label = f"decode batch {s['size']}" if s["phase"] == "decode" else f"prefill {s['size']}"
            shown = []
            for r in s["ranks"]:
                sig = [(o["backend"], o["ms"]) for o in r["ops"]] + [r["dense_ms"], r["comm_ms"]]
                if sig in shown:
                    continue
                shown.append(sig)
                out.append(f"  {label}, rank {r['rank']} ({r['device']}):")
                for o in r["ops"]:
                    ms = "?" if o["ms"] is None else f"{o['ms']:.3f}"
                    out += wrap(f"{o['op']:<15} {o['backend']:<24} {ms:>8} ms  {o['how']}", "    ", hang="      ")
                out.append(f"    {'other weights':<15} {'(read once per step)':<24} {r['dense_ms']:>8.3f} ms  "
                           f"estimated: bytes / bandwidth at 70%")
                out.append(f"    {'all-reduces':<15} {'(2 per layer)':<24} {r['comm_ms']:>8.3f} ms  "
                           f"estimated over the cards' link")
    for op, why in (speeds.rows[0].not_called if speeds.rows else ()):
        out += wrap(f"{op}: not predicted: {why}", "  ", hang="    ")
    out += whose_lines(d["inventory"])
    out += wrap(f"calibrations: {', '.join(d['calibrations']) or 'none'}; {d['cards']}", "")
    out += wrap(f"ignores: {d['ignores']}", "")
    return out


def _gib(n) -> str:
    from ..models.memory import GIB
    return f"{n / GIB:.1f}"


def _part_size(n) -> str:
    """One part of a rank's memory: GiB, or MiB below 0.1 GiB, so that parts the table's
    one-decimal GiB rounds to 0.0 still add up to their total."""
    from ..models.memory import GIB
    return f"{n / GIB:.1f} GiB" if n == 0 or n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def _layout(lay) -> str:
    return f"tp {lay.tp}" + (f" ep {lay.ep}" if lay.ep != 1 else "") + (" dp-attention" if lay.dp_attention else "")


def _grouped(rows) -> list:
    """Consecutive ranks with the same card kind and the same numbers as one row ("0-7")."""
    out = []
    for row in rows:
        kind = row[1].split("@")[0]
        if out and out[-1][1].split("@")[0].split(" x")[0] == kind and out[-1][2:] == row[2:]:
            first = out[-1][0].split("-")[0]
            n = int(row[0]) - int(first) + 1
            out[-1] = (f"{first}-{row[0]}", f"{kind} x{n}") + row[2:]
        else:
            out.append(row)
    return out


def text(p, *, brief: bool = False, speeds=None) -> str:
    from ..models import memory as mem
    from . import rigplan
    from .render import wrap
    out = []
    cards = ", ".join(d.id for d in p.devices)
    verdict = ("REFUSED by SGLang" if p.refusal else "fits" if p.fits else "does NOT fit")
    out += wrap(f"{p.model.name} at {_layout(p.layout)} over {cards}: {verdict}", "")
    if p.refusal:
        out += wrap(p.refusal, "  ")
    fmts = "; ".join(f.describe() + f" ({f.kind})" for f in p.model.formats)
    out += wrap(f"weights: {_gib(p.weights_total)} GiB as SGLang loads them at TP 1 (stored as {fmts}; wo_a "
                f"in bf16 and the rope tables made at load); the cards: {_gib(p.cards_total)} GiB", "")
    out += wrap(f"KV for --context {p.context} x --batch {p.batch}; reserve: {rigplan.RESERVE_TEXT}", "")
    if p.shapes is not None:
        s = p.shapes
        out += wrap(f"per rank: heads {s.heads}, experts {s.experts} of {s.experts_total}, expert "
                    f"intermediate {s.moe_intermediate}, next_n {s.next_n}", "")
    if p.ranks:
        out.append("")
        head = ("rank", "card", "usable", "weights", "KV", "work", "total", "free", "fits", "max context")
        rows = []
        for r in p.ranks:
            m = r.memory
            free = (r.budget - m.total) if r.budget is not None else None
            rows.append((str(r.rank), f"{r.device.id}", _gib(r.budget) if r.budget else "?",
                         _gib(m.weight_bytes), _gib(m.kv_bytes), _gib(m.workspace_bytes), _gib(m.total),
                         _gib(free) if free is not None else "?",
                         "?" if r.fits is None else "yes" if r.fits else "NO",
                         "?" if r.largest_context is None else str(r.largest_context) if r.largest_context
                         else "none"))
        if brief:
            rows = _grouped(rows)
        widths = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
        out.append("memory per rank in GiB; max context in tokens per request:")
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
        out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if p.options:
        out.append("")
        out.append("other layouts over these cards (largest cards first):")
        for o in p.options:
            status = (f"fits, contexts up to {o.largest_context}" if o.fits
                      else f"does not fit: {_gib(o.per_rank_bytes)} GiB on its fullest rank")
            out += wrap(f"{_layout(o.layout)} on {', '.join(o.devices)}: {status}", "  ", hang="    ")
    if p.suggestions:
        out.append("")
        out.append("what would fit:")
        for s in p.suggestions:
            out += wrap(f"- {s}", "  ", hang="    ")
    if not brief and p.ranks:
        shown = []
        for r in p.ranks:
            out.append("")
            twin = next((t for t in shown if t.memory == r.memory and t.card_bytes == r.card_bytes), None)
            out.append(f"rank {r.rank}: {r.device.id} {r.device.name}, "
                       + (f"{_gib(r.card_bytes)} GiB, {_gib(r.budget)} usable" if r.card_bytes else "memory unknown")
                       + (f": the same as rank {twin.rank}" if twin is not None else ""))
            if twin is not None:
                continue
            shown.append(r)
            for title, parts in (("weights", r.memory.weights), ("KV", r.memory.kv),
                                 ("workspace (estimated)", r.memory.workspace)):
                out.append(f"  {title}:")
                for part in parts:
                    out += wrap(f"{_part_size(part.bytes):>10}  {part.name}: {part.note}", "    ", hang="      ")
    out.append("")
    out += wrap(f"margin: {mem.MARGIN_TEXT}", "")
    if speeds is not None:
        out += _speed_lines(speeds, brief)
    return "\n".join(out)

"""`dispatch plan`: plan a rig from a model before anything is loaded: whether SGLang would
load the layout, each rank's memory (weights in their stored formats, the V4 KV pools for
--context x --batch, workspaces) against its card, the largest context that fits, and what
change would fit. Exit codes: 0 every rank fits; 2 bad input; 3 the layout is refused or a
rank does not fit (the plan is printed either way)."""
from __future__ import annotations

EPILOG = """\
examples:
  dispatch plan --model deepseek-v4-flash --device sim:rtx-5090,sim:rtx-3080,sim:rtx-3080 --tp 3
      the seed rig: the layout SGLang refuses, the weights against the cards, layouts that would load
  dispatch plan --model deepseek-v4-flash --device sim:h200 --tp 4 --context 131072 --batch 8
      one card kind, four ranks: memory per rank and the largest context that fits
  dispatch plan --model ./DeepSeek-V4-Pro/config.json --device sim:b200 --tp 8 --ep 8 --format json

exit codes: 0 every rank fits; 2 bad input (unknown model or device, bad numbers);
3 the layout is one SGLang would refuse, or a rank's memory does not fit its card.
"""


def add_parser(sub):
    from .model_cmd import add_layout_options
    p = sub.add_parser("plan", help="plan a rig from a model: layout, memory per rank, what would fit",
                       description="Plan a rig from a model before anything is downloaded or loaded: "
                                   "whether SGLang would load the layout, each rank's memory against "
                                   "its card, the largest context that fits, and what change would fit.",
                       epilog=EPILOG, formatter_class=_raw())
    p.add_argument("--device", action="append", default=[], metavar="DEV[,DEV...]", required=True,
                   help="one card per rank, in rank order: sim:NAME (catalog) or cuda:N; one device "
                        "with --tp N stands for N such cards")
    add_layout_options(p)
    p.set_defaults(tp=None)
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help="tokens per request the KV pools must hold (default 8192)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="requests served at once at that context (default 1)")
    p.add_argument("--brief", action="store_true", help="one screen: the verdict, the ranks and what would fit")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text for people (default) or JSON for programs")
    return p


def _raw():
    import argparse
    return argparse.RawDescriptionHelpFormatter


def run(args) -> int:
    import json

    from ..models import load_model
    from . import rigplan
    from .cli import EXIT_OK, EXIT_UNSAT, _devices_arg
    from .errors import BadInput
    from .group import unique_ids
    from .resolver import as_spec
    if not args.model:
        raise BadInput("--model NAME|PATH is required (`dispatch model` lists the built-ins)")
    model = load_model(args.model)
    ids = _devices_arg(args.device)
    if not ids:
        raise BadInput("--device names no device (valid: sim:NAME or cuda:N, commas for several)")
    tp = args.tp if args.tp is not None else len(ids)
    if tp < 1:
        raise BadInput(f"--tp {tp} is not valid; valid: an integer >= 1")
    if len(ids) == 1 and tp > 1:
        ids = ids * tp
    specs = unique_ids([as_spec(d, via=args.probe if hasattr(args, "probe") else "auto") for d in ids])
    p = rigplan.build(model, specs, tp=tp, ep=args.ep, dp_attention=args.dp_attention, next_n=args.next_n,
                      context=rigplan.DEFAULT_CONTEXT if args.context is None else args.context,
                      batch=rigplan.DEFAULT_BATCH if args.batch is None else args.batch)
    if args.format == "json":
        print(json.dumps(p.to_dict(), indent=2))
    else:
        print(text(p, brief=args.brief))
    return EXIT_OK if p.fits else EXIT_UNSAT


def _gib(n) -> str:
    from ..models.memory import GIB
    return f"{n / GIB:.1f}"


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


def text(p, *, brief: bool = False) -> str:
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
    out += wrap(f"weights: {_gib(p.weights_total)} GiB in their stored formats ({fmts}); "
                f"the cards: {_gib(p.cards_total)} GiB", "")
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
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)) + "   (GiB)")
        out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
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
                    out += wrap(f"{_gib(part.bytes):>7} GiB  {part.name}: {part.note}", "    ", hang="      ")
    out.append("")
    out += wrap(f"margin: {mem.MARGIN_TEXT}", "")
    return "\n".join(out)

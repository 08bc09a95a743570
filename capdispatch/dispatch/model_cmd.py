"""`dispatch model`: a model's facts and one rank's shapes under a layout; and the reading
of the shared `--model` / `--tp` / `--ep` / `--dp-attention` / `--next-n` options
(options.LAYOUT) other commands plan with."""
from __future__ import annotations

import json

from .errors import ExitCode

EPILOG = """\
examples:
  dispatch model                                    the built-in models
  dispatch model deepseek-v4-flash --tp 8           facts, then one rank's shapes at TP 8
  dispatch model deepseek-v4-pro --tp 8 --ep 8 --dp-attention --format json
  dispatch model ./DeepSeek-V4-Flash/config.json    a downloaded config.json (or its folder)
  dispatch model deepseek-v4-flash --tp 3           a layout SGLang refuses: exit 2, with the
                                                    layouts that would work

exit codes: 0 shown; 2 an unknown model, a bad config.json or a layout SGLang would refuse.
"""


def shapes_from_args(args, model=None, tp=None):
    """(ModelShape, RankShape) for the parsed options (TP: the ranks, when the command
    counted them otherwise than --tp); (None, None) without a model.
    Raises ModelError for an unknown model, a bad config or a refused layout."""
    from ..models import load_model
    name = model if model is not None else getattr(args, "model", None)
    if name is None:
        return None, None
    shape = load_model(name)
    return shape, shape.for_rank(args.tp if tp is None else tp, args.ep, args.dp_attention, next_n=args.next_n)


def add_parser(sub):
    from .options import LAYOUT, add
    p = sub.add_parser("model", help="a model's facts and one rank's shapes under --tp/--ep",
                       description="A DeepSeek-V4-class model's facts (a built-in or a Hugging "
                                   "Face config.json) and the shapes one rank holds under a "
                                   "layout, the way SGLang 0.5.23 shards DeepSeek-V4; a layout "
                                   "SGLang would refuse is an error naming the layouts that "
                                   "would work.",
                       epilog=EPILOG)
    from . import completion
    completion.models(p.add_argument("name", nargs="?", metavar="NAME|PATH",
                                     help="a built-in model or a config.json (none: list the built-ins)"))
    add(p, *(k for k in LAYOUT if k != "model"))    # the model is the argument here
    add(p, "format")
    return p


def _ratios_text(shape) -> str:
    if not shape.compress_ratios:
        return "no compress ratios"
    counts: dict = {}
    for r in shape.layer_ratios:
        counts[r] = counts.get(r, 0) + 1
    names = {0: "sliding-window only", 4: "c4", 128: "c128"}
    return ", ".join(f"{n} {names.get(r, f'ratio {r}')}" for r, n in sorted(counts.items()))


def model_lines(shape) -> list:
    lines = [f"{shape.name}  ({shape.source})",
             f"  layers {shape.layers} ({_ratios_text(shape)}), hidden {shape.hidden}, "
             f"vocab {shape.vocab}",
             f"  attention: {shape.heads} heads x head_dim {shape.head_dim} ({shape.nope_dim} "
             f"nope + {shape.rope_dim} rope), one latent KV head, q_lora {shape.q_lora_rank}, "
             f"o_lora {shape.o_lora_rank}, output groups {shape.o_groups}",
             f"  sparse attention: indexer {shape.indexer_heads} heads x {shape.indexer_dim}, "
             f"top-k {shape.index_topk} on c4 layers; sliding window {shape.window}",
             f"  MoE: {shape.experts} routed experts + {shape.shared_experts} shared, "
             f"{shape.experts_per_token} per token, intermediate {shape.moe_intermediate}; "
             f"{shape.hash_layers} hash-routed, {shape.dense_layers} dense layers",
             f"  swiglu limit {shape.swiglu_limit if shape.swiglu_limit is not None else 'none'}"
             f"; MTP layers {shape.mtp}; max context "
             f"{shape.max_context if shape.max_context is not None else 'unstated'}",
             "  checkpoint formats:"]
    from ..models.shape import FORMAT_COVERS
    for f in shape.formats:
        lines.append(f"    {f.kind}: {f.describe()} - {FORMAT_COVERS.get(f.kind, '')}")
    return lines


def rank_lines(r) -> list:
    layout = f"tp {r.tp} ep {r.ep}" + (" dp-attention" if r.dp_attention else "")
    by_ratio = ", ".join(f"{r.layers_by_ratio[k]} x c{k}" if k else
                         f"{r.layers_by_ratio[k]} x window only" for k in r.layers_by_ratio)
    return [f"per rank at {layout} (SGLang 0.5.23's DeepSeek-V4 sharding):",
            f"  attention TP {r.attn_tp} (DP {r.attn_dp}): {r.heads} heads x {r.head_dim}, "
            f"output groups {r.o_groups}; indexer {r.indexer_heads} heads x {r.indexer_dim} "
            f"(replicated), top-k {r.index_topk}, window {r.window}",
            f"  MoE TP {r.moe_tp}, EP {r.ep}: {r.experts} of {r.experts_total} routed experts, "
            f"intermediate {r.moe_intermediate}, top-k {r.topk}, hidden {r.hidden}, "
            f"swiglu limit {r.swiglu_limit if r.swiglu_limit is not None else 'none'}",
            f"  decode: next_n {r.next_n} query tokens per request per step; {r.layers} layers"
            + (f" ({by_ratio})" if by_ratio else ""),
            f"  KV per token per layer: {r.kv_bytes_per_token} B main pool (whole on every "
            f"attention rank); indexer {r.indexer_bytes_per_token} B per c4 token"]


def _list_builtins(args) -> int:
    from ..models import builtin_entry, builtin_names
    rows = [{"name": n, "summary": builtin_entry(n)["summary"],
             "published": builtin_entry(n)["published"]} for n in builtin_names()]
    if args.format == "json":
        print(json.dumps({"schema": 1, "models": rows}, indent=2))
    else:
        from .render import wrap, wrap_lines
        w = max(len(r["name"]) for r in rows)
        # A summary wraps under itself; its URL stays whole.
        lines = [x for r in rows for x in wrap(f"{r['name']:<{w}}  {r['summary']}", hang=" " * (w + 2),
                                              break_long=False)]
        print("\n".join(lines + [""] + wrap_lines(["show one: dispatch model NAME [--tp N --ep N "
                                                   "--dp-attention]; or give a config.json path"])))
    return ExitCode.OK


def run(args) -> int:
    from ..models import ModelError, load_model
    if args.name is None:
        return _list_builtins(args)
    shape = load_model(args.name)
    try:
        rank, refusal = shape.for_rank(args.tp, args.ep, args.dp_attention,
                                       next_n=args.next_n), None
    except ModelError as exc:
        rank, refusal = None, exc
    if args.format == "json":
        obj = {"schema": 1, "model": shape.to_dict(),
               "layout": {"tp": args.tp, "ep": args.ep, "dp_attention": args.dp_attention,
                          "next_n": args.next_n},
               "rank": rank.to_dict() if rank else None,
               "refusal": None if refusal is None else {
                   "message": str(refusal),
                   "layouts": [{"tp": lay.tp, "ep": lay.ep, "dp_attention": lay.dp_attention}
                               for lay in refusal.layouts]}}
        print(json.dumps(obj, indent=2), flush=True)
    else:
        from .render import wrap_lines
        lines = model_lines(shape)
        if rank is not None:
            lines += [""] + rank_lines(rank)
        print("\n".join(wrap_lines(lines, hang="    ", break_long=False)), flush=True)
    if refusal is not None:
        raise refusal
    return ExitCode.OK

"""How SGLang 0.5.23 spreads DeepSeek-V4 over ranks: ModelShape + Layout -> RankShape.

Every `shape` below is a ModelShape (models/shape.py, which builds on this module).

The rules, each read from SGLang's code (docs/models.md quotes the places):
- attention TP width = tp / attention-DP width (runtime_context.derive_attn_tp_size); with
  --enable-dp-attention the DP width is tp, so attention runs unsharded on each rank;
  tp must be a multiple of it (arg_groups/parallel_hook.py);
- query heads and output groups per rank = heads / attention TP, o_groups / attention TP
  (models/deepseek_v4.py, MqaAttentionBase: n_local_heads, n_local_groups);
- the indexer is replicated: every rank runs all its heads
  (layers/attention/dsv4/indexer.py: ReplicatedLinear, n_local_heads = n_heads);
- MoE TP width = tp / ep, with tp == ep * moe_tp exactly (runtime_context.py,
  parallel_widths_of and its check "tp_size == moe_ep_size * moe_dp_size * moe_tp_size");
- routed experts per rank = experts / ep, which must divide (layers/moe/fused_moe_triton/
  layer.py: assert num_global_routed % ep_size == 0); each expert's intermediate size per
  rank = moe_intermediate / MoE TP, which must divide (same file);
- the KV cache is one latent per token (one KV head), so every attention rank holds it
  whole; the V4 main pool row is fp8 nope + bf16 rope + one scale byte per 64 nope
  values + 1 pad byte (mem_cache/deepseek_v4_memory_pool.py): backends/v4_layout.py's
  row_bytes, its TOKEN_BYTES for head_dim 512.
"""
from __future__ import annotations

from typing import Optional

import attrs

from ..backends import v4_layout
from .errors import ModelError


def int_tuple(value) -> tuple:
    return tuple(int(v) for v in value)


@attrs.frozen
class Layout:
    """A way to spread the model over ranks, as SGLang's launch flags say it."""
    tp: int
    ep: int = 1
    dp_attention: bool = False

    def __str__(self) -> str:
        text = f"tp {self.tp} ep {self.ep}"
        return text + " dp-attention" if self.dp_attention else text


@attrs.frozen
class RankShape:
    """What one rank holds and computes under a layout, the way SGLang 0.5.23 shards
    DeepSeek-V4 (docs/models.md says where each rule comes from).

    heads: attention query heads on this rank (heads / attention TP width);
    indexer_heads: the indexer's heads (replicated: every rank runs all of them);
    experts: routed experts stored on this rank; experts_total: all routed experts;
    topk: experts per token; moe_intermediate: each expert's intermediate size on this
    rank (moe_intermediate / MoE TP width); next_n: query tokens per request per decode
    step (1 + speculative tokens); kv_bytes_per_token: bytes per token per layer of
    the V4 main KV pool (fp8 nope + bf16 rope + scales); indexer_bytes_per_token: bytes
    per compressed (c4) token per c4 layer of the indexer pool (fp8 keys + fp32 scales).
    """
    model: str
    tp: int
    ep: int
    dp_attention: bool
    layers: int
    heads: int
    head_dim: int
    indexer_heads: int
    indexer_dim: int
    index_topk: int
    window: int
    next_n: int
    experts: int
    experts_total: int
    topk: int
    hidden: int
    moe_intermediate: int
    swiglu_limit: Optional[float]
    kv_bytes_per_token: int
    # Beyond the contract's names: what the KV and MoE builders also need.
    attn_tp: int
    attn_dp: int
    moe_tp: int
    rope_dim: int
    o_groups: int
    shared_experts: int
    vocab: int
    compress_ratios: tuple = attrs.field(converter=int_tuple)
    indexer_bytes_per_token: int

    @property
    def layers_by_ratio(self) -> dict:
        """Decoder layers per compress ratio: {0: sliding-window only, 4: c4, 128: c128}."""
        out: dict = {}
        for r in self.compress_ratios:
            out[r] = out.get(r, 0) + 1
        return dict(sorted(out.items()))

    def kv_bytes_per_request(self, context: int) -> int:
        """KV bytes one request of `context` tokens holds on this rank, over all layers:
        every layer's sliding-window ring (window + next_n - 1 rows, as SGLang sizes it for
        speculative verify), each c4 layer's compressed rows (context / 4) and their indexer
        keys, each c128 layer's compressed rows (context / 128). A lower bound: the small
        per-request compress-state rings and page rounding are not counted."""
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise ModelError(f"context {context!r} is not valid; valid: an integer >= 0 tokens")
        ring = min(context, self.window + self.next_n - 1)
        total = 0
        for ratio in self.compress_ratios:
            total += ring * self.kv_bytes_per_token
            if ratio:
                rows = -(-context // ratio)
                total += rows * self.kv_bytes_per_token
                if ratio == 4:
                    total += rows * self.indexer_bytes_per_token
        return total

    def to_dict(self) -> dict:
        d = attrs.asdict(self, recurse=False)
        d["compress_ratios"] = list(self.compress_ratios)
        d["layers_by_ratio"] = {str(k): v for k, v in self.layers_by_ratio.items()}
        return d


def kv_bytes_per_token(shape) -> int:
    """Bytes per token per layer of SGLang's V4 main KV pool row (the V4 layout's row)."""
    return v4_layout.row_bytes(shape.nope_dim, shape.rope_dim)


def indexer_bytes_per_token(shape) -> int:
    """Bytes per compressed token of the indexer pool (fp8 keys, one fp32 scale per 128)."""
    return shape.indexer_dim + shape.indexer_dim // 128 * 4


# The largest --tp / --ep a plan takes (a group of 4096 GPUs); checked before any search.
MAX_RANKS = 4096
# The tp x ep pairs the fallback search tries: tp up to this, every ep dividing it.
SEARCH_PAIRS = 64


def _problem(shape, tp, ep, dp_attention: bool):
    """The first rule a layout breaks, as (message, knob to vary), or None."""
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_RANKS:
        return f"tp {tp!r} is not a rank count (an integer from 1 to {MAX_RANKS})", "tp"
    if isinstance(ep, bool) or not isinstance(ep, int) or not 1 <= ep <= MAX_RANKS:
        return f"ep {ep!r} is not a rank count (an integer from 1 to {MAX_RANKS})", "ep"
    attn_tp = 1 if dp_attention else tp
    where = "attention TP 1 (dp-attention)" if dp_attention else f"tp {tp}"
    if shape.heads % attn_tp:
        return f"heads {shape.heads} do not divide over {where}", "tp"
    if shape.o_groups % attn_tp:
        return f"output groups (o_groups) {shape.o_groups} do not divide over {where}", "tp"
    if tp % ep:
        return f"ep {ep} does not divide tp {tp} (SGLang needs tp = ep x MoE TP)", "ep"
    if shape.experts % ep:
        return f"experts {shape.experts} do not divide over ep {ep}", "ep"
    moe_tp = tp // ep
    if shape.moe_intermediate % moe_tp:
        return (f"moe_intermediate {shape.moe_intermediate} does not divide over MoE TP "
                f"{moe_tp} (tp {tp} / ep {ep})", "ep")
    return None


def works(shape, layout: Layout) -> bool:
    return _problem(shape, layout.tp, layout.ep, layout.dp_attention) is None


def _proposals(shape, tp, ep, dp_attention: bool, knob: str) -> tuple:
    """Layouts near the refused one that work; bounded: at most MAX_RANKS single-knob
    candidates, or the tp x ep pairs up to SEARCH_PAIRS."""
    ranked = isinstance(tp, int) and not isinstance(tp, bool) and 1 <= tp <= MAX_RANKS
    top = max(8, tp) if ranked else 8
    if knob == "ep" and ranked:
        found = [Layout(tp, e, dp_attention) for e in range(1, tp + 1)]
    elif isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1:
        found = [Layout(t, ep, dp_attention) for t in range(1, top + 1)]
    else:
        found = [Layout(t, 1, dp_attention) for t in range(1, top + 1)]
    found = [lay for lay in found if works(shape, lay)]
    if not found:
        top = min(top, SEARCH_PAIRS)
        found = [Layout(t, e, dp_attention) for t in range(1, top + 1) for e in range(1, t + 1)]
        found = [lay for lay in found if works(shape, lay)]
    return tuple(found)


def _say(layouts: tuple, knob: str) -> str:
    if not layouts:
        return "no layout up to tp 8 works"
    tps, eps = {lay.tp for lay in layouts}, {lay.ep for lay in layouts}
    if len(tps) == 1 and knob == "ep":
        return f"ep {', '.join(str(lay.ep) for lay in layouts)} would (tp {layouts[0].tp})"
    if len(eps) == 1:
        return f"tp {', '.join(str(lay.tp) for lay in layouts)} would (ep {layouts[0].ep})"
    return "these would: " + ", ".join(f"tp {lay.tp} ep {lay.ep}" for lay in layouts)


def check(shape, tp, ep=1, dp_attention: bool = False) -> None:
    """Raise ModelError, naming the numbers and the layouts that would work, if SGLang
    would refuse this layout."""
    found = _problem(shape, tp, ep, dp_attention)
    if found is None:
        return
    message, knob = found
    layouts = _proposals(shape, tp, ep, dp_attention, knob)
    raise ModelError(f"{shape.name}: {message}; {_say(layouts, knob)}", layouts)


def for_rank(shape, *, tp=1, ep=1, dp_attention: bool = False,
             next_n: Optional[int] = None) -> RankShape:
    if not isinstance(dp_attention, bool):
        raise ModelError(f"dp_attention {dp_attention!r} is not valid; valid: true or false")
    check(shape, tp, ep, dp_attention)
    if next_n is None:
        # Each MTP layer drafts one token; the verify step carries them plus the real one.
        next_n = 1 + shape.mtp
    elif isinstance(next_n, bool) or not isinstance(next_n, int) or next_n < 1:
        raise ModelError(f"next_n {next_n!r} is not valid; valid: an integer >= 1 "
                         f"(1 + speculative draft tokens per request)")
    attn_tp = 1 if dp_attention else tp
    moe_tp = tp // ep
    return RankShape(
        model=shape.name, tp=tp, ep=ep, dp_attention=dp_attention, layers=shape.layers,
        heads=shape.heads // attn_tp, head_dim=shape.head_dim,
        indexer_heads=shape.indexer_heads, indexer_dim=shape.indexer_dim,
        index_topk=shape.index_topk, window=shape.window, next_n=next_n,
        experts=shape.experts // ep, experts_total=shape.experts,
        topk=shape.experts_per_token, hidden=shape.hidden,
        moe_intermediate=shape.moe_intermediate // moe_tp, swiglu_limit=shape.swiglu_limit,
        kv_bytes_per_token=kv_bytes_per_token(shape),
        attn_tp=attn_tp, attn_dp=tp // attn_tp, moe_tp=moe_tp, rope_dim=shape.rope_dim,
        o_groups=shape.o_groups // attn_tp, shared_experts=shape.shared_experts,
        vocab=shape.vocab, compress_ratios=shape.layer_ratios,
        indexer_bytes_per_token=indexer_bytes_per_token(shape))

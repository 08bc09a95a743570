"""The model-shape records: a model's facts (ModelShape) and one rank's share (RankShape)."""
from __future__ import annotations

from typing import Optional

import attrs


def _ints(value) -> tuple:
    return tuple(int(v) for v in value)


@attrs.frozen
class TensorFormat:
    """How one kind of tensor is stored in the checkpoint.

    kind: routed_experts | linear | unquantized; dtype: mxfp4, fp8_e4m3, bf16, ...;
    scale: the scale's format (e8m0, ue8m0) or None; block: the elements one scale
    covers, (rows, cols), or None.
    """
    kind: str
    dtype: str
    scale: Optional[str] = None
    block: Optional[tuple] = attrs.field(default=None, converter=attrs.converters.optional(_ints))

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "scale": self.scale,
                "block": list(self.block) if self.block is not None else None}

    def describe(self) -> str:
        if self.scale is None:
            return self.dtype
        block = "x".join(str(b) for b in self.block) if self.block else "tensor"
        return f"{self.dtype}, {self.scale} scale per {block}"


# What each kind covers, in words (the same for every DeepSeek-V4 checkpoint).
FORMAT_COVERS = {
    "routed_experts": "routed experts' w1/w2/w3 (layers.*.ffn.experts.*)",
    "linear": "weights outside the routed experts that ship a .scale: attention projections, "
              "shared experts",
    "unquantized": "weights without a .scale: embeddings, lm_head, norms, router gate "
                   "(attention sinks and compressor position biases are fp32)",
}


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
    compress_ratios: tuple = attrs.field(converter=_ints)
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
            from .errors import ModelError
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


@attrs.frozen
class ModelShape:
    """A DeepSeek-V4-class model's facts, from a built-in or a config.json.

    heads: attention query heads; head_dim: the MLA latent / attention head dim
    (nope + rope, 512 for V4); index_topk: the c4 indexer's top-k; window: the sliding
    window (its top-k); compress_ratios: one per decoder layer then one per next-n
    layer, as the config lists them (empty if the config has none); experts: routed
    experts in total; dense_layers: leading layers with a dense MLP; hash_layers:
    leading MoE layers routed by token id; mtp: next-n predict layers.
    """
    name: str
    source: str
    layers: int
    hidden: int
    vocab: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    indexer_heads: int
    indexer_dim: int
    index_topk: int
    window: int
    compress_ratios: tuple = attrs.field(converter=_ints)
    experts: int
    experts_per_token: int
    moe_intermediate: int
    shared_experts: int
    dense_layers: int
    hash_layers: int
    mtp: int
    swiglu_limit: Optional[float] = None
    max_context: Optional[int] = None
    formats: tuple = attrs.field(default=(), converter=tuple)

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def layer_ratios(self) -> tuple:
        """The decoder layers' compress ratios (the config's trailing next-n entries dropped)."""
        return self.compress_ratios[: self.layers]

    def format_of(self, kind: str) -> Optional[TensorFormat]:
        return next((f for f in self.formats if f.kind == kind), None)

    def calls(self):
        """What the model calls of capdispatch's ops (models.calls.ModelCalls, from calls.yaml)."""
        from .calls import model_calls
        return model_calls()

    def for_rank(self, tp: int = 1, ep: int = 1, dp_attention: bool = False, *,
                 next_n: Optional[int] = None) -> RankShape:
        """One rank's shapes under `--tp`/`--ep`/`--dp-attention` (attention DP as wide as
        tp); next_n defaults to 1 + mtp. Raises ModelError where SGLang would refuse."""
        from .sharding import for_rank
        return for_rank(self, tp=tp, ep=ep, dp_attention=dp_attention, next_n=next_n)

    def to_dict(self) -> dict:
        d = attrs.asdict(self, recurse=False)
        d["compress_ratios"] = list(self.compress_ratios)
        d["formats"] = {f.kind: f.to_dict() for f in self.formats}
        return d

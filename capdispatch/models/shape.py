"""A model's facts (ModelShape) and how its tensors are stored (TensorFormat); one rank's
share (RankShape) lives with the sharding rules that give it."""
from __future__ import annotations

from typing import Optional

import attrs

from .sharding import RankShape, for_rank, int_tuple


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
    block: Optional[tuple] = attrs.field(default=None, converter=attrs.converters.optional(int_tuple))

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
    compress_ratios: tuple = attrs.field(converter=int_tuple)
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
    # The rope: window-only layers rotate with rope_theta, compressed layers with
    # compress_rope_theta (SGLang's config defaults); YaRN stretches rope_original positions
    # by rope_factor (rope_scaling; None: no scaling).
    rope_theta: float = 10000.0
    compress_rope_theta: float = 40000.0
    rope_factor: float = 1.0
    rope_original: Optional[int] = None

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
        return for_rank(self, tp=tp, ep=ep, dp_attention=dp_attention, next_n=next_n)

    def to_dict(self) -> dict:
        d = attrs.asdict(self, recurse=False)
        d["compress_ratios"] = list(self.compress_ratios)
        d["formats"] = {f.kind: f.to_dict() for f in self.formats}
        return d

"""Memory one rank needs: weights in their stored formats, the V4 KV pools for a context and
batch, and an estimate of workspaces and CUDA-graph pools, the way SGLang 0.5.23 loads and
sizes DeepSeek-V4. Pure arithmetic on the model-shape record (no torch).

Where each number comes from (SGLang 0.5.23):
* weights: `models/deepseek_v4.py` (attention wq_a / wkv replicated; wq_b, wo_a, wo_b split
  over attention TP; attn_sink fp32 per head; the hyper-connection mixers fp32,
  `hc_mult * (2 + hc_mult)` rows of `hc_mult * hidden`), `layers/attention/dsv4/compressor.py`
  (wkv_gate bf16 [hidden, 2 * coff * head_dim], coff 2 for c4, 1 for c128; ape fp32),
  `layers/attention/dsv4/indexer.py` (wq_b and weights_proj bf16, replicated; its own c4
  compressor), the routed experts split over EP and MoE TP, the shared expert over TP,
  `VocabParallelEmbedding` split over TP unless attention is data parallel, `ParallelLMHead`
  split over TP;
* what SGLang makes at load beside the stored weights: `models/deepseek_v4.py` dequantises
  wo_a to bf16 while loading unless its fp8 GEMM runs (SGLANG_OPT_FP8_WO_A_GEMM survives
  the launcher only with DeepGEMM's UE8M0 scales, SM100, or an explicit opt-in on SM90), and
  keeps per rope base (rope_theta for the window layers, compress_rope_theta for the
  compressed ones) a complex64 `freqs_cis` over max_position_embeddings and its rotary
  embedding's fp32 cos|sin cache over original x factor positions (`rotary_embedding/`,
  kept fp32 on CUDA);
* KV: `mem_cache/deepseek_v4_memory_pool.py` (rows of v4_layout.TOKEN_BYTES; each layer's sliding-window ring
  of window + next_n - 1 rows; c4 / c128 compressed rows; the indexer's 132 bytes per c4 row)
  and `model_executor/pool_configurator.py` (the per-request compress-state rings: c4 rings
  of 8 rows, 16 with speculative decoding, of 4 x (head_dim + indexer_dim) fp32 values; c128
  rings of 128 rows, 256 with speculative decoding, of 2 x head_dim fp32 values:
  SGLANG_DSV4_COMPRESS_STATE_DTYPE defaults to float32, online compression is off by default).
"""
from __future__ import annotations

import attrs

from ..backends import v4_layout
from .errors import ModelError
from .shape import ModelShape
from .sharding import RankShape

GIB = 1 << 30
HC_MULT = 4                 # DeepSeek-V4's hyper-connection width (models/deepseek_v4.py: 24 = 4 x (2 + 4))
STATE_BYTES = 4             # compress-state dtype: fp32 (SGLANG_DSV4_COMPRESS_STATE_DTYPE default)
SCALE_BYTES = 4             # SGLang keeps FP8 block scales as fp32 weight_scale_inv per 128x128 block
FREQS_BYTES = 8             # freqs_cis: complex64 per position and rope pair
ROPE_CACHE_BYTES = 4        # the rotary embedding's cos|sin cache: fp32 per position and rope dim
DEFAULT_POSITIONS = 65536   # SGLang's DeepSeek-V4 config: max_position_embeddings when absent

# Bytes per stored element for the formats a checkpoint may state.
ELEMENT_BYTES = {"mxfp4": 17 / 32,          # 4-bit e2m1 + one E8M0 byte per 32: 4.25 bits
                 "fp8_e4m3": 1, "fp8": 1, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
                 "fp32": 4, "float32": 4}

# What the estimate leaves out or can only approximate, with its margin.
MARGINS = {"weights": 0.02, "kv": 0.05, "workspace": 0.5}
MARGIN_TEXT = ("weights within 2% (formats and shapes are exact; norms and small buffers "
               "approximated), KV within 5% (SGLang's paged layout, per-request page rounding not "
               "counted), workspace and CUDA graphs within 50% "
               "(activations depend on SGLang's chunking and the kernels chosen)")


@attrs.frozen
class Part:
    """One line of a rank's memory: a name, bytes, and what it counts."""
    name: str
    bytes: int
    note: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "gib": round(self.bytes / GIB, 3), "note": self.note}


@attrs.frozen
class RankMemory:
    weights: tuple
    kv: tuple
    workspace: tuple
    context: int
    batch: int

    @property
    def weight_bytes(self) -> int:
        return sum(p.bytes for p in self.weights)

    @property
    def kv_bytes(self) -> int:
        return sum(p.bytes for p in self.kv)

    @property
    def workspace_bytes(self) -> int:
        return sum(p.bytes for p in self.workspace)

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.workspace_bytes

    @property
    def high(self) -> int:
        """The total at the top of the stated margins."""
        return int(self.weight_bytes * (1 + MARGINS["weights"]) + self.kv_bytes * (1 + MARGINS["kv"])
                   + self.workspace_bytes * (1 + MARGINS["workspace"]))

    def to_dict(self) -> dict:
        return {"context": self.context, "batch": self.batch,
                "weights": [p.to_dict() for p in self.weights],
                "kv": [p.to_dict() for p in self.kv],
                "workspace": [p.to_dict() for p in self.workspace],
                "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                "workspace_bytes": self.workspace_bytes, "total_bytes": self.total,
                "high_bytes": self.high}


def _elem(model: ModelShape, kind: str) -> float:
    fmt = model.format_of(kind)
    dtype = fmt.dtype if fmt is not None else "bf16"
    if dtype not in ELEMENT_BYTES:
        raise ModelError(f"{model.name}: {kind} tensors stored as {dtype!r}: the memory plan knows "
                         f"{', '.join(sorted(ELEMENT_BYTES))}")
    return ELEMENT_BYTES[dtype]


def _linear(model: ModelShape, rows: int, cols: int) -> float:
    """Bytes of one linear weight in the checkpoint's linear format, with its block scales."""
    fmt = model.format_of("linear")
    n = rows * cols * _elem(model, "linear")
    if fmt is not None and fmt.scale and fmt.block:
        br, bc = fmt.block
        n += -(-rows // br) * -(-cols // bc) * SCALE_BYTES
    return n


def _ratio_of_mtp(model: ModelShape, i: int) -> int:
    extra = model.compress_ratios[model.layers:]
    return extra[i] if i < len(extra) else 0


def _layer(model: ModelShape, rank: RankShape, ratio: int, *, hash_layer: bool, fp8_wo_a: bool) -> dict:
    """Bytes per kind of one decoder layer on this rank."""
    H, D, q = model.hidden, model.head_dim, model.q_lora_rank
    heads = rank.heads
    out = {"linear": 0.0, "routed": 0.0, "bf16": 0.0, "fp32": 0.0}
    # Attention projections (fp8 with block scales in V4 checkpoints).
    out["linear"] += _linear(model, H, q) + _linear(model, H, D)                    # wq_a, wkv
    out["linear"] += _linear(model, q, heads * D)                                  # wq_b
    wo_a = (model.heads * D // model.o_groups, rank.o_groups * model.o_lora_rank)
    out["linear"] += _linear(model, *wo_a) if fp8_wo_a else wo_a[0] * wo_a[1] * 2   # wo_a
    out["linear"] += _linear(model, rank.o_groups * model.o_lora_rank, H)          # wo_b
    out["fp32"] += heads * 4                                                       # attn_sink
    out["bf16"] += (q + D + 2 * H) * 2                                             # norms
    mix = HC_MULT * (2 + HC_MULT)
    out["fp32"] += 2 * mix * HC_MULT * H * 4                                       # hc mixers
    if ratio:
        coff = 2 if ratio == 4 else 1
        out["bf16"] += H * 2 * coff * D * 2                                        # compressor wkv_gate
        out["fp32"] += ratio * coff * D * 4 + D * 4                                # ape, norm
    if ratio == 4:
        I_ = model.indexer_heads * model.indexer_dim
        out["bf16"] += (q * I_ + H * model.indexer_heads) * 2                      # indexer wq_b, weights_proj
        out["bf16"] += H * 2 * 2 * model.indexer_dim * 2                           # its compressor
        out["fp32"] += 4 * 2 * model.indexer_dim * 4
    # MoE: router gate (bf16) and bias, shared expert over TP, routed experts over EP x MoE TP.
    out["bf16"] += model.experts * H * 2
    out["fp32"] += model.experts * 4
    if hash_layer:
        out["fp32"] += model.vocab * model.experts_per_token * 4                   # tid2eid (int32)
    out["linear"] += model.shared_experts * 3 * _linear(model, H, model.moe_intermediate) / rank.tp
    out["routed"] += rank.experts * 3 * H * rank.moe_intermediate * _elem(model, "routed_experts")
    return out


def rope_bytes(model: ModelShape, ratios) -> int:
    """SGLang's rope tables for layers of these compress RATIOS: one freqs_cis and one rotary
    cos|sin cache per distinct base."""
    bases = {model.compress_rope_theta if r else model.rope_theta for r in ratios}
    positions = model.max_context or DEFAULT_POSITIONS
    rows = int(model.rope_original * model.rope_factor) if model.rope_original else positions
    return len(bases) * (positions * (model.rope_dim // 2) * FREQS_BYTES + rows * model.rope_dim * ROPE_CACHE_BYTES)


def weight_parts(model: ModelShape, rank: RankShape, *, fp8_wo_a: bool = False) -> tuple:
    """The weights one rank loads, by stored format, and what SGLang makes beside them at load
    (wo_a in bf16 unless FP8_WO_A: SGLang's fp8 wo_a GEMM runs, on SM100; the rope tables).
    The MTP (next-n) layers are counted when the rank verifies drafts (next_n > 1), as SGLang
    loads them for speculative decoding."""
    if model.dense_layers:
        raise ModelError(f"{model.name}: {model.dense_layers} dense layers: the memory plan models "
                         f"DeepSeek-V4's all-MoE layers only")
    total = {"linear": 0.0, "routed": 0.0, "bf16": 0.0, "fp32": 0.0}
    ratios = list(model.layer_ratios) + [0] * (model.layers - len(model.layer_ratios))
    for i, ratio in enumerate(ratios):
        for k, v in _layer(model, rank, ratio, hash_layer=i < model.hash_layers, fp8_wo_a=fp8_wo_a).items():
            total[k] += v
    mtp = model.mtp if rank.next_n > 1 else 0
    for i in range(mtp):
        for k, v in _layer(model, rank, _ratio_of_mtp(model, i), hash_layer=False, fp8_wo_a=fp8_wo_a).items():
            total[k] += v
        total["linear"] += _linear(model, 2 * model.hidden, model.hidden)           # eh_proj
        total["bf16"] += 3 * model.hidden * 2
    embed = model.vocab * model.hidden * _elem(model, "unquantized")
    embed_rank = embed if rank.dp_attention else embed / rank.tp
    head_rank = embed / rank.tp
    fmt = {k: (model.format_of(k).describe() if model.format_of(k) else "bf16")
           for k in ("routed_experts", "linear", "unquantized")}
    parts = [
        Part("routed experts", int(total["routed"]),
             f"{rank.experts} of {rank.experts_total} experts x {model.layers} layers"
             + (f" + {mtp} MTP" if mtp else "") + f", intermediate {rank.moe_intermediate}; "
             f"{fmt['routed_experts']}"),
        Part("attention and shared-expert linears", int(total["linear"]),
             f"{rank.heads} heads per rank; {fmt['linear']}"
             + ("" if fp8_wo_a else "; wo_a as bf16 (SGLang dequantises it at load where its fp8 GEMM "
                                    "does not run: every card but SM100)")),
        Part("compressors, indexers, norms, router", int(total["bf16"] + total["fp32"]),
             "bf16 projections (replicated), fp32 sinks, position biases, hyper-connection mixers"),
        Part("embedding", int(embed_rank),
             "whole on every rank (dp-attention)" if rank.dp_attention else f"1/{rank.tp} of the vocab"),
        Part("lm_head", int(head_rank), f"1/{rank.tp} of the vocab"),
        Part("rope tables", rope_bytes(model, ratios + [_ratio_of_mtp(model, i) for i in range(mtp)]),
             "SGLang's per rope base: complex64 freqs_cis and the rotary embedding's fp32 cos|sin "
             "cache, made at load"),
    ]
    return tuple(parts)


def state_ring_rows(ratio: int, speculative: bool) -> int:
    """Rows of one request's compress-state ring (SGLang's get_compress_state_ring_size)."""
    if ratio == 4:
        return 16 if speculative else 8
    return 256 if speculative else 128


PAGE_SIZE = 256            # tokens per page of the main pool (a compressed pool: PAGE_SIZE / ratio rows)
INDEX_PAGE = 64            # c4 rows per index-K page (SGLang's block_kv for DSv4)


def page_bytes(rows: int, row_bytes: int = v4_layout.TOKEN_BYTES) -> int:
    """One V4 pool page of ROWS rows of ROW_BYTES (the layout's TOKEN_BYTES: the rows' data,
    then their scales), padded to a multiple of v4_layout.PAGE_ALIGN: at TOKEN_BYTES,
    v4_layout.bytes_per_page(ROWS)."""
    return -(-(rows * row_bytes) // v4_layout.PAGE_ALIGN) * v4_layout.PAGE_ALIGN


@attrs.frozen
class Pool:
    """One kind of KV tensor as SGLang allocates it: COUNT tensors (one per layer) of SHAPE."""
    name: str
    count: int
    shape: tuple = attrs.field(converter=tuple)
    dtype: str                  # "uint8" or "float32"

    @property
    def bytes(self) -> int:
        n = 4 if self.dtype == "float32" else 1
        for d in self.shape:
            n *= d
        return n * self.count


def kv_pools(model: ModelShape, rank: RankShape, context: int, batch: int, *,
             page_size: int = PAGE_SIZE) -> tuple:
    """The V4 pools for BATCH requests of CONTEXT tokens on this rank, one Pool per kind (every
    attention rank holds the latent whole): window rings, c4 / c128 compressed rows and the c4
    indexer keys, paged (pages of PAGE_SIZE tokens; PAGE_SIZE / ratio compressed rows), the MTP
    layers' pools with them, and the compress-state rings (one per request slot: batch + 1, as
    SGLang reserves one)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ModelError(f"context {context!r} is not valid; valid: an integer >= 0 tokens")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ModelError(f"batch {batch!r} is not valid; valid: an integer >= 1 (requests)")
    spec = rank.next_n > 1
    mtp = model.mtp if spec else 0
    ratios = list(rank.compress_ratios) + [_ratio_of_mtp(model, i) for i in range(mtp)]
    ring = min(context, rank.window + rank.next_n - 1)
    row = rank.kv_bytes_per_token

    def pages(rows, per_page):
        return -(-rows // per_page)
    out = [Pool("window rings", len(ratios), (pages(batch * ring, page_size), page_bytes(page_size, row)),
                "uint8")]
    for ratio in (4, 128):
        n = ratios.count(ratio)
        if not n:
            continue
        rows = batch * -(-context // ratio)
        per_page = max(page_size // ratio, 1)
        out.append(Pool(f"c{ratio} rows", n, (pages(rows, per_page), page_bytes(per_page, row)), "uint8"))
        if ratio == 4:
            out.append(Pool("c4 indexer keys", n, (pages(rows, INDEX_PAGE),
                                                   INDEX_PAGE * rank.indexer_bytes_per_token), "uint8"))
    slots = batch + 1
    c4, c128 = ratios.count(4), ratios.count(128)
    if c4:
        out.append(Pool("c4 compress states", c4, (slots * state_ring_rows(4, spec),
                                                   4 * (model.head_dim + model.indexer_dim)), "float32"))
    if c128:
        out.append(Pool("c128 compress states", c128, (slots * state_ring_rows(128, spec),
                                                       2 * model.head_dim), "float32"))
    return tuple(out)


def kv_parts(model: ModelShape, rank: RankShape, context: int, batch: int, *,
             page_size: int = PAGE_SIZE) -> tuple:
    """kv_pools summed into two lines: the pools, and the compress-state rings."""
    pools = kv_pools(model, rank, context, batch, page_size=page_size)
    spec = rank.next_n > 1
    ring = min(context, rank.window + rank.next_n - 1)
    n_layers = pools[0].count
    kv = sum(p.bytes for p in pools if "states" not in p.name)
    st = sum(p.bytes for p in pools if "states" in p.name)
    c4 = next((p.count for p in pools if p.name == "c4 rows"), 0)
    c128 = next((p.count for p in pools if p.name == "c128 rows"), 0)
    return (
        Part("KV pools", kv,
             f"{batch} x {context} tokens: {n_layers} layers' window rings ({ring} rows of "
             f"{rank.kv_bytes_per_token} B), c4 and c128 rows, indexer keys "
             f"({rank.indexer_bytes_per_token} B per c4 row), in pages of {page_size} tokens"),
        Part("compress-state rings", st,
             f"{batch + 1} request slots x ({c4} c4 rings of {state_ring_rows(4, spec)} rows + {c128} c128 "
             f"rings of {state_ring_rows(128, spec)} rows), fp32"),
    )


def prefill_chunk(card_bytes: int) -> int:
    """The prefill chunk the workspace estimate assumes for a card of CARD_BYTES
    (SGLang picks a larger --chunked-prefill-size on larger cards)."""
    gib = card_bytes / GIB
    return 8192 if gib >= 80 else 4096 if gib >= 35 else 2048


def workspace_parts(model: ModelShape, rank: RankShape, card_bytes: int, batch: int) -> tuple:
    """An estimate, not a measurement: the CUDA context and library handles, the activations
    of one prefill chunk, and the decode CUDA graphs' pool."""
    chunk = prefill_chunk(card_bytes)
    H = model.hidden
    per_token = (2 * HC_MULT * H * 4                       # hyper-connection residual streams (fp32)
                 + 3 * rank.heads * model.head_dim * 2     # q, attention out, o projection in
                 + 2 * rank.topk * H * 2                   # MoE dispatch and combine
                 + 2 * rank.topk * rank.moe_intermediate * 2
                 + model.vocab // rank.tp * 4 // 8)        # logits (one token in eight samples)
    graphs = max(batch, 1) * rank.next_n * per_token * 4 + 256 * (1 << 20)
    return (
        Part("CUDA context and handles", 640 * (1 << 20), "CUDA context, cuBLAS and NCCL handles (typical)"),
        Part("prefill activations", chunk * per_token, f"one chunk of {chunk} tokens"),
        Part("CUDA graph pool", graphs, f"decode graphs up to batch {batch} x next_n {rank.next_n}"),
    )


def rank_memory(model: ModelShape, rank: RankShape, *, context: int, batch: int,
                card_bytes: int, fp8_wo_a: bool = False) -> RankMemory:
    return RankMemory(weight_parts(model, rank, fp8_wo_a=fp8_wo_a), kv_parts(model, rank, context, batch),
                      workspace_parts(model, rank, card_bytes, batch), context, batch)


def largest_context(model: ModelShape, rank: RankShape, *, batch: int, card_bytes: int,
                    budget: int, limit: int, fp8_wo_a: bool = False) -> int:
    """The largest context (tokens, up to LIMIT) whose memory at BATCH fits BUDGET bytes;
    0 when not even an empty cache fits."""
    fixed = (sum(p.bytes for p in weight_parts(model, rank, fp8_wo_a=fp8_wo_a))
             + sum(p.bytes for p in workspace_parts(model, rank, card_bytes, batch)))

    def fits(ctx):
        return fixed + sum(p.bytes for p in kv_parts(model, rank, ctx, batch)) <= budget
    if not fits(0):
        return 0
    if fits(limit):
        return limit
    lo, hi = 0, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo

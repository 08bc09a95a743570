"""The rehearsal's small model: a DeepSeek-V4-shaped stack, shrunk, in the stored formats.

Each layer: RMSNorm; attention (q projection to the rank's heads, one shared 512-wide MLA
latent per token written to the V4 fp8 pool by kv_quant; the prefill reads the pool back
through kv_dequant into sparse_prefill over a causal window; each decode step runs the
indexer over the fp8 index-key pages and decode_mla over the pool); the output projection
and a TP all-reduce; RMSNorm; routed MoE over MXFP4 experts with E8M0 scales (each rank
holds its slice of every expert's intermediate, or its experts under EP) and a TP
all-reduce; finally the vocabulary projection (replicated). Under DP attention (attention
TP 1) each rank runs the whole attention on its own sequence, and the MoE runs over every
rank's rows, all-gathered, before each rank keeps its own.

What is shrunk, and how (`Dims`): layers, hidden size, vocabulary, experts (total, then
split by EP as the layout splits them) and the experts' intermediate size (per rank); the
attention heads per rank, the 512-wide latent, the window, the indexer's heads and width
and the experts per token are the model's at the layout (`RankShape`).

Routes are drawn per token from the seed, not from a router: a rounding difference between
two backends then cannot flip an expert choice between the group and the reference. The
rehearsal's contexts are shorter than the model's index_topk, so V4 selects every token and
the indexer's logits do not change the hidden states; each call's logits are checked against
the reference op on the rank's own inputs instead (as every op's output is).

Weights derive from the seed alone: every rank and the reference build the same full model
and take their shard, so the reference is the same model.
"""
from __future__ import annotations

from typing import Callable

import attrs

PAGE = 64                 # the V4 pool's page size (tokens)
INDEX_PAGE = 64           # the indexer's fp8 page size (tokens)
LATENT = 512              # V4's MLA latent: the KV row and the attention head width
SCALE = LATENT ** -0.5


@attrs.frozen
class Dims:
    """One rank's shapes in the small model."""
    layers: int
    hidden: int
    vocab: int
    heads: int              # query heads on this rank (the layout's)
    ranks: int              # attention TP width
    dp: int                 # attention DP width (1, or tp under DP attention)
    experts_total: int
    experts: int            # experts on this rank
    ep: int
    moe_tp: int
    intermediate: int       # each expert's intermediate size on this rank
    topk: int
    window: int
    indexer_heads: int
    indexer_dim: int
    swiglu_limit: float

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def dims_of(shape, *, layers, hidden, vocab, experts, intermediate) -> Dims:
    """The small model's dims from a rank's RankShape and the shrunk sizes."""
    if experts % shape.ep:
        from .errors import RehearseError
        raise RehearseError(f"--experts {experts} does not divide over ep {shape.ep}")
    return Dims(layers=layers, hidden=hidden, vocab=vocab, heads=shape.heads, ranks=shape.attn_tp, dp=shape.attn_dp,
                experts_total=experts, experts=experts // shape.ep, ep=shape.ep, moe_tp=shape.moe_tp,
                intermediate=intermediate, topk=min(shape.topk, experts), window=shape.window,
                indexer_heads=shape.indexer_heads, indexer_dim=shape.indexer_dim,
                swiglu_limit=shape.swiglu_limit if shape.swiglu_limit is not None else 10.0)


def _gen(seed, *salt):
    import torch
    s = seed
    for x in salt:
        s = (s * 1000003 + x) % (2 ** 62)
    return torch.Generator().manual_seed(s)


def rank_weights(d: Dims, seed: int, rank: int) -> dict:
    """RANK's weights: its heads' columns and rows, its expert slice, and the replicated rest.

    Every part is drawn from SEED and the part's own coordinates (layer, and rank for a
    sharded part), so a rank draws only its own part and the reference draws every rank's:
    the same model either way. A full expert is its MoE TP slices side by side along the
    intermediate dimension, so the TP sum of the slices' outputs is the expert's."""
    import torch
    from ..backends.moe import reference as MR
    H, h = d.hidden, d.heads
    e_group, t_slice = divmod(rank, d.moe_tp)
    layers = []
    for i in range(d.layers):
        g = _gen(seed, i)                       # replicated on every rank
        r = _gen(seed, i, 1, rank % d.ranks)    # this rank's heads (its attention TP rank's)
        layers.append({
            "wkv": (torch.randn(H, LATENT, generator=g) * H ** -0.5).bfloat16(),
            "wiq": (torch.randn(H, d.indexer_heads * d.indexer_dim, generator=g) * H ** -0.5).bfloat16(),
            "wik": (torch.randn(H, d.indexer_dim, generator=g) * H ** -0.5).bfloat16(),
            "wiw": (torch.randn(H, d.indexer_heads, generator=g) * H ** -0.5).bfloat16(),
            "wq": (torch.randn(H, h * LATENT, generator=r) * H ** -0.5).bfloat16(),
            "sink": torch.randn(h, generator=r),
            "wo": (torch.randn(h * LATENT, H, generator=r) * (d.ranks * h * LATENT) ** -0.5).bfloat16(),
            "moe": MR.random_weights(d.experts, H, d.intermediate, gen=_gen(seed, i, 7, e_group, t_slice),
                                     swiglu_limit=d.swiglu_limit),
            "expert_base": e_group * d.experts,
        })
    g = _gen(seed, 10 ** 6)
    return {"layers": layers, "head": (torch.randn(H, d.vocab, generator=g) * H ** -0.5).bfloat16()}


def routes(d: Dims, seed: int, step: int, T: int):
    """(weights [T, topk], global expert ids [T, topk]) for STEP's tokens, from the seed."""
    from ..backends.moe import reference as MR
    return MR.random_routing(T, d.topk, d.experts_total, gen=_gen(seed, 99, step))


def tokens(d: Dims, seed: int, prompt: int, steps: int, seq: int = 0):
    """The prompt's token ids and each decode step's token (teacher-forced, from the seed) of
    sequence SEQ (under DP attention each DP rank serves its own)."""
    import torch
    return torch.randint(0, d.vocab, (prompt + steps,), generator=_gen(seed, 5, seq) if seq else _gen(seed, 5))


def embedding(d: Dims, seed: int):
    import torch
    return (torch.randn(d.vocab, d.hidden, generator=_gen(seed, 6))).bfloat16()


def rms(x):
    import torch
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()


class Layer:
    """One layer's cache on one rank: the fp8 KV pool and the index-key rows."""

    def __init__(self, d: Dims, max_tokens: int, device):
        from ..backends.kv_cache import reference as KV
        self.pages = -(-max_tokens // PAGE)
        self.pool = KV.new_pool(self.pages, PAGE, device)
        self.index_rows = []


@attrs.frozen
class Comm:
    """The group's collectives as the forward uses them (identities in the reference).

    reduce_attn(partial): the attention TP all-reduce; gather(rows): every DP rank's rows, in
    DP-rank order, for the MoE (identity without DP attention); reduce_moe(partial): the MoE's
    all-reduce over the whole group; own(rows): the rows of the sequences held here, one
    tensor per sequence."""
    reduce_attn: Callable
    gather: Callable
    reduce_moe: Callable
    own: Callable


def forward(d: Dims, attn: list, moe: list, ops, comm: Comm, xs: list, pos0: int, caches: list, step: int,
            seed: int, *, prefill: bool) -> list:
    """Hidden states -> logits of each held sequence's last token, for tokens at positions
    POS0... (XS: one [T, hidden] per sequence held: a rank's own, or every DP rank's in the
    reference).

    ATTN: the attention shards run here (a rank's one; the reference: each of the attention
    TP group's, whose partials it sums in rank order where the group all-reduces); MOE: the
    MoE shards (a rank's one; the reference: every rank's); CACHES[sequence][attention
    shard][layer]. OPS(name, layer, *args) runs an op (the rank's bound kernel, or the
    reference). Under DP attention each rank serves its own sequence with the whole
    attention, and the MoE runs over every DP rank's rows (gathered), as SGLang does."""
    import torch
    xs = list(xs)
    T, dev = xs[0].shape[0], xs[0].device
    positions = torch.arange(pos0, pos0 + T, device=dev)
    n = pos0 + T
    for li in range(d.layers):
        op = lambda name, *a: ops(name, li, *a)  # noqa: E731
        for si, x in enumerate(xs):
            hx = rms(x)
            part = None
            for w, cache in zip(attn, caches[si]):
                p = _attention(d, w["layers"][li], cache[li], hx, positions, n, op, prefill)
                part = p if part is None else part + p
            xs[si] = (x.float() + comm.reduce_attn(part)).bfloat16()
        hx = comm.gather([rms(x) for x in xs])
        tw, ids = routes(d, seed, step * 1000 + li, hx.shape[0])
        part = None
        for w in moe:
            lw = w["layers"][li]
            local = ids.to(dev) - lw["expert_base"]
            local = torch.where((local >= 0) & (local < d.experts), local, torch.full_like(local, -1))
            p = op("moe", hx, lw["moe"], tw.to(dev), local.to(torch.int32)).float()
            part = p if part is None else part + p
        xs = [(x.float() + o).bfloat16() for x, o in zip(xs, comm.own(comm.reduce_moe(part)))]
    return [rms(x)[-1:].float() @ moe[0]["head"].float() for x in xs]


def _attention(d, lw, cache, hx, positions, n, op, prefill):
    """This shard's heads: the float32 partial of the output projection."""
    import torch
    T, dev = hx.shape[0], hx.device
    q = (hx @ lw["wq"]).view(T, d.heads, LATENT)
    op("kv_quant", (hx @ lw["wkv"]).contiguous(), cache.pool, positions, PAGE)
    cache.index_rows.append((hx @ lw["wik"]).float())
    if prefill:
        rows = op("kv_dequant", cache.pool, torch.arange(n, device=dev), PAGE)
        # Causal window: query t sees positions max(0, t - window + 1) .. t (-1: no token).
        k = torch.arange(d.window, device=dev)
        idx = positions[:, None] - d.window + 1 + k[None, :]
        idx = torch.where(idx >= 0, idx, torch.full_like(idx, -1)).to(torch.int32).view(T, 1, d.window)
        o = op("sparse_prefill", q, rows.view(n, 1, LATENT), idx, SCALE, LATENT, lw["sink"], None)[0]
    else:
        _indexer(d, lw, cache, hx, n, op)
        # The window's positions first, -1 after them up to the window's width: the index list
        # keeps the model's top-k width (what the kernels' shape ranges were checked at).
        width = min(n, d.window)
        idx = torch.full((T, 1, d.window), -1, dtype=torch.int32, device=dev)
        idx[:, 0, :width] = torch.arange(n - width, n, device=dev, dtype=torch.int32)
        lengths = torch.full((T,), width, dtype=torch.int32, device=dev)
        o = op("decode_mla", q.view(T, 1, d.heads, LATENT), cache.pool, idx.contiguous(), PAGE, SCALE,
               lengths, lw["sink"])[0].view(T, d.heads, LATENT)
    return (o.reshape(T, d.heads * LATENT) @ lw["wo"]).float()


def _indexer(d: Dims, lw, cache, hx, n, op):
    """The indexer's logits for the step's last token over every cached token's index key."""
    import torch
    from ..backends.indexer import reference as IR
    dev = hx.device
    rows = torch.cat(cache.index_rows)[:n]
    pages = -(-n // INDEX_PAGE)
    padded = torch.zeros(pages * INDEX_PAGE, d.indexer_dim, device=dev)
    padded[:n] = rows
    codes, scales = IR.quantize_index_k(padded.view(pages, INDEX_PAGE, d.indexer_dim))
    kv = IR.pack_index_k(codes, scales)
    q = (hx[-1:] @ lw["wiq"]).float().view(1, 1, d.indexer_heads, d.indexer_dim).to(torch.float8_e4m3fn)
    wts = (hx[-1:] @ lw["wiw"]).float()
    lens = torch.tensor([n], dtype=torch.int32, device=dev)
    bt = torch.arange(pages, dtype=torch.int32, device=dev).view(1, pages)
    op("indexer", q, kv, wts, lens, bt, None, pages * INDEX_PAGE, False)

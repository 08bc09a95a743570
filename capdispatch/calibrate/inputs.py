"""Inputs for one op at one size, checked against the op's torch reference.

Each builder draws fresh random inputs (never zeros) from the caller's generator at
a rank's shapes (a profile: ladder.PROFILES, or one made from a model's RankShape by
ladder.profile_of), computes the reference output once, and returns a `Case`:
`verify(fn)` runs a backend and compares it with the reference (the op's tolerances, as
its tests state them), `bind(fn)` the zero-argument call that is timed.

A builder given BATCH (the per-batch tensors of another layer's case, at the op's
`batch_args` positions) builds this layer's inputs around them, the way the layers of one
forward share the batch's valid counts, slot maps and block tables.
"""
from __future__ import annotations

import math
from typing import Callable

import attrs

SCALE = 512 ** -0.5
HEADS = 64
SWA_TOPK, C4_TOPK = 128, 512
INDEXER_HEADS, INDEXER_DIM, INDEXER_PAGE = 64, 128, 64
MOE_TOPK, MOE_SWIGLU_LIMIT = 6, 10.0


@attrs.frozen
class Case:
    op: str
    size: int
    args: tuple
    verify: Callable        # fn -> (ok, detail)

    def bind(self, fn):
        args = self.args
        return lambda: fn(*args)


# --------------------------------------------------------------------------- #
# Comparisons
# --------------------------------------------------------------------------- #
def same_bf16(a, b) -> bool:
    """Bit equality, NaN matched by class."""
    import torch
    a, b = a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16)
    na, nb = (a & 0x7FFF) > 0x7F80, (b & 0x7FFF) > 0x7F80
    return bool(((na == nb) & (na | (a == b))).all())


def attention_errors(got, want):
    """(ok, out relative error, statistics abs error): output relative error <= 1e-2
    (Frobenius), statistics within 1e-3 absolute with the same non-finite entries, a
    finite output: the attention tests' bounds."""
    import torch
    o, ro = got[0].float(), want[0].float()
    rel = ((o - ro).norm() / ro.norm().clamp_min(1e-30)).item()
    stat_err, same_inf = 0.0, True
    for g, w in zip(got[1:], want[1:]):
        fin = torch.isfinite(w)
        same_inf &= bool(torch.equal(torch.isfinite(g), fin)) and bool(torch.equal(g[~fin], w[~fin]))
        if fin.any():
            stat_err = max(stat_err, (g[fin] - w[fin]).abs().max().item())
    ok = rel <= 1e-2 and stat_err <= 1e-3 and same_inf and bool(torch.isfinite(got[0]).all())
    return ok, rel, stat_err


def attention_close(got, want):
    ok, rel, stat_err = attention_errors(got, want)
    return ok, f"out rel err {rel:.1e}, statistics abs err {stat_err:.1e}"


# --------------------------------------------------------------------------- #
# KV cache
# --------------------------------------------------------------------------- #
def rand_k(n, gen, device):
    """bf16 K rows [n, 512] with the nope part spread over 2^-24 .. 2^24 per 64-block."""
    import torch
    nope = torch.randn(n, 7, 64, generator=gen, device=device)
    nope *= torch.exp2(torch.randint(-24, 25, (n, 7, 1), generator=gen, device=device).float())
    rope = torch.randn(n, 64, generator=gen, device=device)
    return torch.cat([nope.view(n, 448), rope], dim=1).bfloat16()


def quantized_pool(n_tokens, page_size, gen, device):
    """A V4 pool whose every slot holds a random token written by the reference kv_quant."""
    import torch
    from ..backends.kv_cache import reference as KV
    pages = max(1, math.ceil(n_tokens / page_size))
    pool = KV.new_pool(pages, page_size, device)
    rows = torch.randn(pages * page_size, 512, generator=gen, device=device).bfloat16()
    KV.kv_quant(rows, pool, torch.arange(pages * page_size, device=device), page_size)
    return pool


def kv_quant_case(n, gen, device, prof, batch=None) -> Case:
    import torch
    from ..backends.kv_cache import reference as KV
    P = prof["kv_page"]
    pages = max(4, math.ceil(2 * n / P))        # half the slots written, scattered
    k = rand_k(n, gen, device)
    loc = torch.randperm(pages * P, generator=gen, device=device)[:n] if batch is None else batch[0]
    from ..backends.kv_cache import layout
    poisons = [torch.randint(0, 256, (pages, layout.bytes_per_page(P)), generator=gen,
                             device=device, dtype=torch.uint8)]
    poisons.append(poisons[0] ^ 0xFF)          # every byte differs between the two poisons
    pool = poisons[0].clone()

    def verify(fn):
        # Byte-identical on two complementary poisons: every byte the reference writes is
        # written, no other byte is touched.
        for p in poisons:
            w = p.clone()
            KV.kv_quant(k, w, loc, P)
            got = p.clone()
            fn(k, got, loc, P)
            if not torch.equal(got, w):
                bad = int((got != w).sum())
                return False, f"{bad} pool bytes differ from the reference"
        return True, "pool byte-identical to the reference on two poisons"
    return Case("kv_quant", n, (k, pool, loc, P), verify)


def kv_dequant_case(n, gen, device, prof, batch=None) -> Case:
    import torch
    from ..backends.kv_cache import reference as KV
    P = prof["kv_page"]
    pool = quantized_pool(max(n, 4 * P), P, gen, device)
    ids = torch.randint(0, pool.shape[0] * P, (n,), generator=gen, device=device) if batch is None else batch[0]

    def verify(fn):
        want = KV.kv_dequant(pool, ids, P)
        got = fn(pool, ids, P)
        ok = tuple(got.shape) == tuple(want.shape) and same_bf16(got, want)
        return ok, "bit-identical to the reference" if ok else "differs from the reference"
    return Case("kv_dequant", n, (pool, ids, P), verify)


# --------------------------------------------------------------------------- #
# Attention
# --------------------------------------------------------------------------- #
def prefill_args(s, gen, device, s_kv, topk, heads=HEADS):
    import torch
    q = (torch.randn(s, heads, 512, generator=gen, device=device) * 2).bfloat16()
    kv = torch.randn(s_kv, 1, 512, generator=gen, device=device).bfloat16()
    idx = torch.randint(0, s_kv, (s, 1, topk), generator=gen, device=device, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=gen, device=device) < 0.05] = -1
    sink = torch.randn(heads, generator=gen, device=device)
    return (q, kv, idx, SCALE, 512, sink, None)


def decode_args(T, gen, device, swa_page, c4_page, c4_tokens, heads=HEADS, swa_topk=SWA_TOPK,
                c4_topk=C4_TOPK):
    """q [T,1,HEADS,512] (each query token its own row: MTP's next-n tokens included); a SWA
    list of SWA_TOPK over a page-SWA_PAGE pool holding every token's window, a c4 list of
    C4_TOPK over a page-C4_PAGE compressed pool; lengths; sink."""
    import torch
    swa_tokens = max(4 * swa_page, T * swa_topk)
    pool = quantized_pool(swa_tokens, swa_page, gen, device)
    cpool = quantized_pool(c4_tokens, c4_page, gen, device)
    q = (torch.randn(T, 1, heads, 512, generator=gen, device=device) * 2).bfloat16()
    idx = torch.randint(0, pool.shape[0] * swa_page, (T, 1, swa_topk), generator=gen, device=device,
                        dtype=torch.int32)
    cidx = torch.randint(0, cpool.shape[0] * c4_page, (T, 1, c4_topk), generator=gen, device=device,
                         dtype=torch.int32)
    lengths = torch.full((T,), swa_topk, dtype=torch.int32, device=device)
    clengths = torch.full((T,), c4_topk, dtype=torch.int32, device=device)
    sink = torch.randn(heads, generator=gen, device=device)
    return (q, pool, idx, swa_page, SCALE, lengths, sink, cpool, cidx, c4_page, clengths)


def _with_batch(op, args, batch):
    """ARGS with the op's per-batch positions taken from BATCH (another layer's)."""
    if batch is None:
        return args
    from ..backends import builtin
    out = list(args)
    for i, t in zip(builtin().ops[op].batch_args, batch):
        out[i] = t
    return tuple(out)


def _reference_case(op, size, args, ref):
    # The reference runs when a backend is checked: only the first layer of a forward is.
    def verify(fn):
        if not memo:
            memo.append(ref(*args))
        return attention_close(fn(*args), memo[0])
    memo = []
    return Case(op, size, args, verify)


def sparse_prefill_case(s, gen, device, prof, batch=None) -> Case:
    from ..backends.sparse_prefill import reference as R
    args = prefill_args(s, gen, device, prof["prefill_kv"], prof["prefill_topk"], prof.get("heads", HEADS))
    return _reference_case("sparse_prefill", s, args, R.sparse_prefill)


def decode_mla_case(T, gen, device, prof, batch=None) -> Case:
    from ..backends.decode_mla import reference as R
    args = decode_args(T, gen, device, prof["swa_page"], prof["c4_page"], prof["c4_tokens"],
                       prof.get("heads", HEADS), prof.get("swa_topk", SWA_TOPK), prof.get("c4_topk", C4_TOPK))
    args = _with_batch("decode_mla", args, batch)
    return _reference_case("decode_mla", T, args, R.decode_mla)


# --------------------------------------------------------------------------- #
# Indexer
# --------------------------------------------------------------------------- #
INDEXER_REL_TOL = 2.0 ** -10


def indexer_decode_args(B, next_n, ctx, gen, device, heads=INDEXER_HEADS, lens=None):
    """Decode-shaped indexer inputs: B requests of NEXT_N query rows over contexts of
    CTX/2..CTX tokens (LENS: the batch's, when given), distinct pages per request.
    Returns (args, extras for the check)."""
    import torch
    from ..backends.indexer import reference as R
    PAGE, D, H = INDEXER_PAGE, INDEXER_DIM, heads
    if lens is None:
        lens = torch.randint(max(next_n, ctx // 2), ctx + 1, (B,), generator=gen, device=device,
                             dtype=torch.int32)
    need = (lens + PAGE - 1) // PAGE
    NB = -(-ctx // PAGE)
    P = int(need.sum())
    perm = torch.randperm(P, generator=gen, device=device).int()
    bt = torch.zeros(B, NB, dtype=torch.int32, device=device)
    off = 0
    for b, n in enumerate(need.tolist()):
        bt[b, :n] = perm[off:off + n]
        off += n
    x = torch.randn(P, PAGE, D, generator=gen, device=device)
    codes, scales = R.quantize_index_k(x)
    kv = R.pack_index_k(codes, scales)
    q = torch.randn(B, next_n, H, D, generator=gen, device=device).to(torch.float8_e4m3fn)
    w = torch.randn(B * next_n, H, generator=gen, device=device)
    E = R.row_lengths(lens, next_n, ctx)
    return (q, kv, w, lens, bt, None, ctx, False), E


def indexer_abs_sum(args):
    """s * sum_h |w| * sum_d |q k| per position: the reference on magnitudes (the error bound's scale)."""
    import torch
    from ..backends.indexer import layout as L
    from ..backends.indexer import reference as R
    q, kv, w, ctx, bt, _, S, _ = args
    qa = (q.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    pages = L.pages_u8(kv).clone()
    pages[:, :L.SCALE_OFFSET] &= 0x7F
    return R.fp8_paged_mqa_logits(qa, pages, w.abs(), ctx, bt, None, S)


def indexer_errors(got, want, A, E, S, clean=False):
    """(ok, max abs error, max error / magnitude): |got - want| <= 2^-10 * A at every valid
    position (the indexer tests' bound); with CLEAN, -inf everywhere else."""
    import torch
    pos = torch.arange(S, device=got.device)
    valid = pos[None, :] < E.reshape(-1, 1)
    err = (got - want).abs()
    ok = bool(((err <= INDEXER_REL_TOL * A) | ~valid).all())
    if clean:
        ok = ok and bool((got[~valid] == float("-inf")).all())
    ratio = float(((err / A.clamp_min(1e-30)) * valid).nan_to_num(0.0).max())
    return ok, float((err * valid).nan_to_num(0.0).max()), ratio


def indexer_close(got, want, A, E, S):
    ok, _, ratio = indexer_errors(got, want, A, E, S)
    return ok, f"max error / magnitude {ratio:.1e} (bound {INDEXER_REL_TOL:.1e})"


def indexer_case(B, gen, device, prof, batch=None) -> Case:
    from ..backends.indexer import reference as R
    ctx = prof["indexer_context"]
    # Another layer's lengths give this layer's pages the same count, so its block table fits.
    args, E = indexer_decode_args(B, prof.get("next_n", 1), ctx, gen, device,
                                  prof.get("indexer_heads", INDEXER_HEADS), None if batch is None else batch[0])
    args = _with_batch("indexer", args, batch)
    memo = []

    def verify(fn):
        if not memo:    # the reference, when a backend is checked (the first layer only)
            memo.extend((R.fp8_paged_mqa_logits(*args), indexer_abs_sum(args)))
        want, A = memo
        got = fn(*args)
        if tuple(got.shape) != tuple(want.shape):
            return False, f"shape {tuple(got.shape)}, reference {tuple(want.shape)}"
        return indexer_close(got, want, A, E, ctx)
    return Case("indexer", B, args, verify)


# --------------------------------------------------------------------------- #
# MoE
# --------------------------------------------------------------------------- #
MOE_TOL_NORM = 1.5e-2


def copy_weights(w):
    """A copy a backend may re-lay out in place (`prepare`) without touching the original."""
    from ..backends.moe.weights import MoeWeights
    return MoeWeights(w.w13.clone(), w.w13_scale.clone(), w.w2.clone(), w.w2_scale.clone(),
                      swiglu_limit=w.swiglu_limit)


class MoeCase:
    """MoE weights are laid out per backend (`prepare`), so the case hands each backend
    its own prepared copy of one random weight set."""

    def __init__(self, T, gen, device, prof, batch=None, layer_state=None):
        import torch
        from ..backends.moe import reference as R
        E, H, I = prof["moe_experts"], prof["moe_hidden"], prof["moe_intermediate"]
        K, total = prof.get("moe_topk", MOE_TOPK), prof.get("moe_experts_total", E)
        self.op, self.size = "moe", T
        # The reference's weight and routing draws run on the CPU: a CPU generator, seeded
        # from the caller's, then the tensors move to DEVICE.
        cpu = torch.Generator().manual_seed(
            int(torch.randint(0, 2 ** 62, (1,), generator=gen, device=gen.device).item()))
        # A layer's weights do not depend on the size: LAYER_STATE (a dict kept by the caller
        # for one layer across sizes) holds them and their per-backend layouts.
        state = {} if layer_state is None else layer_state
        if "base" not in state:
            state["base"] = R.random_weights(E, H, I, gen=cpu, device=device,
                                             swiglu_limit=prof.get("swiglu_limit", MOE_SWIGLU_LIMIT))
            state["prepared"] = {}
        self.base = state["base"]
        self.x = torch.randn(T, H, generator=cpu).bfloat16().to(device)
        # Routes over every expert of the model, skewed as PROFILE says; under EP the routes to
        # experts this rank does not hold are -1 (the rank holds the first E).
        self.tw, ids = R.random_routing(T, min(K, total), total, gen=cpu, skew=prof.get("route_skew", 0.0))
        self.ids = torch.where(ids < E, ids, torch.full_like(ids, -1)).to(device)
        self.tw = self.tw.to(device)
        self._want = None
        self._prepared = state["prepared"]
        self.args = (self.x, self.base, self.tw, self.ids)

    def weights_for(self, backend: str):
        from ..backends.moe import prepare
        if backend not in self._prepared:
            w = self.base if backend in ("torch", "triton_w4a16") else copy_weights(self.base)
            prepare(w, backend)
            self._prepared[backend] = w
        return self._prepared[backend]

    @property
    def want(self):
        """The reference output, computed when a backend is first checked."""
        if self._want is None:
            from ..backends.moe import reference as R
            self._want = R.moe(self.x, self.base, self.tw, self.ids)
        return self._want

    def verify_backend(self, backend, fn):
        import torch
        got = fn(self.x, self.weights_for(backend), self.tw, self.ids)
        nrm = ((got.float() - self.want.float()).norm() / self.want.float().norm()).item()
        ok = bool(torch.isfinite(got).all()) and nrm <= MOE_TOL_NORM
        return ok, f"norm rel err {nrm:.1e} (bound {MOE_TOL_NORM})"

    def bind_backend(self, backend, fn):
        x, w, tw, ids = self.x, self.weights_for(backend), self.tw, self.ids
        return lambda: fn(x, w, tw, ids)


_BUILDERS = {
    "kv_quant": kv_quant_case,
    "kv_dequant": kv_dequant_case,
    "sparse_prefill": sparse_prefill_case,
    "decode_mla": decode_mla_case,
    "indexer": indexer_case,
    "moe": MoeCase,
}


def case(op, size, gen, device, profile, batch=None, layer_state=None):
    """A case with the uniform interface `verify_backend(name, fn)` / `bind_backend(name, fn)`;
    BATCH: another layer's per-batch tensors (`batch_of`); LAYER_STATE: a dict the caller
    keeps per layer across sizes (what does not depend on the size: MoE weights)."""
    if op == "moe":
        return MoeCase(size, gen, device, profile, batch, layer_state)
    c = _BUILDERS[op](size, gen, device, profile, batch)
    if isinstance(c, Case):
        return _Uniform(c)
    return c


def batch_of(c) -> tuple:
    """The per-batch tensors of case C, at its op's `batch_args` positions."""
    from ..backends import builtin
    return tuple(c.args[i] for i in builtin().ops[c.op].batch_args)


class _Uniform:
    def __init__(self, c: Case):
        self.c, self.op, self.size, self.args = c, c.op, c.size, c.args

    def verify_backend(self, backend, fn):
        return self.c.verify(fn)

    def bind_backend(self, backend, fn):
        return self.c.bind(fn)

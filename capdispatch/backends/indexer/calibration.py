"""The indexer's calibration and benchmark case (Op.case)."""
from __future__ import annotations

from ..cases import Case, Comparison, with_batch

INDEXER_HEADS, INDEXER_DIM, INDEXER_PAGE = 64, 128, 64
INDEXER_REL_TOL = 2.0 ** -10


def indexer_decode_args(B, next_n, ctx, gen, device, heads=INDEXER_HEADS, lens=None):
    """Decode-shaped indexer inputs: B requests of NEXT_N query rows over contexts of
    CTX/2..CTX tokens (LENS: the batch's, when given), distinct pages per request.
    Returns (args, extras for the check)."""
    import torch
    from . import reference as R
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
    from . import layout as L
    from . import reference as R
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


def indexer_compare(got, want, args) -> Comparison:
    """The indexer's Op.compare: logits of the reference's shape, each valid position within
    2^-10 * A of the reference (A, the reference on magnitudes, bounds the rounding of any
    summation order; an unwritten NaN fails), and with clean_logits (ARGS[7]) every
    position at or past its row's length exactly -inf."""
    import torch
    from ..canary_checks import where_of
    from . import reference as R
    tol = "|err| <= 2**-10 * A; exactly -inf past each row with clean_logits"
    if tuple(got.shape) != tuple(want.shape):
        return Comparison(False, f"shape {tuple(got.shape)}, reference {tuple(want.shape)}", float("inf"),
                          INDEXER_REL_TOL, "logits", tol)
    q, _, _, lens, _, _, S, clean = args
    E = R.row_lengths(lens, q.shape[1], S).reshape(-1, 1).to(got.device)
    valid = torch.arange(S, device=got.device)[None, :] < E
    if clean:
        not_inf = ~valid & (got != float("-inf"))
        if bool(not_inf.any()):
            return Comparison(False, f"{int(not_inf.sum())} positions at or past a row's length are not -inf",
                              float("inf"), INDEXER_REL_TOL, where_of(not_inf.cpu(), "logits"), tol)
    A = indexer_abs_sum(args).to(got.device)
    err = (got.double() - want.double()).abs().nan_to_num(float("inf"))
    over = valid & ~(err <= INDEXER_REL_TOL * A.double())
    ratio = torch.where(valid, err / A.double().clamp_min(1e-300), torch.zeros_like(err)).nan_to_num(float("inf"))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if bool(over.any()):
        return Comparison(False, f"{int(over.sum())} logits off by more than 2**-10 * A (worst {worst:.1e} of A)",
                          worst, INDEXER_REL_TOL, where_of(ratio.cpu(), "logits"), tol)
    return Comparison(True, f"max error / magnitude {worst:.1e} (bound {INDEXER_REL_TOL:.1e})", worst,
                      INDEXER_REL_TOL, "", tol)


def indexer_close(got, want, A, E, S):
    ok, _, ratio = indexer_errors(got, want, A, E, S)
    return ok, f"max error / magnitude {ratio:.1e} (bound {INDEXER_REL_TOL:.1e})"


def indexer_case(B, gen, device, prof, batch=None, layer_state=None) -> Case:
    from . import reference as R
    ctx = prof["indexer_context"]
    # Another layer's lengths give this layer's pages the same count, so its block table fits.
    args, E = indexer_decode_args(B, prof.get("next_n", 1), ctx, gen, device,
                                  prof.get("indexer_heads", INDEXER_HEADS), None if batch is None else batch[0])
    args = with_batch("indexer", args, batch)
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

"""Each op's reference, and the check of one call against it on the same inputs.

Tolerances are the op tests' and the calibration's: kv_quant byte-identical pool,
kv_dequant bit-identical rows, attention output relative error <= 1e-2 with statistics
within 1e-3, indexer |error| <= 2^-10 x the magnitude sum, MoE norm relative error <= 1.5e-2."""
from __future__ import annotations

OPS = ("kv_quant", "kv_dequant", "sparse_prefill", "decode_mla", "indexer", "moe")


def reference(op: str):
    """The op's torch reference (the op contract's signature)."""
    if op in ("kv_quant", "kv_dequant"):
        from ..backends.kv_cache import reference as R
        return getattr(R, op)
    if op == "sparse_prefill":
        from ..backends.sparse_prefill import reference as R
        return R.sparse_prefill
    if op == "decode_mla":
        from ..backends.decode_mla import reference as R
        return R.decode_mla
    if op == "indexer":
        from ..backends.indexer import reference as R
        return R.fp8_paged_mqa_logits
    from ..backends.moe import reference as R
    return R.moe


def call_checked(op: str, fn, args, moe_weights=None):
    """Run FN(*ARGS) and the reference on the same inputs: (output, ok, detail).
    MOE_WEIGHTS: the backend's own layout of the weights (ARGS hold the reference's)."""
    import torch
    ref = reference(op)
    if op == "kv_quant":
        k, pool, loc, page = args
        want = pool.clone()
        ref(k, want, loc, page)
        fn(*args)
        bad = int((pool != want).sum())
        return None, bad == 0, ("pool byte-identical to the reference" if not bad
                                else f"{bad} pool bytes differ from the reference")
    if op == "moe":
        x, w, tw, ids = args
        got = fn(x, moe_weights if moe_weights is not None else w, tw, ids)
        want = ref(x, w, tw, ids).float()
        nrm = ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()
        ok = bool(torch.isfinite(got).all()) and nrm <= 1.5e-2
        return got, ok, f"norm rel err {nrm:.1e} (bound 1.5e-2)"
    got = fn(*args)
    want = ref(*args)
    from ..calibrate import inputs as I     # the comparisons the calibration uses (read only)
    if op == "kv_dequant":
        ok = tuple(got.shape) == tuple(want.shape) and I.same_bf16(got, want)
        return got, ok, "bit-identical to the reference" if ok else "differs from the reference"
    if op in ("sparse_prefill", "decode_mla"):
        ok, rel, stat = I.attention_errors(got, want)
        return got, ok, f"out rel err {rel:.1e} (bound 1e-2), statistics abs err {stat:.1e} (bound 1e-3)"
    from ..backends.indexer import reference as IR
    q, kv, w, lens, bt, _, S, _ = args
    A = I.indexer_abs_sum(args)
    E = IR.row_lengths(lens, q.shape[1], S)
    ok, _, ratio = I.indexer_errors(got, want, A, E, S)
    return got, ok, f"max error / magnitude {ratio:.1e} (bound {I.INDEXER_REL_TOL:.1e})"

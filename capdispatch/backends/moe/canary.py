"""Canary of moe: routed experts over packed MXFP4 weights, small problem.

Cases: fresh random weights (every e2m1 code, several E8M0 scale bytes) and tokens
from the seed, top-k routes with a fraction masked to -1 (experts not local under EP)
and one token with every route masked (its output must be exactly 0). Tolerances
against the torch reference (tests/test_moe.py states how they were measured):
capdispatch's own kernels (torch, triton_w4a16): ||err|| / ||ref|| <= 2e-3 and
max |err| <= 1e-2 max |ref|; other W4A16 kernels 1.5e-2 and 3e-2; the MXFP8-activation
(W4A8) kernels against the MXFP8 reference, 4e-2 and 1e-1. out= is poisoned with NaN.
Imports torch: loaded only when a backend is verified.
"""
from __future__ import annotations

import torch

from ..canary_checks import Mismatch, where_of
from . import reference as R
from .inputs import make_case
from .weights import LAYOUTS, prepare

# backend -> (norm-relative, max-relative, reference activation quantisation)
TOLERANCES = {
    "torch": (2e-3, 1e-2, None),
    "triton_w4a16": (2e-3, 1e-2, None),
    "flashinfer_cutlass_w4a8": (4e-2, 1e-1, "mxfp8"),
    "flashinfer_trtllm_w4a8": (4e-2, 1e-1, "mxfp8"),
}
DEFAULT_TOLERANCE = (1.5e-2, 3e-2, None)


def moe(fn, device, seed: int, backend: str = "") -> dict:
    norm_tol, max_tol, act = TOLERANCES.get(backend, DEFAULT_TOLERANCE)
    # Smaller on the CPU, where Triton runs under its interpreter.
    size = 128 if torch.device(device).type == "cpu" else 256
    w, x, tw, ids = make_case(seed, E=6, H=size, I=size, K=4, T=5, device=device, mask_frac=0.3)
    ids[1] = -1
    want = R.moe(x, w, tw, ids, act_quant=act).float().cpu()
    if backend in LAYOUTS:
        prepare(w, backend)
    out = torch.full(tuple(x.shape), 0x7FC1, dtype=torch.int16, device=device).view(torch.bfloat16)
    got = fn(x, w, tw, ids, out=out)
    if got is None or got.data_ptr() != out.data_ptr():
        raise Mismatch("moe(out=...) did not return out", where="return value", tolerance="the op's contract")
    g = out.float().cpu()
    tol = f"norm-relative {norm_tol:g}, max-relative {max_tol:g}"
    bad = ~torch.isfinite(g)
    if bool(bad.any()):
        raise Mismatch(f"out: {int(bad.sum())} non-finite values (unwritten or overflow)",
                       max_err=float("inf"), where=where_of(bad, "out"), tolerance=tol)
    dead = (ids.cpu() < 0).all(dim=1)
    if bool((g[dead] != 0).any()):
        raise Mismatch("out: a token whose every route is masked is not exactly 0",
                       max_err=float(g[dead].abs().max()), where="out[1, :]", tolerance="exactly 0")
    d = (g - want).abs()
    nrm = float(d.norm() / want.norm().clamp_min(1e-30))
    mx = float(d.max() / want.abs().max().clamp_min(1e-30))
    if not (nrm <= norm_tol and mx <= max_tol):
        raise Mismatch(f"out: norm-relative error {nrm:.3g} (<= {norm_tol:g}), max-relative {mx:.3g} "
                       f"(<= {max_tol:g})", max_err=mx, where=where_of(d, "out"), tolerance=tol)
    return {"tolerance": tol, "checked": g.numel()}

"""Canary of moe: routed experts over packed MXFP4 weights, small problem.

Cases: fresh random weights (every e2m1 code, several E8M0 scale bytes) and tokens
from the seed, top-k routes with a fraction masked to -1 (experts not local under EP)
and one token with every route masked. Judged by the op's comparison (Op.compare,
calibration.moe_compare) at the backend's tolerance (calibration.MOE_TOLERANCES, which
says how tests/test_moe.py measured them), against the reference at that tolerance's
activation quantisation; the masked token must be exactly 0. out= is poisoned with NaN.
Imports torch: loaded only when a backend is verified.
"""
from __future__ import annotations

import torch

from ..canary_checks import Mismatch, compare_as_declared
from . import reference as R
from .calibration import moe_tolerance
from .inputs import make_case
from .weights import LAYOUTS, prepare


def moe(fn, device, seed: int, backend: str = "") -> dict:
    tol = moe_tolerance(backend)
    # Smaller on the CPU, where Triton runs under its interpreter.
    size = 128 if torch.device(device).type == "cpu" else 256
    w, x, tw, ids = make_case(seed, E=6, H=size, I=size, K=4, T=5, device=device, mask_frac=0.3)
    ids[1] = -1
    want = R.moe(x, w, tw, ids, act_quant=tol.act_quant)
    if backend in LAYOUTS:
        prepare(w, backend)
    out = torch.full(tuple(x.shape), 0x7FC1, dtype=torch.int16, device=device).view(torch.bfloat16)
    got = fn(x, w, tw, ids, out=out)
    if got is None or got.data_ptr() != out.data_ptr():
        raise Mismatch("moe(out=...) did not return out", where="return value", tolerance="the op's contract")
    c = compare_as_declared("moe", out, want, (x, w, tw, ids), "out", backend=backend)
    return {"tolerance": c.tolerance, "checked": out.numel()}

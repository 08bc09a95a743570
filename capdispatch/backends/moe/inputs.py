"""Inputs for moe (canaries, tests, benchmarks).

Imports torch: import this module only where inputs are built."""
from __future__ import annotations

import torch

from . import reference as R


def make_case(seed, *, E, H, I, K, T, device, mask_frac=0.25, limit=10.0, scale_lo=119, scale_hi=125):
    gen = torch.Generator().manual_seed(seed)
    w = R.random_weights(E, H, I, gen=gen, device=device, swiglu_limit=limit,
                         scale_lo=scale_lo, scale_hi=scale_hi)
    x = torch.randn(T, H, generator=gen).bfloat16().to(device)
    tw, ids = R.random_routing(T, K, E, gen=gen, device=device, mask_frac=mask_frac)
    return w, x, tw, ids

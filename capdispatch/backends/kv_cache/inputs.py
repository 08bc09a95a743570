"""Inputs for the KV-cache ops and the ops that read the V4 pool (canaries, tests, benchmarks).

Imports torch: import this module only where inputs are built."""
from __future__ import annotations

import torch

def v4_pool(gen, num_pages, page_size, device, *, spare_pages=0):
    """A V4 pool whose every slot holds kv_quant of a random bf16 row (magnitudes vary per
    64-value tile, so the UE8M0 scales vary). Returns the pool (a window of a buffer with
    ``spare_pages`` poisoned pages on either side: every byte 0xFF, a NaN code under an
    infinite scale and NaN rope values, so that any decode of them is non-finite) and its
    buffer."""
    from capdispatch.backends import v4_layout as L
    from capdispatch.backends.kv_cache import reference as KV
    cap = num_pages * page_size
    rows = torch.randn(cap, 512, generator=gen)
    tile_scale = torch.exp2(torch.randint(-4, 5, (cap, 7), generator=gen).float())
    rows[:, :448] *= tile_scale.repeat_interleave(64, dim=1)
    buf = torch.full((num_pages + 2 * spare_pages, L.bytes_per_page(page_size)), 0xFF, dtype=torch.uint8)
    pool = buf[spare_pages:spare_pages + num_pages]
    KV.kv_quant(rows.bfloat16(), pool, torch.arange(cap), page_size)
    buf = buf.to(device)
    return buf[spare_pages:spare_pages + num_pages], buf

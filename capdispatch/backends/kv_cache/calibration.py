"""The KV-cache ops' calibration and benchmark cases (Op.case): fresh random inputs at one
size, checked byte for byte against the torch reference."""
from __future__ import annotations

import math

from ..cases import Case, Comparison, same_bf16


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
    from . import reference as KV
    pages = max(1, math.ceil(n_tokens / page_size))
    pool = KV.new_pool(pages, page_size, device)
    rows = torch.randn(pages * page_size, 512, generator=gen, device=device).bfloat16()
    KV.kv_quant(rows, pool, torch.arange(pages * page_size, device=device), page_size)
    return pool


def kv_quant_case(n, gen, device, prof, batch=None, layer_state=None) -> Case:
    import torch
    from . import reference as KV
    P = prof["kv_page"]
    pages = max(4, math.ceil(2 * n / P))        # half the slots written, scattered
    k = rand_k(n, gen, device)
    loc = torch.randperm(pages * P, generator=gen, device=device)[:n] if batch is None else batch[0]
    from .. import v4_layout as layout
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
            c = kv_quant_compare(got, w, (k, got, loc, P))
            if not c.ok:
                return False, c.detail
        return True, "pool byte-identical to the reference on two poisons"
    return Case("kv_quant", n, (k, pool, loc, P), verify)


def kv_dequant_case(n, gen, device, prof, batch=None, layer_state=None) -> Case:
    import torch
    from . import reference as KV
    P = prof["kv_page"]
    pool = quantized_pool(max(n, 4 * P), P, gen, device)
    ids = torch.randint(0, pool.shape[0] * P, (n,), generator=gen, device=device) if batch is None else batch[0]

    def verify(fn):
        want = KV.kv_dequant(pool, ids, P)
        c = kv_dequant_compare(fn(pool, ids, P), want, (pool, ids, P))
        return c.ok, c.detail
    return Case("kv_dequant", n, (pool, ids, P), verify)


def kv_quant_compare(got, want, args) -> Comparison:
    """kv_quant's Op.compare: the pool it wrote byte-identical to the reference's (the
    error figure: the bytes that differ)."""
    diff = got != want
    bad = int(diff.sum())
    if not bad:
        return Comparison(True, "pool byte-identical to the reference", 0.0, 0.0)
    from ..canary_checks import where_of
    return Comparison(False, f"{bad} pool bytes differ from the reference", float(bad), 0.0,
                      where_of(diff, "pool"))


def kv_dequant_compare(got, want, args) -> Comparison:
    """kv_dequant's Op.compare: rows bit-identical to the reference's, NaN matching NaN (the
    error figure: the values that differ)."""
    import torch
    if tuple(got.shape) != tuple(want.shape):
        return Comparison(False, f"shape {tuple(got.shape)} differs from the reference's {tuple(want.shape)}",
                          float("inf"), 0.0, "out")
    if same_bf16(got, want):
        return Comparison(True, "bit-identical to the reference", 0.0, 0.0)
    from ..canary_checks import where_of
    g, w = got.reshape(-1).view(torch.int16), want.reshape(-1).view(torch.int16)
    ng, nw = (g & 0x7FFF) > 0x7F80, (w & 0x7FFF) > 0x7F80
    diff = ((ng != nw) | (~nw & (g != w))).reshape(got.shape)
    return Comparison(False, f"{int(diff.sum())} of {diff.numel()} values differ from the reference bits",
                      float(int(diff.sum())), 0.0, where_of(diff, "out"), "bit-exact (NaN matches NaN)")

"""Canaries of kv_quant and kv_dequant: small canonical problems judged by each op's
comparison (Op.compare): byte- and bit-exact against the torch reference (both ops are
exact by contract: the same UE8M0 scales, RNE fp8 codes and raw bf16 rope bits).

Cases: fresh random rows from the seed (tile magnitudes spread over several binades),
rows whose 448 fp8 values are every finite e4m3 code at several UE8M0 scales, and for
dequant a pool holding all 256 codes (NaN codes included) under several scale bytes.
Outputs are poisoned with two different patterns, so a byte or value never written
shows as a difference. Imports torch: loaded only when a backend is verified.
"""
from __future__ import annotations

import torch

from ..canary_checks import Mismatch, compare_as_declared
from .. import v4_layout as L
from . import reference as R
from .inputs import v4_pool

PAGE_SIZE = 4
SCALE_EXPONENTS = (-30, -9, 0, 7, 40)         # UE8M0 bytes 97, 118, 127, 134, 167
DEQUANT_SCALE_BYTES = (92, 110, 127, 134, 160, 200, 247)
POISONS = (0xA5, 0x5A)


def _e4m3_values():
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def code_rows(gen, device) -> torch.Tensor:
    """bf16 [len(SCALE_EXPONENTS), 512]: each tile holds 448 (so its scale exponent is
    the row's) and every finite e4m3 code's value, times 2**s for each s."""
    vals = _e4m3_values()
    finite = [c for c in range(256) if c not in (0x7F, 0xFF)]
    nope = torch.empty(L.NUM_TILES, L.TILE)
    codes = (finite * 2)[:L.NUM_TILES * (L.TILE - 1)]
    for t in range(L.NUM_TILES):
        nope[t, 0] = 448.0 if t % 2 == 0 else -448.0
        nope[t, 1:] = vals[codes[t * (L.TILE - 1):(t + 1) * (L.TILE - 1)]]
    rows = torch.empty(len(SCALE_EXPONENTS), L.DIM)
    for i, s in enumerate(SCALE_EXPONENTS):
        rows[i, :L.DIM_NOPE] = nope.reshape(-1) * 2.0 ** s
        rows[i, L.DIM_NOPE:] = torch.randn(L.DIM - L.DIM_NOPE, generator=gen)
    return rows.bfloat16().to(device)


def kv_quant(fn, device, seed: int, backend: str = "") -> dict:
    gen = torch.Generator().manual_seed(seed)
    n_rand = 11
    k = torch.randn(n_rand, L.DIM, generator=gen)
    k[:, :L.DIM_NOPE] *= torch.exp2(torch.randint(-12, 12, (n_rand, L.NUM_TILES), generator=gen)
                                    .float()).repeat_interleave(L.TILE, dim=1)
    k = k.bfloat16()
    rope_bits = torch.randint(-2**15, 2**15, (n_rand, L.DIM - L.DIM_NOPE), generator=gen, dtype=torch.int16)
    k[:, L.DIM_NOPE:] = rope_bits.view(torch.bfloat16)     # raw bits: copied, never computed
    k = torch.cat([k.to(device), code_rows(gen, device)])
    n = k.shape[0]
    num_pages = -(-2 * n // PAGE_SIZE)
    loc = torch.randperm(num_pages * PAGE_SIZE, generator=gen)[:n].to(torch.int32).to(device)
    for poison in POISONS:
        want = torch.full((num_pages, L.bytes_per_page(PAGE_SIZE)), poison, dtype=torch.uint8, device=device)
        got = want.clone()
        R.kv_quant(k, want, loc, PAGE_SIZE)
        ret = fn(k, got, loc, PAGE_SIZE)
        if ret is not None:
            raise Mismatch(f"kv_quant returned {type(ret).__name__}, the contract returns None",
                           where="return value", tolerance="byte-exact")
        compare_as_declared("kv_quant", got, want, (k, got, loc, PAGE_SIZE), f"pool (poisoned 0x{poison:02X})")
    return {"tolerance": "byte-exact pool, two poison patterns", "checked": n}


def code_pool(gen, device):
    """A pool of random kv_quant rows, with tokens holding all 256 codes (NaN codes too)
    under each of DEQUANT_SCALE_BYTES; returns (pool, the code tokens' ids)."""
    num_pages = 8
    pool, _ = v4_pool(gen, num_pages, PAGE_SIZE, "cpu")
    data, scale = R._page_views(pool, PAGE_SIZE)
    ids = torch.randperm(num_pages * PAGE_SIZE, generator=gen)[:len(DEQUANT_SCALE_BYTES)]
    nope = torch.arange(256, dtype=torch.uint8).repeat(2)[:L.DIM_NOPE]
    for j, t in enumerate(ids.tolist()):
        data[t // PAGE_SIZE, t % PAGE_SIZE, :L.DIM_NOPE] = nope.roll(37 * j)
        scale[t // PAGE_SIZE, t % PAGE_SIZE, :L.NUM_TILES] = DEQUANT_SCALE_BYTES[j]
    return pool.to(device), ids


def kv_dequant(fn, device, seed: int, backend: str = "") -> dict:
    gen = torch.Generator().manual_seed(seed)
    pool, code_ids = code_pool(gen, device)
    cap = pool.shape[0] * PAGE_SIZE
    ids = torch.cat([code_ids, torch.randint(0, cap, (13,), generator=gen)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].to(torch.int32).to(device)
    want = R.kv_dequant(pool, ids, PAGE_SIZE)
    for bits in (0x7FC1, -0x5455):
        out = torch.full((ids.numel(), 1, L.DIM), bits, dtype=torch.int16, device=device).view(torch.bfloat16)
        got = fn(pool, ids, PAGE_SIZE, out=out)
        if got is None or got.data_ptr() != out.data_ptr():
            raise Mismatch("kv_dequant(out=...) did not return out", where="return value",
                           tolerance="bit-exact")
        compare_as_declared("kv_dequant", out, want, (pool, ids, PAGE_SIZE), f"out (poisoned 0x{bits & 0xFFFF:04X})")
    fresh = fn(pool, ids, PAGE_SIZE)
    compare_as_declared("kv_dequant", fresh, want, (pool, ids, PAGE_SIZE), "out (allocated)")
    return {"tolerance": "bit-exact bf16 (NaN matches NaN), two poison patterns", "checked": ids.numel()}

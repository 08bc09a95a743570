"""Inputs for the indexer (canaries, tests, benchmarks).

Imports torch: import this module only where inputs are built."""
from __future__ import annotations

import torch

from . import layout as L
from . import reference as R

E4M3_NAN_CODES = (0x7F, 0xFF)
FINITE_CODES = torch.tensor([c for c in range(256) if c not in E4M3_NAN_CODES], dtype=torch.uint8)


def rand_codes(gen, shape):
    """Random finite e4m3fn codes (every binade, subnormals, both zeros)."""
    return FINITE_CODES[torch.randint(0, len(FINITE_CODES), shape, generator=gen)]


def make_case(gen, B, N, H, S, lens, *, ctx_2d=False, device="cpu", max_blocks=None,
              kind="quant", junk_table=True, shared_pages=False):
    """One call's inputs. `lens`: per-row lengths L [B, N] (2-D form) or per-batch
    context lengths [B] (1-D form). Pages a row can reach are distinct random pages
    (one list for all batch entries with `shared_pages`, as the rows of one prefill);
    every other page and every slot past a batch entry's longest row is poisoned (NaN
    codes, NaN scales); block-table entries past the needed pages are junk ids."""
    lens = torch.as_tensor(lens, dtype=torch.int32)
    ctx = lens if ctx_2d else lens.view(B)
    E = R.row_lengths(ctx, N, S)                                # [B, N]
    need = [max(1, -(-int(E[b].max()) // 64)) for b in range(B)]
    if shared_pages:
        need = [max(need)] * B
    mb = max_blocks or max(need) + 1
    used = need[0] if shared_pages else sum(need)
    P = used + 3
    perm = torch.randperm(P, generator=gen)
    bt = torch.empty((B, mb), dtype=torch.int32)
    k = 0
    for b in range(B):
        bt[b, :need[b]] = perm[k:k + need[b]].int()
        k += 0 if shared_pages else need[b]
        if junk_table:
            junk = torch.tensor([-1, P + 10**6, int(perm[-1]), -(2**31)], dtype=torch.int32)
            bt[b, need[b]:] = junk[torch.randint(0, 4, (mb - need[b],), generator=gen)]
        else:
            bt[b, need[b]:] = perm[-1]
    # Pool: poison everywhere, then real data where rows can reach.
    raw = torch.randint(0, 256, (P, L.PAGE_BYTES), generator=gen, dtype=torch.uint8)
    raw[:, :L.SCALE_OFFSET].view(P, 64, 128)[..., 0] = 0x7F               # NaN codes
    raw[:, L.SCALE_OFFSET:].view(torch.float32)[:] = float("nan")           # NaN scales
    if kind == "quant":
        codes, scales = R.quantize_index_k(torch.randn(P, 64, 128, generator=gen)
                                           * torch.exp2(torch.randint(-3, 4, (P, 64, 1), generator=gen)))
    else:
        codes = rand_codes(gen, (P, 64, 128))
        scales = torch.exp2(torch.randint(-12, 1, (P, 64), generator=gen).float())
    for b in (range(1) if shared_pages else range(B)):
        emax = int(E.max()) if shared_pages else int(E[b].max())
        for p in range(-(-emax // 64)):
            page = int(bt[b, p])
            n = min(64, emax - p * 64)
            raw[page, :L.SCALE_OFFSET].view(64, 128)[:n] = codes[page, :n]
            raw[page, L.SCALE_OFFSET:].view(torch.float32)[:n] = scales[page, :n]
    kv = raw.view(P, 64, 1, 132)
    if kind == "quant":
        q = (torch.randn(B, N, H, 128, generator=gen)).to(torch.float8_e4m3fn)
    else:
        q = rand_codes(gen, (B, N, H, 128)).view(torch.float8_e4m3fn)
    w = torch.randn(B * N, H, generator=gen)
    to = lambda t: t.to(device)  # noqa: E731
    return dict(q=to(q), kv=to(kv), w=to(w), ctx=to(ctx), bt=to(bt), S=S, N=N, E=E)

"""decode_mla's calibration and benchmark case (Op.case)."""
from __future__ import annotations

from ..cases import HEADS, SCALE, Case, reference_case, with_batch
from ..kv_cache.calibration import quantized_pool

SWA_TOPK, C4_TOPK = 128, 512


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


def decode_mla_case(T, gen, device, prof, batch=None, layer_state=None) -> Case:
    from . import reference as R
    args = decode_args(T, gen, device, prof["swa_page"], prof["c4_page"], prof["c4_tokens"],
                       prof.get("heads", HEADS), prof.get("swa_topk", SWA_TOPK), prof.get("c4_topk", C4_TOPK))
    args = with_batch("decode_mla", args, batch)
    return reference_case("decode_mla", T, args, R.decode_mla)

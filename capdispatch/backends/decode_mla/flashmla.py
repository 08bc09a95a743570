"""decode_mla through FlashMLA (distribution ``sgl-flash-mla``, module ``flash_mla``;
SM90 wgmma / SM100 tcgen05). Converts our contract (reference.decode_mla: FlashMLA's
decode semantics, lse natural-log, unaffected by the sink, +inf for a query with nothing
valid) to the library call and back; the argument chores it shares with the FlashInfer
adapter are in library_args.py.
"""

from __future__ import annotations

import functools

import torch

from .. import batch_scope
from .library_args import clean_ids, deliver, pad_heads, pool_view
from .reference import DIM, check_decode_args

__all__ = ["flashmla"]


@functools.cache
def _flash_mla():
    """flash_mla, imported on the first call (defining the custom ops below needs no library)."""
    import flash_mla
    return flash_mla


def flashmla(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None,
             extra_pool=None, extra_indices=None, extra_page_size=None, extra_topk_length=None,
             *, out=None, checks=True):
    """decode_mla via ``flash_mla.flash_mla_with_kvcache`` (sgl-flash-mla >= 1.0), the call
    SGLang 0.5.23 makes for DSv4 decode on SM90/SM100: V4 pools are FlashMLA's legacy
    format (584 bytes/token, detected from the view's last dim), so ``use_legacy=True``.
    A fresh ``FlashMLASchedMeta`` per call (it may not be reused across shapes or
    ``topk_length`` values); inside ``capdispatch.batch()`` one per batch, shared by the
    calls with the same shapes and the same ``topk_length`` / ``extra_topk_length``
    objects (batch_scope.py). A schedule the caller made itself (SGLang's
    ``tile_scheduler_metadata``) comes in through ``capdispatch.given("flashmla_decode",
    sched)`` and is used as it is. Contract: reference.decode_mla."""
    flash_mla = _flash_mla()
    a = check_decode_args(q, pool, indices, page_size, sm_scale, topk_length, attn_sink,
                          extra_pool, extra_indices, extra_page_size, extra_topk_length, out, checks)
    qp, sink, h = pad_heads(q, a.attn_sink, (64, 128))
    idx = clean_ids(a.idx, a.pool.shape[0] * a.page_size, checks)
    kw = {}
    if a.extra_pool is not None:
        kw = dict(extra_k_cache=pool_view(a.extra_pool, a.extra_page_size),
                  extra_indices_in_kvcache=clean_ids(a.extra_idx, a.extra_pool.shape[0] * a.extra_page_size,
                                                              checks),
                  extra_topk_length=a.extra_topk_length.to(torch.int32) if a.extra_topk_length is not None else None)
    # The schedule depends on the shapes and the valid counts: shared within one batch,
    # or the caller's own (given).
    def key_of():
        return (("flashmla_decode", qp.device, tuple(qp.shape), a.page_size, idx.shape[-1],
                 a.extra_page_size if a.extra_pool is not None else None,
                 kw["extra_indices_in_kvcache"].shape[-1] if kw else None, id(topk_length), id(extra_topk_length)),
                (topk_length, extra_topk_length))
    sched = batch_scope.shared(key_of, lambda: flash_mla.get_mla_metadata()[0], "flashmla_decode")
    o, lse = flash_mla.flash_mla_with_kvcache(
        q=qp, k_cache=pool_view(a.pool, a.page_size), block_table=None, cache_seqlens=None,
        head_dim_v=DIM, tile_scheduler_metadata=sched, softmax_scale=float(sm_scale),
        is_fp8_kvcache=True, indices=idx, attn_sink=sink,
        topk_length=a.topk_length.to(torch.int32) if a.topk_length is not None else None,
        use_legacy=True, **kw)
    if qp.shape[-2] != h:
        o, lse = o[..., :h, :], lse[:, :h, :].contiguous()
    return deliver(o, a.out), lse


# Custom ops (backends/torch_ops.py): what the registry binds. Defining them needs no
# library, so their schemas and fake implementations trace anywhere.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_flashmla = custom_op(OPS[0], "flashmla", flashmla)

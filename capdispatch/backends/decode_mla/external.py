"""decode_mla through external libraries: FlashMLA (``sgl-flash-mla`` / ``flash_mla``) and
FlashInfer's SM120 sparse MLA (``flashinfer-python`` / ``flashinfer``).

Both adapters convert our contract (reference.decode_mla: FlashMLA's decode semantics,
lse natural-log, unaffected by the sink, +inf for a query with nothing valid) to the
library call and back. Their shared chores, on the [b, s_q, topk]-sized index tensors
(one Triton launch each, index_prep.py) and the [b, h] statistics (small torch ops):
* ids outside [0, num_pages * page_size) become -1 (both libraries treat only -1 as
  masked and do not bound-check other ids);
* index lists are padded with -1 to a multiple of 64 (both kernels tile top-k by 64);
* head counts the kernels do not instantiate are zero-padded and sliced back.
Bound with ``checks=False`` (serving), index lists that are already int32, contiguous
and 64-aligned go to the library as they are (their ids trusted, as SGLang's are), so
inside a CUDA graph the call is the library's kernels only (for 64 / 128 heads).
"""

from __future__ import annotations

import functools
import math

import torch

from ...errors import ArgumentError
from ..kv_cache.layout import TOKEN_BYTES
from .reference import DIM, check_decode_args

__all__ = ["flashmla", "flashinfer_sparse_mla"]

TOPK_ALIGN = 64


def _pool_view(pool_u8, page_size):
    """FlashMLA / FlashInfer NHD view [num_pages, page_size, 1, 584] over a 2-D pool."""
    n, bpp = pool_u8.shape
    return torch.as_strided(pool_u8, (n, page_size, 1, TOKEN_BYTES), (bpp, TOKEN_BYTES, TOKEN_BYTES, 1))


@functools.cache
def _flash_mla():
    """flash_mla, imported on the first call (defining the custom ops below needs no library)."""
    import flash_mla
    return flash_mla


@functools.cache
def _clean_ids_fn():
    from .index_prep import clean_ids   # imports triton: only adapters that run import it
    return clean_ids


def _clean_ids(idx, capacity, checks=True):
    """ids outside [0, capacity) -> -1, padded with -1 to a multiple of 64: one launch.
    Without checks (serving) a list that is already int32, contiguous and 64-aligned is
    taken as it is: its ids are trusted to be -1 or in range, as SGLang's are."""
    if not checks and idx.dtype == torch.int32 and idx.shape[-1] % TOPK_ALIGN == 0 and idx.is_contiguous():
        return idx
    return _clean_ids_fn()(idx, capacity, TOPK_ALIGN)


def _pad_heads(q, attn_sink, allowed):
    h = q.shape[-2]
    hp = next((n for n in allowed if n >= h), None)
    if hp is None:
        raise ArgumentError(f"at most {allowed[-1]} query heads per call, got {h}")
    if hp == h:
        return q.contiguous(), attn_sink, h
    qp = q.new_zeros(q.shape[:-2] + (hp, q.shape[-1]))
    qp[..., :h, :] = q
    sink = None
    if attn_sink is not None:
        sink = attn_sink.new_zeros((hp,))
        sink[:h] = attn_sink
    return qp, sink, h


# --------------------------------------------------------------------------- #
# FlashMLA (SM90 wgmma / SM100 tcgen05)
# --------------------------------------------------------------------------- #
def flashmla(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None,
             extra_pool=None, extra_indices=None, extra_page_size=None, extra_topk_length=None,
             *, out=None, checks=True):
    """decode_mla via ``flash_mla.flash_mla_with_kvcache`` (sgl-flash-mla >= 1.0), the call
    SGLang 0.5.23 makes for DSv4 decode on SM90/SM100: V4 pools are FlashMLA's legacy
    format (584 bytes/token, detected from the view's last dim), so ``use_legacy=True``.
    A fresh ``FlashMLASchedMeta`` per call (it may not be reused across shapes).
    Contract: reference.decode_mla."""
    flash_mla = _flash_mla()
    a = check_decode_args(q, pool, indices, page_size, sm_scale, topk_length, attn_sink,
                          extra_pool, extra_indices, extra_page_size, extra_topk_length, out, checks)
    qp, sink, h = _pad_heads(q, a.attn_sink, (64, 128))
    idx = _clean_ids(a.idx, a.pool.shape[0] * a.page_size, checks)
    kw = {}
    if a.extra_pool is not None:
        kw = dict(extra_k_cache=_pool_view(a.extra_pool, a.extra_page_size),
                  extra_indices_in_kvcache=_clean_ids(a.extra_idx, a.extra_pool.shape[0] * a.extra_page_size,
                                                              checks),
                  extra_topk_length=a.extra_topk_length.to(torch.int32) if a.extra_topk_length is not None else None)
    sched = flash_mla.get_mla_metadata()[0]
    o, lse = flash_mla.flash_mla_with_kvcache(
        q=qp, k_cache=_pool_view(a.pool, a.page_size), block_table=None, cache_seqlens=None,
        head_dim_v=DIM, tile_scheduler_metadata=sched, softmax_scale=float(sm_scale),
        is_fp8_kvcache=True, indices=idx, attn_sink=sink,
        topk_length=a.topk_length.to(torch.int32) if a.topk_length is not None else None,
        use_legacy=True, **kw)
    if qp.shape[-2] != h:
        o, lse = o[..., :h, :], lse[:, :h, :].contiguous()
    if a.out is not None:
        a.out.copy_(o)
        o = a.out
    elif not o.is_contiguous():
        o = o.contiguous()
    return o, lse


# --------------------------------------------------------------------------- #
# FlashInfer SM120 sparse MLA
# --------------------------------------------------------------------------- #
_FI_HEADS = (8, 16, 32, 64, 128)
_wrappers: dict = {}


def _fi_wrapper(device):
    w = _wrappers.get(device)
    if w is None:
        from flashinfer.mla import SparseMLASm120Wrapper
        w = SparseMLASm120Wrapper(d_v=DIM, kv_scale_format="auto", kv_cache_format="fp8", device=device)
        _wrappers[device] = w
    return w


def flashinfer_sparse_mla(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None,
                          extra_pool=None, extra_indices=None, extra_page_size=None, extra_topk_length=None,
                          *, out=None, checks=True):
    """decode_mla via FlashInfer's public ``flashinfer.mla.SparseMLASm120Wrapper.run``
    (flashinfer-python >= 0.7.2; SM120/SM121). One persistent wrapper per device.

    The decode/extend split is FlashInfer's: calls of at most 64 query tokens may take
    its split-K decode kernels (scratch in grow-only arenas the wrapper owns, sized by
    that bound), larger calls its prefill kernels, which use no split-K scratch. This
    replaces SGLang 0.5.23's private ``_sparse_mla_sm120_paged_attention`` call and its
    256 -> 64 page split (0.7.x takes runtime page sizes and padded page strides).

    FlashInfer's LSE is base 2 by default and includes the sink (lse' = ln(e^lse +
    e^sink); an empty row with a sink gets lse' = sink): we ask for base e
    (``lse_scale = ln 2``) and take the sink back out, lse = lse' + log1p(-e^(sink - lse')),
    which is exact up to rounding unless the sink dominates the row; empty rows -> +inf.
    Contract: reference.decode_mla."""
    a = check_decode_args(q, pool, indices, page_size, sm_scale, topk_length, attn_sink,
                          extra_pool, extra_indices, extra_page_size, extra_topk_length, out, checks)
    b, s_q, h, _ = q.shape
    T = b * s_q
    qp, sink, _ = _pad_heads(q.reshape(T, h, DIM), a.attn_sink, _FI_HEADS)
    hp = qp.shape[1]

    def per_token(lengths):
        if lengths is None:
            return None
        lengths = lengths.to(torch.int32)
        return lengths.repeat_interleave(s_q) if s_q > 1 else lengths.contiguous()

    kw = {}
    if a.extra_pool is not None:
        kw = dict(extra_kv_cache=_pool_view(a.extra_pool, a.extra_page_size),
                  extra_indices=_clean_ids(a.extra_idx.reshape(T, -1), a.extra_pool.shape[0] * a.extra_page_size,
                                         checks),
                  extra_topk_length=per_token(a.extra_topk_length))
    o = torch.empty((T, hp, DIM), dtype=torch.bfloat16, device=q.device)
    lse_e = torch.empty((T, hp), dtype=torch.float32, device=q.device)
    _fi_wrapper(q.device).run(
        qp, _pool_view(a.pool, a.page_size),
        _clean_ids(a.idx.reshape(T, -1), a.pool.shape[0] * a.page_size, checks),
        o, float(sm_scale),
        topk_length=per_token(a.topk_length), attn_sink=sink, out_lse=lse_e,
        return_lse=False, lse_scale=math.log(2.0), **kw)
    o, lse_e = o[:, :h], lse_e[:, :h]
    if a.attn_sink is not None:
        lse_e = lse_e + torch.log1p(-torch.exp(a.attn_sink[None, :] - lse_e))
    lse = torch.where(lse_e == float("-inf"), float("inf"), lse_e)
    lse = lse.view(b, s_q, h).permute(0, 2, 1).contiguous()
    o = o.reshape(b, s_q, h, DIM)
    if a.out is not None:
        a.out.copy_(o)
        o = a.out
    elif not o.is_contiguous():
        o = o.contiguous()
    return o, lse


# Custom ops (backends/torch_ops.py): what the registry binds. Defining them needs
# neither library, so their schemas and fake implementations trace anywhere.
from .ops import decode_mla_op  # noqa: E402

op_flashmla = decode_mla_op("flashmla", flashmla)
op_flashinfer_sparse_mla = decode_mla_op("flashinfer_sparse_mla", flashinfer_sparse_mla)

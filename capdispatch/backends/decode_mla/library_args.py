"""What both library adapters of decode_mla (flashmla.py, flashinfer.py) do to our
arguments before the library call, on the [b, s_q, topk]-sized index tensors (one
Triton launch each, index_prep.py) and the query heads:
* ids outside [0, num_pages * page_size) become -1 (both libraries treat only -1 as
  masked and do not bound-check other ids);
* index lists are padded with -1 to a multiple of 64 (both kernels tile top-k by 64);
* head counts the kernels do not instantiate are zero-padded and sliced back;
* after the call, the output goes into the caller's ``out=`` (``deliver``).
Bound with ``checks=False`` (serving), index lists that are already int32, contiguous
and 64-aligned go to the library as they are (their ids trusted, as SGLang's are), so
inside a CUDA graph the call is the library's kernels only (for 64 / 128 heads).
"""

from __future__ import annotations

import functools

import torch

from ...errors import ArgumentError
from ..v4_layout import TOKEN_BYTES

__all__ = ["DECODE_TOPK_ALIGN", "pool_view", "clean_ids", "pad_heads", "deliver"]

# The decode kernels of FlashMLA and FlashInfer (SM120) tile top-k by 64. Sparse prefill's
# alignment is another kernel's: sparse_prefill/flashmla.py PREFILL_TOPK_ALIGN.
DECODE_TOPK_ALIGN = 64


def pool_view(pool_u8, page_size):
    """FlashMLA / FlashInfer NHD view [num_pages, page_size, 1, 584] over a 2-D pool."""
    n, bpp = pool_u8.shape
    return torch.as_strided(pool_u8, (n, page_size, 1, TOKEN_BYTES), (bpp, TOKEN_BYTES, TOKEN_BYTES, 1))


@functools.cache
def _clean_ids_fn():
    from .index_prep import clean_ids   # imports triton: only adapters that run import it
    return clean_ids


def clean_ids(idx, capacity, checks=True):
    """ids outside [0, capacity) -> -1, padded with -1 to a multiple of 64: one launch.
    Without checks (serving) a list that is already int32, contiguous and 64-aligned is
    taken as it is: its ids are trusted to be -1 or in range, as SGLang's are."""
    if not checks and idx.dtype == torch.int32 and idx.shape[-1] % DECODE_TOPK_ALIGN == 0 and idx.is_contiguous():
        return idx
    return _clean_ids_fn()(idx, capacity, DECODE_TOPK_ALIGN)


def pad_heads(q, attn_sink, allowed):
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


def deliver(o, out):
    """The library's output O as the op returns it: copied into the caller's OUT when
    given, else O itself, made contiguous if the library's head slicing left it strided."""
    if out is not None:
        out.copy_(o)
        return out
    return o if o.is_contiguous() else o.contiguous()

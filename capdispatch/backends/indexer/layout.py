"""DeepSeek-V4 sparse-indexer ("C4 indexer") layout and argument checks.

Byte layout of SGLang 0.5.23's index-K pool (what DeepGEMM's
``fp8_paged_mqa_logits`` reads; SGLang's own view is ``[num_pages, 64, 1, 132]``
uint8, ``srt/layers/attention/dsv4/indexer.py``):

    one page of PAGE_TOKENS = 64 tokens is PAGE_BYTES = 64 * 132 = 8448 bytes:
        [64 x 128 fp8 e4m3fn values, token-major][64 x float32 scale]
    token t of a page: values at bytes t*128 .. t*128+127, scale at 8192 + 4*t.

So the 4-D view's "132 bytes per token" is only a shape: the bytes of token t are
not contiguous (values first for all 64 tokens, then the 64 scales).

This module holds the constants and the argument checks shared by every backend.
It imports torch only (no kernel library) and never synchronises with the device.
"""

from __future__ import annotations

from typing import NamedTuple
import operator

import torch

from ...errors import ArgumentError, ArgumentTypeError
from ..arg_checks import dtype_in, index_dtype, same_device, tensor

__all__ = [
    "PAGE_TOKENS", "HEAD_DIM", "NUM_HEADS", "TOKEN_BYTES", "PAGE_BYTES", "SCALE_OFFSET",
    "QUERY_CHUNK", "IndexerArgs", "check_args", "alloc_logits", "pages_u8",
]

PAGE_TOKENS = 64            # tokens per index-K page (SGLang's block_kv for DSv4)
HEAD_DIM = 128              # index head dim (DeepSeek-V4 config.index_head_dim)
NUM_HEADS = 64              # index heads (DeepSeek-V4 config.index_n_heads)
TOKEN_BYTES = HEAD_DIM + 4  # 128 fp8 values + one float32 scale
PAGE_BYTES = PAGE_TOKENS * TOKEN_BYTES   # 8448
SCALE_OFFSET = PAGE_TOKENS * HEAD_DIM    # 8192: the scales follow all the values
QUERY_CHUNK = 1024          # the torch reference scores at most this many query rows at once

_FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)


class IndexerArgs(NamedTuple):
    """Checked, normalised views of one call's arguments (no copies, no device sync)."""
    batch: int                # B
    next_n: int
    heads: int                # H
    q_u8: torch.Tensor        # uint8 [B, next_n, H, 128] (the fp8 bits of q)
    pages: torch.Tensor       # uint8 [num_pages, 8448] (page stride may exceed 8448)
    weights: torch.Tensor     # float32 [B*next_n, H], stride(1) == 1
    context_lens: torch.Tensor  # int32/int64 [B] (1-D form) or [B, next_n] (2-D form)
    ctx_2d: bool
    block_table: torch.Tensor   # int32/int64 [B, max_blocks], stride(1) == 1
    max_context_len: int


def pages_u8(kv_cache: torch.Tensor) -> torch.Tensor:
    """The index-K pool as uint8 [num_pages, 8448]: accepts SGLang's [P, 64, 1, 132] view,
    [P, 64, 132], or [P, 8448] (any dtype of 1-byte elements; pages need not be adjacent,
    but each page's 8448 bytes must be)."""
    tensor(kv_cache, "kv_cache")
    if kv_cache.element_size() != 1:
        raise ArgumentTypeError(f"kv_cache must hold bytes (uint8 / fp8 views), got {kv_cache.dtype}")
    shape = tuple(kv_cache.shape)
    ok_shape = (
        (kv_cache.dim() == 4 and shape[1:] == (PAGE_TOKENS, 1, TOKEN_BYTES))
        or (kv_cache.dim() == 3 and shape[1:] == (PAGE_TOKENS, TOKEN_BYTES))
        or (kv_cache.dim() == 2 and shape[1] == PAGE_BYTES)
    )
    if not ok_shape:
        raise ArgumentError(
            f"kv_cache must be [num_pages, 64, 1, 132], [num_pages, 64, 132] or [num_pages, 8448] bytes, "
            f"got shape {shape}")
    u8 = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.view(torch.uint8)
    if u8.shape[0] > 0 and not u8[0].is_contiguous():
        raise ArgumentError("kv_cache pages must be contiguous inside (8448 adjacent bytes per page)")
    s0 = u8.stride(0) if u8.shape[0] > 1 else PAGE_BYTES
    if s0 < PAGE_BYTES or s0 % 4:
        raise ArgumentError(f"kv_cache page stride must be >= 8448 bytes and a multiple of 4, got {s0}")
    if u8.storage_offset() % 4:
        raise ArgumentError("kv_cache must start at a 4-byte aligned offset (the float32 scales are read in place)")
    return u8.as_strided((u8.shape[0], PAGE_BYTES), (s0, 1))


def _normalised(q, kv_cache, weights, context_lens, block_table, max_context_len) -> IndexerArgs:
    u8 = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.view(torch.uint8)
    s0 = u8.stride(0) if u8.shape[0] > 1 else PAGE_BYTES
    B, next_n, H, _ = q.shape
    return IndexerArgs(B, next_n, H, q if q.dtype == torch.uint8 else q.view(torch.uint8),
                       u8.as_strided((u8.shape[0], PAGE_BYTES), (s0, 1)), weights, context_lens,
                       context_lens.dim() == 2, block_table, max_context_len)


def check_args(q, kv_cache, weights, context_lens, block_table, max_context_len,
               checks: bool = True) -> IndexerArgs:
    """Validate one call (shapes, dtypes, devices, layouts); raise TypeError / ValueError naming
    the argument. Never reads device memory (so never synchronises). ``checks=False``
    (serving, inputs known good) only takes the normalised views."""
    if not checks:
        return _normalised(q, kv_cache, weights, context_lens, block_table, max_context_len)
    tensor(q, "q")
    if q.dtype not in _FP8_DTYPES:
        raise ArgumentTypeError(f"q must be float8_e4m3fn (or its uint8 bits), got {q.dtype}")
    if q.dim() != 4 or q.shape[3] != HEAD_DIM:
        raise ArgumentError(f"q must be [batch, next_n, heads, {HEAD_DIM}], got shape {tuple(q.shape)}")
    if not q.is_contiguous():
        raise ArgumentError("q must be contiguous")
    B, next_n, H, _ = q.shape
    if next_n < 1 or H < 1:
        raise ArgumentError(f"q has next_n={next_n}, heads={H}; both must be >= 1")
    dev = q.device
    pages = pages_u8(kv_cache)

    dtype_in(tensor(weights, "weights"), "weights", (torch.float32,))
    if tuple(weights.shape) != (B * next_n, H):
        raise ArgumentError(f"weights must be [batch*next_n, heads] = [{B * next_n}, {H}], got {tuple(weights.shape)}")
    if weights.numel() and weights.stride(1) != 1:
        raise ArgumentError("weights must have unit stride over heads")

    index_dtype(tensor(context_lens, "context_lens"), "context_lens")
    if context_lens.dim() == 1 and context_lens.shape[0] == B:
        ctx_2d = False
    elif context_lens.dim() == 2 and tuple(context_lens.shape) == (B, next_n):
        ctx_2d = True
    else:
        raise ArgumentError(
            f"context_lens must be [batch] = [{B}] or [batch, next_n] = [{B}, {next_n}], "
            f"got {tuple(context_lens.shape)}")
    if ctx_2d and next_n > 1 and context_lens.stride(1) != 1:
        raise ArgumentError("2-D context_lens must have unit stride over next_n")

    index_dtype(tensor(block_table, "block_table"), "block_table")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ArgumentError(f"block_table must be [batch, max_blocks] = [{B}, *], got {tuple(block_table.shape)}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ArgumentError("block_table must have unit stride over blocks")

    if isinstance(max_context_len, bool) or not isinstance(max_context_len, int):
        try:
            max_context_len = operator.index(max_context_len)
        except TypeError:
            raise ArgumentTypeError(f"max_context_len must be an int, got {type(max_context_len).__name__}") from None
    if max_context_len < 0:
        raise ArgumentError(f"max_context_len must be >= 0, got {max_context_len}")

    for name, t in (("kv_cache", pages), ("weights", weights), ("context_lens", context_lens),
                    ("block_table", block_table)):
        same_device(t, name, dev, "q")
    q_u8 = q if q.dtype == torch.uint8 else q.view(torch.uint8)
    return IndexerArgs(B, next_n, H, q_u8, pages, weights, context_lens, ctx_2d, block_table,
                       int(max_context_len))


def alloc_logits(rows: int, max_context_len: int, device, out=None) -> torch.Tensor:
    """The float32 [rows, max_context_len] result, or `out` checked (any row stride, unit column stride)."""
    if out is None:
        return torch.empty((rows, max_context_len), dtype=torch.float32, device=device)
    dtype_in(tensor(out, "out"), "out", (torch.float32,))
    if tuple(out.shape) != (rows, max_context_len):
        raise ArgumentError(f"out must be [{rows}, {max_context_len}], got {tuple(out.shape)}")
    if out.device != torch.device(device):
        raise ArgumentError(f"out is on {out.device}, expected {device}")
    if max_context_len > 1 and out.stride(1) != 1:
        raise ArgumentError("out must have unit stride over positions")
    return out

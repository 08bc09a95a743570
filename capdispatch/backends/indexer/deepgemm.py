"""Adapter to DeepGEMM's ``fp8_paged_mqa_logits`` (distribution ``sgl-deep-gemm``, module
``deep_gemm``; SGLang 0.5.23 pins sgl-deep-gemm==0.2.3.post2 and calls
``deep_gemm.fp8_paged_mqa_logits`` at its DSv4 indexer site).

DeepGEMM's API (sgl-deep-gemm 0.2.3.post2, ``deep_gemm/__init__.py``; op schema in ``_C.so``):

    get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=None) -> int32 [num_sms + 1, 2]
    fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                         max_context_len, clean_logits=False, indices=None) -> float32 [B*next_n, max_context_len]

with q float8_e4m3fn [B, next_n, H, D], kv_cache uint8 [num_pages, block_kv, 1, D + 4]
(stride(1) == D + 4, stride(3) == 1), weights float32 [B*next_n, H], context_lens int32
**2-D** [B, next_n] (DeepGEMM accepts only the per-token form; SGLang unsqueezes its
1-D lengths for this backend), block_table int32 [B, max_blocks]. `clean_logits=True` is
rejected for paged logits: positions past a row's length are left unwritten. The
result is a view whose row stride is padded (1024-byte aligned).

This adapter keeps the op's contract (reference.py): it turns 1-D context lengths into
the 2-D form (a view for next_n == 1), builds the schedule when none is given (the
caller's own through ``schedule_metadata`` or ``capdispatch.given("deepgemm_indexer", m)``;
inside ``capdispatch.batch()`` one per batch, shared by the calls with the same lengths
object and shape, as batch_scope.py says), and
writes -inf past each row's length when `clean_logits=True`. Import lazily: this
imports deep_gemm (which needs CUDA).
"""

from __future__ import annotations

import torch

import deep_gemm

from .. import batch_scope
from ...errors import ArgumentTypeError
from .layout import PAGE_TOKENS, TOKEN_BYTES, alloc_logits, check_args
from .reference import row_lengths

__all__ = ["fp8_paged_mqa_logits", "paged_mqa_logits_metadata", "context_lens_2d"]


def context_lens_2d(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """int32 [B, next_n] per-token lengths, DeepGEMM's form: [B, next_n] kept, [B] turned
    into ctx - next_n + 1 + j (for next_n == 1 a view, no copy when already int32)."""
    if context_lens.dim() == 2:
        c = context_lens
    elif next_n == 1:
        c = context_lens.view(-1, 1)
    else:
        c = context_lens[:, None].to(torch.int32) - (next_n - 1) + torch.arange(
            next_n, dtype=torch.int32, device=context_lens.device)
    if c.dtype != torch.int32 or not c.is_contiguous():
        c = c.to(torch.int32).contiguous()
    return c


def paged_mqa_logits_metadata(context_lens: torch.Tensor, next_n: int = 1) -> torch.Tensor:
    """DeepGEMM's schedule for these lengths (call once per batch, outside the hot loop)."""
    return deep_gemm.get_paged_mqa_logits_metadata(
        context_lens_2d(context_lens, next_n), PAGE_TOKENS, deep_gemm.get_num_sms())


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None,
                         max_context_len=None, clean_logits=False, *, out=None, checks=True):
    """The indexer op through DeepGEMM (SM90 wgmma / SM100 tcgen05 kernels)."""
    if max_context_len is None:
        raise ArgumentTypeError("max_context_len is required")
    a = check_args(q, kv_cache, weights, context_lens, block_table, max_context_len, checks)
    B, N, S = a.batch, a.next_n, a.max_context_len
    P = a.pages.shape[0]
    kv4 = a.pages.as_strided((P, PAGE_TOKENS, 1, TOKEN_BYTES),
                             (a.pages.stride(0), TOKEN_BYTES, TOKEN_BYTES, 1))
    qv = a.q_u8.view(torch.float8_e4m3fn)
    ctx = context_lens_2d(a.context_lens, N)
    bt = a.block_table if a.block_table.dtype == torch.int32 else a.block_table.to(torch.int32)
    if schedule_metadata is None:
        def key_of():
            return ("deepgemm_indexer", ctx.device, tuple(ctx.shape), id(context_lens)), (context_lens,)
        schedule_metadata = batch_scope.shared(
            key_of, lambda: deep_gemm.get_paged_mqa_logits_metadata(ctx, PAGE_TOKENS, deep_gemm.get_num_sms()),
            "deepgemm_indexer")
    logits = deep_gemm.fp8_paged_mqa_logits(qv, kv4, a.weights, ctx, bt, schedule_metadata, S, False)
    if clean_logits:
        E = row_lengths(a.context_lens, N, S).view(B * N, 1)
        logits.masked_fill_(torch.arange(S, device=logits.device) >= E, float("-inf"))
    if out is not None:
        out = alloc_logits(B * N, S, qv.device, out)
        out.copy_(logits)
        return out
    return logits


# Custom op (backends/torch_ops.py): what the registry binds. DeepGEMM returns its
# logits with padded rows, and the fake says so (no copy to a contiguous tensor).
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402


def padded_fake(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None,
                max_context_len=None, clean_logits=False, *, checks=True):
    """DeepGEMM's logits: rows padded to a multiple of 256 floats (1024 bytes)."""
    if max_context_len is None:
        raise ArgumentTypeError("max_context_len is required")
    rows, cols = q.shape[0] * q.shape[1], max_context_len
    return torch.empty_strided((rows, cols), (-(-cols // 256) * 256, 1), dtype=torch.float32, device=q.device)


op_fp8_paged_mqa_logits = custom_op(OPS[0], "deepgemm", fp8_paged_mqa_logits, fake=padded_fake)

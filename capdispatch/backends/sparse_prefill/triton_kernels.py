"""Triton sparse prefill: bf16 K/V rows (``KV_MODE = 0``) through the shared sparse-attention
kernel (backends/sparse_attention, which also serves decode_mla). One program per (query,
head block), no scratch; tiles from sparse_attention/launch_table.py ("prefill" kind).
This module imports triton at module level and is meant to be imported lazily (at
backend bind time).
"""

from __future__ import annotations

import torch

from ..device_scope import on_device
from ..sparse_attention import kernels as attn
from . import reference as R

__all__ = ["sparse_prefill", "op_sparse_prefill", "INTERPRETED"]

INTERPRETED = attn.INTERPRETED


def sparse_prefill(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                   *, use_legacy=True, out=None, checks=True):
    """Triton sparse prefill; same contract as reference.sparse_prefill (SGLang's
    ``flash_mla_sparse_fwd``). No scratch memory: one program per (query, head block)."""
    q, kv2, idx2, attn_sink, topk_length, out = R.check_sparse_prefill_args(
        q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, checks)
    if checks:
        attn.check_device(q)
    s, h, _ = q.shape
    dev = q.device
    if out is None:
        out = torch.empty((s, h, R.D_V), dtype=torch.bfloat16, device=dev)
    max_logits = torch.empty((s, h), dtype=torch.float32, device=dev)
    lse = torch.empty((s, h), dtype=torch.float32, device=dev)
    if s == 0 or h == 0:
        return out, max_logits, lse
    if q.stride(2) != 1:
        q = q.contiguous()
    if kv2.shape[0] and kv2.stride(1) != 1:
        kv2 = kv2.contiguous()
    if idx2.stride(1) != 1:
        idx2 = idx2.contiguous()
    topk = idx2.shape[1]
    dummy = lse
    with on_device(dev):
        attn.launch_sparse_mla(
            kind="prefill", device=dev, T=s, H=h,
            q_ptr=q, q_sb=q.stride(0), q_ss=0, q_sh=q.stride(1),
            kv_ptr=kv2, kv_row_stride=kv2.stride(0), n_kv=kv2.shape[0],
            idx_ptr=idx2, idx_sb=idx2.stride(0), idx_ss=0, n_idx=topk,
            len_ptr=topk_length if topk_length is not None else dummy,
            kv2_ptr=kv2, n_kv2=0, idx2_ptr=idx2, idx2_sb=0, idx2_ss=0, n_idx2=0, len2_ptr=dummy,
            sink_ptr=attn_sink if attn_sink is not None else dummy,
            out_ptr=out, out_sb=out.stride(0), out_ss=0, out_sh=out.stride(1),
            ml_ptr=max_logits, lse_ptr=lse, st_sb=h, st_ss=0, st_sh=1,
            DIV=1, LEN_DIV=1, qk_scale=sm_scale * R.LOG2E,
            KV_MODE=0, PAGE_SIZE=1, BYTES_PER_PAGE=1, PAGE_SIZE2=1, BYTES_PER_PAGE2=1,
            HAS_LEN=topk_length is not None, HAS_EXTRA=False, HAS_LEN2=False,
            HAS_SINK=attn_sink is not None, STATS=0 if use_legacy else 1,
        )
    return out, max_logits, lse


# Custom op (backends/torch_ops.py): what the registry binds.
from .ops import sparse_prefill_op  # noqa: E402

op_sparse_prefill = sparse_prefill_op("triton", sparse_prefill)

"""Torch reference for DeepSeek-V4 sparse-attention prefill (the op's meaning).

Contract: SGLang 0.5.23's ``sglang.kernels.ops.attention.flash_mla_interface.flash_mla_sparse_fwd``
(argument order, shapes, statistics), which calls sgl-flash-mla 1.0.0's
``flash_mla.flash_mla_sparse_fwd(..., use_legacy=True, return_log2_lse=True)``::

    sparse_prefill(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                   *, use_legacy=True, out=None) -> (out, max_logits, lse)

    q            bf16 [s, h, 512]          (last dim unit-stride; any token/head strides)
    kv           bf16 [s_kv, 1, 512]       (h_kv = 1; K and V are the same 512 values)
    indices      int32/int64 [s, 1, topk] (or [s, topk]); an entry is *masked* when it is
                 < 0 (SGLang pads with -1) or >= s_kv, or when its position is >= topk_length[i]
    sm_scale     float (DeepSeek-V4: 512 ** -0.5)
    d_v          must be 512
    attn_sink    optional fp32 [h]: out[i, h] *= exp(lse) / (exp(lse) + exp(attn_sink[h]))
                 (natural-log lse); -inf has no effect, +inf zeroes the output; no effect
                 on max_logits / lse
    topk_length  optional int32/int64 [s]: query i only attends indices[i, :topk_length[i]]
    use_legacy   the statistics convention of SGLang's wrapper (keyword-only, default True):
                   True  (what SGLang's DSv4 prefill gets): base 2, FlashMLA's legacy kernel,
                         P = q.k * sm_scale * log2(e);  max_logits = max P,  lse = log2(sum 2**P);
                         a query with no valid index: out 0, max_logits -inf, lse +inf
                         (sgl-flash-mla 1.0.0's legacy kernel on an H200, 2026-11-29)
                   False (FlashMLA's current kernels): natural log,
                         P = q.k * sm_scale;  max_logits = max P,  lse = ln(sum e**P);
                         a query with no valid index: out 0, max_logits -inf, lse +inf
    out          optional bf16 [s, h, 512] to write into (last dim unit-stride)

    returns out bf16 [s, h, 512], max_logits fp32 [s, h], lse fp32 [s, h]

Masked entries are never gathered from ``kv`` (their rows are taken as zeros and their
logits as -inf), so NaN/garbage rows behind them cannot leak into the result.

The reference works on chunks of queries so that the gathered fp32 K/V tile
``[chunk, topk, 512]`` stays within ``GATHER_BUDGET`` elements (64 MiB of fp32),
independent of the sequence length.
"""

from __future__ import annotations

import torch

from ...errors import ArgumentError
from ..arg_checks import dtype_in, finite_float, index_dtype, same_device, tensor, unit_last_stride

__all__ = ["sparse_prefill", "check_sparse_prefill_args", "DIM", "LOG2E", "LN2"]

DIM = 512            # head dim of q and of the shared K/V latent (448 nope + 64 rope)
D_V = 512            # value dim (the same 512 values)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
GATHER_BUDGET = 1 << 24   # fp32 elements of gathered K/V per chunk in the reference


def check_sparse_prefill_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out,
                              checks: bool = True):
    """Shape/dtype/device checks shared by every backend (never synchronises).

    Returns (q, kv2d [s_kv, 512] view, idx2d [s, topk], attn_sink or None,
    topk_length or None, out or None). ``checks=False`` (serving, inputs known good)
    only takes the 2-D views.
    """
    if not checks:
        return (q, kv[:, 0, :] if kv.dim() == 3 else kv, indices[:, 0, :] if indices.dim() == 3 else indices,
                attn_sink, topk_length, out)
    q, kv, indices = tensor(q, "q"), tensor(kv, "kv"), tensor(indices, "indices")
    if q.dim() != 3 or q.shape[2] != DIM:
        raise ArgumentError(f"q must be [s, h, {DIM}], got shape {tuple(q.shape)}")
    dtype_in(q, "q", (torch.bfloat16,))
    s, h, _ = q.shape
    if kv.dim() == 3:
        if kv.shape[1] != 1 or kv.shape[2] != DIM:
            raise ArgumentError(f"kv must be [s_kv, 1, {DIM}] (h_kv = 1), got shape {tuple(kv.shape)}")
        kv2 = kv[:, 0, :]
    elif kv.dim() == 2 and kv.shape[1] == DIM:
        kv2 = kv
    else:
        raise ArgumentError(f"kv must be [s_kv, 1, {DIM}], got shape {tuple(kv.shape)}")
    dtype_in(kv, "kv", (torch.bfloat16,))
    if int(d_v) != D_V:
        raise ArgumentError(f"d_v must be {D_V} (the only value FlashMLA's sparse prefill supports), got {d_v}")
    finite_float(sm_scale, "sm_scale")
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ArgumentError(f"indices must be [s, 1, topk] (h_kv = 1), got shape {tuple(indices.shape)}")
        idx2 = indices[:, 0, :]
    elif indices.dim() == 2:
        idx2 = indices
    else:
        raise ArgumentError(f"indices must be [s, 1, topk], got shape {tuple(indices.shape)}")
    if idx2.shape[0] != s:
        raise ArgumentError(f"indices has {idx2.shape[0]} rows, q has {s} queries")
    index_dtype(idx2, "indices")
    dev = q.device
    same_device(kv, "kv", dev, "q")
    same_device(indices, "indices", dev, "q")
    if attn_sink is not None:
        tensor(attn_sink, "attn_sink")
        if attn_sink.dim() != 1 or attn_sink.shape[0] != h:
            raise ArgumentError(f"attn_sink must be [{h}], got shape {tuple(attn_sink.shape)}")
        dtype_in(attn_sink, "attn_sink", (torch.float32,))
        same_device(attn_sink, "attn_sink", dev, "q")
    if topk_length is not None:
        tensor(topk_length, "topk_length")
        if topk_length.dim() != 1 or topk_length.shape[0] != s:
            raise ArgumentError(f"topk_length must be [{s}], got shape {tuple(topk_length.shape)}")
        index_dtype(topk_length, "topk_length")
        same_device(topk_length, "topk_length", dev, "q")
    if out is not None:
        tensor(out, "out")
        if tuple(out.shape) != (s, h, D_V):
            raise ArgumentError(f"out must have shape ({s}, {h}, {D_V}), got {tuple(out.shape)}")
        dtype_in(out, "out", (torch.bfloat16,))
        same_device(out, "out", dev, "q")
        unit_last_stride(out, "out")
    return q, kv2, idx2, attn_sink, topk_length, out


def _valid_mask(idx, start, end, n_kv, topk_length):
    valid = (idx >= 0) & (idx < n_kv)
    if topk_length is not None:
        pos = torch.arange(idx.shape[1], device=idx.device)
        valid &= pos[None, :] < topk_length[start:end, None].to(idx.dtype)
    return valid


def attend_gathered(qc, kg, valid, sm_scale, attn_sink):
    """Core math on one chunk, all in fp32.

    qc [c, h, 512] fp32, kg [c, n, 512] fp32 (masked rows already zero), valid [c, n] bool.
    Returns (o [c, h, 512] fp32 with the sink applied and lonely rows 0,
             m [c, h] natural-log max logit (-inf when lonely),
             lse [c, h] natural-log lse (-inf when lonely)).
    """
    scores = torch.einsum("chd,cnd->chn", qc, kg) * sm_scale
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    m = scores.amax(dim=-1) if scores.shape[-1] else scores.new_full(scores.shape[:2], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if scores.shape[-1] else m.clone()
    lonely = lse == float("-inf")
    w = torch.exp(scores - torch.where(lonely, 0.0, lse).unsqueeze(-1))   # lonely rows: all exp(-inf) = 0
    o = torch.einsum("chn,cnd->chd", w, kg)
    if attn_sink is not None:
        # exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); lonely rows are 0 anyway.
        diff = torch.where(lonely, 0.0, lse - attn_sink.float()[None, :])
        o = o * torch.sigmoid(diff).unsqueeze(-1)
    o = torch.where(lonely.unsqueeze(-1), 0.0, o)
    return o, m, lse


def sparse_prefill(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                   *, use_legacy=True, out=None, checks=True):
    """Sparse attention over gathered top-k K/V rows; see the module docstring for the contract."""
    q, kv2, idx2, attn_sink, topk_length, out = check_sparse_prefill_args(
        q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, checks)
    s, h, _ = q.shape
    topk = idx2.shape[1]
    n_kv = kv2.shape[0]
    dev = q.device
    if out is None:
        out = torch.empty((s, h, D_V), dtype=torch.bfloat16, device=dev)
    max_logits = torch.empty((s, h), dtype=torch.float32, device=dev)
    lse = torch.empty((s, h), dtype=torch.float32, device=dev)
    if s == 0:
        return out, max_logits, lse

    chunk = max(1, GATHER_BUDGET // max(1, topk * DIM))
    for start in range(0, s, chunk):
        end = min(s, start + chunk)
        idx = idx2[start:end].long()
        valid = _valid_mask(idx, start, end, n_kv, topk_length)
        safe = torch.where(valid, idx, 0)
        if n_kv:
            kg = kv2.index_select(0, safe.flatten()).view(end - start, topk, DIM).float()
        else:
            kg = torch.zeros((end - start, topk, DIM), dtype=torch.float32, device=dev)
        kg.masked_fill_(~valid.unsqueeze(-1), 0.0)
        o, m, l_e = attend_gathered(q[start:end].float(), kg, valid, float(sm_scale), attn_sink)
        out[start:end] = o.to(torch.bfloat16)
        if use_legacy:
            max_logits[start:end] = m * LOG2E
            lse[start:end] = torch.where(l_e == float("-inf"), float("inf"), l_e * LOG2E)
        else:
            max_logits[start:end] = m
            lse[start:end] = torch.where(l_e == float("-inf"), float("inf"), l_e)
    return out, max_logits, lse


# Custom op (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_sparse_prefill = custom_op(OPS[0], "torch", sparse_prefill)

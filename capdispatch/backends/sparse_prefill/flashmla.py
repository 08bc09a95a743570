"""sparse_prefill through FlashMLA (distribution ``sgl-flash-mla``, module ``flash_mla``).

SGLang 0.5.23 depends on ``sgl-flash-mla==1.0.0`` and imports ``flash_mla``
(``sglang/kernels/ops/attention/flash_mla_interface.py``); its ``flash_mla_sparse_fwd``
calls ``flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink,
topk_length, use_legacy=use_legacy, return_log2_lse=True if use_legacy else None)``,
and the DSv4 prefill takes the default ``use_legacy=True``: the legacy kernels (SM90
wgmma, SM100 tcgen05), statistics in base 2. This adapter makes exactly that call.

What the adapter adds, all cheap and outside the kernel:
* heads: FlashMLA's kernels take h_q in {64, 128}; other head counts are zero-padded
  to 64 (or 128) and sliced back (a TP rank of DSv4 may hold 8/16/32 heads);
* top-k width: the kernels need topk % B_TOPK == 0 (64 for h_q 64, 128 for h_q 128);
  indices are padded with -1 to a multiple of 128, as SGLang's
  ``SPARSE_PREFILL_TOPK_ALIGNMENT`` does;
* statistics: the legacy kernel runs for both conventions. FlashMLA's current
  sparse-prefill kernel exists for SM100f only (on an H200 it raises "only supported
  on SM100f architectures"), so ``use_legacy=False`` converts the legacy base-2
  statistics to natural log (x ln 2; a lonely query's lse is +inf either way);
* ``out=``: copied into.

Not installable on a CPU-only machine (the wheel is a CUDA extension and pins
torch >= 2.14.1), so it is tested only where it runs (tests marked gpu) and its
declared requirements are tested on simulated devices.
"""

from __future__ import annotations

import functools

import torch

from ...errors import ArgumentError
from .reference import D_V, LN2, check_sparse_prefill_args

__all__ = ["flashmla_sparse"]

# FlashMLA's sparse-prefill kernels need topk % B_TOPK == 0 (64 at 64 heads, 128 at 128):
# 128 serves both, as SGLang's SPARSE_PREFILL_TOPK_ALIGNMENT. Decode tiles by 64:
# decode_mla/library_args.py DECODE_TOPK_ALIGN.
PREFILL_TOPK_ALIGN = 128


@functools.cache
def _flash_mla():
    """flash_mla, imported on the first call (defining the custom op below needs no library)."""
    import flash_mla
    return flash_mla


def _pad_heads(h: int) -> int:
    if h <= 64:
        return 64
    if h <= 128:
        return 128
    raise ArgumentError(f"FlashMLA sparse prefill supports at most 128 query heads per call, got {h}")


def flashmla_sparse(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                    *, use_legacy=True, out=None, checks=True):
    """sparse_prefill via ``flash_mla.flash_mla_sparse_fwd``. Contract: reference.sparse_prefill."""
    flash_mla = _flash_mla()
    q, kv2, idx2, attn_sink, topk_length, out = check_sparse_prefill_args(
        q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, checks)
    s, h, _ = q.shape
    hp = _pad_heads(h)
    if hp != h:
        qp = q.new_zeros((s, hp, q.shape[2]))
        qp[:, :h] = q
        q = qp
        if attn_sink is not None:
            sp = attn_sink.new_zeros((hp,))
            sp[:h] = attn_sink
            attn_sink = sp
    elif not q.is_contiguous():
        q = q.contiguous()
    idx = idx2.to(torch.int32)
    topk = idx.shape[1]
    pad = (-topk) % PREFILL_TOPK_ALIGN
    if pad:
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
    idx = idx.contiguous().unsqueeze(1)
    if topk_length is not None:
        topk_length = topk_length.to(torch.int32)
    o, max_logits, lse = flash_mla.flash_mla_sparse_fwd(
        q, kv2.unsqueeze(1).contiguous(), idx, float(sm_scale), D_V, attn_sink, topk_length,
        use_legacy=True, return_log2_lse=True)
    if not use_legacy:
        max_logits, lse = max_logits * LN2, lse * LN2       # +inf / -inf stay as they are
    if hp != h:
        o, max_logits, lse = o[:, :h], max_logits[:, :h].contiguous(), lse[:, :h].contiguous()
        if out is None:
            o = o.contiguous()
    if out is not None:
        out.copy_(o)
        o = out
    return o, max_logits, lse


# Custom op (backends/torch_ops.py): what the registry binds. Defining it needs no
# library, so its schema and fake implementation trace anywhere.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_flashmla_sparse = custom_op(OPS[0], "flashmla_sparse", flashmla_sparse)

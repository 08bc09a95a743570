"""Triton sparse prefill: bf16 K/V rows (``KV_MODE = 0``) through the shared sparse-attention
kernel (backends/sparse_attention, which also serves decode_mla). One program per (query,
head block), no scratch; tiles from sparse_attention/launch_table.py ("prefill" kind).
This module imports triton at module level and is meant to be imported lazily (at
backend bind time).
"""

from __future__ import annotations

import torch

from .. import launch_limits as _limits
from ..device_scope import on_device_of
from ..sparse_attention import kernels as attn
from ..sparse_attention.launch_table import MEASURED_CONFIGS, PORTABLE_CONFIGS
from . import reference as R

__all__ = ["sparse_prefill", "op_sparse_prefill", "forget_plans", "INTERPRETED"]

INTERPRETED = attn.INTERPRETED


def sparse_prefill(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                   *, use_legacy=True, out=None, checks=True):
    """Triton sparse prefill; same contract as reference.sparse_prefill (SGLang's
    ``flash_mla_sparse_fwd``). No scratch memory: one program per (query, head block)."""
    if checks:
        q, kv, indices, attn_sink, topk_length, out = R.check_sparse_prefill_args(
            q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, checks)
        attn.check_device(q)
    s, h, _ = q.shape
    dev = q.device
    if out is None:
        out = torch.empty((s, h, R.D_V), dtype=torch.bfloat16, device=dev)
    max_logits = torch.empty((s, h), dtype=torch.float32, device=dev)
    lse = torch.empty((s, h), dtype=torch.float32, device=dev)
    if s == 0 or h == 0:
        return out, max_logits, lse
    # kv [s_kv, 1, 512] or [s_kv, 512], indices [s, 1, topk] or [s, topk]: the kernel takes
    # the row pointer and the row / column strides, read here without a 2-D view.
    qs = q.stride()
    if qs[2] != 1:
        q = q.contiguous()
        qs = q.stride()
    ks = kv.stride()
    if kv.shape[0] and ks[-1] != 1:
        kv = kv.contiguous()
        ks = kv.stride()
    xs = indices.stride()
    if xs[-1] != 1:
        indices = indices.contiguous()
        xs = indices.stride()
    topk = indices.shape[-1]
    has_len, has_sink = topk_length is not None, attn_sink is not None
    key = (dev, s if _PREFILL_BY_TOKENS else None, h, topk, has_len, has_sink, bool(use_legacy)) + _limits.plan_key() + attn.table_key()
    plan = _plans.get(key)
    if plan is None:
        consts = (0, 1, 1, 1, 1, has_len, False, False, has_sink, 0 if use_legacy else 1)
        plan = _plans[key] = attn.plan_launch(dev, "prefill", s, h, consts)
    os_ = out.stride()
    len1 = topk_length if has_len else lse
    sink = attn_sink if has_sink else lse
    head = (q, qs[0], 0, qs[1], kv, ks[0], kv.shape[0], indices, xs[0], 0, topk, len1,
            kv, 0, indices, 0, 0, 0, lse, sink, out, os_[0], 0, os_[1], max_logits, lse, h, 0, 1)
    with on_device_of(q):
        ran = attn.launch_planned(plan, s, head, 1, 1, sm_scale * R.LOG2E, dev)
    if ran is not plan:       # this shape's configuration did not fit: the next calls start there
        _plans[key] = ran
    return out, max_logits, lse


# (device, tokens or None, heads, top-k, has lengths, has sink, legacy statistics, forced
# launch target) -> its sparse_attention LaunchPlan: keyed by the device, never answering
# for another card. The tokens are part of the key only when a prefill launch
# configuration is limited to a token count (none is today), so the plans do not grow with
# every prefill length.
_plans: dict = {}
_PREFILL_BY_TOKENS = any("max_tokens" in c for table in (PORTABLE_CONFIGS, *MEASURED_CONFIGS.values())
                         for c in table["prefill"])


def forget_plans() -> None:
    """Drop every prefill launch plan (tuning changes the launch table between calls)."""
    _plans.clear()


# Custom op (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_sparse_prefill = custom_op(OPS[0], "triton", sparse_prefill)

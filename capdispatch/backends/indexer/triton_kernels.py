"""Triton kernel for the sparse indexer's fp8 paged MQA logits (contract: reference.py).

One program scores one query row (batch entry b, next_n row j: its heads, padded to at
least 16 for the MMA) over one split of the positions, BLOCK_N = 64 tokens (one page) per
step; the next_n rows of an entry read the same pages, mostly from L2:

    S = K [64, 128] @ q^T [128, heads]       (tensor cores, float32 accumulation)
    logits[row, t] = scale[t] * sum_h w[row, h] * relu(S[t, h])

Positions at or past a row's length are written -inf, so the whole
[rows, max_context_len] result is written (clean logits). Pages past a row's length are
never read; the page id of such a position is never loaded either.

Two codecs, selected by the NATIVE_FP8 constexpr per device (cc >= 8.9: native):
* native: q and the pool are passed as float8e4nv views and tl.dot multiplies fp8
  directly (Triton admits fp8e4nv from compute capability 8.9);
* uint8: only uint8 views reach the kernel; e4m3fn codes are widened to float16 with
  integer operations (every e4m3fn value is exact in float16) and tl.dot runs in
  float16 with float32 accumulation, which SM80/SM86 have. Products of two fp8 values
  are exact either way.
All address arithmetic is int64. Import lazily (at bind time): this imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import ArgumentError, ArgumentTypeError
from .. import device_facts as _device_facts
from .. import launch_limits as _limits
from ..device_scope import on_device_of
from ..triton_common.env import check_device, interpreted, jit_module
from .layout import HEAD_DIM, PAGE_BYTES, PAGE_TOKENS, SCALE_OFFSET, alloc_logits, check_args

__all__ = ["fp8_paged_mqa_logits", "fp8_paged_mqa_logits_u8", "fp8_paged_mqa_logits_native",
           "plan_splits", "INTERPRETED"]

from .launch_table import BLOCK_N, NUM_STAGES, NUM_WARPS  # noqa: E402
_SCALE_OFFSET = tl.constexpr(SCALE_OFFSET)
_PAGE = tl.constexpr(PAGE_TOKENS)

# The toolbox's e4m3fn decoder (triton_common), built the way this kernel is.
_e4m3fn_bits_to_f16 = jit_module("codec").e4m3fn_bits_to_f16


@triton.jit
def _indexer_kernel(
    q_ptr,            # float8e4nv / uint8 [B, NEXT_N, H, 128] contiguous
    kv_ptr,           # float8e4nv / uint8 pages, page stride kv_page_stride bytes
    w_ptr,            # float32 [B*NEXT_N, H]
    ctx_ptr,          # int32/int64 [B] or [B, NEXT_N]
    bt_ptr,           # int32/int64 [B, max_blocks]
    out_ptr,          # float32 [B*NEXT_N, max_ctx], row stride out_stride
    max_ctx, tokens_per_split,
    kv_page_stride, w_stride, ctx_stride, bt_stride, out_stride,
    NEXT_N: tl.constexpr, HP: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    CTX_2D: tl.constexpr, NATIVE_FP8: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)            # b * NEXT_N + j
    split = tl.program_id(1)
    b = row // NEXT_N
    j = row % NEXT_N

    # Row length E = clamp(L, 0, max_ctx).
    if CTX_2D:
        L = tl.load(ctx_ptr + b * ctx_stride + j).to(tl.int32)
    else:
        L = tl.load(ctx_ptr + b * ctx_stride).to(tl.int32) - (NEXT_N - 1) + j.to(tl.int32)
    E = tl.minimum(tl.maximum(L, 0), max_ctx)

    # q tile [HP, D] and weights [HP] of this row (heads past H: zero weight).
    h = tl.arange(0, HP)
    hvalid = h < H
    d = tl.arange(0, D)
    q_off = row * (H * D) + h[:, None] * D + d[None, :]
    if NATIVE_FP8:
        qt = tl.load(q_ptr + q_off, mask=hvalid[:, None], other=0.0)
    else:
        qt = _e4m3fn_bits_to_f16(tl.load(q_ptr + q_off, mask=hvalid[:, None], other=0))
    w = tl.load(w_ptr + row * w_stride + h, mask=hvalid, other=0.0)

    t_begin = split * tokens_per_split
    t_end = tl.minimum(t_begin + tokens_per_split, max_ctx)
    t_comp = tl.maximum(tl.minimum(t_end, E), t_begin)       # tokens [t_begin, t_comp) are scored
    n_comp = tl.cdiv(t_comp - t_begin, BLOCK)

    out_row = out_ptr + row * out_stride
    kv_u8 = kv_ptr.to(tl.pointer_type(tl.uint8))
    kv_f32 = kv_ptr.to(tl.pointer_type(tl.float32))
    # A step is one page (splits start on page boundaries): one page id per step, and the
    # rows' offsets inside the page are the same every step. Rows past the length in the
    # last page are read (the page exists) and their logits replaced by -inf.
    tl.static_assert(BLOCK == _PAGE)
    tn = tl.arange(0, BLOCK)
    k_rel = tn[:, None] * D + d[None, :]
    for it in tl.range(0, n_comp, num_stages=NUM_STAGES):
        t0 = t_begin + it * BLOCK
        t = t0 + tn                                                    # [BLOCK] positions
        base = tl.load(bt_ptr + b * bt_stride + t0 // _PAGE).to(tl.int64) * kv_page_stride
        if NATIVE_FP8:
            kt = tl.load(kv_ptr + base + k_rel)
        else:
            kt = _e4m3fn_bits_to_f16(tl.load(kv_u8 + base + k_rel))
        scale = tl.load(kv_f32 + ((base + _SCALE_OFFSET) >> 2) + tn)
        # Positions are the MMA's rows and heads its columns: the head sum stays within
        # each warp (a quad's lanes hold one row), with no exchange through shared memory.
        s = tl.dot(kt, tl.trans(qt))                                   # [BLOCK, HP] float32
        logit = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1) * scale
        logit = tl.where(t < E, logit, float("-inf"))
        tl.store(out_row + t, logit, mask=t < t_end)

    # The rest of the split: past the row's length.
    neg = tl.full((BLOCK,), float("-inf"), tl.float32)
    for t0 in range(t_begin + n_comp * BLOCK, t_end, BLOCK):
        t = t0 + tn
        tl.store(out_row + t, neg, mask=t < t_end)


INTERPRETED = interpreted(_indexer_kernel)


def _native_fp8_default(device: torch.device) -> bool:
    """Native fp8 where the device's effective facts have it (an emulated card's: device_facts)."""
    return _device_facts.native_fp8(device)


def plan_splits(rows: int, max_context_len: int, num_sms: int) -> int:
    """Tokens per program along the positions: enough programs to fill the card
    (about 4 per SM) for decode-sized batches, whole rows for large batches."""
    pages = -(-max_context_len // PAGE_TOKENS)
    if pages == 0:
        return PAGE_TOKENS
    splits = max(1, min(pages, -(-4 * num_sms // max(rows, 1))))
    return -(-pages // splits) * PAGE_TOKENS


class _Plan:
    """One shape class's launch on one device: the codec, the SM count the split of the
    positions is planned for, the constexprs and the launch options. Not keyed by
    max_context_len, which grows with every decode step: the split and the grid are
    a few integer operations per call."""
    __slots__ = ("native", "num_sms", "tail", "options")

    def __init__(self, dev, native_fp8, N, H, ctx_2d):
        if native_fp8 is None:
            native_fp8 = _native_fp8_default(dev)
        if H & (H - 1) or H > 128:
            raise ArgumentError(f"the Triton indexer needs a power-of-two head count <= 128, got heads={H}")
        self.num_sms = _device_facts.sm_count(dev) if dev.type == "cuda" else 4
        self.native = bool(native_fp8)
        self.tail = (N, max(H, 16), H, HEAD_DIM, ctx_2d, self.native, BLOCK_N, NUM_STAGES)
        self.options = dict(num_warps=NUM_WARPS)


# (device, codec asked for, next_n, heads, 2-D lengths) -> its launch plan: keyed by the
# device and emptied when an emulated card changes, never answering for another card.
_plans: dict = _device_facts.plan_cache()
_FP8, _U8 = torch.float8_e4m3fn, torch.uint8


def _launch(q, kv_cache, weights, context_lens, block_table, max_context_len, out, native_fp8, checks=True):
    if max_context_len is None:
        raise ArgumentTypeError("max_context_len is required")
    if checks:
        a = check_args(q, kv_cache, weights, context_lens, block_table, max_context_len, checks)
        check_device(a.q_u8, interpreted=INTERPRETED, kernels="Triton indexer kernels",
                     native_fp8=bool(native_fp8), instead="use fp8_paged_mqa_logits_u8")
        B, N, H, S, ctx_2d = a.batch, a.next_n, a.heads, a.max_context_len, a.ctx_2d
        q, kv_cache, weights, context_lens, block_table = a.q_u8, a.pages, a.weights, a.context_lens, a.block_table
    else:
        B, N, H, _ = q.shape
        S, ctx_2d = max_context_len, context_lens.dim() == 2
    dev = q.device
    key = (dev, native_fp8, N, H, ctx_2d)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(dev, native_fp8, N, H, ctx_2d)
    if checks:
        out = alloc_logits(B * N, S, dev, out)
    elif out is None:
        out = torch.empty((B * N, S), dtype=torch.float32, device=dev)
    if B == 0 or S == 0:
        return out
    want = _FP8 if plan.native else _U8
    q_arg = q if q.dtype == want else q.view(want)
    kv_arg = kv_cache if kv_cache.dtype == want else kv_cache.view(want)
    page_stride = kv_cache.stride()[0] if kv_cache.shape[0] > 1 else PAGE_BYTES
    ctx_stride = context_lens.stride()[0] if context_lens.numel() else 0
    tps = plan_splits(B * N, S, plan.num_sms)
    with on_device_of(q):
        _limits.launch(_indexer_kernel, (B * N, -(-S // tps)))(
            q_arg, kv_arg, weights, context_lens, block_table, out, S, tps,
            page_stride, weights.stride()[0], ctx_stride, block_table.stride()[0], out.stride()[0],
            *plan.tail, **plan.options)
    return out


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None,
                         max_context_len=None, clean_logits=False, *, out=None, checks=True):
    """The indexer op (contract: reference.fp8_paged_mqa_logits). Native fp8 where the
    device has it (cc >= 8.9), the uint8 codec elsewhere; `schedule_metadata` is ignored
    and positions past a row's length are written -inf whatever `clean_logits` says."""
    del schedule_metadata, clean_logits
    return _launch(q, kv_cache, weights, context_lens, block_table, max_context_len, out, None, checks)


def fp8_paged_mqa_logits_u8(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None,
                            max_context_len=None, clean_logits=False, *, out=None, checks=True):
    """The uint8-codec kernel on any device (SM80+; the interpreter)."""
    del schedule_metadata, clean_logits
    return _launch(q, kv_cache, weights, context_lens, block_table, max_context_len, out, False, checks)


def fp8_paged_mqa_logits_native(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None,
                                max_context_len=None, clean_logits=False, *, out=None, checks=True):
    """The native-fp8 kernel (cc >= 8.9, or the interpreter)."""
    del schedule_metadata, clean_logits
    return _launch(q, kv_cache, weights, context_lens, block_table, max_context_len, out, True, checks)


# Custom op (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_fp8_paged_mqa_logits = custom_op(OPS[0], "triton", fp8_paged_mqa_logits)


# Types of the kernel's runtime arguments (uint8 q and pool; the native variant passes
# both as *fp8e4nv): what an offline compile for a GPUTarget needs (backends/compile_matrix.py).
COMPILE_SIGNATURES = {
    "_indexer_kernel": {"q_ptr": "*u8", "kv_ptr": "*u8", "w_ptr": "*fp32", "ctx_ptr": "*i32", "bt_ptr": "*i32",
                        "out_ptr": "*fp32", "max_ctx": "i32", "tokens_per_split": "i32",
                        "kv_page_stride": "i32", "w_stride": "i32", "ctx_stride": "i32", "bt_stride": "i32",
                        "out_stride": "i32"},
}

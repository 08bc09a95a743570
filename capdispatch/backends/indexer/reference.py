"""Torch reference for the DeepSeek-V4 sparse indexer: fp8 paged MQA logits.

The op (SGLang 0.5.23 ``srt/layers/attention/dsv4/indexer.py`` calls it as
``fn(q, kv_cache, weights, seq_lens, page_table, metadata, max_seq_len, False)``;
the external kernel behind it is DeepGEMM's ``fp8_paged_mqa_logits``):

    row r = b * next_n + j  (b < batch, j < next_n)
    L[r]  = context_lens[b] - next_n + 1 + j      (context_lens 1-D, [batch])
          = context_lens[b, j]                    (context_lens 2-D, [batch, next_n])
    E[r]  = clamp(L[r], 0, max_context_len)
    for k < E[r]:  page = block_table[b, k // 64], slot = k % 64
        K     = fp8 e4m3fn values of token `slot` of `page` (128), s = its float32 scale
        logits[r, k] = s * sum_h weights[r, h] * relu(sum_d q[b, j, h, d] * K[d])
    for E[r] <= k < max_context_len: -inf with clean_logits=True; unspecified with
        clean_logits=False (SGLang's call; DeepGEMM leaves them unwritten). Every
        capdispatch kernel writes -inf there anyway.

Memory: queries are scored at most QUERY_CHUNK (1024) rows at a time and the index-K
pages of a chunk are gathered and decoded a few pages at a time (`plan_steps`), so
the transient memory is bounded by the chunk and the step, never by the context
length; only the result itself ([rows, max_context_len] float32) grows with it.
Gathering a whole chunk's index-K and widening it to float in one piece would need
1024 x 32768 x 128 x 4 bytes = 16 GiB at 32k tokens.

fp8 is decoded with integer operations through a 256-entry float32 table built from
the e4m3fn definition in pure Python (no torch fp8 dtype is needed), so every code,
subnormals and NaNs included, decodes exactly. Products of two fp8 values are exact in
float32; sums are float32 (torch.bmm / torch.matmul).

Nothing here synchronises with the device (no .item(), no data-dependent shapes).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...errors import ArgumentError, ArgumentTypeError
from .layout import (
    HEAD_DIM, PAGE_BYTES, PAGE_TOKENS, QUERY_CHUNK, SCALE_OFFSET, alloc_logits, check_args,
)

__all__ = [
    "fp8_paged_mqa_logits", "decode_e4m3fn", "e4m3fn_table", "row_lengths", "plan_steps",
    "step_bytes", "StepPlan", "DEFAULT_WORK_BYTES", "pack_index_k", "quantize_index_k",
]

# Transient bytes one (query chunk, page step) may use; see step_bytes().
DEFAULT_WORK_BYTES = 256 << 20


def _e4m3fn_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    mag = math.ldexp(man, -9) if exp == 0 else math.ldexp(8 + man, exp - 10)
    return math.copysign(mag, sign)


_TABLES: dict = {}


def e4m3fn_table(device) -> torch.Tensor:
    """float32 [256]: the value of every e4m3fn code (0x7F/0xFF NaN, 0x80 -0.0), per device."""
    device = torch.device(device)
    t = _TABLES.get(device)
    if t is None:
        t = torch.tensor([_e4m3fn_value(c) for c in range(256)], dtype=torch.float32, device=device)
        _TABLES[device] = t
    return t


def decode_e4m3fn(codes: torch.Tensor) -> torch.Tensor:
    """uint8 (or fp8 viewed as bytes) e4m3fn codes -> exact float32, same shape."""
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8)
    flat = codes.reshape(-1).to(torch.int32)
    return torch.index_select(e4m3fn_table(codes.device), 0, flat).view(codes.shape)


def row_lengths(context_lens: torch.Tensor, next_n: int, max_context_len: int) -> torch.Tensor:
    """int64 [batch, next_n]: how many positions each query row scores (E[r] in the module doc)."""
    ctx = context_lens.to(torch.int64)
    if ctx.dim() == 1:
        ctx = ctx[:, None] - (next_n - 1) + torch.arange(next_n, device=ctx.device)
    return ctx.clamp(0, max_context_len)


class StepPlan(NamedTuple):
    batch_chunk: int   # batch entries per query chunk (batch_chunk * next_n <= QUERY_CHUNK)
    pages: int         # index-K pages gathered and decoded per step
    bytes: int         # accounted transient bytes of one step (step_bytes)


def step_bytes(batch_chunk: int, next_n: int, heads: int, pages: int) -> int:
    """Transient bytes of one step, accounted allocation by allocation (upper bound):
    page ids (int64) + gathered pages (uint8) + decode index (int32) + decoded K (float32)
    + scores (float32 [rows, heads, tokens]) + head-reduced logits and mask temporaries,
    plus the chunk's decoded q (float32) and weights."""
    tokens = pages * PAGE_TOKENS
    rows = batch_chunk * next_n
    per_b = (pages * 8 + pages * PAGE_BYTES + tokens * HEAD_DIM * (4 + 4) + tokens * 4 * 2)
    per_row = heads * tokens * 4 + tokens * (4 * 3 + 1) + tokens * 8
    chunk = rows * heads * HEAD_DIM * (4 + 4) + rows * heads * 4
    return batch_chunk * per_b + rows * per_row + chunk


def plan_steps(batch: int, next_n: int, heads: int, max_pages: int,
               work_bytes: int = DEFAULT_WORK_BYTES) -> StepPlan:
    """Chunk sizes for the reference: <= QUERY_CHUNK query rows per chunk, and as many
    pages per step as fit in `work_bytes` (at least one)."""
    bc = max(1, min(batch, QUERY_CHUNK // next_n)) if batch else 1
    pages = 1
    cap = max(1, max_pages)
    while pages * 2 <= cap and step_bytes(bc, next_n, heads, pages * 2) <= work_bytes:
        pages *= 2
    return StepPlan(bc, pages, step_bytes(bc, next_n, heads, pages))


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor,
                         schedule_metadata=None, max_context_len: int | None = None,
                         clean_logits: bool = False, *, out: torch.Tensor | None = None, checks: bool = True,
                         work_bytes: int = DEFAULT_WORK_BYTES) -> torch.Tensor:
    """fp8 paged MQA logits (module doc). `schedule_metadata` is accepted and ignored
    (DeepGEMM's schedule); positions past a row's length are always written -inf.
    Returns float32 [batch * next_n, max_context_len] (`out` if given)."""
    del schedule_metadata
    if max_context_len is None:
        raise ArgumentTypeError("max_context_len is required")
    a = check_args(q, kv_cache, weights, context_lens, block_table, max_context_len, checks)
    B, N, H, S = a.batch, a.next_n, a.heads, a.max_context_len
    dev = a.q_u8.device
    out = alloc_logits(B * N, S, dev, out)
    if B == 0 or S == 0:
        return out
    num_pages = a.pages.shape[0]
    # Pages that can hold scored positions: no more than the table has, or S needs.
    max_pages = min(-(-S // PAGE_TOKENS), a.block_table.shape[1])
    covered = max_pages * PAGE_TOKENS
    if covered < S:
        out[:, covered:] = float("-inf")
    if max_pages == 0:
        return out
    if num_pages == 0:
        # Nothing can be scored; any row with E > 0 would be out of contract.
        out[:, :covered] = float("-inf")
        return out
    plan = plan_steps(B, N, H, max_pages, work_bytes)
    E = row_lengths(a.context_lens, N, S)                      # [B, N]

    for b0 in range(0, B, plan.batch_chunk):
        b1 = min(B, b0 + plan.batch_chunk)
        bc = b1 - b0
        qf = decode_e4m3fn(a.q_u8[b0:b1]).view(bc, N * H, HEAD_DIM)          # [bc, N*H, D]
        w = a.weights[b0 * N:b1 * N].view(bc, N, 1, H)
        e = E[b0:b1]                                                          # [bc, N]
        for p0 in range(0, max_pages, plan.pages):
            p1 = min(max_pages, p0 + plan.pages)
            t0, t1 = p0 * PAGE_TOKENS, p1 * PAGE_TOKENS
            ids = a.block_table[b0:b1, p0:p1].to(torch.int64).clamp_(0, num_pages - 1)
            raw = a.pages[ids]                                                # [bc, np, 8448] uint8
            k = decode_e4m3fn(raw[..., :SCALE_OFFSET]).view(bc, t1 - t0, HEAD_DIM)
            scale = raw[..., SCALE_OFFSET:].contiguous().view(torch.float32).view(bc, 1, t1 - t0)
            del raw
            s = torch.bmm(qf, k.transpose(1, 2))                              # [bc, N*H, T]
            del k
            s.relu_()
            logits = torch.matmul(w, s.view(bc, N, H, t1 - t0)).view(bc, N, t1 - t0)
            del s
            logits.mul_(scale)
            pos = torch.arange(t0, t1, device=dev)
            logits.masked_fill_(pos >= e[..., None], float("-inf"))
            c1 = min(t1, S)
            out[b0 * N:b1 * N, t0:c1] = logits.view(bc * N, -1)[:, :c1 - t0]
            del logits
    return out


# --------------------------------------------------------------------------- #
# Helpers to build index-K pools (tests, benchmarks)
# --------------------------------------------------------------------------- #
def pack_index_k(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values: e4m3fn codes (uint8 or float8_e4m3fn) [num_pages, 64, 128]; scales float32
    [num_pages, 64] -> the pool in SGLang's view, uint8 [num_pages, 64, 1, 132]."""
    if values.dtype != torch.uint8:
        values = values.view(torch.uint8)
    P = values.shape[0]
    if tuple(values.shape) != (P, PAGE_TOKENS, HEAD_DIM) or tuple(scales.shape) != (P, PAGE_TOKENS):
        raise ArgumentError(f"values must be [P, 64, 128] and scales [P, 64], got {tuple(values.shape)}, "
                         f"{tuple(scales.shape)}")
    pool = torch.empty((P, PAGE_BYTES), dtype=torch.uint8, device=values.device)
    pool[:, :SCALE_OFFSET] = values.reshape(P, SCALE_OFFSET)
    pool[:, SCALE_OFFSET:] = scales.to(torch.float32).contiguous().view(torch.uint8).view(P, -1)
    return pool.view(P, PAGE_TOKENS, 1, HEAD_DIM + 4)


def quantize_index_k(x: torch.Tensor) -> tuple:
    """float [..., 128] -> (e4m3fn codes uint8, float32 power-of-two scales [...]) with
    scale = 2**ceil(log2(amax / 448)) per token (UE8M0, as SGLang's indexer quantiser)."""
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=-1).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    codes = (x / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


# Custom op (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_fp8_paged_mqa_logits = custom_op(OPS[0], "torch", fp8_paged_mqa_logits)

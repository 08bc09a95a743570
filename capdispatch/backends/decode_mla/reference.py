"""Torch reference for DeepSeek-V4 sparse MLA decode over the V4 fp8 paged pool.

Contract, derived from SGLang 0.5.23's DSv4 decode call site
(``DeepseekV4AttnBackend._forward_attention`` -> ``flash_mla_with_kvcache(q, k_cache,
indices=swa_page_indices, topk_length, attn_sink, extra_k_cache,
extra_indices_in_kvcache, extra_topk_length)`` on SM90/SM100 and
``flash_mla_with_kvcache_sm120`` on SM120), with FlashMLA's decode semantics::

    decode_mla(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None,
               extra_pool=None, extra_indices=None, extra_page_size=None,
               extra_topk_length=None, *, out=None) -> (out, lse)

    q                  bf16 [b, s_q, h, 512] (last dim unit-stride)
    pool               the V4 paged KV pool (backends/v4_layout.py): uint8 [num_pages,
                       bytes_per_page] (any dtype viewable as bytes), or FlashMLA's 4-D
                       view [num_pages, page_size, 1, 584] over such a buffer
    indices            int32/int64 [b, s_q, topk]: token ids into ``pool``
                       (page * page_size + slot). An entry is *masked* when it is < 0
                       (SGLang pads with -1), >= num_pages * page_size, or at a position
                       >= topk_length[b]
    page_size          tokens per page of ``pool``
    sm_scale           float (DeepSeek-V4: 512 ** -0.5)
    topk_length        optional int32/int64 [b]: batch entry b attends indices[b, :, :topk_length[b]]
    attn_sink          optional fp32 [h]: out *= exp(lse) / (exp(lse) + exp(attn_sink[h]));
                       -inf has no effect, +inf zeroes the output; lse is unaffected
    extra_pool, extra_indices [b, s_q, extra_topk], extra_page_size, extra_topk_length [b]:
                       a second V4 pool (DSv4's compressed c4/c128 KV) attended together
                       with the first, under one softmax
    out                optional bf16 [b, s_q, h, 512] to write into (last dim unit-stride)

    returns out bf16 [b, s_q, h, 512] and lse fp32 [b, h, s_q]: natural-log
    log-sum-exp of the scaled logits q.k * sm_scale over the valid entries of both
    lists; +inf (and out = 0) when a query has no valid entry (FlashMLA's convention).

K and V are the same dequantised 512 values (448 fp8 e4m3 nope x UE8M0 tile scale,
then 64 raw bf16 rope), exactly as ``kv_dequant`` produces them. Masked entries are
never gathered: their rows are zeros and their logits -inf.

The reference works on chunks of query tokens so that the gathered fp32 K/V tile stays
within ``GATHER_BUDGET`` elements, whatever the number of tokens.
"""

from __future__ import annotations

import torch

from ...errors import ArgumentError
from ..arg_checks import dtype_in, finite_float, index_dtype, same_device, tensor, unit_last_stride
from ..v4_layout import TOKEN_BYTES, min_bytes_per_page
from ..kv_cache.reference import kv_dequant
from ..sparse_prefill.reference import DIM, GATHER_BUDGET, attend_gathered

__all__ = ["decode_mla", "check_decode_args", "pool_2d", "DecodeArgs", "new_outputs"]


def pool_2d(pool, page_size, name="pool"):
    """The pool as uint8 [num_pages, bytes_per_page] and its page size.

    Accepts the KV op's 2-D pool (page_size required) or FlashMLA's 4-D view
    [num_pages, page_size, 1, 584] whose page stride is bytes_per_page (its page
    size is taken from the view; a page_size argument must then agree).
    """
    tensor(pool, name)
    if pool.dim() == 4:
        if pool.shape[2] != 1 or pool.shape[3] != TOKEN_BYTES or pool.element_size() != 1:
            raise ArgumentError(f"a 4-D {name} must be a 1-byte view [num_pages, page_size, 1, {TOKEN_BYTES}], "
                             f"got shape {tuple(pool.shape)} dtype {pool.dtype}")
        ps = int(pool.shape[1])
        if page_size is not None and int(page_size) != ps:
            raise ArgumentError(f"{name} is a view with page size {ps}, but page_size={page_size}")
        if pool.stride(3) != 1 or pool.stride(1) != TOKEN_BYTES:
            raise ArgumentError(f"{name} view must have token stride {TOKEN_BYTES} and unit byte stride, "
                             f"got strides {pool.stride()}")
        n, bpp = int(pool.shape[0]), int(pool.stride(0))
        need = pool.storage_offset() + max(n, 1) * bpp
        if pool.untyped_storage().nbytes() < need:
            raise ArgumentError(f"{name}'s storage is smaller than num_pages x page stride ({need} bytes)")
        u8 = torch.as_strided(pool.view(torch.uint8) if pool.dtype != torch.uint8 else pool,
                              (n, bpp), (bpp, 1))
        page_size = ps
    elif pool.dim() == 2:
        if page_size is None:
            raise ArgumentError(f"{name} is 2-D: page_size is required")
        if not pool.is_contiguous():
            raise ArgumentError(f"{name} must be contiguous")
        u8 = pool if pool.dtype == torch.uint8 else pool.view(torch.uint8)
    else:
        raise ArgumentError(f"{name} must be [num_pages, bytes_per_page] or [num_pages, page_size, 1, "
                         f"{TOKEN_BYTES}], got shape {tuple(pool.shape)}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ArgumentError(f"page_size must be a positive int, got {page_size!r}")
    if u8.shape[1] < min_bytes_per_page(page_size):
        raise ArgumentError(f"{name} rows hold {u8.shape[1]} bytes but page_size={page_size} needs "
                         f">= {min_bytes_per_page(page_size)}")
    return u8, page_size


class DecodeArgs:
    """Validated, normalised decode arguments (shared by every backend)."""
    __slots__ = ("q", "pool", "page_size", "idx", "topk_length", "attn_sink",
                 "extra_pool", "extra_page_size", "extra_idx", "extra_topk_length", "out")


def _index3(idx, name, b, s_q, dev):
    tensor(idx, name)
    if idx.dim() != 3 or idx.shape[0] != b or idx.shape[1] != s_q:
        raise ArgumentError(f"{name} must be [{b}, {s_q}, topk], got shape {tuple(idx.shape)}")
    index_dtype(idx, name)
    return same_device(idx, name, dev, "q")


def _lengths(x, name, b, dev):
    if x is None:
        return None
    tensor(x, name)
    if x.dim() != 1 or x.shape[0] != b:
        raise ArgumentError(f"{name} must be [{b}], got shape {tuple(x.shape)}")
    index_dtype(x, name)
    return same_device(x, name, dev, "q")


def _source(pool, page_size, indices, topk_length, prefix, b, s_q, dev):
    """One K/V source (the main one, or with PREFIX "extra_" the extra one), checked:
    (uint8 pool, page size, indices, topk_length or None)."""
    u8, page_size = pool_2d(pool, page_size, prefix + "pool")
    same_device(u8, prefix + "pool", dev, "q")
    return (u8, page_size, _index3(indices, prefix + "indices", b, s_q, dev),
            _lengths(topk_length, prefix + "topk_length", b, dev))


def _pool_2d_unchecked(pool, page_size):
    if pool.dim() == 4:
        n, bpp = pool.shape[0], pool.stride(0)
        u8 = pool if pool.dtype == torch.uint8 else pool.view(torch.uint8)
        return torch.as_strided(u8, (n, bpp), (bpp, 1)), pool.shape[1]
    return (pool if pool.dtype == torch.uint8 else pool.view(torch.uint8)), page_size


def _normalised(q, pool, indices, page_size, topk_length, attn_sink, extra_pool, extra_indices,
                extra_page_size, extra_topk_length, out) -> DecodeArgs:
    a = DecodeArgs()
    a.q, a.idx, a.topk_length, a.attn_sink, a.out = q, indices, topk_length, attn_sink, out
    a.pool, a.page_size = _pool_2d_unchecked(pool, page_size)
    if extra_pool is None:
        a.extra_pool = a.extra_idx = a.extra_page_size = a.extra_topk_length = None
    else:
        a.extra_pool, a.extra_page_size = _pool_2d_unchecked(extra_pool, extra_page_size)
        a.extra_idx, a.extra_topk_length = extra_indices, extra_topk_length
    return a


def check_decode_args(q, pool, indices, page_size, sm_scale, topk_length, attn_sink,
                      extra_pool, extra_indices, extra_page_size, extra_topk_length, out,
                      checks: bool = True) -> DecodeArgs:
    """Shape/dtype/device checks (never synchronises; token ids are not range-checked
    here, out-of-range ids are masked by every backend). ``checks=False`` (serving,
    inputs known good) only normalises the pools to their 2-D uint8 form."""
    if not checks:
        return _normalised(q, pool, indices, page_size, topk_length, attn_sink, extra_pool, extra_indices,
                           extra_page_size, extra_topk_length, out)
    tensor(q, "q")
    if q.dim() != 4 or q.shape[3] != DIM:
        raise ArgumentError(f"q must be [b, s_q, h, {DIM}], got shape {tuple(q.shape)}")
    dtype_in(q, "q", (torch.bfloat16,))
    finite_float(sm_scale, "sm_scale")
    b, s_q, h, _ = q.shape
    dev = q.device
    a = DecodeArgs()
    a.q = q
    a.pool, a.page_size, a.idx, a.topk_length = _source(pool, page_size, indices, topk_length, "", b, s_q, dev)
    if attn_sink is not None:
        tensor(attn_sink, "attn_sink")
        if attn_sink.dim() != 1 or attn_sink.shape[0] != h or attn_sink.dtype != torch.float32:
            raise ArgumentError(f"attn_sink must be float32 [{h}], got {attn_sink.dtype} {tuple(attn_sink.shape)}")
        same_device(attn_sink, "attn_sink", dev, "q")
    a.attn_sink = attn_sink
    if (extra_pool is None) != (extra_indices is None):
        raise ArgumentError("extra_pool and extra_indices must be given together")
    if extra_pool is None:
        if extra_topk_length is not None or extra_page_size is not None:
            raise ArgumentError("extra_topk_length / extra_page_size need extra_pool and extra_indices")
        a.extra_pool = a.extra_idx = a.extra_page_size = a.extra_topk_length = None
    else:
        a.extra_pool, a.extra_page_size, a.extra_idx, a.extra_topk_length = _source(
            extra_pool, extra_page_size, extra_indices, extra_topk_length, "extra_", b, s_q, dev)
    if out is not None:
        tensor(out, "out")
        if tuple(out.shape) != (b, s_q, h, DIM) or out.dtype != torch.bfloat16:
            raise ArgumentError(f"out must be bfloat16 [{b}, {s_q}, {h}, {DIM}], got {out.dtype} {tuple(out.shape)}")
        same_device(out, "out", dev, "q")
        unit_last_stride(out, "out")
    a.out = out
    return a


def new_outputs(a: DecodeArgs):
    """(out, lse) of one call: the caller's bf16 ``out`` [b, s_q, h, 512] or a new one, and
    a new float32 ``lse`` [b, h, s_q]."""
    b, s_q, h, _ = a.q.shape
    out = a.out if a.out is not None else torch.empty((b, s_q, h, DIM), dtype=torch.bfloat16, device=a.q.device)
    return out, torch.empty((b, h, s_q), dtype=torch.float32, device=a.q.device)


def _gather(pool, page_size, idx, lengths, bsel):
    """Dequantised rows [c, n, 512] fp32 and validity [c, n] for flattened tokens."""
    capacity = pool.shape[0] * page_size
    idx = idx.long()
    valid = (idx >= 0) & (idx < capacity)
    if lengths is not None:
        pos = torch.arange(idx.shape[1], device=idx.device)
        valid &= pos[None, :] < lengths.long()[bsel][:, None]
    safe = torch.where(valid, idx, 0)
    rows = kv_dequant(pool, safe.flatten(), page_size).view(idx.shape[0], idx.shape[1], DIM).float()
    rows.masked_fill_(~valid.unsqueeze(-1), 0.0)
    return rows, valid


def decode_mla(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None,
               extra_pool=None, extra_indices=None, extra_page_size=None, extra_topk_length=None,
               *, out=None, checks=True):
    """Sparse MLA decode over the V4 fp8 pool; see the module docstring for the contract."""
    a = check_decode_args(q, pool, indices, page_size, sm_scale, topk_length, attn_sink,
                          extra_pool, extra_indices, extra_page_size, extra_topk_length, out, checks)
    b, s_q, h, _ = q.shape
    dev = q.device
    out, lse = new_outputs(a)
    T = b * s_q
    if T == 0 or h == 0:
        return out, lse
    width = a.idx.shape[2] + (a.extra_idx.shape[2] if a.extra_idx is not None else 0)
    chunk = max(1, GATHER_BUDGET // max(1, width * DIM))
    idx = a.idx.reshape(T, -1)
    eidx = a.extra_idx.reshape(T, -1) if a.extra_idx is not None else None
    batch_of = torch.arange(T, device=dev) // s_q
    qf = q.reshape(T, h, DIM)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        bsel = batch_of[start:end]
        rows, valid = _gather(a.pool, a.page_size, idx[start:end], a.topk_length, bsel)
        if eidx is not None:
            rows2, valid2 = _gather(a.extra_pool, a.extra_page_size, eidx[start:end], a.extra_topk_length, bsel)
            rows, valid = torch.cat([rows, rows2], dim=1), torch.cat([valid, valid2], dim=1)
        o, _, l_e = attend_gathered(qf[start:end].float(), rows, valid, float(sm_scale), a.attn_sink)
        tb, ts = bsel, torch.arange(start, end, device=dev) % s_q
        out[tb, ts] = o.to(torch.bfloat16)
        lse[tb, :, ts] = torch.where(l_e == float("-inf"), float("inf"), l_e)
    return out, lse


# Custom op (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_decode_mla = custom_op(OPS[0], "torch", decode_mla)

"""Triton sparse MLA decode over the V4 fp8 paged pool (same contract as reference.decode_mla).

The kernel is the sparse-attention kernel of backends/sparse_attention (shared with
sparse_prefill) with its paged K/V loader: each gathered token's 448 e4m3 nope bytes are
decoded and scaled by its UE8M0 tile exponents, its 64 bf16 rope values copied, giving
exactly the bf16 rows ``kv_dequant`` would produce, then fed to bf16 tensor-core dots.

* ``decode_mla_u8`` (backend ``triton``): the pool is read through uint8 and e4m3 is
  decoded with integer operations: no fp8 type, so it compiles on SM80/SM86, where
  Triton rejects ``fp8e4nv`` (it admits it from cc 8.9).
* ``decode_mla_fp8`` (backend ``triton_fp8``): native fp8 loads and conversion (cc >= 8.9).

Decode-sized calls (at most ``DECODE_MAX_TOKENS`` = 64 query tokens) that would leave
SMs idle split each token's index lists into up to 32 ranges and merge the partial
results in a second kernel; they use the "decode_split" launch configurations (small
head tiles: many programs), larger calls the "decode" ones (see
``sparse_attention/launch_table.py``). The split scratch holds one fp32 [BLOCK_H, 512]
partial per program, and the split factor keeps programs below ~4 x SM count, so it is
bounded by 4 x SM count x BLOCK_H x 2 KiB (69 MB on an H200 with its 64-head split
tile) whatever the sequence. Larger calls (extends) take the one-pass kernel and
allocate nothing but the outputs.
"""

from __future__ import annotations

import torch

from .. import launch_limits as _limits
from ..device_scope import on_device
from ..sparse_attention import kernels as attn
from .reference import check_decode_args, new_outputs

__all__ = ["decode_mla_u8", "decode_mla_fp8", "INTERPRETED"]

INTERPRETED = attn.INTERPRETED


# (device type, device index, tokens, heads, index entries) -> split-K factor: the split
# plan is a search, done once per shape and device.
_splits: dict = {}

_LOG2E = 1.4426950408889634


def _num_splits(dev, T, h, width):
    key = attn.device_key(dev) + (T, h, width) + _limits.plan_key()
    n = _splits.get(key)
    if n is None:
        # The split decision uses the split-K tile: decode-sized calls run with it.
        cfg = attn.device_configs(dev, "decode_split", T)[0]
        n = _splits[key] = attn.decode_splits(dev, T, h, width, block_h=cfg["BLOCK_H"], block_n=cfg["BLOCK_N"])
    return n


def _launch(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool, extra_indices,
            extra_page_size, extra_topk_length, out, native_fp8, config=None, num_splits=None, checks=True):
    a = check_decode_args(q, pool, indices, page_size, sm_scale, topk_length, attn_sink,
                          extra_pool, extra_indices, extra_page_size, extra_topk_length, out, checks)
    if checks:
        attn.check_device(q, native_fp8)
    b, s_q, h, _ = q.shape
    dev = q.device
    out, lse = new_outputs(a)
    T = b * s_q
    if T == 0 or h == 0:
        return out, lse
    if q.stride(3) != 1:
        q = q.contiguous()
    idx = a.idx if a.idx.stride(2) == 1 else a.idx.contiguous()
    has_extra = a.extra_pool is not None
    if has_extra:
        eidx = a.extra_idx if a.extra_idx.stride(2) == 1 else a.extra_idx.contiguous()
        epool = a.extra_pool
    else:
        eidx, epool = idx, a.pool
    pool_arg = a.pool.view(torch.float8_e4m3fn) if native_fp8 else a.pool
    epool_arg = epool.view(torch.float8_e4m3fn) if native_fp8 else epool
    width = idx.shape[2] + (eidx.shape[2] if has_extra else 0)
    if num_splits is None:
        if config is None:
            num_splits = _num_splits(dev, T, h, width)
        else:
            num_splits = attn.decode_splits(dev, T, h, width, block_h=config["BLOCK_H"], block_n=config["BLOCK_N"])
    dummy = lse
    with on_device(dev):
        attn.launch_sparse_mla(
            kind="decode_split" if num_splits > 1 else "decode", device=dev, T=T, H=h, config=config, num_splits=num_splits,
            q_ptr=q, q_sb=q.stride(0), q_ss=q.stride(1), q_sh=q.stride(2),
            kv_ptr=pool_arg, kv_row_stride=0, n_kv=a.pool.shape[0] * a.page_size,
            idx_ptr=idx, idx_sb=idx.stride(0), idx_ss=idx.stride(1), n_idx=idx.shape[2],
            len_ptr=a.topk_length if a.topk_length is not None else dummy,
            kv2_ptr=epool_arg, n_kv2=(epool.shape[0] * a.extra_page_size) if has_extra else 0,
            idx2_ptr=eidx, idx2_sb=eidx.stride(0), idx2_ss=eidx.stride(1),
            n_idx2=eidx.shape[2] if has_extra else 0,
            len2_ptr=a.extra_topk_length if (has_extra and a.extra_topk_length is not None) else dummy,
            sink_ptr=a.attn_sink if a.attn_sink is not None else dummy,
            out_ptr=out, out_sb=out.stride(0), out_ss=out.stride(1), out_sh=out.stride(2),
            ml_ptr=dummy, lse_ptr=lse, st_sb=lse.stride(0), st_ss=lse.stride(2), st_sh=lse.stride(1),
            DIV=s_q, LEN_DIV=s_q, qk_scale=sm_scale * _LOG2E,
            KV_MODE=2 if native_fp8 else 1,
            PAGE_SIZE=a.page_size, BYTES_PER_PAGE=a.pool.shape[1],
            PAGE_SIZE2=a.extra_page_size if has_extra else 1,
            BYTES_PER_PAGE2=epool.shape[1] if has_extra else 1,
            HAS_LEN=a.topk_length is not None, HAS_EXTRA=has_extra,
            HAS_LEN2=has_extra and a.extra_topk_length is not None,
            HAS_SINK=a.attn_sink is not None, STATS=2,
        )
    return out, lse


def decode_mla_u8(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None,
                  extra_pool=None, extra_indices=None, extra_page_size=None, extra_topk_length=None,
                  *, out=None, checks=True):
    """decode_mla with an integer e4m3 decoder (no fp8 types; SM80/86 ok). Contract: reference.decode_mla."""
    return _launch(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool, extra_indices,
                   extra_page_size, extra_topk_length, out, native_fp8=False, checks=checks)


def decode_mla_fp8(q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None,
                   extra_pool=None, extra_indices=None, extra_page_size=None, extra_topk_length=None,
                   *, out=None, checks=True):
    """decode_mla with Triton's native fp8 conversion (cc >= 8.9). Contract: reference.decode_mla."""
    return _launch(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool, extra_indices,
                   extra_page_size, extra_topk_length, out, native_fp8=True, checks=checks)


# Custom ops (backends/torch_ops.py): what the registry binds.
from .ops import decode_mla_op  # noqa: E402

op_decode_mla_fp8 = decode_mla_op("triton_fp8", decode_mla_fp8)
op_decode_mla_u8 = decode_mla_op("triton", decode_mla_u8)

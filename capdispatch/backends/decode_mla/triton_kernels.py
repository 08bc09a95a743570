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
from ..device_scope import on_device_of
from ..sparse_attention import kernels as attn
from .reference import check_decode_args

__all__ = ["decode_mla_u8", "decode_mla_fp8", "INTERPRETED", "DecodeMla", "forget_plans"]

INTERPRETED = attn.INTERPRETED

_LOG2E = 1.4426950408889634
_FP8 = torch.float8_e4m3fn
_BF16, _F32 = torch.bfloat16, torch.float32


class DecodeMla:
    """decode_mla on the shared Triton sparse-attention kernel with one codec (NATIVE_FP8:
    Triton's fp8 loads, else the uint8 integer decode). Contract: reference.decode_mla.

    Per call it normalises the pools, allocates the outputs (the launch allocates the
    split scratch), reads the pointers and strides, and launches; everything that
    depends only on the device and the call's shape class (tile configuration, split-K
    count, constexprs) is a ``sparse_attention.kernels.LaunchPlan`` kept in ``plans``,
    keyed by the device, the shapes and any forced launch target (launch_limits), so it
    never answers for another card."""

    def __init__(self, native_fp8: bool):
        self.native_fp8 = native_fp8
        self.plans: dict = {}
        self.__name__ = self.__qualname__ = "decode_mla_fp8" if native_fp8 else "decode_mla_u8"
        self.__doc__ = ("decode_mla with Triton's native fp8 conversion (cc >= 8.9). Contract: reference.decode_mla."
                        if native_fp8 else
                        "decode_mla with an integer e4m3 decoder (no fp8 types; SM80/86 ok). Contract: "
                        "reference.decode_mla.")

    def __call__(self, q, pool, indices, page_size, sm_scale, topk_length=None, attn_sink=None,
                 extra_pool=None, extra_indices=None, extra_page_size=None, extra_topk_length=None,
                 *, out=None, checks=True):
        return self.launch(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool,
                           extra_indices, extra_page_size, extra_topk_length, out, checks)

    def launch(self, q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool, extra_indices,
               extra_page_size, extra_topk_length, out, checks=True, config=None, num_splits=None):
        """The call; CONFIG and NUM_SPLITS force a tile configuration and a split count
        (tests, tuning), and such a call's plan is not kept."""
        native = self.native_fp8
        if checks:
            a = check_decode_args(q, pool, indices, page_size, sm_scale, topk_length, attn_sink,
                                  extra_pool, extra_indices, extra_page_size, extra_topk_length, out, checks)
            attn.check_device(q, native)
            pool, page_size, indices, topk_length = a.pool, a.page_size, a.idx, a.topk_length
            extra_pool, extra_page_size = a.extra_pool, a.extra_page_size
            extra_indices, extra_topk_length = a.extra_idx, a.extra_topk_length
        else:
            if pool.dim() != 2 or pool.dtype != torch.uint8:
                pool, page_size = _pool_2d(pool, page_size)
            if extra_pool is not None and (extra_pool.dim() != 2 or extra_pool.dtype != torch.uint8):
                extra_pool, extra_page_size = _pool_2d(extra_pool, extra_page_size)
        b, s_q, h, _ = q.shape
        dev = q.device
        T = b * s_q
        if out is None:
            out = torch.empty((b, s_q, h, 512), dtype=_BF16, device=dev)
            os_ = (s_q * h * 512, h * 512, 512)
        else:
            os_ = None
        lse = torch.empty((b, h, s_q), dtype=_F32, device=dev)
        if T == 0 or h == 0:
            return out, lse
        if os_ is None:
            os_ = out.stride()
        qs = q.stride()
        if qs[3] != 1:
            q = q.contiguous()
            qs = q.stride()
        idx = indices
        ids = idx.stride()
        if ids[2] != 1:
            idx = idx.contiguous()
            ids = idx.stride()
        n_idx = idx.shape[2]
        has_extra = extra_pool is not None
        if has_extra:
            eidx = extra_indices
            eids = eidx.stride()
            if eids[2] != 1:
                eidx = eidx.contiguous()
                eids = eidx.stride()
            epool, n_idx2 = extra_pool, eidx.shape[2]
            ebpp, eps = epool.shape[1], extra_page_size
        else:
            eidx, eids, epool, n_idx2, ebpp, eps = idx, ids, pool, 0, 1, 1
        bpp = pool.shape[1]
        has_len2 = has_extra and extra_topk_length is not None
        key = (dev, b, s_q, h, n_idx, n_idx2, page_size, bpp, has_extra, eps, ebpp, topk_length is not None,
               has_len2, attn_sink is not None) + _limits.plan_key() + attn.table_key()
        forced = config is not None or num_splits is not None
        plan = None if forced else self.plans.get(key)
        if plan is None:
            plan = self._plan(dev, T, h, key, config, num_splits)
            if not forced:
                self.plans[key] = plan
        n_kv = pool.shape[0] * page_size
        n_kv2 = epool.shape[0] * eps if has_extra else 0
        if native:
            pool = pool.view(_FP8)
            epool = epool.view(_FP8) if has_extra else pool
        len1 = topk_length if topk_length is not None else lse
        len2 = extra_topk_length if has_len2 else lse
        sink = attn_sink if attn_sink is not None else lse
        head = (q, qs[0], qs[1], qs[2], pool, 0, n_kv, idx, ids[0], ids[1], n_idx, len1,
                epool, n_kv2, eidx, eids[0], eids[1], n_idx2, len2, sink,
                out, os_[0], os_[1], os_[2], lse, lse, h * s_q, 1, s_q)    # lse [b, h, s_q]: (sb, ss, sh)
        with on_device_of(q):
            ran = attn.launch_planned(plan, T, head, s_q, s_q, sm_scale * _LOG2E, dev)
        if ran is not plan and not forced:    # this shape's configuration did not fit: the next calls start there
            self.plans[key] = ran
        return out, lse

    def _plan(self, dev, T, h, key, config, num_splits):
        _, b, s_q, _, n_idx, n_idx2, ps, bpp, has_extra, eps, ebpp, has_len, has_len2, has_sink = key[:14]
        if num_splits is None:
            # The split decision uses the split-K tile: decode-sized calls run with it.
            cfg = config if config is not None else attn.device_configs(dev, "decode_split", T)[0]
            num_splits = attn.decode_splits(dev, T, h, n_idx + n_idx2, block_h=cfg["BLOCK_H"], block_n=cfg["BLOCK_N"],
                                            max_splits=cfg.get("max_splits", attn.MAX_SPLITS))
        consts = (2 if self.native_fp8 else 1, ps, bpp, eps, ebpp, has_len, has_extra, has_len2, has_sink, 2)
        return attn.plan_launch(dev, "decode_split" if num_splits > 1 else "decode", T, h, consts, config=config,
                                num_splits=num_splits, n_idx=n_idx, n_idx2=n_idx2)


def _pool_2d(pool, page_size):
    """FlashMLA's 4-D pool view or another byte dtype as the 2-D uint8 pool (serving: unchecked)."""
    if pool.dim() == 4:
        n, bpp = pool.shape[0], pool.stride(0)
        u8 = pool if pool.dtype == torch.uint8 else pool.view(torch.uint8)
        return torch.as_strided(u8, (n, bpp), (bpp, 1)), pool.shape[1]
    return pool.view(torch.uint8), page_size


def _launch(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool, extra_indices,
            extra_page_size, extra_topk_length, out, native_fp8, config=None, num_splits=None, checks=True):
    """One call with a forced tile CONFIG and / or split count NUM_SPLITS (tests, tuning)."""
    fn = decode_mla_fp8 if native_fp8 else decode_mla_u8
    return fn.launch(q, pool, indices, page_size, sm_scale, topk_length, attn_sink, extra_pool, extra_indices,
                     extra_page_size, extra_topk_length, out, checks, config, num_splits)


decode_mla_fp8 = DecodeMla(native_fp8=True)
decode_mla_u8 = DecodeMla(native_fp8=False)


def forget_plans() -> None:
    """Drop every launch plan (tuning changes the launch table between calls)."""
    decode_mla_fp8.plans.clear()
    decode_mla_u8.plans.clear()


# Custom ops (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_decode_mla_fp8 = custom_op(OPS[0], "triton_fp8", decode_mla_fp8)
op_decode_mla_u8 = custom_op(OPS[0], "triton", decode_mla_u8)

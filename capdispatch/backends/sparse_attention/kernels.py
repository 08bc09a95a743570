"""Triton sparse MLA attention over gathered top-k K/V rows (DeepSeek-V4: head dim 512,
K = V = the same 512 latent values, one KV head), and its launcher.

One kernel body serves both attention ops, the K/V source chosen by the ``KV_MODE``
constexpr:

* ``KV_MODE = 0``: bf16 rows ``kv[s_kv, 512]`` (sparse_prefill ``triton``);
* ``KV_MODE = 1``: the V4 fp8 paged pool read through uint8 with an integer e4m3
  decode (no fp8 type anywhere: compiles for SM80/SM86) (decode_mla ``triton``);
* ``KV_MODE = 2``: the same pool with Triton's native fp8 loads (cc >= 8.9)
  (decode_mla ``triton_fp8``).

With ``DIRECT`` (a launch-table entry's ``"DIRECT": True``; KV_MODE 1 only) the uint8
pool's e4m3 bytes go straight to bf16 in PTX (triton_common/v4_rows.py
``load_rows_direct``) instead of through float32: the same rows bit for bit.

Each program owns one query token and ``BLOCK_H`` heads and walks that token's index
list in blocks of ``BLOCK_N`` rows: gather the rows (masked entries are never loaded),
S = Q K^T on bf16 tensor cores with fp32 accumulation, an online softmax in base 2,
O += P V with P rounded to bf16. The walk stops at the token's ``topk_length``. With
``SPLIT`` (decode-sized calls only) the index list is cut into contiguous
ranges, each program writes a normalised partial output and its base-2 lse to a
scratch buffer, and ``_combine_kernel`` merges them; the scratch is sized by the
program count, never by sequence length. Extends never use scratch.

Statistics modes (``STATS``): 0 = FlashMLA legacy prefill (base 2; lonely query:
max_logits -inf, lse +inf), 1 = FlashMLA current prefill (natural log; lonely:
max_logits -inf, lse +inf), 2 = decode (natural-log lse only; lonely: +inf).
All address arithmetic is int64. This module imports triton at module level and is
meant to be imported lazily (at backend bind time); the ops' ``triton_kernels.py``
keep a ``LaunchPlan`` per (device, call shape) (``plan_launch``), read their pointers and
strides and call ``launch_planned``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib

import torch
import triton
import triton.language as tl

from ...errors import UnsupportedDeviceError
from .. import launch_limits as _limits
from .. import device_facts as _device_facts
from ..device_scope import cdiv, capability as _capability
from ..triton_common.env import check_device as _check_device, interpreted, jit_module

__all__ = ["DIM", "INTERPRETED", "OUT_OF_RESOURCES", "check_device", "device_key", "device_configs",
           "LaunchPlan", "plan_launch", "launch_planned", "forget_plans", "num_sms", "plan_splits", "decode_splits",
           "compile_signature", "COMPILE_SIGNATURES", "compile_offline", "compile_combine_offline",
           "tables_as", "table_key"]

DIM = 512   # head dim of q and of the shared K/V latent (448 nope + 64 rope)

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_DIM = tl.constexpr(DIM)

# The toolbox's helpers (triton_common), built the way these kernels are.
_round_bf16 = jit_module("codec").round_bf16
_v4_rows = jit_module("v4_rows")
_token_bases = _v4_rows.token_bases
_load_v4_rows = _v4_rows.load_rows
_load_v4_rows_direct = _v4_rows.load_rows_direct

from .launch_table import (COMBINE_BLOCK_D, COMBINE_BLOCK_H, COMBINE_WARPS, DECODE_MAX_TOKENS,  # noqa: E402
                           INTERP_CONFIG, MAX_SPLITS, configs_for, table_configs)


# --------------------------------------------------------------------------- #
# K/V tile loaders
# --------------------------------------------------------------------------- #
@triton.jit
def _load_rows(kv_ptr, ids, valid, row_stride, cols):
    """bf16 rows kv[ids, :] -> [BN, 512] bf16; masked rows are zeros and never loaded."""
    ptrs = kv_ptr + ids.to(tl.int64)[:, None] * row_stride + cols[None, :]
    return tl.load(ptrs, mask=valid[:, None], other=0.0)


@triton.jit
def _load_paged(pool_ptr, ids, valid, PAGE_SIZE: tl.constexpr, BYTES_PER_PAGE: tl.constexpr,
                NATIVE_FP8: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, EMULATE: tl.constexpr):
    """Tokens ``ids`` of a V4 paged pool -> dequantised [BN, 512] bf16 rows (exact, as
    kv_dequant); masked rows are zeros and none of their bytes are loaded. ``pool_ptr``
    is a uint8 pointer, or float8e4nv with NATIVE_FP8 (triton_common/v4_rows.py); DIRECT
    (uint8 only) decodes in PTX, or, with EMULATE (the interpreter), its emulation."""
    data_base, scale_base = _token_bases(ids.to(tl.int64), PAGE_SIZE, BYTES_PER_PAGE)
    if DIRECT:
        rows = _load_v4_rows_direct(pool_ptr, data_base, scale_base, valid, EMULATE)
    else:
        rows = _load_v4_rows(pool_ptr, data_base, scale_base, valid, NATIVE_FP8)
    return tl.reshape(rows, (BLOCK_N, _DIM))


# --------------------------------------------------------------------------- #
# One index list, a range of its blocks
# --------------------------------------------------------------------------- #
@triton.jit
def _attend_range(q, m_i, l_i, acc, qk_scale,
                  kv_ptr, row_stride, n_kv,
                  idx_row_ptr, n_idx, b_lo, b_hi, cols,
                  KV_MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, BYTES_PER_PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, DIRECT: tl.constexpr):
    """Online softmax (base 2) over index blocks [b_lo, b_hi) of one token's list of n_idx
    valid-position entries. An entry is valid when 0 <= id < n_kv."""
    offs = tl.arange(0, BLOCK_N)
    for b in range(b_lo, b_hi):
        pos = b * BLOCK_N + offs
        inr = pos < n_idx
        ids = tl.load(idx_row_ptr + pos, mask=inr, other=-1).to(tl.int64)
        valid = inr & (ids >= 0) & (ids < n_kv)
        if KV_MODE == 0:
            k = _load_rows(kv_ptr, ids, valid, row_stride, cols)
        else:
            k = _load_paged(kv_ptr, ids, valid, PAGE_SIZE, BYTES_PER_PAGE, KV_MODE == 2, BLOCK_N,
                            DIRECT and KV_MODE == 1, DOT_F32)
        if DOT_F32:   # interpreter: its bf16 dot multiplies raw bits; use the same values in fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale                                         # [BH, BN] fp32, base-2 logits
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # no (-inf) - (-inf)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            pv = tl.dot(_round_bf16(p), k.to(tl.float32))
        else:
            pv = tl.dot(p.to(tl.bfloat16), k)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _finish(o, lse2, m2, t, heads, hmask, smask, cols, sink_ptr,
            out_ptr, out_sb, out_ss, out_sh,
            ml_ptr, lse_ptr, st_sb, st_ss, st_sh, DIV,
            HAS_SINK: tl.constexpr, STATS: tl.constexpr, ROUND: tl.constexpr):
    """Sink, lonely rows, bf16 output (columns ``cols``) and statistics (heads in ``smask``)
    for one token x BLOCK_H heads. o: normalised output (0 where lonely); lse2 / m2:
    base-2 (-inf where lonely)."""
    lonely = lse2 == float("-inf")
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
        d = tl.where(lonely, 0.0, sink * _LOG2E - lse2)
        o = o * (1.0 / (1.0 + tl.exp2(d)))[:, None]
    o = tl.where(lonely[:, None], 0.0, o)
    if ROUND:
        o = _round_bf16(o)
    tb = t // DIV
    ts = t % DIV
    optrs = out_ptr + tb * out_sb + ts * out_ss + heads.to(tl.int64)[:, None] * out_sh + cols[None, :]
    tl.store(optrs, o.to(tl.bfloat16), mask=hmask[:, None])
    st = tb * st_sb + ts * st_ss + heads.to(tl.int64) * st_sh
    if STATS == 0:
        tl.store(ml_ptr + st, m2, mask=smask)
        tl.store(lse_ptr + st, tl.where(lonely, float("inf"), lse2), mask=smask)
    elif STATS == 1:
        tl.store(ml_ptr + st, m2 * _LN2, mask=smask)
        tl.store(lse_ptr + st, tl.where(lonely, float("inf"), lse2 * _LN2), mask=smask)
    else:
        tl.store(lse_ptr + st, tl.where(lonely, float("inf"), lse2 * _LN2), mask=smask)


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #
@triton.jit
def _sparse_mla_kernel(
    q_ptr, q_sb, q_ss, q_sh,                        # q: token t at (t // DIV) * q_sb + (t % DIV) * q_ss
    kv_ptr, kv_row_stride, n_kv,                    # main source: bf16 rows, or a paged pool
    idx_ptr, idx_sb, idx_ss, n_idx,                 # main index list [T, n_idx]
    len_ptr,                                        # main topk_length, indexed by t // LEN_DIV
    kv2_ptr, n_kv2,                                 # extra paged pool (decode)
    idx2_ptr, idx2_sb, idx2_ss, n_idx2,
    len2_ptr,
    sink_ptr,
    out_ptr, out_sb, out_ss, out_sh,
    ml_ptr, lse_ptr, st_sb, st_ss, st_sh,
    part_o_ptr, part_lse_ptr,                       # split-K scratch [T, H_pad, S, 512], [T, H_pad, S]
    H, H_pad, DIV, LEN_DIV, qk_scale: tl.float32, blocks_per_split, num_splits,
    KV_MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, BYTES_PER_PAGE: tl.constexpr,
    PAGE_SIZE2: tl.constexpr, BYTES_PER_PAGE2: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_LEN2: tl.constexpr, HAS_SINK: tl.constexpr,
    STATS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, DIRECT: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    cols = tl.arange(0, 512)
    tb = t // DIV
    ts = t % DIV

    qptrs = q_ptr + tb * q_sb + ts * q_ss + heads.to(tl.int64)[:, None] * q_sh + cols[None, :]
    q = tl.load(qptrs, mask=hmask[:, None], other=0.0)

    # Valid positions of each list (topk_length caps them), in blocks.
    n1 = n_idx
    if HAS_LEN:
        n1 = tl.minimum(tl.maximum(tl.load(len_ptr + t // LEN_DIV).to(tl.int32), 0), n_idx)
    nb1 = tl.cdiv(n_idx, BLOCK_N)              # static block count (split ranges)
    nb1_used = tl.cdiv(n1, BLOCK_N)            # blocks holding valid positions
    nb2 = 0
    n2 = 0
    if HAS_EXTRA:
        n2 = n_idx2
        if HAS_LEN2:
            n2 = tl.minimum(tl.maximum(tl.load(len2_ptr + t // LEN_DIV).to(tl.int32), 0), n_idx2)
        nb2 = tl.cdiv(n_idx2, BLOCK_N)

    lo = 0
    hi = nb1 + nb2
    if SPLIT:
        lo = split * blocks_per_split
        hi = tl.minimum(lo + blocks_per_split, nb1 + nb2)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)

    m_i, l_i, acc = _attend_range(
        q, m_i, l_i, acc, qk_scale, kv_ptr, kv_row_stride, n_kv,
        idx_ptr + tb * idx_sb + ts * idx_ss, n1,
        tl.minimum(lo, nb1_used), tl.minimum(hi, nb1_used), cols,
        KV_MODE, PAGE_SIZE, BYTES_PER_PAGE, BLOCK_N, DOT_F32, DIRECT)
    if HAS_EXTRA:
        nb2_used = tl.cdiv(n2, BLOCK_N)
        m_i, l_i, acc = _attend_range(
            q, m_i, l_i, acc, qk_scale, kv2_ptr, 0, n_kv2,
            idx2_ptr + tb * idx2_sb + ts * idx2_ss, n2,
            tl.minimum(tl.maximum(lo - nb1, 0), nb2_used), tl.minimum(tl.maximum(hi - nb1, 0), nb2_used), cols,
            KV_MODE, PAGE_SIZE2, BYTES_PER_PAGE2, BLOCK_N, DOT_F32, DIRECT)

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if not SPLIT:
        _finish(o, lse2, m_i, t, heads, hmask, hmask, cols, sink_ptr,
                out_ptr, out_sb, out_ss, out_sh, ml_ptr, lse_ptr, st_sb, st_ss, st_sh, DIV,
                HAS_SINK, STATS, DOT_F32)
    else:
        prow = (t * H_pad + heads.to(tl.int64)) * num_splits + split     # [BH]
        tl.store(part_o_ptr + prow[:, None] * 512 + cols[None, :], o, mask=hmask[:, None])
        tl.store(part_lse_ptr + prow, lse2, mask=hmask)


@triton.jit
def _combine_kernel(
    part_o_ptr, part_lse_ptr, sink_ptr,
    out_ptr, out_sb, out_ss, out_sh,
    ml_ptr, lse_ptr, st_sb, st_ss, st_sh,
    H, H_pad, DIV, num_splits,
    HAS_SINK: tl.constexpr, STATS: tl.constexpr,
    SPLITS_P2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROUND: tl.constexpr,
):
    """Merge the split partials of one token x BLOCK_H heads x BLOCK_D output columns."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    db = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    cols = db * BLOCK_D + tl.arange(0, BLOCK_D)
    sp = tl.arange(0, SPLITS_P2)
    row = (t * H_pad + heads.to(tl.int64)) * num_splits                     # [BH]
    lse_s = tl.load(part_lse_ptr + row[:, None] + sp[None, :],
                    mask=hmask[:, None] & (sp < num_splits)[None, :], other=float("-inf"))
    mx = tl.max(lse_s, axis=1)
    mx_ref = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse_s - mx_ref[:, None])                                    # [BH, S]
    tot = tl.sum(w, axis=1)
    has = tot > 0.0
    o = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for s in range(num_splits):
        ws = tl.sum(tl.where(sp[None, :] == s, w, 0.0), axis=1)
        po = tl.load(part_o_ptr + (row + s)[:, None] * 512 + cols[None, :], mask=hmask[:, None], other=0.0)
        o += ws[:, None] * po
    o = o / tl.where(has, tot, 1.0)[:, None]
    lse2 = tl.where(has, mx_ref + tl.log2(tl.where(has, tot, 1.0)), float("-inf"))
    _finish(o, lse2, lse2, t, heads, hmask, hmask & ((heads * 0 + db) == 0), cols, sink_ptr,
            out_ptr, out_sb, out_ss, out_sh, ml_ptr, lse_ptr, st_sb, st_ss, st_sh, DIV,
            HAS_SINK, STATS, ROUND)


# --------------------------------------------------------------------------- #
# Host side
# --------------------------------------------------------------------------- #
INTERPRETED = interpreted(_sparse_mla_kernel)


def check_device(t: torch.Tensor, native_fp8: bool = False) -> None:
    """Raise when T's device cannot run these kernels (the native-fp8 variant with NATIVE_FP8)."""
    _check_device(t, interpreted=INTERPRETED, kernels="Triton attention kernels", native_fp8=native_fp8,
                  instead="use the uint8 (integer-decode) Triton backend")


def num_sms(device_index: int) -> int:
    """SM count the splits on CUDA device DEVICE_INDEX are planned for: the card's own,
    or the emulated card's (device_facts)."""
    return _device_facts.for_index(device_index).sm_count


# (device type, device index, kind, tokens) -> the configurations to try, the last one
# that fit this device first. Keyed by the device index and emptied when an emulated card
# changes: never answers for another card.
_plans: dict = _device_facts.plan_cache()


def device_key(device: torch.device) -> tuple:
    """(type, index) of DEVICE, the current CUDA device's index for a bare "cuda"."""
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


# A candidate launch table forced on the lookups inside a ``tables_as`` block: (name,
# {kind: configurations}) or None. A context variable: it ends with the block and never
# reaches another thread's calls.
_TABLE: contextvars.ContextVar = contextvars.ContextVar("capdispatch_attention_table", default=None)


@contextlib.contextmanager
def tables_as(name: str, table: dict, *, on_cpu: bool = False):
    """Inside the block, every launch-table lookup of these kernels answers from TABLE
    ({kind: configurations}, e.g. a ``launch_table.CANDIDATE_TABLES`` entry) under NAME,
    whatever the device's capability; the ops' launch plans are keyed by NAME
    (``table_key``), so a plan made inside never answers outside. With ON_CPU the
    interpreter uses TABLE too (tests of the candidates' tiles), else its small tile."""
    token = _TABLE.set((name, table, on_cpu))
    try:
        yield
    finally:
        _TABLE.reset(token)


def table_key() -> tuple:
    """What a cached launch plan must add to its key: () outside a ``tables_as`` block,
    the forced table's name inside one."""
    forced = _TABLE.get()
    return () if forced is None else (("table", forced[0], forced[2]),)


def device_configs(device: torch.device, kind: str, tokens: int | None = None) -> tuple:
    """The launch configurations to try on DEVICE for call KIND of TOKENS query tokens,
    best first: the interpreter's small tile on a CPU, else the launch table for the
    device's compute capability (a ``tables_as`` table inside such a block), starting
    from the one that last fit this device."""
    key = device_key(device) + (kind, tokens) + _limits.plan_key() + table_key()
    plan = _plans.get(key)
    if plan is None:
        forced = _TABLE.get()
        if forced is not None and (device.type == "cuda" or forced[2]):
            plan = table_configs(forced[1], kind, tokens)
        elif device.type != "cuda":
            plan = (INTERP_CONFIG,)
        else:
            plan = configs_for(_limits.capability_for(_capability(device)), kind, tokens)
        _plans[key] = plan
    return plan


def _out_of_resources_errors() -> tuple:
    """Triton's OutOfResources exception classes (where this Triton keeps them), looked up once."""
    errs = []
    for mod, name in (("triton.runtime.errors", "OutOfResources"), ("triton.runtime.autotuner", "OutOfResources")):
        try:
            errs.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            pass
    return tuple(dict.fromkeys(errs)) or (RuntimeError,)


OUT_OF_RESOURCES = _out_of_resources_errors()


# Offline compile support (tests and tuning: no GPU needed). Kernel argument types and
# the constexprs of one launch, for triton.compile(ASTSource(...), target=GPUTarget(...)).
def compile_signature(kv_mode: int) -> dict:
    kvt = {0: "*bf16", 1: "*u8", 2: "*fp8e4nv"}[kv_mode]
    return dict(q_ptr="*bf16", q_sb="i64", q_ss="i64", q_sh="i64", kv_ptr=kvt, kv_row_stride="i64", n_kv="i64",
                idx_ptr="*i32", idx_sb="i64", idx_ss="i64", n_idx="i32", len_ptr="*i32",
                kv2_ptr=kvt, n_kv2="i64", idx2_ptr="*i32", idx2_sb="i64", idx2_ss="i64", n_idx2="i32",
                len2_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16", out_sb="i64", out_ss="i64", out_sh="i64",
                ml_ptr="*fp32", lse_ptr="*fp32", st_sb="i64", st_ss="i64", st_sh="i64",
                part_o_ptr="*fp32", part_lse_ptr="*fp32", H="i32", H_pad="i32", DIV="i32", LEN_DIV="i32",
                qk_scale="fp32", blocks_per_split="i32", num_splits="i32")


COMPILE_SIGNATURES = {
    "_combine_kernel": dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", sink_ptr="*fp32", out_ptr="*bf16",
                            out_sb="i64", out_ss="i64", out_sh="i64", ml_ptr="*fp32", lse_ptr="*fp32",
                            st_sb="i64", st_ss="i64", st_sh="i64", H="i32", H_pad="i32", DIV="i32",
                            num_splits="i32"),
}


def compile_offline(cc: int, kv_mode: int, cfg: dict, *, extra: bool = False, num_splits: int = 1):
    """Compile ``_sparse_mla_kernel`` for CUDA compute capability ``cc`` (e.g. 86) without a
    GPU; returns (CompiledKernel, ptx). Raises what Triton raises (e.g. fp8e4nv below 8.9)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    consts = dict(KV_MODE=kv_mode, PAGE_SIZE=256 if kv_mode else 1, BYTES_PER_PAGE=149760 if kv_mode else 1,
                  PAGE_SIZE2=64 if extra else 1, BYTES_PER_PAGE2=37440 if extra else 1,
                  HAS_LEN=True, HAS_EXTRA=extra, HAS_LEN2=extra, HAS_SINK=True,
                  STATS=0 if kv_mode == 0 else 2, SPLIT=num_splits > 1,
                  BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], DOT_F32=False,
                  DIRECT=bool(cfg.get("DIRECT", False)))
    sig = compile_signature(kv_mode)
    sig.update({k: "constexpr" for k in consts})
    ck = triton.compile(ASTSource(fn=_sparse_mla_kernel, signature=sig, constexprs=consts),
                        target=GPUTarget("cuda", cc, 32),
                        options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return ck, ck.asm["ptx"]


def compile_combine_offline(cc: int, block_h: int = COMBINE_BLOCK_H):
    """Compile ``_combine_kernel`` for compute capability ``cc`` without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = dict(COMPILE_SIGNATURES["_combine_kernel"])
    consts = dict(HAS_SINK=True, STATS=2, SPLITS_P2=MAX_SPLITS, BLOCK_H=block_h, BLOCK_D=COMBINE_BLOCK_D,
                  ROUND=False)
    sig.update({k: "constexpr" for k in consts})
    return triton.compile(ASTSource(fn=_combine_kernel, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", cc, 32), options=dict(num_warps=COMBINE_WARPS))


class LaunchPlan:
    """How one call shape of an op launches on one device, computed once by the op that
    keeps it (keyed by the device and the shapes): the tile configuration and those still
    to try should it not fit, the split-K count and its scratch, and the constexprs and
    launch options of the kernel and of the combine. CONSTS are the kernel's constexprs
    from KV_MODE to STATS, in its signature's order."""
    __slots__ = ("kind", "cfg", "rest", "requested", "H", "consts", "n_idx", "n_idx2", "n_hb", "splits", "per",
                 "h_pad", "tail", "options", "combine_hb", "combine_tail")

    def __init__(self, kind, configs, H, consts, num_splits=1, n_idx=0, n_idx2=0):
        cfg = self.cfg = configs[0]
        self.rest = tuple(configs[1:])
        self.kind, self.requested, self.H, self.consts = kind, num_splits, H, tuple(consts)
        self.n_idx, self.n_idx2 = n_idx, n_idx2
        bh, bn = cfg["BLOCK_H"], cfg["BLOCK_N"]
        self.n_hb = cdiv(H, bh)
        self.options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        num_splits = min(num_splits, MAX_SPLITS)
        if num_splits == 1:
            self.splits, self.per, self.h_pad = 1, 0, H
        else:
            has_extra = self.consts[6]
            total = cdiv(n_idx, bn) + (cdiv(n_idx2, bn) if has_extra else 0)
            self.per = cdiv(max(total, 1), num_splits)
            self.splits = cdiv(max(total, 1), self.per)
            self.h_pad = self.n_hb * bh
        self.tail = self.consts + (self.splits > 1, bh, bn, INTERPRETED, bool(cfg.get("DIRECT", False)))
        self.combine_hb = cdiv(H, COMBINE_BLOCK_H)
        self.combine_tail = (self.consts[8], self.consts[9], MAX_SPLITS, COMBINE_BLOCK_H, COMBINE_BLOCK_D,
                             INTERPRETED)

    def fallback(self):
        """The same launch with the next configuration, or None when none is left."""
        if not self.rest:
            return None
        return LaunchPlan(self.kind, self.rest, self.H, self.consts, self.requested, self.n_idx, self.n_idx2)


def plan_launch(device, kind, T, H, consts, *, config=None, num_splits=1, n_idx=0, n_idx2=0) -> LaunchPlan:
    """The LaunchPlan of a KIND call over T tokens x H heads on DEVICE with constexprs
    CONSTS (KV_MODE ... STATS): CONFIG alone, else the device's configurations for KIND,
    best first; N_IDX / N_IDX2 (the index lists' widths) size a split."""
    configs = (config,) if config is not None else device_configs(device, kind, T)
    return LaunchPlan(kind, configs, H, consts, num_splits, n_idx, n_idx2)


def launch_planned(plan: LaunchPlan, T, head, DIV, LEN_DIV, qk_scale, device) -> LaunchPlan:
    """Launch ``_sparse_mla_kernel`` (and the combine kernel when split) as PLAN says over
    T tokens. HEAD is the kernel's first 29 arguments, ``q_ptr`` to ``st_sh``, positional
    (pointers and strides read by the op); the rest comes from the plan. While a
    configuration does not fit the device the next one is tried; returns the plan that
    ran, which the op keeps for its next call of this shape."""
    while True:
        try:
            _run_plan(plan, T, head, DIV, LEN_DIV, qk_scale, device)
            return plan
        except OUT_OF_RESOURCES as exc:   # does not fit this device: try a smaller tile
            nxt = plan.fallback()
            if nxt is None:
                raise UnsupportedDeviceError(f"no Triton configuration fits this device for {plan.kind}: {exc}") \
                    from exc
            plan = nxt


def _run_plan(plan, T, head, DIV, LEN_DIV, qk_scale, device):
    H = plan.H
    if plan.splits == 1:
        _limits.launch(_sparse_mla_kernel, (T, plan.n_hb, 1))(
            *head, head[20], head[25], H, H, DIV, LEN_DIV, qk_scale, 0, 1, *plan.tail, **plan.options)
        return
    part_o = torch.empty((T, plan.h_pad, plan.splits, DIM), dtype=torch.float32, device=device)
    part_lse = torch.empty((T, plan.h_pad, plan.splits), dtype=torch.float32, device=device)
    _limits.launch(_sparse_mla_kernel, (T, plan.n_hb, plan.splits))(
        *head, part_o, part_lse, H, plan.h_pad, DIV, LEN_DIV, qk_scale, plan.per, plan.splits, *plan.tail,
        **plan.options)
    _limits.launch(_combine_kernel, (T, plan.combine_hb, DIM // COMBINE_BLOCK_D))(
        part_o, part_lse, *head[19:29], H, plan.h_pad, DIV, plan.splits, *plan.combine_tail,
        num_warps=COMBINE_WARPS)


def forget_plans() -> None:
    """Drop every configuration choice (tuning changes the launch table between calls)."""
    _plans.clear()


def plan_splits(programs: int, blocks: int, sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Split count for ``programs`` (token x head-block) programs over index lists of
    ``blocks`` blocks on ``sms`` SMs: the one that minimises waves x (blocks per program
    + 1, the program's fixed cost: its query tile in, its partial out), assuming one
    resident program per SM (the H200's 64-head tile needs 196 KB of shared memory);
    ties go to fewer splits (less scratch, a cheaper merge), and the split programs stay
    below 4 x SM count, which bounds the scratch. Returns the effective count,
    ceil(blocks / ceil(blocks / s)), which is what the launch uses.

    Why not just 'enough programs to fill the GPU': 32 tokens x 5 splits of 2 blocks are
    160 programs, two waves on 132 SMs (2 x 3 block-times); 4 splits of 3 blocks are one
    wave (4 block-times)."""
    best = None
    cap = max(1, min(max_splits, blocks, (4 * sms - 1) // max(programs, 1)))
    for s in range(1, cap + 1):
        per = -(-blocks // s)
        eff = -(-blocks // per)
        key = (-(-programs * eff // sms) * (per + 1), eff)
        if best is None or key < best:
            best = key
    return best[1]


def decode_splits(device: torch.device, T: int, H: int, total_index_entries: int, block_h: int = 32,
                  block_n: int = 32, max_splits: int = MAX_SPLITS) -> int:
    """Split-K factor: >1 only for decode-sized calls (T <= DECODE_MAX_TOKENS) that would
    otherwise leave the GPU idle (fewer than ~2 programs per SM); see plan_splits.
    MAX_SPLITS caps it (a launch-table entry's ``max_splits``: fewer fp32 partials to write
    and merge)."""
    if device.type != "cuda" or T > DECODE_MAX_TOKENS or T == 0:
        return 1
    programs = T * cdiv(H, block_h)
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= 2 * sms:
        return 1
    return plan_splits(programs, cdiv(max(total_index_entries, 1), block_n), sms, min(max_splits, MAX_SPLITS))

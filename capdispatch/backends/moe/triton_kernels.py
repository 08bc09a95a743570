"""Triton W4A16 routed-expert MoE: MXFP4 dequantised on load inside a grouped GEMM.

Three launches plus one small routing kernel, no atomics (bit-stable run to run):

1. routing: routes (t, k) with id >= 0 are grouped by expert, stable in route
   order, into ``sorted_routes``; a block table lists, for each block of up to
   BM routes of one expert, (expert, start, end). Blocks past the last real one
   carry expert -1. A masked route (-1) gets no position: it is never computed
   and its id is never used as an address. One Triton program does this for up
   to ROUTING_MAX_ROUTES routes (decode and small prefill); beyond that torch ops
   build the same table (large prefill, where the GEMMs dwarf them).
2. GEMM1 + SwiGLU: per block and N-tile of I, acc_gate/acc_up over H with the
   gate and up rows of w13 decoded from packed bytes in registers (on the GPU by
   PTX straight to bf16, _E2M1_ASM; under the interpreter in float32), bf16
   tensor-core dots with float32 accumulation; the clamped SwiGLU in float32; h
   stored bf16 at the route's sorted position. Only positions of unmasked routes are written.
3. GEMM2: per block and N-tile of H, h rows times decoded w2, times the route's
   top-k weight, stored float32 at the route's own row of ``routed`` [T*K, H].
   Rows of masked routes are never written.
4. combine: y[t] = sum over k in order of routed[t*K+k] where id >= 0 (loads of
   masked rows are masked off: never read), rounded to bf16 once.

One token skips 1: each of its routes is a block of its own, whose expert the GEMMs read
from topk_ids (DIRECT).

The grid of 2 and 3 is an upper bound (routes // BM + min(E, routes) blocks) known on
the host without reading device data, so nothing synchronises and the launch
sequence is capturable in a CUDA graph. Shapes: H and I multiples of 64.
This module imports triton at import time; it is imported when bound.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import ArgumentError
from .. import launch_limits as _limits
from ..device_scope import cdiv, on_device_of
from ..triton_common.env import check_device, interpreted, jit_module
from .launch_table import Tiles, mean_rows, routing_launch, tiles_for
from .reference import check_moe_args
from .weights import CHECKPOINT, FOLD_SCALE_MAX

__all__ = ["moe_w4a16", "routing_tables", "ROUTING_MAX_ROUTES", "Tiles", "KERNEL_PARTS"]

ROUTING_MAX_ROUTES = 2048      # one-program routing kernel up to this many routes (torch ops beyond)

# The toolbox's bf16 rounding (triton_common), built the way these kernels are.
_round_bf16 = jit_module("codec").round_bf16


# --------------------------------------------------------------------------- #
# Device helpers
# --------------------------------------------------------------------------- #
@triton.jit
def _fp16_bits_to_f32(h):
    """An e2m1 code's sign, exponent and mantissa placed in fp16 bits 15, 11-10 and 9 ->
    its float32 value, exact. That fp16 is the e2m1 value times 2**-14, the e2m1
    subnormal (0.5) included, so scaling it by 2**14 in fp16 and widening are exact.
    The interpreter's decode (the GPU decodes in PTX, _E2M1_ASM). The sign is set with a
    bitwise OR (never by negating a zero)."""
    return (h.to(tl.uint16).to(tl.float16, bitcast=True) * 16384.0).to(tl.float32)


@triton.jit
def _e8m0_to_f32(s):
    """E8M0 byte (int32 0..255) -> float32 2**(s-127); 0 -> 2**-127, 255 -> NaN."""
    bits = tl.where(s == 0, 0x00400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16(v, EXACT_RNE: tl.constexpr):
    """float32 -> bf16, round to nearest even. The interpreter's own cast truncates
    (triton 3.9 numpy emulation), so under it the rounding is done on the bits
    first (triton_common/codec.py) and the cast is then exact; on the GPU the
    hardware cvt rounds."""
    if EXACT_RNE:
        v = _round_bf16(v)
    return v.to(tl.bfloat16)


@triton.jit
def _e8m0_to_bf16(s):
    """E8M0 byte (int32 0..255) -> bf16 2**(s-127): 0 -> 2**-127 (the subnormal 0x0040),
    255 -> NaN; exact, as bf16 has float32's exponent range."""
    bits = tl.maximum(s << 7, 0x0040)           # s >= 1 gives s << 7 >= 0x80; s == 0 gives 0x40
    bits = tl.where(s == 255, 0x7FC0, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


# Four MXFP4 bytes (one 32-bit register, $4) and their four bf16 E8M0 scales ($5, $6)
# -> the four low-nibble values ($0, $1) and four high-nibble values ($2, $3), each
# register a bf16x2 pair of consecutive bytes. Per pair, prmt puts each byte in the
# low half of a 16-bit lane and its top bit replicated in the high half; a 2-bit left
# shift and a mask leave the nibble's sign at bit 15 and its exponent and mantissa at
# bits 8..6: that bf16 is the e2m1 value times 2**-126 (code 1, 0.5, becomes the
# subnormal 0x0040; codes 0 and 8 stay +0 and -0). The low nibble takes the same path
# from the bytes shifted left by 4. Then fma.rn.bf16x2 (sm_80+, no flush of subnormal
# inputs or results) times 2**126 (exact) and times the scale (exact, or +-inf past
# bf16's range, as float32 is); the -0.0 addend keeps the sign of zero products.
# With FOLDED the 2**126 rides in the scales ($5, $6 hold 2**126 times the E8M0 scale,
# _e8m0_to_bf16_folded): one fma per pair. Exact while every scale byte is at most 128
# (the folded scale 2**(s-1) is then a bf16 number), which MoeWeights.scale_max tells the
# host.
def _e2m1_ptx(folded: bool) -> str:
    lines = ["{", ".reg .b32 t, p, c126, nz;", "mov.b32 c126, 0x7E807E80;", "mov.b32 nz, 0x80008000;",
             "shl.b32 t, $4, 4;"]
    for out, src, sel, scale in (("$0", "t", "0x9180", "$5"), ("$1", "t", "0xB3A2", "$6"),
                                 ("$2", "$4", "0x9180", "$5"), ("$3", "$4", "0xB3A2", "$6")):
        lines += [f"prmt.b32 p, {src}, 0, {sel};", "shl.b32 p, p, 2;", "and.b32 p, p, 0x81C081C0;"]
        if not folded:
            lines.append("fma.rn.bf16x2 p, p, c126, nz;")
        lines.append(f"fma.rn.bf16x2 {out}, p, {scale}, nz;")
    return "\n".join(lines + ["}"])


_E2M1_ASM = tl.constexpr(_e2m1_ptx(False))
_E2M1_ASM_FOLDED = tl.constexpr(_e2m1_ptx(True))


@triton.jit
def _e8m0_to_bf16_folded(s):
    """E8M0 byte (int32 0..128) -> bf16 2**126 * 2**(s-127) = 2**(s-1), exact (bytes above
    128 never reach it: the host picks _e8m0_to_bf16 and two fmas for those weights)."""
    return ((s + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e2m1_bf16_folded(wb, scale):
    """_e2m1_bf16 with a folded scale (_e8m0_to_bf16_folded)."""
    return tl.inline_asm_elementwise(_E2M1_ASM_FOLDED, "=r,=r,=r,=r,r,r,r", [wb, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _e2m1_bf16(wb, scale):
    """uint8 MXFP4 bytes and a bf16 scale tensor of their shape -> (low-nibble, high-nibble)
    bf16 values, exact (PTX: GPU only; the interpreter runs _decode_halves' F32 path)."""
    return tl.inline_asm_elementwise(_E2M1_ASM, "=r,=r,=r,=r,r,r,r", [wb, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _decode_halves(w_ptrs, s_ptrs, mask_n, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                   FOLD: tl.constexpr):
    """Packed rows [BN, BK/2] bytes + scales [BN, BK/32] -> (low, high) nibble values, each
    [BN, BK/2]: element j is byte j's weight k = 2j (low) or 2j + 1 (high). F32 (the
    interpreter) decodes in float32 with Triton ops; the GPU path decodes to bf16 in PTX
    (_E2M1_ASM), the same values bit for bit."""
    wb = tl.load(w_ptrs, mask=mask_n[:, None], other=0)
    sb = tl.load(s_ptrs, mask=mask_n[:, None], other=127)
    return _decode_loaded(wb, sb, BN, BK, F32, FOLD)


@triton.jit
def _decode_loaded(wb, sb, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, FOLD: tl.constexpr):
    """_decode_halves of bytes already loaded: wb uint8 [BN, BK/2], sb uint8 [BN, BK/32].
    FOLD (every scale byte <= 128): one fma per pair on the GPU (_E2M1_ASM_FOLDED)."""
    sb = sb.to(tl.int32)
    if F32:
        w = tl.reshape(wb.to(tl.int32), (BN, BK // 32, 16))
        sc = _e8m0_to_f32(sb)[:, :, None]
        lo = _fp16_bits_to_f32(((w & 0x07) << 9) | ((w & 0x08) << 12)) * sc
        hi = _fp16_bits_to_f32(((w & 0x70) << 5) | ((w & 0x80) << 8)) * sc
    elif FOLD:
        sc = tl.broadcast_to(_e8m0_to_bf16_folded(sb)[:, :, None], (BN, BK // 32, 16))
        lo, hi = _e2m1_bf16_folded(tl.reshape(wb, (BN, BK // 32, 16)), sc)
    else:
        sc = tl.broadcast_to(_e8m0_to_bf16(sb)[:, :, None], (BN, BK // 32, 16))
        lo, hi = _e2m1_bf16(tl.reshape(wb, (BN, BK // 32, 16)), sc)
    return tl.reshape(lo, (BN, BK // 2)), tl.reshape(hi, (BN, BK // 2))


@triton.jit
def _dequant_tile(w_ptrs, s_ptrs, mask_n, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                  FOLD: tl.constexpr):
    """Packed rows [BN, BK/2] bytes + scales [BN, BK/32] -> bf16 [BN, BK] (float32 when F32),
    element 2j the low nibble of byte j, 2j + 1 the high one."""
    lo, hi = _decode_halves(w_ptrs, s_ptrs, mask_n, BN, BK, F32, FOLD)
    return tl.reshape(tl.join(lo, hi), (BN, BK))


# Below this many rows per block the GEMMs' dots are mma.sync with the activations in
# registers, where splitting them into even and odd columns costs one PRMT per register
# and saves the interleave of the decoded nibbles (sm_90a: ~350 against ~410 main-loop
# instructions at 16 rows). From 64 rows Hopper's wgmma reads the activations from
# shared memory, and one dot over the interleaved tile is the shorter loop.
SPLIT_MAX_BM = tl.constexpr(64)


@triton.jit
def _dot_dequant(acc, a, w_ptrs, s_ptrs, mask_n, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                 FOLD: tl.constexpr):
    """acc + a [BM, BK] @ dequant(w)^T. Below SPLIT_MAX_BM rows the low nibbles (even k)
    and high nibbles (odd k) go to two dots against the even and odd columns of ``a``:
    the same products, with no interleave of the decoded halves."""
    if a.shape[0] < SPLIT_MAX_BM:
        lo, hi = _decode_halves(w_ptrs, s_ptrs, mask_n, BN, BK, F32, FOLD)
        a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], BK // 2, 2)))
        acc = tl.dot(a_even, tl.trans(lo), acc)
        acc = tl.dot(a_odd, tl.trans(hi), acc)
    else:
        acc = tl.dot(a, tl.trans(_dequant_tile(w_ptrs, s_ptrs, mask_n, BN, BK, F32, FOLD)), acc)
    return acc


@triton.jit
def _dot_loaded(acc, a, wb, sb, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, FOLD: tl.constexpr):
    """_dot_dequant of weight bytes and scales already loaded (the prefetching loops)."""
    lo, hi = _decode_loaded(wb, sb, BN, BK, F32, FOLD)
    if a.shape[0] < SPLIT_MAX_BM:
        a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], BK // 2, 2)))
        acc = tl.dot(a_even, tl.trans(lo), acc)
        acc = tl.dot(a_odd, tl.trans(hi), acc)
    else:
        acc = tl.dot(a, tl.trans(tl.reshape(tl.join(lo, hi), (BN, BK))), acc)
    return acc


# --------------------------------------------------------------------------- #
# Routing
# --------------------------------------------------------------------------- #
@triton.jit
def _routing_kernel(ids_ptr, sorted_ptr, blk_expert_ptr, blk_start_ptr, blk_end_ptr,
                    R, E, MAXB,
                    CH: tl.constexpr, EP: tl.constexpr, BP: tl.constexpr, BM: tl.constexpr):
    """One program: counts per expert, stable positions (two passes over CH-route
    chunks, so the scan scratch stays [CH, EP]), then the block table."""
    ex = tl.arange(0, EP)
    c = tl.arange(0, CH)
    counts = tl.zeros((EP,), dtype=tl.int32)
    for r0 in range(0, R, CH):
        r = r0 + c
        ids = tl.load(ids_ptr + r, mask=r < R, other=-1).to(tl.int32)
        onehot = ((ids[:, None] == ex[None, :]) & (ids[:, None] >= 0)).to(tl.int32)      # [CH, EP]
        counts += tl.sum(onehot, axis=0)
    offsets = tl.cumsum(counts, axis=0) - counts            # exclusive start of each expert
    base = offsets
    for r0 in range(0, R, CH):
        r = r0 + c
        rmask = r < R
        ids = tl.load(ids_ptr + r, mask=rmask, other=-1).to(tl.int32)
        onehot = ((ids[:, None] == ex[None, :]) & (ids[:, None] >= 0)).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0)                    # inclusive rank within the chunk
        pos = tl.sum(onehot * (base[None, :] + rank - 1), axis=1)
        tl.store(sorted_ptr + pos, r, mask=rmask & (ids >= 0))     # a masked route gets no position
        base += tl.sum(onehot, axis=0)
    nblk = (counts + BM - 1) // BM
    bcum = tl.cumsum(nblk, axis=0)                          # inclusive block ends
    b = tl.arange(0, BP)
    in_e = ((bcum[None, :] - nblk[None, :]) <= b[:, None]) & (b[:, None] < bcum[None, :])   # [BP, EP]
    sel = in_e.to(tl.int32)
    has = tl.sum(sel, axis=1) > 0
    expert = tl.sum(sel * ex[None, :], axis=1)
    lb = b - tl.sum(sel * (bcum - nblk)[None, :], axis=1)
    start = tl.sum(sel * offsets[None, :], axis=1) + lb * BM
    end = tl.minimum(start + BM, tl.sum(sel * (offsets + counts)[None, :], axis=1))
    bmask = b < MAXB
    tl.store(blk_expert_ptr + b, tl.where(has, expert, -1), mask=bmask)
    tl.store(blk_start_ptr + b, tl.where(has, start, 0), mask=bmask)
    tl.store(blk_end_ptr + b, tl.where(has, end, 0), mask=bmask)


def max_blocks(R: int, E: int, BM: int) -> int:
    """Upper bound on the block table's real blocks, known on the host: expert e with
    c_e > 0 routes takes cdiv(c_e, BM) <= c_e // BM + 1 blocks; the c_e // BM sum to at
    most R // BM, and at most min(E, R) experts have a route."""
    return R // BM + min(E, R)


def routing_tables(topk_ids: torch.Tensor, E: int, BM: int, force_torch: bool = False):
    """(sorted_routes int32 [R], blk_expert, blk_start, blk_end int32 [MAXB]).

    sorted_routes[p] for p < number of unmasked routes is a route index t*K+k,
    grouped by expert in ascending expert order, route order kept inside an
    expert; entries past that are never read. Same table from both paths."""
    ids = topk_ids.reshape(-1)
    R = ids.numel()
    MAXB = max_blocks(R, E, BM)
    dev = ids.device
    sorted_routes = torch.empty(max(R, 1), dtype=torch.int32, device=dev)
    blk = torch.empty(3, MAXB, dtype=torch.int32, device=dev)
    if R <= ROUTING_MAX_ROUTES and E <= 128 and not force_torch:
        EP = max(16, triton.next_power_of_2(E))
        BP = max(16, triton.next_power_of_2(MAXB))
        CH, warps = routing_launch(R)
        _limits.launch(_routing_kernel, (1,))(ids, sorted_routes, blk[0], blk[1], blk[2], R, E, MAXB,
                              CH=CH, EP=EP, BP=BP, BM=BM, num_warps=warps)
        return sorted_routes, blk[0], blk[1], blk[2]
    ids64 = ids.long()
    key = torch.where(ids64 >= 0, ids64, E)
    _, order = torch.sort(key, stable=True)
    sorted_routes.copy_(order.to(torch.int32)) if R else None
    # scatter_add, not bincount: bincount reads its output size back to the host, which
    # CUDA-graph capture refuses (decode graphs reach this path from 512 tokens).
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    offsets = torch.cumsum(counts, 0) - counts
    nblk = (counts + BM - 1) // BM
    bcum = torch.cumsum(nblk, 0)
    b = torch.arange(MAXB, device=dev)
    e_of_b = torch.searchsorted(bcum, b, right=True)
    has = e_of_b < E
    ec = e_of_b.clamp(max=E - 1)
    start = offsets[ec] + (b - (bcum[ec] - nblk[ec])) * BM
    end = torch.minimum(start + BM, offsets[ec] + counts[ec])
    blk[0].copy_(torch.where(has, ec, -1))
    blk[1].copy_(torch.where(has, start, 0))
    blk[2].copy_(torch.where(has, end, 0))
    return sorted_routes, blk[0], blk[1], blk[2]


# --------------------------------------------------------------------------- #
# GEMMs
# --------------------------------------------------------------------------- #
@triton.jit
def _block_rows(pid_b, sorted_ptr, blk_start_ptr, blk_end_ptr, BM: tl.constexpr, DIRECT: tl.constexpr):
    """(positions [BM], their mask, their routes) of block PID_B. From the routing table; or,
    DIRECT (one token: its routes are its blocks, none shares a row), position and route b
    alone, read from nothing (the block's expert is then topk_ids[b] itself)."""
    if DIRECT:
        offs_m = pid_b + tl.arange(0, BM)
        mask_m = offs_m < pid_b + 1
        route = offs_m
    else:
        start = tl.load(blk_start_ptr + pid_b)
        end = tl.load(blk_end_ptr + pid_b)
        offs_m = start + tl.arange(0, BM)
        mask_m = offs_m < end
        route = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0)
    return offs_m, mask_m, route


@triton.jit
def _gemm1_swiglu_kernel(x_ptr, w_ptr, s_ptr, h_ptr, part_ptr, sorted_ptr, blk_expert_ptr, blk_start_ptr,
                         blk_end_ptr, H, I, R, stride_x, limit: tl.float32,
                         TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, F32: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr = 1,
                         PREFETCH: tl.constexpr = 0, DIRECT: tl.constexpr = 0, FOLD: tl.constexpr = 0):
    """SPLIT == 1: h = SwiGLU(x @ [gate; up]^T) stored bf16. SPLIT > 1: program (b, n, s)
    sums the s-th of SPLIT equal K ranges and stores gate and up float32 partials at
    part[s, position, 0:I] and [I:2I] (_swiglu_reduce_kernel finishes them).
    PREFETCH: the next K tile's weight bytes and scales are loaded into registers before
    this tile is decoded, so each warp keeps two tiles of loads in flight (the decoded
    loads feed register arithmetic, which Triton's pipeliner does not stage).
    DIRECT: block b is route b alone (_block_rows), with no routing table."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Each part is whole K tiles (the host checks): say so, or the loads lose their vector width.
    KS = tl.multiple_of(H // SPLIT, BK) if SPLIT > 1 else H
    k_lo = tl.multiple_of(tl.program_id(2) * KS, BK) if SPLIT > 1 else 0
    e = tl.load(blk_expert_ptr + pid_b).to(tl.int32)
    if e >= 0:
        offs_m, mask_m, route = _block_rows(pid_b, sorted_ptr, blk_start_ptr, blk_end_ptr, BM, DIRECT)
        tok = (route // TOPK).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_n = offs_n < I
        e64 = e.to(tl.int64)
        w_base = w_ptr + e64 * (2 * I) * (H // 2)
        s_base = s_ptr + e64 * (2 * I) * (H // 32)
        rows_g = offs_n.to(tl.int64)
        rows_u = rows_g + I
        kb = tl.arange(0, BK // 2)
        ks = tl.arange(0, BK // 32)
        kx = tl.arange(0, BK)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        if PREFETCH:
            wg_p = w_base + rows_g[:, None] * (H // 2) + kb[None, :]
            wu_p = w_base + rows_u[:, None] * (H // 2) + kb[None, :]
            sg_p = s_base + rows_g[:, None] * (H // 32) + ks[None, :]
            su_p = s_base + rows_u[:, None] * (H // 32) + ks[None, :]
            nwg = tl.load(wg_p + k_lo // 2, mask=mask_n[:, None], other=0)
            nwu = tl.load(wu_p + k_lo // 2, mask=mask_n[:, None], other=0)
            nsg = tl.load(sg_p + k_lo // 32, mask=mask_n[:, None], other=127)
            nsu = tl.load(su_p + k_lo // 32, mask=mask_n[:, None], other=127)
            for kk in range(0, KS, BK):
                k0 = k_lo + kk
                cwg, cwu, csg, csu = nwg, nwu, nsg, nsu
                kn = k0 + BK
                pm = (mask_n & (offs_n * 0 + kn < k_lo + KS))[:, None]     # the last tile prefetches nothing
                nwg = tl.load(wg_p + kn // 2, mask=pm, other=0)
                nwu = tl.load(wu_p + kn // 2, mask=pm, other=0)
                nsg = tl.load(sg_p + kn // 32, mask=pm, other=127)
                nsu = tl.load(su_p + kn // 32, mask=pm, other=127)
                a = tl.load(x_ptr + tok[:, None] * stride_x + (k0 + kx)[None, :], mask=mask_m[:, None], other=0.0)
                if F32:
                    a = a.to(tl.float32)
                acc_g = _dot_loaded(acc_g, a, cwg, csg, BN, BK, F32, FOLD)
                acc_u = _dot_loaded(acc_u, a, cwu, csu, BN, BK, F32, FOLD)
        else:
            for kk in range(0, KS, BK):
                k0 = k_lo + kk
                a = tl.load(x_ptr + tok[:, None] * stride_x + (k0 + kx)[None, :], mask=mask_m[:, None], other=0.0)
                if F32:
                    a = a.to(tl.float32)
                acc_g = _dot_dequant(acc_g, a, w_base + rows_g[:, None] * (H // 2) + (k0 // 2 + kb)[None, :],
                                     s_base + rows_g[:, None] * (H // 32) + (k0 // 32 + ks)[None, :], mask_n, BN,
                                     BK, F32, FOLD)
                acc_u = _dot_dequant(acc_u, a, w_base + rows_u[:, None] * (H // 2) + (k0 // 2 + kb)[None, :],
                                     s_base + rows_u[:, None] * (H // 32) + (k0 // 32 + ks)[None, :], mask_n, BN,
                                     BK, F32, FOLD)
        if SPLIT > 1:
            prow = (tl.program_id(2) * R + offs_m).to(tl.int64)[:, None] * (2 * I)
            pmask = mask_m[:, None] & mask_n[None, :]
            tl.store(part_ptr + prow + offs_n[None, :], acc_g, mask=pmask)
            tl.store(part_ptr + prow + I + offs_n[None, :], acc_u, mask=pmask)
        else:
            if HAS_LIMIT:
                acc_g = tl.minimum(acc_g, limit)
                acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :], _to_bf16(h, F32),
                     mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _swiglu_reduce_kernel(part_ptr, h_ptr, ids_ptr, R, I, limit: tl.float32,
                          SPLIT: tl.constexpr, HAS_LIMIT: tl.constexpr, F32: tl.constexpr,
                          RP: tl.constexpr, BN: tl.constexpr):
    """Split-K GEMM1's finish: at sorted position p (program 0), below the number of unmasked
    routes (positions past it hold nothing and are never read), sum the SPLIT gate and up
    partials in order, then the clamped SwiGLU, stored bf16 into h[p]."""
    p = tl.program_id(0)
    r = tl.arange(0, RP)
    live = tl.sum((tl.load(ids_ptr + r, mask=r < R, other=-1) >= 0).to(tl.int32), axis=0)
    if p < live:
        offs = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = offs < I
        g = tl.zeros((BN,), dtype=tl.float32)
        u = tl.zeros((BN,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            row = part_ptr + (s * R + p).to(tl.int64) * (2 * I)
            g += tl.load(row + offs, mask=mask, other=0.0)
            u += tl.load(row + I + offs, mask=mask, other=0.0)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + p.to(tl.int64) * I + offs, _to_bf16(h, F32), mask=mask)


@triton.jit
def _gemm2_kernel(h_ptr, w_ptr, s_ptr, tw_ptr, routed_ptr, sorted_ptr, blk_expert_ptr, blk_start_ptr, blk_end_ptr,
                  H, I, R, F32: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr = 1,
                  PREFETCH: tl.constexpr = 0, DIRECT: tl.constexpr = 0, FOLD: tl.constexpr = 0):
    """routed[s, route] = top-k weight * (h @ w2^T) over the s-th of SPLIT equal K ranges
    (SPLIT == 1: the whole of I, s = 0); the combine sums the SPLIT partials in order.
    PREFETCH and DIRECT: as _gemm1_swiglu_kernel's."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Each part is whole K tiles (the host checks): say so, or the loads lose their vector width.
    KS = tl.multiple_of(I // SPLIT, BK) if SPLIT > 1 else I
    k_lo = tl.multiple_of(tl.program_id(2) * KS, BK) if SPLIT > 1 else 0
    e = tl.load(blk_expert_ptr + pid_b).to(tl.int32)
    if e >= 0:
        offs_m, mask_m, route = _block_rows(pid_b, sorted_ptr, blk_start_ptr, blk_end_ptr, BM, DIRECT)
        route = route.to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_n = offs_n < H
        e64 = e.to(tl.int64)
        w_base = w_ptr + e64 * H * (I // 2)
        s_base = s_ptr + e64 * H * (I // 32)
        rows = offs_n.to(tl.int64)
        kb = tl.arange(0, BK // 2)
        ks = tl.arange(0, BK // 32)
        kx = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if PREFETCH:
            w_p = w_base + rows[:, None] * (I // 2) + kb[None, :]
            s_p = s_base + rows[:, None] * (I // 32) + ks[None, :]
            nw = tl.load(w_p + k_lo // 2, mask=mask_n[:, None], other=0)
            ns = tl.load(s_p + k_lo // 32, mask=mask_n[:, None], other=127)
            for kk in range(0, KS, BK):
                k0 = k_lo + kk
                cw, cs = nw, ns
                kn = k0 + BK
                pm = (mask_n & (offs_n * 0 + kn < k_lo + KS))[:, None]     # the last tile prefetches nothing
                nw = tl.load(w_p + kn // 2, mask=pm, other=0)
                ns = tl.load(s_p + kn // 32, mask=pm, other=127)
                a = tl.load(h_ptr + offs_m.to(tl.int64)[:, None] * I + (k0 + kx)[None, :], mask=mask_m[:, None],
                            other=0.0)
                if F32:
                    a = a.to(tl.float32)
                acc = _dot_loaded(acc, a, cw, cs, BN, BK, F32, FOLD)
        else:
            for kk in range(0, KS, BK):
                k0 = k_lo + kk
                a = tl.load(h_ptr + offs_m.to(tl.int64)[:, None] * I + (k0 + kx)[None, :], mask=mask_m[:, None],
                            other=0.0)
                if F32:
                    a = a.to(tl.float32)
                acc = _dot_dequant(acc, a, w_base + rows[:, None] * (I // 2) + (k0 // 2 + kb)[None, :],
                                   s_base + rows[:, None] * (I // 32) + (k0 // 32 + ks)[None, :], mask_n, BN, BK,
                                   F32, FOLD)
        tw = tl.load(tw_ptr + route, mask=mask_m, other=0.0).to(tl.float32)
        acc = acc * tw[:, None]
        if SPLIT > 1:
            route += tl.program_id(2).to(tl.int64) * R
        tl.store(routed_ptr + route[:, None] * H + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _combine_kernel(routed_ptr, ids_ptr, out_ptr, H, stride_out, R, TOPK: tl.constexpr, BN: tl.constexpr,
                    EXACT_RNE: tl.constexpr, SPLIT: tl.constexpr = 1):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = offs < H
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        eid = tl.load(ids_ptr + t * TOPK + k)
        live = mask & ((offs * 0 + eid) >= 0)      # masked route: its row is never read
        for s in tl.static_range(SPLIT):
            acc += tl.load(routed_ptr + (s * R + t * TOPK + k).to(tl.int64) * H + offs, mask=live, other=0.0)
    tl.store(out_ptr + t * stride_out + offs, _to_bf16(acc, EXACT_RNE), mask=mask)


# --------------------------------------------------------------------------- #
# Host side
# --------------------------------------------------------------------------- #
INTERPRETED = interpreted(_combine_kernel)

# Which part of the op each kernel is (benchmarks/bench_moe_breakdown.py groups a profile
# by it; kernels not named here, the torch routing ops of large calls, are "routing").
KERNEL_PARTS = {"_routing_kernel": "routing", "_gemm1_swiglu_kernel": "gemm1", "_swiglu_reduce_kernel": "activation",
                "_gemm2_kernel": "gemm2", "_combine_kernel": "combine"}

# Types of each kernel's runtime (non-constexpr) arguments, in order: what an offline
# compile (triton.compile(ASTSource(...)) for a GPUTarget, no GPU) needs. Used by the
# tests' compile checks and benchmarks/sass_moe_triton.py.
COMPILE_SIGNATURES = {
    "_gemm1_swiglu_kernel": {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "h_ptr": "*bf16", "part_ptr": "*fp32",
                             "sorted_ptr": "*i32", "blk_expert_ptr": "*i32", "blk_start_ptr": "*i32",
                             "blk_end_ptr": "*i32", "H": "i32", "I": "i32", "R": "i32", "stride_x": "i32",
                             "limit": "fp32"},
    "_swiglu_reduce_kernel": {"part_ptr": "*fp32", "h_ptr": "*bf16", "ids_ptr": "*i32", "R": "i32", "I": "i32",
                              "limit": "fp32"},
    "_gemm2_kernel": {"h_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "tw_ptr": "*fp32", "routed_ptr": "*fp32",
                      "sorted_ptr": "*i32", "blk_expert_ptr": "*i32", "blk_start_ptr": "*i32",
                      "blk_end_ptr": "*i32", "H": "i32", "I": "i32", "R": "i32"},
    "_routing_kernel": {"ids_ptr": "*i32", "sorted_ptr": "*i32", "blk_expert_ptr": "*i32", "blk_start_ptr": "*i32",
                        "blk_end_ptr": "*i32", "R": "i32", "E": "i32", "MAXB": "i32"},
    "_combine_kernel": {"routed_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16", "H": "i32",
                        "stride_out": "i32", "R": "i32"},
}


def _alloc(shape, dtype, device):
    """Scratch buffers (uninitialised on purpose; tests poison them through this hook)."""
    return torch.empty(shape, dtype=dtype, device=device)


class _Plan:
    """One shape class's launches on one device: the tiles, the routing table's size and
    kind, every grid, constexpr and launch option of the kernels."""
    __slots__ = ("R", "MAXB", "direct", "route_grid", "route_tail", "route_warps", "torch_routing", "BM", "g1_grid", "g1_tail", "g1_opts",
                 "g2_grid", "g2_tail", "g2_opts", "c_grid", "c_tail", "SK1", "SK2", "a_grid", "a_tail")

    def __init__(self, T, K, E, H, I, has_limit, tiles, force_torch_routing, fold=False):
        if H % 64 or I % 64:
            raise ArgumentError(f"triton_w4a16 needs H and I to be multiples of 64 (H={H}, I={I})")
        R = self.R = T * K
        if tiles is None:
            tiles = tiles_for(mean_rows(R, E), H, I, INTERPRETED)
        BM, BN1, BK1, W1, S1, BN2, BK2, W2, S2 = tiles[:9]
        BK1 = BK1 if H % BK1 == 0 else 64           # K tiles never straddle the end of a row
        BK2 = BK2 if I % BK2 == 0 else 64
        # Split-K needs whole K tiles in each part; a split that does not divide falls back
        # to fewer parts (down to 1, the unsplit kernels).
        SK1, SK2 = tiles.SK1, tiles.SK2
        while SK1 > 1 and H % (SK1 * BK1):
            SK1 //= 2
        while SK2 > 1 and I % (SK2 * BK2):
            SK2 //= 2
        self.SK1, self.SK2 = SK1, SK2
        self.BM = BM
        # One token: each route is a block of its own, the routing launch is skipped and the
        # GEMMs take their experts from topk_ids (DIRECT). Split GEMM1's reduce reads
        # compacted positions, so a split keeps the table.
        self.direct = T == 1 and SK1 == 1 and not force_torch_routing
        MAXB = self.MAXB = R if self.direct else max_blocks(R, E, BM)
        self.torch_routing = not (R <= ROUTING_MAX_ROUTES and E <= 128 and not force_torch_routing)
        self.route_grid = (1,)
        CH, self.route_warps = routing_launch(R)
        self.route_tail = (CH, max(16, triton.next_power_of_2(E)), max(16, triton.next_power_of_2(MAXB)),
                           BM)
        self.g1_grid = (MAXB, cdiv(I, BN1)) + ((SK1,) if SK1 > 1 else ())
        self.g2_grid = (MAXB, cdiv(H, BN2)) + ((SK2,) if SK2 > 1 else ())
        PF = tiles.PF
        # FOLD: every scale byte is at most FOLD_SCALE_MAX, so 2**126 rides in the scales.
        self.g1_tail = (K, has_limit, INTERPRETED, BM, BN1, BK1, SK1, PF, int(self.direct), int(fold))
        self.g2_tail = (INTERPRETED, BM, BN2, BK2, SK2, PF, int(self.direct), int(fold))
        self.g1_opts, self.g2_opts = dict(num_warps=W1, num_stages=S1), dict(num_warps=W2, num_stages=S2)
        BNA = min(1024, triton.next_power_of_2(I))
        self.a_grid = (R, cdiv(I, BNA))
        self.a_tail = (SK1, has_limit, INTERPRETED, max(16, triton.next_power_of_2(R)), BNA)
        BNC = 1024 if H >= 1024 else triton.next_power_of_2(H)
        self.c_grid, self.c_tail = (T, cdiv(H, BNC)), (K, BNC, INTERPRETED, SK2)


# (device, tokens, top-k, experts, hidden, intermediate, has a clamp limit, scales fold) -> its launch
# plan: keyed by the device, never answering for another card. Kept for calls of up to
# PLAN_MAX_TOKENS tokens (decode and small extends, where host time matters), so the
# dict stays bounded; a larger call builds its plan (microseconds against its kernels'
# milliseconds).
_plans: dict = {}
PLAN_MAX_TOKENS = 1024


def moe_w4a16(x, weights, topk_weights, topk_ids, out=None, *, checks: bool = True,
              force_torch_routing: bool = False,
              tiles: Tiles | None = None):
    """The ``moe`` op (contract: reference.py) with the Triton W4A16 kernels.
    ``tiles`` overrides the size-based choice (benchmarks/sweep_moe_triton.py uses it)."""
    if checks:
        check_moe_args(x, weights, topk_weights, topk_ids, out)
        check_device(x, interpreted=INTERPRETED, kernels="Triton MoE kernels")
    weights.require_layout(CHECKPOINT, "triton_w4a16")
    dev = x.device
    T, H = x.shape
    K = topk_ids.shape[1]
    E, I = weights.num_experts, weights.intermediate
    limit = weights.swiglu_limit
    fold = weights.scale_max <= FOLD_SCALE_MAX
    if tiles is None and not force_torch_routing and T <= PLAN_MAX_TOKENS:
        key = (dev, T, K, E, H, I, limit is not None, fold)
        plan = _plans.get(key)
        if plan is None:
            plan = _plans[key] = _Plan(T, K, E, H, I, limit is not None, None, False, fold)
    else:
        plan = _Plan(T, K, E, H, I, limit is not None, tiles, force_torch_routing, fold)
    if out is None:
        out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
    if T == 0:
        return out
    if out.stride()[1] != 1:
        raise ArgumentError("out must have unit stride along H")
    if x.stride()[1] != 1:
        x = x.contiguous()
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    tw = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    R, MAXB = plan.R, plan.MAXB
    with on_device_of(x):
        if plan.direct:
            sorted_routes = be = bs = bend = ids.view(-1)      # the experts; the rest is never read
        elif plan.torch_routing:
            sorted_routes, be, bs, bend = routing_tables(ids, E, plan.BM, force_torch=True)
        else:
            sorted_routes = torch.empty(max(R, 1), dtype=torch.int32, device=dev)
            blk = torch.empty((3, MAXB), dtype=torch.int32, device=dev)
            be, bs, bend = blk
            _limits.launch(_routing_kernel, plan.route_grid)(ids, sorted_routes, be, bs, bend, R, E, MAXB,
                                                             *plan.route_tail, num_warps=plan.route_warps)
        h = _alloc((R, I), torch.bfloat16, dev)           # rows of masked routes: never written/read
        routed = _alloc((plan.SK2, R, H), torch.float32, dev)
        lim = float(limit) if limit is not None else 0.0
        part = _alloc((plan.SK1, R, 2 * I), torch.float32, dev) if plan.SK1 > 1 else h
        _limits.launch(_gemm1_swiglu_kernel, plan.g1_grid)(
            x, weights.w13, weights.w13_scale, h, part, sorted_routes, be, bs, bend,
            H, I, R, x.stride()[0], lim, *plan.g1_tail, **plan.g1_opts)
        if plan.SK1 > 1:
            _limits.launch(_swiglu_reduce_kernel, plan.a_grid)(part, h, ids, R, I, lim, *plan.a_tail, num_warps=4)
        _limits.launch(_gemm2_kernel, plan.g2_grid)(
            h, weights.w2, weights.w2_scale, tw, routed, sorted_routes, be, bs, bend, H, I, R, *plan.g2_tail,
            **plan.g2_opts)
        _limits.launch(_combine_kernel, plan.c_grid)(routed, ids, out, H, out.stride()[0], R, *plan.c_tail,
                                                     num_warps=4)
    return out


# Custom ops (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_moe_w4a16 = custom_op(OPS[0], "triton_w4a16", moe_w4a16)

"""torch reference for the routed-expert MoE op (defines the op's meaning).

    moe(x, weights, topk_weights, topk_ids, out=None) -> bf16 [T, H]

  x             bf16 [T, H]
  weights       MoeWeights in the checkpoint layout (see weights.py)
  topk_weights  float32 (or bf16) [T, K]: final per-route weights, already
                renormalised over the top-k and with DSv4's routed scaling factor
                folded in (SGLang's ``fuse_routed_scaling_factor_in_topk``)
  topk_ids      int32/int64 [T, K]: LOCAL expert ids in [0, E), or -1 for a
                route that is masked (under EP: its expert lives on another rank)
  out           optional bf16 [T, H] to write into

  y[t] = sum over k with id >= 0 of  w[t,k] * W2_e @ h,   e = topk_ids[t,k]
  h    = silu(min(g, L)) * clamp(u, -L, L)  (no clamp when L is None)
  [g; u] = W13_e @ x[t]   (rows 0..I-1 of w13 = gate, I..2I-1 = up)

Numerics (what every W4A16 backend is compared against): weights decoded
exactly (e2m1 x 2**(s-127)), products accumulated in float32, the activation
in float32 and rounded to bf16 (the dtype every W4A16 kernel feeds GEMM2), the
per-route outputs weighted in float32 and summed over k in order, rounded to
bf16 once. With ``act_quant="mxfp8"`` x and h are instead rounded through
MXFP8 (e4m3 values, one E8M0 scale per 32, scale = 2**ceil(log2(amax/448)))
— the reference for the W4A8 backends.

Memory: only one expert's chunk of rows is ever decoded (at most CHUNK_ELEMS
float32 values), and only for experts that some unmasked route selects; a
masked route's id is never used as an index, so it reads no weight memory.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ...errors import ArgumentError, ArgumentTypeError
from ..arg_checks import dtype_in, index_dtype, same_device, tensor
from .weights import CHECKPOINT, GROUP, MoeWeights

__all__ = ["moe", "check_moe_args", "dequant_rows", "swiglu", "mxfp8_qdq", "random_weights",
           "E2M1_VALUES", "CHUNK_ELEMS"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
CHUNK_ELEMS = 1 << 22      # 16 MiB of float32 per decoded chunk, at most

_tables = {}


def _luts(device):
    key = (device.type, device.index)
    if key not in _tables:
        e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
        e8m0 = torch.tensor([math.ldexp(1.0, i - 127) for i in range(255)] + [math.nan],
                            dtype=torch.float32, device=device)
        _tables[key] = (e2m1, e8m0)
    return _tables[key]


def dequant_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] codes + uint8 [R, C/32] E8M0 -> float32 [R, C], exact."""
    e2m1, e8m0 = _luts(packed.device)
    r = packed.shape[0]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(r, -1).long()
    vals = e2m1[codes].view(r, -1, GROUP)
    vals *= e8m0[scales.long()].unsqueeze(-1)
    return vals.view(r, -1)


def _matmul_dequant(a: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """a float32 [M, C] @ dequant(packed [N, C/2], scales)^T -> float32 [M, N], N in chunks."""
    n, c = packed.shape[0], packed.shape[1] * 2
    rows = max(1, CHUNK_ELEMS // c)
    out = torch.empty(a.shape[0], n, dtype=torch.float32, device=a.device)
    for r0 in range(0, n, rows):
        w = dequant_rows(packed[r0:r0 + rows], scales[r0:r0 + rows])
        torch.matmul(a, w.t(), out=out[:, r0:r0 + rows])
        del w
    return out


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    """DSv4's clamped SwiGLU in float32 (SGLang ``swiglu_limit_func``; FlashInfer's
    SwigluBias with alpha=1, beta=0, limit=L)."""
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(g) * u


def mxfp8_qdq(a: torch.Tensor) -> torch.Tensor:
    """float32 [M, C] -> the float32 values of its MXFP8 rounding (e4m3 RNE, one
    E8M0 scale per 32 along C, scale = 2**ceil(log2(amax / 448)))."""
    m, c = a.shape
    blk = a.view(m, c // GROUP, GROUP)
    amax = blk.abs().amax(dim=-1, keepdim=True).clamp_min(2.0 ** -126)
    e = torch.ceil(torch.log2(amax / 448.0)).clamp(-127, 127)
    scale = torch.exp2(e)
    q = (blk / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).view(m, c)


def check_moe_args(x, weights, topk_weights, topk_ids, out):
    if not isinstance(weights, MoeWeights):
        raise ArgumentTypeError(f"weights must be a MoeWeights, got {type(weights).__name__}")
    dtype_in(tensor(x, "x"), "x", (torch.bfloat16,))
    if x.dim() != 2 or x.shape[1] != weights.hidden:
        raise ArgumentError(f"x must be [T, {weights.hidden}], got {tuple(x.shape)}")
    index_dtype(tensor(topk_ids, "topk_ids"), "topk_ids")
    dtype_in(tensor(topk_weights, "topk_weights"), "topk_weights", (torch.float32, torch.bfloat16, torch.float16))
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ArgumentError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={x.shape[0]}, K]")
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        same_device(t, name, weights.device, "weights")
    if out is not None:
        dtype_in(tensor(out, "out"), "out", (torch.bfloat16,))
        if tuple(out.shape) != tuple(x.shape):
            raise ArgumentError(f"out must be {tuple(x.shape)}, got {tuple(out.shape)}")
        same_device(out, "out", x.device, "x")


def _expert_fn(weights, act_quant):
    I, L = weights.intermediate, weights.swiglu_limit

    def expert(a, e):
        if act_quant:
            a = mxfp8_qdq(a)
        g = _matmul_dequant(a, weights.w13[e, :I], weights.w13_scale[e, :I])
        u = _matmul_dequant(a, weights.w13[e, I:], weights.w13_scale[e, I:])
        h = swiglu(g, u, L)
        del g, u
        h = mxfp8_qdq(h) if act_quant else h.bfloat16().float()
        return _matmul_dequant(h, weights.w2[e], weights.w2_scale[e])
    return expert


def sum_over_routes(x, topk_weights, topk_ids, E, expert):
    """Each expert over the routes sent to it (host reads which experts and how many)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    if bool(((flat < -1) | (flat >= E)).any()):
        raise ArgumentError(f"topk_ids must lie in [-1, {E}); got min {int(flat.min())}, "
                            f"max {int(flat.max())}")
    tw = topk_weights.reshape(-1).float()
    routed = torch.zeros(T * K, H, dtype=torch.float32, device=x.device)   # masked rows stay 0
    routes = (flat >= 0).nonzero().flatten()
    if routes.numel():
        ids_sorted, order = torch.sort(flat[routes], stable=True)
        routes = routes[order]
        experts, counts = torch.unique_consecutive(ids_sorted, return_counts=True)
        start = 0
        for e, c in zip(experts.tolist(), counts.tolist()):
            r = routes[start:start + c]
            start += c
            routed[r] = expert(x[r // K].float(), e) * tw[r].unsqueeze(1)
    return routed.view(T, K, H).sum(dim=1)


def sum_over_experts(x, topk_weights, topk_ids, E, expert):
    """Every expert over every token, masked by the routing weights: no host reads, so a
    CUDA graph can hold it (the route loop's cannot). Same function, E/K times the work."""
    T, H = x.shape
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    xf, tw = x.float(), topk_weights.float()
    for e in range(E):
        y += expert(xf, e) * torch.where(topk_ids == e, tw, 0.0).sum(dim=1, keepdim=True)
    return y


def moe(x, weights, topk_weights, topk_ids, out=None, *, act_quant: Optional[str] = None,
        checks: bool = True):
    if checks:
        check_moe_args(x, weights, topk_weights, topk_ids, out)
    weights.require_layout(CHECKPOINT, "torch")
    if act_quant not in (None, "mxfp8"):
        raise ArgumentError(f"act_quant must be None or 'mxfp8', got {act_quant!r}")
    E = weights.num_experts
    expert = _expert_fn(weights, act_quant)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        y = sum_over_experts(x, topk_weights, topk_ids, E, expert)
    else:
        y = sum_over_routes(x, topk_weights, topk_ids, E, expert)
    if out is None:
        return y.bfloat16()
    out.copy_(y)
    return out


# ---------------------------------------------------------------------- #
# Test and benchmark inputs
# ---------------------------------------------------------------------- #
def random_weights(num_experts, hidden, intermediate, *, gen=None, device="cpu",
                   scale_lo=119, scale_hi=125, swiglu_limit=10.0) -> MoeWeights:
    """Random packed MXFP4 weights (every e2m1 code, never all zero) with E8M0
    scale bytes uniform in [scale_lo, scale_hi]. The defaults give DSv4-sized
    GEMM1 outputs of a few units, so a clamp of 10 engages on some values."""
    E, H, I = num_experts, hidden, intermediate

    def rb(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.uint8).to(device)

    return MoeWeights(rb(E, 2 * I, H // 2), rb(E, 2 * I, H // GROUP, lo=scale_lo, hi=scale_hi + 1),
                      rb(E, H, I // 2), rb(E, H, I // GROUP, lo=scale_lo, hi=scale_hi + 1),
                      swiglu_limit=swiglu_limit)


def random_routing(T, K, E, *, gen=None, device="cpu", mask_frac=0.0, scale=1.5, skew=0.0):
    """DSv4-style routing: K distinct experts per token, weights renormalised over
    the top-k then multiplied by the routed scaling factor; a fraction of routes
    masked to -1 (as under EP when the expert is not local). SKEW > 0 makes some experts
    popular: expert e (in a random order) is drawn with weight (e + 1) ** -SKEW, K without
    replacement (Gumbel top-k); 0 is uniform."""
    scores = torch.rand(T, E, generator=gen)
    if skew:
        rank = torch.randperm(E, generator=gen).float() + 1.0
        gumbel = -(-scores.clamp_min(1e-12).log()).log()
        scores = -skew * rank.log()[None, :] + gumbel
    ids = scores.topk(K, dim=1).indices
    w = torch.rand(T, K, generator=gen) + 0.05
    w = w / w.sum(dim=1, keepdim=True) * scale
    if mask_frac:
        m = torch.rand(T, K, generator=gen) < mask_frac
        ids = torch.where(m, torch.full_like(ids, -1), ids)
    return w.float().to(device), ids.to(torch.int32).to(device)


# Custom ops (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_moe = custom_op(OPS[0], "torch", moe)

"""Thin adapter from the ``moe`` op to SGLang's MXFP4 Marlin MoE (W4A16, cc >= 8.0), as
SGLang 0.5.17 (with sglang-kernel 0.4.5) and 0.5.23 (sglang-kernel 0.4.10) ship it: the same
``fused_marlin_moe`` keywords, the same repack and scale helpers.

Where the kernel lives (SGLang 0.5.23; 0.5.17 alike): the Marlin MoE GEMM is not an
AOT op of sgl-kernel; it is JIT-built from the ``sglang`` wheel
(``sglang.kernels.ops.moe.moe_wna16_marlin.moe_wna16_marlin_gemm``, sources
``sglang/kernels/jit/csrc/gemm/marlin_moe/moe_wna16_marlin.cuh``, through
apache-tvm-ffi and nvcc) and driven by
``sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe.fused_marlin_moe``,
which takes ``ScalarType`` and ``moe_sum_reduce`` from ``sgl_kernel``
(distribution ``sglang-kernel`` 0.4.10). Weight repacking is SGLang's
``gptq_marlin_repack`` (JIT) and ``marlin_permute_scales`` /
``mxfp4_marlin_process_scales`` (torch), called here one expert at a time into
the same storage: SGLang's own ``prepare_moe_mxfp4_layer_for_marlin`` stages
every scale as bf16 for the whole layer and stacks a second full copy of the
weights; this preparer keeps the bytes per expert equal to the packed size
and uses one expert's scratch.

Masked routes: the 0.5.23 align kernel puts id -1 in an inactive bucket whose
blocks the GEMMs skip (and GEMM2 zeroes their output rows,
``zero_inactive_output``); their top-k weight is also set to 0 here, so a
masked route contributes exactly nothing even if a future kernel computed it.
A Marlin GEMM without ``zero_inactive_output`` (0.5.17) leaves a skipped route's
GEMM2 rows as they were in a buffer GEMM1 shares, and the top-k sum would add them:
there each masked route is sent to an expert its token does not use (distinct, as
the single-token align needs) with weight 0, so it is computed and adds exactly 0.
Activation: ``clamp_limit=L`` -> SGLang's ``swiglu_limit_func`` (gate clamped
above, up clamped both sides, silu(gate) * up), the DSv4 contract.
"""
from __future__ import annotations

import functools
import inspect

import torch

from ...errors import ArgumentError
from .reference import check_moe_args

__all__ = ["prepare_marlin", "moe_marlin", "fill_masked", "MARLIN_KWARGS"]

LAYOUT = "marlin"
GROUP = 32
MARLIN_KWARGS = ("hidden_states", "w1", "w2", "w1_scale", "w2_scale", "gating_output", "topk_weights",
                 "topk_ids", "global_num_experts", "expert_map", "workspace", "num_bits", "is_k_full",
                 "inplace", "clamp_limit")

_workspaces = {}


@functools.cache   # imported once, on the first call
def _sglang():
    """(fused_marlin_moe, whether its GEMM zeroes the rows of skipped routes)."""
    from sglang.kernels.ops.moe.moe_wna16_marlin import moe_wna16_marlin_gemm
    from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe
    return fused_marlin_moe, "zero_inactive_output" in inspect.signature(moe_wna16_marlin_gemm).parameters


def fill_masked(ids, num_experts: int):
    """IDS (int [T, K], -1 masked) with each masked route of a row on an expert that row
    does not use, the lowest first: distinct within the row, all on the device, no host
    synchronisation (graph-capturable)."""
    masked = ids < 0
    used = torch.zeros(ids.shape[0], num_experts + 1, dtype=torch.int32, device=ids.device)
    used.scatter_(1, torch.where(masked, num_experts, ids).long(), 1)   # column E gathers the masked
    free = torch.argsort(used[:, :num_experts], dim=1, stable=True)     # unused experts first, ascending
    nth = (torch.cumsum(masked.int(), dim=1) - 1).clamp(min=0).long()   # the j-th masked route of its row
    return torch.where(masked, torch.gather(free, 1, nth).to(ids.dtype), ids)


def _prep_fns():
    from sglang.kernels.ops.quantization.gptq_marlin_repack import gptq_marlin_repack
    from sglang.srt.layers.quantization.marlin_utils import marlin_permute_scales
    from sglang.srt.layers.quantization.marlin_utils_fp4 import mxfp4_marlin_process_scales
    return gptq_marlin_repack, marlin_permute_scales, mxfp4_marlin_process_scales


def _workspace(device):
    key = device.index
    if key not in _workspaces:
        # The card that is there: Marlin's kernel sizes its grid from the real SM count
        # itself, so an emulated card's smaller count would under-size its locks.
        from ..device_facts import real
        sms = real(device.index if device.index is not None else torch.cuda.current_device()).sm_count
        _workspaces[key] = torch.zeros(sms * 4, dtype=torch.int32, device=device)
    return _workspaces[key]


def prepare_marlin(weights) -> None:
    repack, permute_scales, process_scales = _prep_fns()
    E, H, I = weights.num_experts, weights.hidden, weights.intermediate
    if H % 128 or I % 64:
        raise ArgumentError(f"marlin_w4a16 needs H % 128 == 0 and I % 64 == 0 (H={H}, I={I}); "
                         "SGLang pads, this preparer keeps the packed size and refuses")
    if weights.device.type != "cuda":
        raise ArgumentError(f"marlin_w4a16 needs CUDA weights, these are on {weights.device}")
    perm = torch.empty(0, dtype=torch.int32, device=weights.device)

    def weight(name, size_n, size_k):
        t = getattr(weights, name)                          # uint8 [E, n, k/2]
        flat = t.view(E, -1)
        for e in range(E):
            q = t[e].view(torch.int32).t().contiguous()     # [k/8, n]
            m = repack(b_q_weight=q, perm=perm, size_k=size_k, size_n=size_n, num_bits=4)
            flat[e].copy_(m.contiguous().view(-1).view(torch.uint8))
            del q, m
        setattr(weights, name, t.view(torch.int32).view(E, size_k // 16, size_n * 2))

    def scale(name, size_n, size_k):
        t = getattr(weights, name)                          # uint8 [E, n, k/32]
        flat = t.view(E, -1)
        for e in range(E):
            s = t[e].view(torch.float8_e8m0fnu).to(torch.bfloat16).t().contiguous()   # one expert, 2 B each
            s = permute_scales(s=s, size_k=size_k, size_n=size_n, group_size=GROUP)
            s = process_scales(s, input_dtype=torch.bfloat16)                        # -> float8_e8m0fnu
            flat[e].copy_(s.contiguous().view(torch.uint8).view(-1))
            del s
        setattr(weights, name, t.view(torch.float8_e8m0fnu).view(E, size_k // GROUP, size_n))

    weight("w13", 2 * I, H)
    weight("w2", H, I)
    scale("w13_scale", 2 * I, H)
    scale("w2_scale", H, I)
    _workspace(weights.device)
    weights.layout = LAYOUT


def moe_marlin(x, weights, topk_weights, topk_ids, out=None, *, checks=True):
    if checks:
        check_moe_args(x, weights, topk_weights, topk_ids, out)
    weights.require_layout(LAYOUT, "marlin_w4a16")
    fused_marlin_moe, zeroes_skipped = _sglang()
    T = x.shape[0]
    if T == 0:
        return torch.empty_like(x) if out is None else out
    ids = topk_ids.to(torch.int32)
    tw = torch.where(ids >= 0, topk_weights.float(), 0.0)
    if not zeroes_skipped:
        ids = fill_masked(ids, weights.num_experts)
    y = fused_marlin_moe(
        hidden_states=x.contiguous(),
        w1=weights.w13, w2=weights.w2,
        w1_scale=weights.w13_scale, w2_scale=weights.w2_scale,
        gating_output=tw,                       # read only for its row count
        topk_weights=tw, topk_ids=ids,
        global_num_experts=-1, expert_map=None,
        workspace=_workspace(x.device),
        num_bits=4, is_k_full=True, inplace=False,
        clamp_limit=weights.swiglu_limit,
    )
    if out is None:
        return y
    out.copy_(y)
    return out


# Custom ops (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_moe_marlin = custom_op(OPS[0], "marlin_w4a16", moe_marlin)

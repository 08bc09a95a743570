"""Thin adapters from the ``moe`` op to FlashInfer's MoE kernels (flashinfer-python >= 0.6.14).

Each backend has a preparer (run once after loading, through
``capdispatch.backends.moe.prepare``) and a call. Argument lists are the
intersection of 0.6.14 and 0.7.x (tests check them with inspect.signature
against the installed package); layouts are produced by FlashInfer's own
helpers of the installed version (0.6.14 and 0.7 fold the SM90 scales
differently), rewritten one expert at a time into the same storage.

* flashinfer_cutlass_w4a8 (SM120, what SGLang 0.5.23 runs for
  ``--moe-runner-backend flashinfer_mxfp4`` on sm_120): activations quantised to
  MXFP8 with swizzled E8M0 scales (``mxfp8_quantize(x, True, alignment=32)``),
  weights checkpoint-packed MXFP4 viewed as int64, w13 rows reordered to
  [up; gate] (FlashInfer's GEMM1 takes the linear half first), E8M0 weight
  scales block-interleaved (``block_scale_interleave``) and viewed as int32,
  a unit per-expert global weight scale (float32 [E]), the clamp limit as a
  per-expert float32 vector (``swiglu_limit``; alpha/beta left at FlashInfer's
  defaults 1/0, i.e. silu(min(g, L)) * clamp(u, -L, L)), ``use_mxfp8_act_scaling``.
  GEMM2's input is re-quantised to MXFP8 inside the kernel.
* flashinfer_cutlass_w4a16 (SM90): bf16 activations, w13 [up; gate], weights
  and scales interleaved by ``interleave_moe_{weights,scales}_for_sm90_mixed_gemm``,
  ``use_w4_group_scaling``.
* flashinfer_trtllm_w4a8 (SM100 family): ``trtllm_fp4_block_scale_routed_moe``
  with precomputed (ids, weights), MXFP8 activations in the linear scale layout,
  w13 [up; gate] then FlashInfer's row shuffles for its epilogue tile (128),
  interleaved scales viewed as float8_e4m3fn (its ABI), unit output scales.

Masked routes (-1): FlashInfer's CUTLASS MoE treats any id outside
[ep_rank*E, (ep_rank+1)*E) as not local (its routing and finalize kernels skip
it), so -1 is passed through with ep_size=1. For the TRT-LLM-gen routed kernel
we do not rely on that: -1 becomes expert E of a 2E-expert model whose local
range is [0, E) — exactly the EP case SGLang runs — so the route is dropped by
the routing kernel and never reads a weight.
"""
from __future__ import annotations

import functools

import torch

from ...errors import ArgumentError
from .reference import check_moe_args
from .weights import rewrite_per_expert_, swap_halves_

__all__ = ["prepare_cutlass_w4a8", "moe_cutlass_w4a8", "prepare_cutlass_w4a16", "moe_cutlass_w4a16",
           "prepare_trtllm_w4a8", "moe_trtllm_w4a8", "CUTLASS_KWARGS", "TRTLLM_KWARGS"]

LAYOUT_SM120 = "flashinfer_cutlass_sm120"
LAYOUT_SM90 = "flashinfer_cutlass_sm90"
LAYOUT_TRTLLM = "flashinfer_trtllm"
EPILOGUE_TILE_M = 128

# Keyword arguments these adapters pass; each must exist in the installed
# FlashInfer's signature (tests/test_moe.py checks with inspect.signature).
CUTLASS_KWARGS = ("input", "token_selected_experts", "token_final_scales", "fc1_expert_weights",
                  "fc2_expert_weights", "output_dtype", "quant_scales", "input_sf", "swiglu_limit",
                  "use_w4_group_scaling", "use_mxfp8_act_scaling", "output")
TRTLLM_KWARGS = ("topk_ids", "routing_bias", "hidden_states", "hidden_states_scale", "gemm1_weights",
                 "gemm1_weights_scale", "gemm1_bias", "gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit",
                 "gemm2_weights", "gemm2_weights_scale", "gemm2_bias", "output1_scale_scalar",
                 "output1_scale_gate_scalar", "output2_scale_scalar", "num_experts", "top_k", "n_group",
                 "topk_group", "intermediate_size", "local_expert_offset", "local_num_experts",
                 "routed_scaling_factor", "routing_method_type", "do_finalize", "output")


@functools.cache   # imported once, on the first call
def _fi():
    import flashinfer
    from flashinfer import fused_moe
    return flashinfer, fused_moe


def _require_cuda(weights, backend):
    if weights.device.type != "cuda":
        raise ArgumentError(f"{backend} needs CUDA weights, these are on {weights.device}")


def _check_shapes(weights, backend):
    H, I = weights.hidden, weights.intermediate
    if H % 128 or I % 128:
        raise ArgumentError(f"{backend} needs hidden and intermediate sizes that are multiples of 128 "
                         f"(H={H}, I={I})")
    _require_cuda(weights, backend)


def _limit_vector(weights):
    if weights.swiglu_limit is None:
        return
    weights.aux["swiglu_limit"] = torch.full((weights.num_experts,), weights.swiglu_limit,
                                             dtype=torch.float32, device=weights.device)


def _out(x, out):
    return torch.empty_like(x) if out is None else out


def _cutlass_moe(fm, x, weights, topk_weights, topk_ids, out, *, fc1, fc2, quant_scales, input_sf,
                 mxfp8_act: bool) -> None:
    """flashinfer's cutlass_fused_moe into OUT, as both CUTLASS backends call it: MXFP8
    activations (MXFP8_ACT: X quantised, INPUT_SF its scales) or bf16 ones with MXFP4
    group scaling; FC1/FC2 and QUANT_SCALES in the layout each backend prepared."""
    fm.cutlass_fused_moe(
        input=x,
        token_selected_experts=topk_ids.to(torch.int32),
        token_final_scales=topk_weights.float(),
        fc1_expert_weights=fc1,
        fc2_expert_weights=fc2,
        output_dtype=torch.bfloat16,
        quant_scales=quant_scales,
        input_sf=input_sf,
        swiglu_limit=weights.aux.get("swiglu_limit"),
        use_w4_group_scaling=not mxfp8_act,
        use_mxfp8_act_scaling=mxfp8_act,
        output=out,
    )


# --------------------------------------------------------------------------- #
# SM120: CUTLASS, MXFP8 activations x MXFP4 weights
# --------------------------------------------------------------------------- #
def prepare_cutlass_w4a8(weights) -> None:
    flashinfer, _ = _fi()
    _check_shapes(weights, "flashinfer_cutlass_w4a8")
    swap_halves_(weights.w13)
    swap_halves_(weights.w13_scale)
    for s in (weights.w13_scale, weights.w2_scale):
        rewrite_per_expert_(s, lambda t: flashinfer.block_scale_interleave(t[0].contiguous()))
    weights.aux["global_scale"] = torch.ones(weights.num_experts, dtype=torch.float32, device=weights.device)
    _limit_vector(weights)
    weights.layout = LAYOUT_SM120


def moe_cutlass_w4a8(x, weights, topk_weights, topk_ids, out=None, *, checks=True):
    if checks:
        check_moe_args(x, weights, topk_weights, topk_ids, out)
    weights.require_layout(LAYOUT_SM120, "flashinfer_cutlass_w4a8")
    flashinfer, fm = _fi()
    out = _out(x, out)
    if x.shape[0] == 0:
        return out
    xq, xsf = flashinfer.mxfp8_quantize(x.contiguous(), True, alignment=32)
    gs = weights.aux["global_scale"]
    _cutlass_moe(fm, xq, weights, topk_weights, topk_ids, out,
                 fc1=weights.w13.view(torch.int64), fc2=weights.w2.view(torch.int64),
                 quant_scales=[weights.w13_scale.view(torch.int32), gs, weights.w2_scale.view(torch.int32), gs],
                 input_sf=xsf, mxfp8_act=True)
    return out


# --------------------------------------------------------------------------- #
# SM90: CUTLASS mixed-input, bf16 activations x MXFP4 weights
# --------------------------------------------------------------------------- #
def prepare_cutlass_w4a16(weights) -> None:
    _, fm = _fi()
    _check_shapes(weights, "flashinfer_cutlass_w4a16")
    E = weights.num_experts
    swap_halves_(weights.w13)
    swap_halves_(weights.w13_scale)
    for name in ("w13", "w2"):
        rewrite_per_expert_(getattr(weights, name),
                            lambda t: fm.interleave_moe_weights_for_sm90_mixed_gemm(t, "fp4"))
    for name in ("w13_scale", "w2_scale"):
        t = getattr(weights, name)
        shape, _ = rewrite_per_expert_(t, lambda s: fm.interleave_moe_scales_for_sm90_mixed_gemm(s, group_size=32))
        setattr(weights, name, t.view((E,) + tuple(shape[1:])))   # same storage, the kernel's shape
    _limit_vector(weights)
    weights.layout = LAYOUT_SM90


def moe_cutlass_w4a16(x, weights, topk_weights, topk_ids, out=None, *, checks=True):
    if checks:
        check_moe_args(x, weights, topk_weights, topk_ids, out)
    weights.require_layout(LAYOUT_SM90, "flashinfer_cutlass_w4a16")
    _, fm = _fi()
    out = _out(x, out)
    if x.shape[0] == 0:
        return out
    _cutlass_moe(fm, x.contiguous(), weights, topk_weights, topk_ids, out,
                 fc1=weights.w13, fc2=weights.w2,
                 quant_scales=[weights.w13_scale.view(torch.int32), weights.w2_scale.view(torch.int32)],
                 input_sf=None, mxfp8_act=False)
    return out


# --------------------------------------------------------------------------- #
# SM100 family: TRT-LLM-gen routed MoE, MXFP8 x MXFP4
# --------------------------------------------------------------------------- #
def prepare_trtllm_w4a8(weights) -> None:
    flashinfer, _ = _fi()
    from flashinfer.fused_moe.core import (_maybe_get_cached_w3_w1_permute_indices,
                                           get_w2_permute_indices_with_cache)
    _check_shapes(weights, "flashinfer_trtllm_w4a8")
    swap_halves_(weights.w13)          # [w1; w3] -> [w3; w1]
    swap_halves_(weights.w13_scale)
    cache: dict = {}
    dev = weights.device

    def rows(perm_fn, sf):
        def fn(t):
            m = t[0]
            kw = {"num_elts_per_sf": 16} if sf else {}
            perm = perm_fn(cache, m, EPILOGUE_TILE_M, **kw).to(dev)
            shuffled = m[perm].contiguous()
            return flashinfer.block_scale_interleave(shuffled) if sf else shuffled
        return fn

    rewrite_per_expert_(weights.w13, rows(_maybe_get_cached_w3_w1_permute_indices, False))
    rewrite_per_expert_(weights.w13_scale, rows(_maybe_get_cached_w3_w1_permute_indices, True))
    rewrite_per_expert_(weights.w2, rows(get_w2_permute_indices_with_cache, False))
    rewrite_per_expert_(weights.w2_scale, rows(get_w2_permute_indices_with_cache, True))
    weights.aux["unit_scale"] = torch.ones(weights.num_experts, dtype=torch.float32, device=dev)
    _limit_vector(weights)
    weights.layout = LAYOUT_TRTLLM


@functools.cache   # imported once, on the first call
def _topk_method():
    try:
        from flashinfer.fused_moe import RoutingMethodType
    except ImportError:
        from flashinfer.tllm_enums import RoutingMethodType
    return int(RoutingMethodType.TopK)


def moe_trtllm_w4a8(x, weights, topk_weights, topk_ids, out=None, *, checks=True):
    if checks:
        check_moe_args(x, weights, topk_weights, topk_ids, out)
    weights.require_layout(LAYOUT_TRTLLM, "flashinfer_trtllm_w4a8")
    flashinfer, fm = _fi()
    out = _out(x, out)
    T, H = x.shape
    if T == 0:
        return out
    E, K = weights.num_experts, topk_ids.shape[1]
    ids = torch.where(topk_ids >= 0, topk_ids, E).to(torch.int32)   # -1 -> a non-local expert
    xq, xsf = flashinfer.mxfp8_quantize(x.contiguous(), False, alignment=H)
    one = weights.aux["unit_scale"]
    fm.trtllm_fp4_block_scale_routed_moe(
        topk_ids=(ids, topk_weights),        # as SGLang passes them (unpacked)
        routing_bias=None,
        hidden_states=xq,
        hidden_states_scale=xsf.view(torch.float8_e4m3fn).reshape(T, -1),
        gemm1_weights=weights.w13,
        gemm1_weights_scale=weights.w13_scale.view(torch.float8_e4m3fn),
        gemm1_bias=None, gemm1_alpha=None, gemm1_beta=None,
        gemm1_clamp_limit=weights.aux.get("swiglu_limit"),
        gemm2_weights=weights.w2,
        gemm2_weights_scale=weights.w2_scale.view(torch.float8_e4m3fn),
        gemm2_bias=None,
        output1_scale_scalar=one, output1_scale_gate_scalar=one, output2_scale_scalar=one,
        num_experts=2 * E, top_k=K, n_group=1, topk_group=1,
        intermediate_size=weights.intermediate,
        local_expert_offset=0, local_num_experts=E,
        routed_scaling_factor=1.0,
        routing_method_type=_topk_method(),
        do_finalize=True,
        output=out,
    )
    return out


# Custom ops (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_moe_cutlass_w4a8 = custom_op(OPS[0], "flashinfer_cutlass_w4a8", moe_cutlass_w4a8)
op_moe_trtllm_w4a8 = custom_op(OPS[0], "flashinfer_trtllm_w4a8", moe_trtllm_w4a8)
op_moe_cutlass_w4a16 = custom_op(OPS[0], "flashinfer_cutlass_w4a16", moe_cutlass_w4a16)

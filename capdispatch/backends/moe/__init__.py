"""Routed-expert MoE of DeepSeek-V4: packed MXFP4 weights, E8M0 scales, clamped SwiGLU, top-k 6.

Declarations only (no torch, no kernel library at import): the torch reference
is in reference.py, the Triton W4A16 kernels in triton_kernels.py, the thin
adapters to FlashInfer and SGLang's Marlin in flashinfer.py and
sglang_marlin.py; each is imported when its backend is bound or prepared.

Op contract (see reference.py): ``moe(x, weights, topk_weights, topk_ids,
out=None) -> bf16 [T, H]`` with LOCAL expert ids and -1 for masked routes.
Weights are a ``MoeWeights`` (weights.py); a backend whose kernel consumes a
shuffled layout needs ``prepare(weights, backend)`` once after loading (in
place, bytes per expert unchanged).
"""
from ..base import (DECODE_SIZES, Backend, ComputeCapability, Feature, Library, Op, SizeArg, Platform, ShapeRange, TORCH,
                    TRITON, TritonTarget)
from ..signature import Out
from .weights import LAYOUTS, LayoutError, MoeWeights, packed_bytes_per_expert, prepare

__all__ = ["OPS", "register", "MoeWeights", "prepare", "packed_bytes_per_expert", "LayoutError",
           "LAYOUTS", "SGLANG_RUNNER_BACKEND"]

_PKG = "capdispatch.backends.moe"

OPS = (
    Op("moe",
       "routed experts: packed MXFP4 weights + E8M0 scales (never widened), clamped SwiGLU, "
       "weighted top-k sum; expert id -1 = masked (not local under EP)",
       "moe(Tensor x, MoeWeights weights, Tensor topk_weights, Tensor topk_ids, Tensor(a!)? out=None) -> Tensor",
       outputs=(Out(("x.0", "x.1"), "bfloat16"),), records={"MoeWeights": f"{_PKG}.weights:MoeWeights"},
       reference="torch",
       size=SizeArg("tokens", 0, "x"),
       layouts={name: layout for name, (layout, _) in LAYOUTS.items()},
       canary=f"{_PKG}.canary:moe", compare=f"{_PKG}.calibration:moe_compare",
       case=f"{_PKG}.calibration:MoeCase", sizes=DECODE_SIZES,
       compile_jobs="capdispatch.backends.compile_matrix:moe_jobs",
       # Routing is each layer's own; decode steps replay it from CUDA graphs.
       served="decode"),
)

# 0.6.14: first release with the SM120 MXFP8 x MXFP4 CUTLASS MoE and the SM90
# mixed-input (W4A16) interleave helpers that SGLang 0.5.23 calls.
_FLASHINFER = Library("flashinfer-python", ">=0.6.14", module="flashinfer.fused_moe")
# SGLang's MXFP4 Marlin MoE: sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe
# (GEMM JIT-built from the sglang wheel's csrc through apache-tvm-ffi), which imports
# sgl_kernel (distribution sglang-kernel) for scalar types and moe_sum_reduce. 0.5.17
# (with its pin, sglang-kernel 0.4.5) has the same call and helpers; its GEMM does not zero
# skipped routes' rows, which the adapter works around (sglang_marlin.py).
_SGLANG = Library("sglang", ">=0.5.17", module="sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe")
_SGL_KERNEL = Library("sglang-kernel", ">=0.4.5", module="sgl_kernel")
_CUDA = Platform("cuda")

# SGLang 0.5.23 `--moe-runner-backend` value that runs the same kernel family,
# for the adapter's knob map (None: capdispatch routes the call itself).
SGLANG_RUNNER_BACKEND = {
    "flashinfer_cutlass_w4a8": "flashinfer_mxfp4",    # Mxfp4FlashinferCutlassMoEMethod, SM120 MXFP8 path
    "flashinfer_trtllm_w4a8": "flashinfer_mxfp4",     # Mxfp4FlashinferTrtllmMoEMethod (SM100)
    "flashinfer_cutlass_w4a16": "flashinfer_mxfp4",   # Mxfp4FlashinferCutlassMoEMethod, SM90 W4A16
    "marlin_w4a16": "marlin",                          # Mxfp4MarlinMoEMethod
    "triton_w4a16": None,
    "torch": None,
}


# SGLang runs one forward inside FlashInfer's autotuner before it captures graphs
# (model_executor/runner/flashinfer_autotune.py): its MoE tactics are tuned when served.
_FI_TUNE = "flashinfer.autotuner:autotune"
# Shape ranges (checked against a rank's shapes when a decision has a model and layout): the
# hidden size and each rank's share of the expert intermediate size (moe_intermediate / MoE TP).
def _sizes(multiple: int, source: str) -> tuple:
    return (ShapeRange("hidden", source, multiple_of=multiple, what="the hidden size"),
            ShapeRange("moe_intermediate", source, multiple_of=multiple,
                       what="the expert intermediate size per rank"))


_FI_SIZES = _sizes(128, "capdispatch moe/flashinfer.py _check_shapes: FlashInfer's MXFP4 MoE needs H and I "
                        "multiples of 128")
_MARLIN_SIZES = (ShapeRange("hidden", "capdispatch moe/sglang_marlin.py prepare_marlin: H % 128 == 0 "
                            "(Marlin's repack tiles)", multiple_of=128, what="the hidden size"),
                 ShapeRange("moe_intermediate", "capdispatch moe/sglang_marlin.py prepare_marlin: I % 64 == 0 "
                            "(Marlin's repack tiles; SGLang pads, capdispatch keeps the packed size)",
                            multiple_of=64, what="the expert intermediate size per rank"))
_TRITON_SIZES = _sizes(64, "capdispatch moe/triton_kernels.py: H and I multiples of 64 (its GEMM tiles)")
_TORCH_SIZES = _sizes(32, "capdispatch moe/weights.py GROUP = 32: one E8M0 scale per 32 weights (MXFP4 block)")


BACKENDS = (
    Backend("moe", "flashinfer_cutlass_w4a8", f"{_PKG}.flashinfer:op_moe_cutlass_w4a8",
        requires=(TORCH, _CUDA, Feature("sm120_block_scaled_mma"), _FLASHINFER) + _FI_SIZES,
        summary="FlashInfer CUTLASS MoE, MXFP8 activations x MXFP4 weights on the SM120 "
                "block-scaled MMA (SGLang flashinfer_mxfp4 on SM120)", tune=_FI_TUNE),
    Backend("moe", "flashinfer_trtllm_w4a8", f"{_PKG}.flashinfer:op_moe_trtllm_w4a8",
        requires=(TORCH, _CUDA, Feature("tcgen05"), _FLASHINFER) + _FI_SIZES,
        summary="FlashInfer TRT-LLM-gen routed MoE, MXFP8 x MXFP4 on tcgen05 (SM100 family; "
                "cubins from flashinfer-cubin or FlashInfer's download cache)", tune=_FI_TUNE),
    Backend("moe", "flashinfer_cutlass_w4a16", f"{_PKG}.flashinfer:op_moe_cutlass_w4a16",
        requires=(TORCH, _CUDA, Feature("wgmma"), _FLASHINFER) + _FI_SIZES,
        summary="FlashInfer CUTLASS mixed-input MoE, bf16 x MXFP4 on wgmma (SM90; JIT-built)", tune=_FI_TUNE),
    Backend("moe", "marlin_w4a16", f"{_PKG}.sglang_marlin:op_moe_marlin",
        requires=(TORCH, _CUDA, ComputeCapability(">=8.0"), _SGLANG, _SGL_KERNEL) + _MARLIN_SIZES,
        summary="SGLang's MXFP4 Marlin MoE (bf16 x MXFP4, JIT), -1 routes dropped before it"),
    Backend("moe", "triton_w4a16", f"{_PKG}.triton_kernels:op_moe_w4a16",
        requires=(TORCH, TRITON, TritonTarget("8.0")) + _TRITON_SIZES,
        summary="Triton grouped GEMM, MXFP4 decoded on load, bf16 tensor cores (any card Triton "
                "supports from cc 8.0)"),
    Backend("moe", "torch", f"{_PKG}.reference:op_moe",
        requires=(TORCH,) + _TORCH_SIZES,
        summary="torch reference, one expert chunk decoded at a time (runs anywhere)"),
)


def register(registry) -> None:
    """Declare this package's ops and backends (the order says nothing: default.yaml
    gives the preference order)."""
    registry.add_all(OPS, BACKENDS)

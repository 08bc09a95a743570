"""DeepSeek-V4 sparse indexer: fp8 paged MQA logits (SGLang 0.5.23 DSv4 indexer site).

Declarations only: the kernels live in reference.py (torch), triton_kernels.py,
tilelang_kernel.py and deepgemm.py, and are imported when a backend is bound.
Contract: reference.py's module docstring and docs/ops/indexer.md.
"""
from ..base import (DECODE_SIZES, AnyFeature, Backend, ComputeCapability, Library, Op, SizeArg, Platform, ShapeRange, TORCH,
                    TRITON, TritonTarget)
from ..signature import Out

_PKG = "capdispatch.backends.indexer"

OPS = (Op(
    "indexer",
    "fp8 paged MQA logits: q fp8 [B,next_n,64,128], index-K pages of 64 tokens x (128 fp8 + fp32 scale), "
    "weights fp32 [B*next_n,64], context lens, block table -> fp32 logits [B*next_n, max_context_len]",
    "indexer(Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, Tensor block_table, "
    "Tensor? schedule_metadata=None, int? max_context_len=None, bool clean_logits=False, *, "
    "Tensor(a!)? out=None) -> Tensor",
    outputs=(Out(("q.0*q.1", "max_context_len"), "float32"),),
    reference="torch",
    size=SizeArg("tokens", 0, "q"),     # B: decode batch rows, or prefill query rows
    canary=f"{_PKG}.canary:indexer", compare=f"{_PKG}.calibration:indexer_compare",
    case=f"{_PKG}.calibration:indexer_case", sizes=DECODE_SIZES,
    compile_jobs="capdispatch.backends.compile_matrix:indexer_jobs",
    # Context lengths, block table and DeepGEMM's schedule are the batch's; q, weights and the
    # index-K pages each layer's.
    served="decode", batch_args=(3, 4),
),)

# SGLang 0.5.23 pins tilelang==0.1.12; the kernel is lowered and tested with it.
_TILELANG = Library("tilelang", ">=0.1.12", module="tilelang")
# The DeepGEMM SGLang installs (and pins, 0.2.3.post2); the module is `deep_gemm`. Its _C.so
# is built against one torch: 0.2.3.post2 and 0.2.5 do not load with torch 2.11 (undefined
# symbol c10::cuda::CUDAErrorLogCapture). The import check rejects it there; a canary on the
# card decides what requirements cannot see.
_DEEPGEMM = Library("sgl-deep-gemm", ">=0.2.3", module="deep_gemm")
# Shape ranges (checked against a rank's shapes when a decision has a model and layout).
# The index-K page holds 128 fp8 values + one fp32 scale per token (indexer/layout.py HEAD_DIM).
_DIM = ShapeRange("indexer_dim", "capdispatch indexer/layout.py HEAD_DIM = 128 (64-token pages of "
                  "128 fp8 + fp32 scale, 8448 bytes)", allowed=(128,), what="the indexer head dim")
# DeepGEMM's host checks of fp8_paged_mqa_logits (sgl-deep-gemm 0.2.3.post2, deep_gemm/_C.so:
# "next_n == 1 or next_n == 2", "num_heads == 32 or num_heads == 64").
_DG_HEADS = ShapeRange("indexer_heads", "sgl-deep-gemm 0.2.3.post2 fp8_paged_mqa_logits host check "
                       "`num_heads == 32 or num_heads == 64` (deep_gemm/_C.so)", allowed=(32, 64),
                       what="indexer heads per rank")
_DG_NEXT_N = ShapeRange("next_n", "sgl-deep-gemm 0.2.3.post2 fp8_paged_mqa_logits host check "
                        "`next_n == 1 or next_n == 2` (deep_gemm/_C.so)", allowed=(1, 2),
                        what="query tokens per request per decode step")
_TRITON_HEADS = ShapeRange("indexer_heads", "capdispatch indexer/triton_kernels.py _Plan: a power-of-two "
                           "head count <= 128", allowed=(1, 2, 4, 8, 16, 32, 64, 128),
                           what="indexer heads per rank")

BACKENDS = (
    Backend("indexer", "deepgemm", f"{_PKG}.deepgemm:op_fp8_paged_mqa_logits",
            requires=(TORCH, _DEEPGEMM, Platform("cuda"), AnyFeature(("wgmma", "tcgen05")), _DG_HEADS,
                      _DG_NEXT_N, _DIM),
            summary="DeepGEMM fp8_paged_mqa_logits (SM90 wgmma / SM100 tcgen05 kernels; JIT needs the CUDA toolkit; "
                    "its _C.so loads only with the torch it was built for: not torch 2.11)"),
    Backend("indexer", "tilelang", f"{_PKG}.tilelang_kernel:op_fp8_paged_mqa_logits",
            requires=(TORCH, _TILELANG, Platform("cuda"), ComputeCapability(">=8.0"), _DIM),
            summary="capdispatch's TileLang kernel: fp8 MMA from cc 8.9 (wgmma on SM90), fp16 MMA over "
                    "integer-widened fp8 below; JIT-built for the card's arch-specific target from SM90 "
                    "(sm_90a: wgmma needs it), needs the CUDA toolkit"),
    Backend("indexer", "triton", f"{_PKG}.triton_kernels:op_fp8_paged_mqa_logits",
            requires=(TORCH, TRITON, TritonTarget("8.0"), _TRITON_HEADS, _DIM),
            summary="Triton: native fp8 dot from cc 8.9, uint8 views widened to fp16 with integer ops below"),
    Backend("indexer", "torch", f"{_PKG}.reference:op_fp8_paged_mqa_logits",
            requires=(TORCH,),
            summary="torch reference, 1024 query rows at a time, index-K gathered a few pages at a time"),
)


def register(registry) -> None:
    """Declare this package's ops and backends (the order says nothing: default.yaml
    gives the preference order)."""
    registry.add_all(OPS, BACKENDS)

"""decode_mla: DeepSeek-V4 sparse MLA decode over the V4 fp8 paged KV pool.

Contract: derived from SGLang 0.5.23's DSv4 decode call site (``flash_mla_with_kvcache``
on SM90/SM100, ``flash_mla_with_kvcache_sm120`` on SM120) with FlashMLA's decode
semantics; see reference.py. Covers the main (SWA) pool, an optional extra (c4/c128
compressed) pool in the same V4 layout, per-batch top-k lengths and the attention
sink. Declarations only: kernels are imported when bound (reference.py, triton_kernels.py,
flashmla.py, flashinfer.py; library_args.py holds what both library adapters do to the
arguments).
"""
from ..base import DECODE_SIZES, AnyFeature, Backend, Feature, Library, Op, ShapeRange, SizeArg, TORCH, TRITON, TritonTarget
from ..signature import Out
from ..v4_layout import DIM

_PKG = "capdispatch.backends.decode_mla"

OPS = (
    Op("decode_mla",
       "DeepSeek-V4 sparse MLA decode/extend over the V4 fp8 paged pool (448 e4m3 + 64 bf16 + UE8M0 "
       "scales per token) by token ids, optional extra (compressed) pool, top-k lengths and attention "
       "sink -> out and natural-log lse. q [b,s_q,h,512] bf16, pool uint8 [num_pages,bytes_per_page] "
       "(or the 4-D [num_pages,page_size,1,584] view), indices [b,s_q,topk] int32 token ids, topk_length "
       "[b], attn_sink [h] fp32, extra_indices [b,s_q,extra_topk], extra_topk_length [b] -> out "
       "[b,s_q,h,512] bf16, lse [b,h,s_q] fp32 natural log, sink not included, +inf and out 0 where no "
       "entry is valid; ids < 0, >= num_pages*page_size or past topk_length are masked",
       "decode_mla(Tensor q, Tensor pool, Tensor indices, int page_size, float sm_scale, "
       "Tensor? topk_length=None, Tensor? attn_sink=None, Tensor? extra_pool=None, "
       "Tensor? extra_indices=None, int? extra_page_size=None, Tensor? extra_topk_length=None, *, "
       "Tensor(a!)? out=None) -> (Tensor, Tensor)",
       outputs=(Out(("q.0", "q.1", "q.2", DIM), "bfloat16"), Out(("q.0", "q.2", "q.1"), "float32")),
       reference="torch", size=SizeArg("tokens", 0, "q"), canary=f"{_PKG}.canary:decode_mla",
       compare="capdispatch.backends.cases:attention_compare",
       case=f"{_PKG}.calibration:decode_mla_case", sizes=DECODE_SIZES,
       compile_jobs="capdispatch.backends.compile_matrix:attention_jobs",
       # The valid counts (topk_length, extra_topk_length) are the batch's: FlashMLA's schedule
       # is derived from them once per batch (SGLang passes it to every layer).
       served="decode", batch_args=(5, 10)),
)

_FLASHMLA = Library("sgl-flash-mla", ">=1.0", module="flash_mla")
# The public SparseMLASm120Wrapper with runtime page sizes and lse_scale: 0.7.2 is
# what SGLang 0.5.23 pins (0.6.x needed 64-token pages and a private entry point).
_FLASHINFER = Library("flashinfer-python", ">=0.7.2", module="flashinfer")

# Shape ranges (checked against a rank's shapes when a decision has a model and layout).
# Every kernel here reads the V4 pool's 512-wide rows (448 fp8 nope + 64 bf16 rope).
_HEAD_DIM = ShapeRange("head_dim", "capdispatch backends/v4_layout.py DIM = 512: the V4 pool row "
                       "(448 nope + 64 rope)", allowed=(512,), what="the MLA head dim")
# FlashMLA instantiates h_q 64 and 128; flashmla.py pads fewer heads up (library_args.pad_heads).
_FLASHMLA_HEADS = ShapeRange("heads", "capdispatch decode_mla/flashmla.py pad_heads(q, sink, (64, 128)): "
                             "FlashMLA's kernels take h_q 64 or 128, fewer are zero-padded",
                             min=1, max=128, what="query heads per rank")
_FI_HEADS = ShapeRange("heads", "capdispatch decode_mla/flashinfer.py _FI_HEADS = (8, 16, 32, 64, 128): "
                       "SparseMLASm120Wrapper's head counts, fewer are zero-padded",
                       min=1, max=128, what="query heads per rank")


BACKENDS = (
    Backend(
        "decode_mla", "flashmla", f"{_PKG}.flashmla:op_flashmla",
        requires=(TORCH, _FLASHMLA, AnyFeature(("wgmma", "tcgen05")), _FLASHMLA_HEADS, _HEAD_DIM),
        summary="FlashMLA sparse fp8 decode (legacy V4-format kernels: SM90a wgmma, SM100 tcgen05)"),
    Backend(
        "decode_mla", "flashinfer_sparse_mla", f"{_PKG}.flashinfer:op_flashinfer_sparse_mla",
        requires=(TORCH, _FLASHINFER, Feature("sm120_block_scaled_mma"), _FI_HEADS, _HEAD_DIM),
        summary="FlashInfer SM120 sparse MLA (block-scaled MMA); split-K scratch only for <= 64 tokens"),
    Backend(
        "decode_mla", "triton_fp8", f"{_PKG}.triton_kernels:op_decode_mla_fp8",
        requires=(TORCH, TRITON, TritonTarget("8.0"), Feature("fp8_e4m3"), _HEAD_DIM),
        summary="Triton with native fp8 loads (Triton admits fp8e4nv from cc 8.9)"),
    Backend(
        "decode_mla", "triton", f"{_PKG}.triton_kernels:op_decode_mla_u8",
        requires=(TORCH, TRITON, TritonTarget("8.0"), _HEAD_DIM),
        summary="Triton, pool read through uint8 with an integer e4m3 decode (any CUDA card from SM80); "
                "split-K only for <= 64 tokens"),
    Backend(
        "decode_mla", "torch", f"{_PKG}.reference:op_decode_mla",
        requires=(TORCH,),
        summary="torch reference, chunked over tokens (runs anywhere)"),
)


def register(registry) -> None:
    """Declare this package's ops and backends (the order says nothing: default.yaml
    gives the preference order)."""
    registry.add_all(OPS, BACKENDS)

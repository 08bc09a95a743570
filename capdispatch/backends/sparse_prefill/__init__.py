"""sparse_prefill: DeepSeek-V4 sparse attention over gathered top-k bf16 K/V rows.

Contract: SGLang 0.5.23's ``flash_mla_interface.flash_mla_sparse_fwd`` (see reference.py).
Declarations only: kernels live in reference.py (torch), triton_kernels.py and
flashmla.py (FlashMLA) and are imported when bound.

Not declared here: FlashInfer. Its SM120 sparse-MLA kernels read only fp8 paged
caches, not a bf16 K/V workspace, so they cannot serve this contract; on SM120 SGLang
runs extends through the paged kernel instead, which is the ``decode_mla`` op's
``flashinfer_sparse_mla`` backend (its extend path takes no split-K scratch).
"""
from ..base import AnyFeature, Backend, Library, Op, ShapeRange, SizeArg, TORCH, TRITON, TritonTarget
from ..signature import Out

_PKG = "capdispatch.backends.sparse_prefill"

OPS = (
    Op("sparse_prefill",
       "DeepSeek-V4 sparse attention prefill: bf16 q [s,h,512] over gathered top-k rows of bf16 kv "
       "[s_kv,1,512] (K = V), -1 / out-of-range / past-topk_length entries masked, optional attention "
       "sink -> out, max_logits, lse (base 2 by default, FlashMLA legacy statistics). q [s,h,512] bf16, "
       "kv [s_kv,1,512] bf16, indices [s,1,topk] int32, attn_sink [h] fp32, topk_length [s] int32 "
       "-> out [s,h,d_v] bf16, max_logits [s,h] fp32, lse [s,h] fp32; use_legacy=True: base-2 "
       "statistics, a query with no valid index gives out 0, max_logits -inf, lse +inf; "
       "use_legacy=False: natural log, lse +inf for such a query",
       "sparse_prefill(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v=512, "
       "Tensor? attn_sink=None, Tensor? topk_length=None, *, bool use_legacy=True, Tensor(a!)? out=None) "
       "-> (Tensor, Tensor, Tensor)",
       outputs=(Out(("q.0", "q.1", "d_v"), "bfloat16"), Out(("q.0", "q.1"), "float32"),
                Out(("q.0", "q.1"), "float32")),
       reference="torch", size=SizeArg("tokens", 0, "q"), canary=f"{_PKG}.canary:sparse_prefill",
       compare="capdispatch.backends.cases:attention_compare",
       case=f"{_PKG}.calibration:sparse_prefill_case", sizes=(256, 512, 1024, 2048, 4096, 8192, 16384),
       compile_jobs="capdispatch.backends.compile_matrix:attention_jobs",
       # Top-k indices come from each layer's indexer: nothing is the batch's alone.
       served="prefill"),
)

# SGLang 0.5.23 pins sgl-flash-mla==1.0.0 and imports it as flash_mla; the
# use_legacy / return_log2_lse arguments the adapter passes exist from 1.0.
_FLASHMLA = Library("sgl-flash-mla", ">=1.0", module="flash_mla")

# Shape ranges (checked against a rank's shapes when a decision has a model and layout).
_HEAD_DIM = ShapeRange("head_dim", "capdispatch sparse_prefill/reference.py DIM = D_V = 512 (FlashMLA's "
                       "sparse prefill supports d_v 512 only; the Triton kernels' DIM is 512)",
                       allowed=(512,), what="the MLA head dim")
_FLASHMLA_HEADS = ShapeRange("heads", "capdispatch sparse_prefill/flashmla.py _pad_heads: FlashMLA takes "
                             "h_q 64 or 128, fewer are zero-padded, more are refused",
                             min=1, max=128, what="query heads per rank")


BACKENDS = (
    Backend(
        "sparse_prefill", "flashmla_sparse", f"{_PKG}.flashmla:op_flashmla_sparse",
        requires=(TORCH, _FLASHMLA, AnyFeature(("wgmma", "tcgen05")), _FLASHMLA_HEADS, _HEAD_DIM),
        summary="FlashMLA sparse prefill (legacy kernels: SM90a wgmma, SM100 tcgen05), as SGLang calls it"),
    Backend(
        "sparse_prefill", "triton", f"{_PKG}.triton_kernels:op_sparse_prefill",
        requires=(TORCH, TRITON, TritonTarget("8.0"), _HEAD_DIM),
        summary="Triton: one program per (query, head block), bf16 tensor-core dots, online softmax, "
                "no scratch (any CUDA card from SM80)"),
    Backend(
        "sparse_prefill", "torch", f"{_PKG}.reference:op_sparse_prefill",
        requires=(TORCH,),
        summary="torch reference, chunked over queries (runs anywhere)"),
)


def register(registry) -> None:
    """Declare this package's ops and backends (the order says nothing: default.yaml
    gives the preference order)."""
    registry.add_all(OPS, BACKENDS)

"""KV-cache fp8 quant/dequant in SGLang 0.5.23's DeepSeek-V4 `V4` paged layout.

Declarations only: kernels live in reference.py (torch) and triton_kernels.py
and are imported when bound.
"""
from ..base import DECODE_SIZES, Backend, Feature, Op, SizeArg, TORCH, TRITON, TritonTarget
from ..signature import Out
from ..v4_layout import DIM

_PKG = "capdispatch.backends.kv_cache"

OPS = (
    Op("kv_quant",
       "bf16 K [n,512] -> V4 paged uint8 pool at token slots `loc` (448 fp8 e4m3 + 64 bf16 + 7 UE8M0 scales + pad)",
       "kv_quant(Tensor k, Tensor(a!) pool, Tensor loc, int page_size) -> ()", outputs=(), reference="torch",
       size=SizeArg("rows", 0, "k"), canary=f"{_PKG}.canary:kv_quant",
       compare=f"{_PKG}.calibration:kv_quant_compare",
       case=f"{_PKG}.calibration:kv_quant_case", sizes=DECODE_SIZES + (16384,),
       compile_jobs="capdispatch.backends.compile_matrix:kv_cache_jobs",
       # Every step stores its tokens; the slot map is the batch's, the pool each layer's.
       served="decode", batch_args=(2,)),
    Op("kv_dequant",
       "V4 paged uint8 pool, token ids -> bf16 [n,1,512]",
       "kv_dequant(Tensor pool, Tensor token_ids, int page_size, Tensor(a!)? out=None) -> Tensor",
       outputs=(Out(("token_ids.0", 1, DIM), "bfloat16"),), reference="torch",
       size=SizeArg("rows", 1, "token_ids"), canary=f"{_PKG}.canary:kv_dequant",
       compare=f"{_PKG}.calibration:kv_dequant_compare",
       case=f"{_PKG}.calibration:kv_dequant_case", sizes=(64, 256, 1024, 4096, 16384, 65536, 262144),
       compile_jobs="capdispatch.backends.compile_matrix:kv_cache_jobs",
       # SGLang dequantizes the pool for sparse prefill (deepseek_v4_backend.py); the token ids
       # are the batch's, the pool each layer's.
       served="prefill", batch_args=(1,)),
)


def _backends(op):
    return (
        Backend(op, "triton_fp8", f"{_PKG}.triton_kernels:op_{op}_fp8",
                requires=(TORCH, TRITON, TritonTarget("8.0"), Feature("fp8_e4m3")),
                summary="Triton with native fp8 e4m3 types (Triton admits fp8e4nv from cc 8.9)"),
        Backend(op, "triton_u8", f"{_PKG}.triton_kernels:op_{op}_u8",
                requires=(TORCH, TRITON, TritonTarget("8.0")),
                summary="Triton over uint8 views, fp8 coded with integer operations (any CUDA card Triton "
                        "supports)"),
        Backend(op, "torch", f"{_PKG}.reference:op_{op}",
                requires=(TORCH,),
                summary="torch reference (runs anywhere)"),
    )


BACKENDS = _backends("kv_quant") + _backends("kv_dequant")


def register(registry) -> None:
    """Declare this package's ops and backends (the order says nothing: default.yaml
    gives the preference order)."""
    registry.add_all(OPS, BACKENDS)

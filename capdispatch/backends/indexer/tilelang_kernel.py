"""TileLang kernel for the sparse indexer's fp8 paged MQA logits (contract: reference.py).

One thread block (128 threads, one warpgroup) scores one query row over one split of
the positions, one 64-token page per pipelined step:

    acc[t, h] = K_page [64, 128] @ q_row^T [128, H]        (float32 accumulation)
    logits[t] = scale[t] * sum_h w[h] * relu(acc[t, h])

Positions at or past the row's length are written -inf and so is the rest of the
split: the whole [rows, max_context_len] result is written. Page ids are read only
for pages below the row's length.

The JIT target is arch-specific from SM90 (`target_arch`: sm_90a, sm_100a, sm_120a): the
SM90 multiply is wgmma, which only sm_90a code may use.

Two variants, picked per target (`native_fp8_for_arch`):
* native (cc >= 8.9: sm_89; sm_90a -> wgmma; sm_100a, sm_120a -> fp8 mma.sync): q and
  the pages are passed as float8_e4m3fn buffers and T.gemm multiplies fp8 directly;
* uint8 (sm_80 / sm_86, which have no fp8 MMA): the bytes are widened to float16 with
  integer operations on their way into shared memory (exact for every e4m3fn value)
  and T.gemm runs in float16 with float32 accumulation.

`lower_cuda_source(arch)` lowers the kernel to CUDA C++ for any of these targets with
no GPU present; the tests lower it for every device's target (sm_80 .. sm_120a), build it
with nvcc, and check its PTX against what each target can run. Running it needs a CUDA device and
a CUDA toolkit for TileLang's JIT; kernels are compiled once per (device arch, next_n,
context-length form, variant) and cached.

Import lazily (at bind time): this imports tilelang.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations,
# which name closure variables.
import functools
import re

import torch

import tilelang
import tilelang.language as T

from ...errors import ArgumentError, ArgumentTypeError
from .layout import HEAD_DIM, PAGE_BYTES, PAGE_TOKENS, alloc_logits, check_args

__all__ = ["fp8_paged_mqa_logits", "build_kernel", "lower_cuda_source", "native_fp8_for_arch",
           "compile_kernel", "target_arch", "plan_splits", "PASS_CONFIGS", "THREADS"]

THREADS = 128
NUM_STAGES = 2
_ROWS_PER_PAGE = PAGE_BYTES // HEAD_DIM      # 66: a page viewed as [66, 128] (64 value rows + scales)
_SCALE_WORD = PAGE_TOKENS * HEAD_DIM // 4    # 2048: first float32 word of the scales


def _pass_configs() -> dict:
    # As SGLang's TileLang kernels: no TMA lowering and no warp specialisation (the
    # page gather is data dependent), which also keeps one code path for every target.
    keys = tilelang.PassConfigKey
    return {keys.TL_DISABLE_TMA_LOWER: True, keys.TL_DISABLE_WARP_SPECIALIZED: True}


PASS_CONFIGS = _pass_configs()


def native_fp8_for_arch(arch: str) -> bool:
    """'sm_86' -> False, 'sm_89' / 'sm_90' / 'sm_90a' / 'sm_120' -> True (fp8 MMA from cc 8.9)."""
    m = re.fullmatch(r"sm_(\d+)(\d)[af]?", arch)
    if not m:
        raise ArgumentError(f"arch must look like sm_86 / sm_90a / sm_120, got {arch!r}")
    return (int(m.group(1)), int(m.group(2))) >= (8, 9)


def build_kernel(next_n: int = 1, ctx_2d: bool = False, native_fp8: bool = True,
                 heads: int = 64, threads: int = THREADS, num_stages: int = NUM_STAGES):
    """The TileLang prim_func for one (next_n, context-length form, variant, heads).

    Arguments (all symbolic sizes): q [rows, H, 128] (fp8 or its uint8 bits), pages
    [num_pages, 66, 128] (same dtype; rows 64..65 hold the scales), pages_f32
    [num_pages, 2112] (the same bytes as float32), weights float32 [rows, H],
    context_lens int32 [batch] or [rows], block_table int32 [batch, max_blocks],
    splits int32 [n_splits] (only its length is used: it sets the grid), out float32
    [rows, max_context_len]."""
    H, D, PAGE = int(heads), HEAD_DIM, PAGE_TOKENS
    N = int(next_n)
    _dyn = getattr(T, "dynamic", None) or T.symbolic
    Bsym = _dyn("batch")
    R = _dyn("rows")
    C = _dyn("num_pages")
    NB = _dyn("max_blocks")
    S = _dyn("max_context_len")
    SK = _dyn("n_splits")
    NC = _dyn("n_context_lens")
    in_dtype = "float8_e4m3fn" if native_fp8 else "uint8"
    mma_dtype = "float8_e4m3fn" if native_fp8 else "float16"
    neg_inf = -T.infinity("float32")

    @T.macro
    def widen(c8):
        # e4m3fn code -> float16: magnitude bits at bit 7 give value * 2**-8 (exact), sign to bit 15.
        c = T.Cast("int32", c8)
        bits = T.Cast("uint16", ((c << 7) & 0x3F80) | ((c << 8) & 0x8000))
        return T.if_then_else((c & 0x7F) == 0x7F, T.reinterpret(T.uint16(0x7E00), "float16"),
                              T.reinterpret(bits, "float16") * T.float16(256.0))

    @T.prim_func
    def fp8_paged_mqa_logits(
        q: T.Tensor((R, H, D), in_dtype),
        pages: T.Tensor((C, _ROWS_PER_PAGE, D), in_dtype),
        pages_f32: T.Tensor((C, PAGE_BYTES // 4), "float32"),
        weights: T.Tensor((R, H), "float32"),
        context_lens: T.Tensor((NC,), "int32"),
        block_table: T.Tensor((Bsym, NB), "int32"),
        splits: T.Tensor((SK,), "int32"),
        out: T.Tensor((R, S), "float32"),
    ):
        with T.Kernel(R, SK, threads=threads) as (r, s):
            q_sh = T.alloc_shared((H, D), mma_dtype)
            k_sh = T.alloc_shared((PAGE, D), mma_dtype)
            res_sh = T.alloc_shared((PAGE,), "float32")
            acc = T.alloc_fragment((PAGE, H), "float32")
            w_f = T.alloc_fragment((H,), "float32")
            red = T.alloc_fragment((PAGE,), "float32")
            sc_f = T.alloc_fragment((PAGE,), "float32")
            L = T.alloc_var("int32")
            b = r // N
            if ctx_2d:
                L = context_lens[r]
            else:
                L = context_lens[b] - (N - 1) + r % N
            # Scalars held in registers (alloc_var): keeps the index expressions small, which
            # makes TileLang's layout inference several times faster on the pipelined loop.
            E = T.alloc_var("int32")
            p_begin = T.alloc_var("int32")
            p_comp = T.alloc_var("int32")
            p_end = T.alloc_var("int32")
            E = T.max(T.min(L, S), 0)
            n_pages = T.ceildiv(S, PAGE)
            per_split = T.ceildiv(n_pages, SK)
            p_begin = s * per_split
            p_end = T.min(p_begin + per_split, n_pages)
            p_comp = T.max(p_begin, T.min(p_end, T.ceildiv(E, PAGE)))   # pages [p_begin, p_comp) scored

            if native_fp8:
                T.copy(q[r, 0, 0], q_sh)
            else:
                for h, d in T.Parallel(H, D):
                    q_sh[h, d] = widen(q[r, h, d])
            T.copy(weights[r, 0], w_f)

            for it in T.Pipelined(p_comp - p_begin, num_stages=num_stages):
                p = p_begin + it
                page = block_table[b, p]
                if native_fp8:
                    T.copy(pages[page, 0:PAGE, 0:D], k_sh)
                else:
                    for t, d in T.Parallel(PAGE, D):
                        k_sh[t, d] = widen(pages[page, t, d])
                for t in T.Parallel(PAGE):
                    sc_f[t] = pages_f32[page, _SCALE_WORD + t]
                T.gemm(k_sh, q_sh, acc, transpose_B=True, clear_accum=True)
                for t, h in T.Parallel(PAGE, H):
                    acc[t, h] = T.max(acc[t, h], 0.0) * w_f[h]
                T.reduce_sum(acc, red, dim=1)
                for t in T.Parallel(PAGE):
                    res_sh[t] = T.if_then_else(p * PAGE + t < E, red[t] * sc_f[t], neg_inf)
                for t in T.Parallel(PAGE):
                    if p * PAGE + t < S:
                        out[r, p * PAGE + t] = res_sh[t]

            for p in T.serial(p_comp, p_end):
                for t in T.Parallel(PAGE):
                    if p * PAGE + t < S:
                        out[r, p * PAGE + t] = neg_inf

    return fp8_paged_mqa_logits


def _target(arch: str):
    from tilelang import tvm
    return tvm.target.Target({"kind": "cuda", "arch": arch})


def lower_cuda_source(arch: str, *, next_n: int = 1, ctx_2d: bool = False, native_fp8=None,
                      heads: int = 64) -> str:
    """Lower the kernel for `arch` (e.g. 'sm_86', 'sm_90a', 'sm_120a') to CUDA C++ source;
    needs no GPU. `native_fp8=None` picks the variant the backend runs on that arch."""
    if native_fp8 is None:
        native_fp8 = native_fp8_for_arch(arch)
    func = build_kernel(next_n, ctx_2d, native_fp8, heads)
    tgt = _target(arch)
    with tgt, tilelang.transform.PassContext(config=PASS_CONFIGS):
        artifact = tilelang.lower(func, target=tgt)
    return artifact.kernel_source


@functools.lru_cache(maxsize=None)
def compile_kernel(arch: str, next_n: int, ctx_2d: bool, native_fp8: bool, heads: int):
    """JIT-compile (TileLang + the CUDA toolkit) and cache one kernel variant."""
    func = build_kernel(next_n, ctx_2d, native_fp8, heads)
    return tilelang.compile(func, target=_target(arch), pass_configs=PASS_CONFIGS)


def target_arch(major: int, minor: int) -> str:
    """The TileLang target the kernel is JIT-built for on a device of compute capability
    major.minor: arch-specific from SM90 ('sm_90a', 'sm_100a', 'sm_120a').

    The fp8 T.gemm lowers to wgmma on SM90, and wgmma exists only in sm_90a code: built for
    plain sm_90, CUTLASS compiles the wgmma path to a device-side assert (`wgmma.fence without
    CUTE_ARCH_MMA_SM90A_ENABLED`) that fires at the first launch and poisons the CUDA context.
    The JIT builds for the card it runs on, so the arch-specific target costs no portability."""
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def _device_facts(index: int) -> tuple:
    """(compile target, SM count for the splits, native fp8) on device INDEX: the kernel is
    built for the card that is there; the splits and the codec follow the effective facts
    (an emulated card's, device_facts), so an emulated card without fp8 runs the uint8 variant."""
    from .. import device_facts
    real, eff = device_facts.real(index), device_facts.for_index(index)
    return target_arch(*real.cc), eff.sm_count, eff.fp8


_SPLITS: dict = {}


def _splits_tensor(device: torch.device, n: int) -> torch.Tensor:
    key = (device, n)
    t = _SPLITS.get(key)
    if t is None:
        t = torch.arange(n, dtype=torch.int32, device=device)
        _SPLITS[key] = t
    return t


def plan_splits(rows: int, max_context_len: int, num_sms: int) -> int:
    """Splits of the positions per row: about 4 blocks per SM for decode-sized batches,
    one per row for large ones (a power of two, so few distinct split tensors exist)."""
    pages = -(-max_context_len // PAGE_TOKENS)
    want = max(1, min(pages, -(-4 * num_sms // max(rows, 1))))
    return 1 << (want - 1).bit_length() if want > 1 else 1


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_metadata=None,
                         max_context_len=None, clean_logits=False, *, out=None, checks=True):
    """The indexer op with the TileLang kernel (CUDA only; contract: reference.py).
    `schedule_metadata` is ignored; positions past a row's length are written -inf."""
    del schedule_metadata, clean_logits
    if max_context_len is None:
        raise ArgumentTypeError("max_context_len is required")
    a = check_args(q, kv_cache, weights, context_lens, block_table, max_context_len, checks)
    dev = a.q_u8.device
    if dev.type != "cuda":
        raise ArgumentError(f"the TileLang indexer needs CUDA tensors, got {dev}")
    if a.pages.shape[0] > 1 and a.pages.stride(0) != PAGE_BYTES:
        raise ArgumentError("the TileLang indexer needs the index-K pages packed (page stride 8448 bytes)")
    B, N, H, S = a.batch, a.next_n, a.heads, a.max_context_len
    rows = B * N
    result = alloc_logits(rows, S, dev, out)
    if rows == 0 or S == 0:
        return result
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    arch, num_sms, native = _device_facts(index)
    kernel = compile_kernel(arch, N, a.ctx_2d, native, H)

    dt = torch.float8_e4m3fn if native else torch.uint8
    num_pages = a.pages.shape[0]
    flat = a.pages.as_strided((max(num_pages, 1), PAGE_BYTES), (PAGE_BYTES, 1)) if num_pages else \
        torch.zeros((1, PAGE_BYTES), dtype=torch.uint8, device=dev)
    pages = flat.view(dt).view(-1, _ROWS_PER_PAGE, HEAD_DIM)
    pages_f32 = flat.view(torch.float32)
    qv = a.q_u8.view(dt).view(rows, H, HEAD_DIM)
    w = a.weights.contiguous()
    ctx = a.context_lens.reshape(-1)
    if ctx.dtype != torch.int32 or not ctx.is_contiguous():
        ctx = ctx.to(torch.int32).contiguous()
    bt = a.block_table
    if bt.dtype != torch.int32 or not bt.is_contiguous():
        bt = bt.to(torch.int32).contiguous()
    target = result if result.is_contiguous() else torch.empty((rows, S), dtype=torch.float32, device=dev)
    splits = _splits_tensor(dev, plan_splits(rows, S, num_sms))
    with torch.cuda.device(dev):
        kernel(qv, pages, pages_f32, w, ctx, bt, splits, target)
    if target is not result:
        result.copy_(target)
    return result


# Custom op (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_fp8_paged_mqa_logits = custom_op(OPS[0], "tilelang", fp8_paged_mqa_logits)

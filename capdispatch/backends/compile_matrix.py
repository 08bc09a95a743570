"""The compile matrix: every Triton kernel of every op, in each variant a card's policy
can choose, compiled offline (Triton's compiler for a ``GPUTarget``; no GPU) for the
catalog's architectures, with registers, spills and shared memory per kernel.

Which variants a target gets comes from the runtime's own rules: the native-fp8
variants only where the ``fp8_e4m3`` feature holds (features.yaml, the rule the
``triton_fp8`` backends require), the attention tiles from
``sparse_attention.launch_table.configs_for`` for that compute capability, the MoE
tiles from ``moe.launch_table.tiles_for`` at each of its size classes, and the shared
memory limit from the catalog's opt-in figure for that architecture. A row is ok when
the kernel compiles and its shared memory fits that limit.

The kernel modules are imported on first use, without ``TRITON_INTERPRET`` (under the
interpreter ``triton.jit`` returns no compilable function): run this in a process of
its own, as ``benchmarks/compile_matrix.py`` and the tests do.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
from typing import Callable, Optional
import inspect
import tempfile

import attrs

from ..capabilities import catalog
from ..capabilities.features import derive

__all__ = ["TARGETS", "Target", "Job", "Row", "target", "jobs_for", "kv_cache_jobs", "indexer_jobs", "attention_jobs", "moe_jobs", "covering_set", "compile_job", "with_defaults", "run"]

# Catalog architecture keys; Triton builds cc 9.0 / 10.0 / 12.0 as sm_90a / sm_100a / sm_120a.
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


@attrs.frozen
class Target:
    key: str                 # catalog key, e.g. "sm_90"
    cc: tuple                # (major, minor)
    smem: int                # opt-in shared memory per block, bytes
    features: frozenset

    @property
    def number(self) -> int:
        return self.cc[0] * 10 + self.cc[1]

    @property
    def arch(self) -> str:
        """The architecture Triton compiles for (sm_90a from 9.0 on)."""
        return f"sm_{self.number}a" if self.number >= 90 else f"sm_{self.number}"


def target(key: str) -> Target:
    spec = catalog.simulate(key)
    if spec.smem_optin_per_block is None:
        raise ValueError(f"catalog entry {key!r} has no smem_optin_per_block; the compile matrix needs it")
    return Target(key=key, cc=tuple(spec.cc), smem=int(spec.smem_optin_per_block), features=derive(spec))


@attrs.frozen
class Job:
    """One compile: kernel ``module:name`` with its runtime argument types and constexprs."""
    op: str
    kernel: str              # "module.path:function"
    variant: str
    signature: dict = attrs.field(eq=False)
    constexprs: dict = attrs.field(eq=False)
    num_warps: int = 4
    num_stages: int = 3

    @property
    def key(self) -> tuple:
        return (self.op, self.kernel, self.variant)

    @property
    def name(self) -> str:
        return self.kernel.rsplit(":", 1)[1]


@attrs.frozen
class Row:
    target: str
    op: str
    kernel: str
    variant: str
    regs: Optional[int]
    spills: Optional[int]    # bytes of spill stores (ptxas -v)
    smem: Optional[int]      # bytes of shared memory the launch requests
    limit: int
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.smem is not None and self.smem <= self.limit

    @property
    def problem(self) -> str:
        if self.error is not None:
            return self.error
        if not self.ok:
            return f"needs {self.smem} B of shared memory, {self.target} has {self.limit} B"
        return ""


_PKG = __name__.rsplit(".", 1)[0]


def _mod(path: str):
    """A kernel module: a path under capdispatch.backends (built-in ops name theirs so, e.g.
    "kv_cache.triton_kernels"), else an absolute module path (a plugin's)."""
    first = path.split(".", 1)[0]
    if os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), first)):
        return importlib.import_module(f"{_PKG}.{path}")
    return importlib.import_module(path)


def _cfg_label(cfg: dict) -> str:
    s = f"h{cfg['BLOCK_H']}n{cfg['BLOCK_N']}w{cfg['num_warps']}s{cfg['num_stages']}"
    return s + (f"<=t{cfg['max_tokens']}" if "max_tokens" in cfg else "")


def kv_cache_jobs(t: Target) -> list:
    K = _mod("kv_cache.triton_kernels")
    from . import v4_layout as L
    out = []
    for native in _codecs(t):
        for name, tokens, warps in (("_kv_quant_kernel", K.QUANT_TOKENS_PER_PROG, K.QUANT_NUM_WARPS),
                                    ("_kv_dequant_kernel", K.DEQUANT_TOKENS_PER_PROG, K.DEQUANT_NUM_WARPS)):
            sig = dict(K.COMPILE_SIGNATURES[name])
            if native:
                sig["pool_ptr"] = "*fp8e4nv"
            consts = dict(PAGE_SIZE=64, BYTES_PER_PAGE=L.bytes_per_page(64), NATIVE_FP8=native, TOKENS=tokens)
            out.append(Job("kv_cache", f"kv_cache.triton_kernels:{name}", "fp8" if native else "u8",
                           sig, consts, num_warps=warps, num_stages=1))
    return out


def indexer_jobs(t: Target) -> list:
    K = _mod("indexer.triton_kernels")
    native = "fp8_e4m3" in t.features     # as _native_fp8_default: cc >= 8.9
    out = []
    for next_n in (1, 2):
        sig = dict(K.COMPILE_SIGNATURES["_indexer_kernel"])
        if native:
            sig.update(q_ptr="*fp8e4nv", kv_ptr="*fp8e4nv")
        consts = dict(NEXT_N=next_n, HP=64, H=64, D=K.HEAD_DIM,
                      CTX_2D=next_n > 1, NATIVE_FP8=native, BLOCK=K.BLOCK_N, NUM_STAGES=K.NUM_STAGES)
        out.append(Job("indexer", "indexer.triton_kernels:_indexer_kernel",
                       f"{'fp8' if native else 'u8'} next_n={next_n}", sig, consts,
                       num_warps=K.NUM_WARPS, num_stages=K.NUM_STAGES))
    return out


def _codecs(t: Target) -> tuple:
    """The decode variants a target's policy can choose: uint8 everywhere, native fp8
    where fp8_e4m3 holds."""
    return (False, True) if "fp8_e4m3" in t.features else (False,)


def attention_job(op: str, kv_mode: int, kind: str, cfg: dict) -> Job:
    K = _mod("sparse_attention.kernels")
    paged = kv_mode != 0
    consts = dict(KV_MODE=kv_mode, PAGE_SIZE=256 if paged else 1, BYTES_PER_PAGE=149760 if paged else 1,
                  PAGE_SIZE2=64 if paged else 1, BYTES_PER_PAGE2=37440 if paged else 1,
                  HAS_LEN=True, HAS_EXTRA=paged, HAS_LEN2=paged, HAS_SINK=True,
                  STATS=2 if paged else 0, SPLIT=kind == "decode_split",
                  BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], DOT_F32=False)
    codec = {0: "bf16", 1: "u8", 2: "fp8"}[kv_mode]
    return Job(op, "sparse_attention.kernels:_sparse_mla_kernel", f"{kind} {codec} {_cfg_label(cfg)}",
               K.compile_signature(kv_mode), consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def attention_jobs(t: Target) -> list:
    K = _mod("sparse_attention.kernels")
    L = _mod("sparse_attention.launch_table")
    out = [attention_job("sparse_prefill", 0, "prefill", c) for c in L.configs_for(t.cc, "prefill")]
    for native in _codecs(t):
        for kind in ("decode", "decode_split"):
            out += [attention_job("decode_mla", 2 if native else 1, kind, c) for c in L.configs_for(t.cc, kind)]
    out.append(Job("decode_mla", "sparse_attention.kernels:_combine_kernel", "split combine",
                   dict(K.COMPILE_SIGNATURES["_combine_kernel"]),
                   dict(HAS_SINK=True, STATS=2, SPLITS_P2=L.MAX_SPLITS, BLOCK_H=L.COMBINE_BLOCK_H,
                        BLOCK_D=L.COMBINE_BLOCK_D, ROUND=False), num_warps=L.COMBINE_WARPS))
    P = _mod("decode_mla.index_prep")
    for ids in ("i32", "i64"):      # clean_ids takes int32 or int64 ids
        sig = dict(P.COMPILE_SIGNATURES["_clean_ids_kernel"], src_ptr=f"*{ids}")
        out.append(Job("decode_mla", "decode_mla.index_prep:_clean_ids_kernel", f"{ids} ids BLOCK={P.MAX_BLOCK}",
                       sig, dict(BLOCK=P.MAX_BLOCK), num_warps=4))
    return out


# Mean routes per active expert at which moe's tiles_for changes tiles (one per size class).
MOE_SIZE_CLASSES = (1.0, 4.0, 16.0, 64.0, 128.0, 1024.0)
MOE_SHAPE = dict(H=7168, I=2048, TOPK=6)
# Split-K parts the MoE's decode candidates use (launch_table.Tiles.SK1/SK2).
SPLIT_K_PARTS = (2, 4, 8)


def moe_jobs(t: Target) -> list:
    K = _mod("moe.triton_kernels")
    sig = K.COMPILE_SIGNATURES
    out = []
    seen = set()
    H, I = MOE_SHAPE["H"], MOE_SHAPE["I"]
    for avg in MOE_SIZE_CLASSES:
        tiles = _mod("moe.launch_table").tiles_for(avg, H, I, False)
        if tiles in seen:
            continue
        seen.add(tiles)
        BM, BN1, BK1, W1, S1, BN2, BK2, W2, S2 = tiles[:9]
        BK1 = BK1 if H % BK1 == 0 else 64
        BK2 = BK2 if I % BK2 == 0 else 64
        # The decode class also runs one token's blocks without a routing table (DIRECT);
        # every class decodes with the scales folded (scale bytes <= 128) or not.
        for direct in ((0, 1) if avg == MOE_SIZE_CLASSES[0] else (0,)):
            for fold in (1, 0):
                label = f"BM={BM}" + (" direct" if direct else "") + ("" if fold else " unfolded")
                out.append(Job("moe", "moe.triton_kernels:_gemm1_swiglu_kernel", f"{label} n{BN1}k{BK1}w{W1}s{S1}",
                               dict(sig["_gemm1_swiglu_kernel"]),
                               dict(TOPK=MOE_SHAPE["TOPK"], HAS_LIMIT=True, F32=False, BM=BM, BN=BN1, BK=BK1,
                                    SPLIT=1, PREFETCH=0, DIRECT=direct, FOLD=fold),
                               num_warps=W1, num_stages=S1))
                out.append(Job("moe", "moe.triton_kernels:_gemm2_kernel", f"{label} n{BN2}k{BK2}w{W2}s{S2}",
                               dict(sig["_gemm2_kernel"]),
                               dict(F32=False, BM=BM, BN=BN2, BK=BK2, SPLIT=1, PREFETCH=0, DIRECT=direct, FOLD=fold),
                               num_warps=W2, num_stages=S2))
    # Split-K candidates of the decode class (Tiles.SK1/SK2 > 1): the split GEMMs differ from
    # the unsplit ones only in their K range and stores, plus the SwiGLU reduce and the
    # combine's sum over parts.
    t = _mod("moe.launch_table").tiles_for(1.0, H, I, False)
    for sk in SPLIT_K_PARTS:
        out.append(Job("moe", "moe.triton_kernels:_gemm1_swiglu_kernel",
                       f"BM={t.BM} n{t.BN1}k{t.BK1}w{t.W1}s{t.S1} split{sk}", dict(sig["_gemm1_swiglu_kernel"]),
                       dict(TOPK=MOE_SHAPE["TOPK"], HAS_LIMIT=True, F32=False, BM=t.BM, BN=t.BN1, BK=t.BK1,
                            SPLIT=sk, PREFETCH=0), num_warps=t.W1, num_stages=t.S1))
        out.append(Job("moe", "moe.triton_kernels:_gemm2_kernel", f"BM={t.BM} n{t.BN2}k{t.BK2}w{t.W2}s{t.S2} split{sk}",
                       dict(sig["_gemm2_kernel"]), dict(F32=False, BM=t.BM, BN=t.BN2, BK=t.BK2, SPLIT=sk, PREFETCH=0),
                       num_warps=t.W2, num_stages=t.S2))
        out.append(Job("moe", "moe.triton_kernels:_swiglu_reduce_kernel", f"split{sk} RP=512 BN=1024",
                       dict(sig["_swiglu_reduce_kernel"]),
                       dict(SPLIT=sk, HAS_LIMIT=True, F32=False, RP=512, BN=1024), num_warps=4))
        out.append(Job("moe", "moe.triton_kernels:_combine_kernel", f"BN=1024 split{sk}",
                       dict(sig["_combine_kernel"]), dict(TOPK=MOE_SHAPE["TOPK"], BN=1024, EXACT_RNE=False,
                                                         SPLIT=sk), num_warps=4))
    # The routing kernel per launch-table row, at the largest tables that row serves: 128
    # experts, its most routes (ROUTING_MAX_ROUTES for the last row), the smallest BM.
    bm = min(s.BM for s in seen)
    ep = 128
    for most, ch, warps in _mod("moe.launch_table").ROUTING_LAUNCHES:
        bp = max(16, 1 << (K.max_blocks(most or K.ROUTING_MAX_ROUTES, ep, bm) - 1).bit_length())
        out.append(Job("moe", "moe.triton_kernels:_routing_kernel", f"CH={ch} w{warps} EP={ep} BP={bp} BM={bm}",
                       dict(sig["_routing_kernel"]), dict(CH=ch, EP=ep, BP=bp, BM=bm), num_warps=warps))
    out.append(Job("moe", "moe.triton_kernels:_combine_kernel", "BN=1024",
                   dict(sig["_combine_kernel"]), dict(TOPK=MOE_SHAPE["TOPK"], BN=1024, EXACT_RNE=False, SPLIT=1),
                   num_warps=4))
    return out


def jobs_for(t: Target, registry=None) -> list:
    """Every (kernel, variant) the policy can choose on target ``t``: the jobs each op of
    REGISTRY (default: this process's) names in its Op.compile_jobs, a function shared by
    several ops run once."""
    from .registry import builtin
    reg = registry or builtin()
    seen, out = set(), []
    for op in reg.ops.values():
        if op.compile_jobs and op.compile_jobs not in seen:
            seen.add(op.compile_jobs)
            out += op.load_compile_jobs()(t)
    return out


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores")


def with_defaults(fn, constexprs: dict) -> dict:
    """CONSTEXPRS plus the value of each constexpr parameter of the @triton.jit FN that has a
    default and is not given: an offline compile (ASTSource) takes every constexpr, where a
    launch fills the defaults itself."""
    return dict({p.name: p.default for p in fn.params
                 if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs)


def compile_job(job: Job, t: Target) -> Row:
    """Compile ``job`` for ``t``; a failure is a row with its error, never an exception."""

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, name = job.kernel.split(":")
    fn = getattr(_mod(mod), name)
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("the compile matrix needs the kernels imported without TRITON_INTERPRET")
    constexprs = with_defaults(fn, job.constexprs)
    sig = dict(job.signature, **{k: "constexpr" for k in constexprs})
    log = io.StringIO()
    base = dict(target=t.key, op=job.op, kernel=name, variant=job.variant, limit=t.smem)
    # A fresh cache directory: every compile runs ptxas, whose -v log gives registers and spills.
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope():
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        try:
            with contextlib.redirect_stdout(log):
                ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                    target=GPUTarget("cuda", t.number, 32),
                                    options=dict(num_warps=job.num_warps, num_stages=job.num_stages))
        except Exception as exc:   # what Triton raises is the finding (e.g. fp8e4nv below 8.9)
            msg = " ".join(f"{type(exc).__name__}: {exc}".split())
            return Row(regs=None, spills=None, smem=None, error=msg[:300], **base)
    text = log.getvalue()
    regs, spill = _REGS.search(text), _SPILL.search(text)
    return Row(regs=int(regs.group(1)) if regs else None, spills=int(spill.group(1)) if spill else None,
               smem=int(ck.metadata.shared), **base)


def covering_set(targets=TARGETS) -> list:
    """(target, job) pairs that compile every (op, kernel, variant) of the matrix once, on
    the tightest target that can choose it: least opt-in shared memory, then lowest
    compute capability. The full matrix costs minutes per target; this is its CI form."""
    best: dict = {}
    for key in targets:
        t = target(key)
        for job in jobs_for(t):
            old = best.get(job.key)
            if old is None or (t.smem, t.number) < (old[0].smem, old[0].number):
                best[job.key] = (t, job)
    return list(best.values())


def run(targets=TARGETS, progress: Optional[Callable[[Row], None]] = None, *, cover: bool = False) -> list:
    """Compile the matrix for ``targets`` (catalog keys); one row per (target, job). With
    ``cover``, only the covering set."""
    pairs = covering_set(targets) if cover else [(t, j) for t in map(target, targets) for j in jobs_for(t)]
    rows = []
    for t, job in pairs:
        row = compile_job(job, t)
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows

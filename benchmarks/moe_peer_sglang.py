"""The peer of the Triton W4A16 MoE: SGLang's Triton fused MoE with int4 W4A16 weights.

SGLang 0.5.23 ships its fused MoE GEMM as Triton source (``sglang.kernels.ops.moe.
fused_moe_triton_kernels``: ``invoke_fused_moe_kernel``, the GPTQ/AWQ kernel for int4
weights with group scales). Its routing table (``moe_align_block_size``) is a CUDA JIT
module, its activation and sum are sgl-kernel or JIT ops; none of those is needed to run
the GEMMs: this module builds the table the GEMM kernel reads (sorted route ids padded
per expert to the block size with the sentinel R, one expert id per block, -1 for blocks
of no expert, the padded count) with torch ops that never synchronise (capturable), and
does the activation and the sum with torch ops. Those three are timed with the peer (so
its whole call is comparable) and reported apart by the breakdown.

Weights: int4 codes two per byte (element 2j in the low nibble), stored [E, N, K/2],
zero point 8, with one bf16 scale per GROUP = 64 weights [E, N, K/64]: 0.5 + 2/64 =
0.53125 bytes per weight, exactly the MXFP4 + E8M0 bytes per weight of capdispatch's
layout. Imported by benchmarks/bench_moe_breakdown.py only on a CUDA machine.
"""
from __future__ import annotations

GROUP = 64          # bf16 scale per 64 int4 weights: the MXFP4 + E8M0 bytes per weight
SGLANG_MODULE = "sglang.kernels.ops.moe.fused_moe_triton_kernels"
# SGLang 0.5.23's default tiles for int4 W4A16 without a tuned file (fused_moe_triton_config.
# get_default_config): M <= E rows use the first, larger M the second. Its lookup needs a
# running server's configuration, so the values are stated here.
SGLANG_DEFAULT_SMALL = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1)
SGLANG_DEFAULT_LARGE = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8)


def load():
    """(invoke_fused_moe_kernel, sglang version) or raise with what stops it."""
    import importlib
    import importlib.metadata as md

    from capdispatch.adapters.sglang.sglang_run import vision_placeholder
    vision_placeholder()            # sglang.srt imports torchvision at import time
    mod = importlib.import_module(SGLANG_MODULE)
    return mod.invoke_fused_moe_kernel, md.version("sglang")


def random_int4_weights(E, H, I, gen, device):
    """(w13 u8 [E, 2I, H/2], s13 bf16 [E, 2I, H/64], w2 u8 [E, H, I/2], s2 bf16 [E, H, I/64])."""
    import torch

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(device)

    def scales(*shape):          # a few units out of GEMM1 at DSv4 sizes, as the MXFP4 weights give
        return (torch.rand(shape, generator=gen) * 0.01 + 0.005).to(torch.bfloat16).to(device)
    return codes(E, 2 * I, H // 2), scales(E, 2 * I, H // GROUP), codes(E, H, I // 2), scales(E, H, I // GROUP)


def dequant(w, s):
    """int4 codes [.., N, K/2] + bf16 scales [.., N, K/GROUP] -> bf16 [.., N, K] (reference)."""
    import torch
    lo = (w & 0xF).to(torch.int16) - 8
    hi = (w >> 4).to(torch.int16) - 8
    q = torch.stack((lo, hi), dim=-1).reshape(*w.shape[:-1], w.shape[-1] * 2).float()
    return (q * s.float().repeat_interleave(GROUP, dim=-1)).to(torch.bfloat16)


def reference(x, w13, s13, w2, s2, tw, ids, limit):
    """The peer's own torch reference on its int4 weights: per route, clamped SwiGLU of
    x @ [gate; up]^T (float32, h rounded to bf16), times w2, times the top-k weight, summed
    in float32 over the token's routes, bf16 once. Masked (-1) routes contribute nothing."""
    import torch
    T, K = ids.shape
    I = w2.shape[-1] * 2
    out = torch.zeros(T, w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        t, k = torch.nonzero(ids == e, as_tuple=True)
        a = x[t].float()
        gu = a @ dequant(w13[e], s13[e]).float().t()
        g, u = gu[:, :I], gu[:, I:]
        if limit is not None:
            g = g.clamp(max=limit)
            u = u.clamp(-limit, limit)
        h = (g * torch.sigmoid(g) * u).to(torch.bfloat16).float()
        y = h @ dequant(w2[e], s2[e]).float().t()
        out.index_add_(0, t, y * tw[t, k].float()[:, None])
    return out.to(torch.bfloat16)


def align(ids, E, BM):
    """The GEMM kernel's routing table from top-k ids [T, K], with torch ops only (no host
    read of device data, so it captures in a CUDA graph):
    sorted [R + E*(BM-1)] int32: per expert in ascending order its routes t*K+k in route
    order, padded to a multiple of BM with R (the kernel's "no route"); masked routes
    (-1) are in no block; blocks [len/BM] int32: the expert of each block, -1 past the last;
    post [1] int32: the padded route count."""
    import torch
    flat = ids.reshape(-1).long()
    R = flat.numel()
    dev = flat.device
    maxpad = R + E * (BM - 1)
    key = torch.where(flat >= 0, flat, E)
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + BM - 1) // BM * BM
    pstart = torch.cumsum(padded, 0) - padded
    cstart = torch.cumsum(counts, 0) - counts
    skey = key[order]
    i = torch.arange(R, device=dev)
    live = skey < E
    ske = skey.clamp(max=E - 1)
    pos = torch.where(live, pstart[ske] + i - cstart[ske], maxpad)        # masked: a dump slot past the end
    sorted_ids = torch.full((maxpad + 1,), R, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    nblk = -(-maxpad // BM)
    bend = torch.cumsum(padded, 0) // BM
    b = torch.arange(nblk, device=dev)
    e_of_b = torch.searchsorted(bend, b, right=True)
    blocks = torch.where(e_of_b < E, e_of_b, -1).to(torch.int32)
    post = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids[:maxpad], blocks, post


def make_call(invoke, x, w13, s13, w2, s2, tw, ids, limit, cfg1, cfg2):
    """The peer's whole MoE call (routing table, GEMM1, clamped SwiGLU, GEMM2 with the
    top-k weight, sum over routes) as a zero-argument function; buffers held."""
    import torch
    import triton.language as tl
    T, K = ids.shape
    E, N1, _ = w13.shape
    I, H = N1 // 2, w2.shape[1]
    R = T * K
    c1 = torch.empty(R, N1, dtype=torch.bfloat16, device=x.device)
    c2 = torch.empty(R, H, dtype=torch.bfloat16, device=x.device)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=x.device)
    tw = tw.contiguous()

    def gemm(a, w, s, c, mul, top_k, cfg, tables):
        sorted_ids, blocks, post = tables
        invoke(a, w, None, c, None, s, None, tw, ids, sorted_ids, blocks, post, mul, top_k, dict(cfg),
               tl.bfloat16, False, False, False, True, False, block_shape=[0, GROUP])

    def call():
        t1 = align(ids, E, cfg1["BLOCK_SIZE_M"])
        t2 = t1 if cfg2["BLOCK_SIZE_M"] == cfg1["BLOCK_SIZE_M"] else align(ids, E, cfg2["BLOCK_SIZE_M"])
        gemm(x, w13, s13, c1, False, K, cfg1, t1)
        g, u = c1[:, :I].float(), c1[:, I:].float()
        if limit is not None:
            g = g.clamp(max=limit)
            u = u.clamp(-limit, limit)
        h = (g * torch.sigmoid(g) * u).to(torch.bfloat16)
        gemm(h, w2, s2, c2, True, 1, cfg2, t2)
        out.copy_(c2.view(T, K, H).float().sum(dim=1))
        return out
    return call


def configs(T, E):
    """The peer's tiles timed at T tokens: SGLang's default and a small sweep around it."""
    base = SGLANG_DEFAULT_SMALL if T <= E else SGLANG_DEFAULT_LARGE     # its M is the token count
    out = [("sglang_default", dict(base, num_warps=4, num_stages=3))]
    bm = 16 if T <= 64 else 64
    for bn in (32, 64, 128):
        for bk in (64, 128):
            for st in (3,):
                c = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1 if T <= 64 else 8,
                         num_warps=4 if bm < 64 else 8, num_stages=st)
                out.append((f"m{bm}n{bn}k{bk}s{st}", c))
    return out

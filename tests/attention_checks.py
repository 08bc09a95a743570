"""Helpers shared by the attention-op tests (sparse_prefill, decode_mla, the SGLang
routes): tolerances, seeds, inputs and comparisons."""
import os
import random

import torch

SCALE = 512 ** -0.5          # DeepSeek-V4's softmax scale
OUT_RTOL = 1e-2              # attention outputs: relative error (Frobenius)
# Softmax statistics (max logits, lse) in fp32: 1e-3 absolute, infinities identical.
STAT_ATOL = 1e-3
# A target machine's software, for decisions on simulated devices.
ASSUME = ["sgl-flash-mla==1.0.0", "flashinfer-python==0.7.2", "triton==3.9.0", "torch==2.13.0"]


def new_seed():
    """A fresh seed for every random test; ATTN_TEST_SEED=<int> replays one."""
    env = os.environ.get("ATTN_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def flashmla_runs() -> bool:
    """sgl-flash-mla imports here and this card is SM90 or SM100 (its kernels' targets)."""
    if not torch.cuda.is_available():
        return False
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0) and cc[0] != 10:
        return False
    try:
        import flash_mla  # noqa: F401
    except Exception:   # noqa: BLE001 - any import failure means "not runnable here"
        return False
    return True


def v4_pool(gen, num_pages, page_size, device, *, spare_pages=0):
    """A V4 pool whose every slot holds kv_quant of a random bf16 row (magnitudes vary per
    64-value tile, so the UE8M0 scales vary). Returns the pool (a window of a buffer with
    ``spare_pages`` poisoned pages on either side) and its buffer."""
    from capdispatch.backends.kv_cache import layout as L
    from capdispatch.backends.kv_cache import reference as KV
    cap = num_pages * page_size
    rows = torch.randn(cap, 512, generator=gen)
    tile_scale = torch.exp2(torch.randint(-4, 5, (cap, 7), generator=gen).float())
    rows[:, :448] *= tile_scale.repeat_interleave(64, dim=1)
    buf = torch.full((num_pages + 2 * spare_pages, L.bytes_per_page(page_size)), 0x7F, dtype=torch.uint8)
    pool = buf[spare_pages:spare_pages + num_pages]
    KV.kv_quant(rows.bfloat16(), pool, torch.arange(cap), page_size)
    buf = buf.to(device)
    return buf[spare_pages:spare_pages + num_pages], buf


def v4_view(pool, page_size):
    """The [num_pages, page_size, 1, 584] view SGLang's DSv4 backend hands to FlashMLA."""
    return pool[:, :page_size * 584].view(pool.shape[0], page_size, 1, 584)


def rel_err(got, want):
    g, w = got.float(), want.float()
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


def assert_stats_close(got, want, msg, atol=STAT_ATOL):
    g, w = got.float().cpu(), want.float().cpu()
    fin = torch.isfinite(w)
    assert torch.equal(torch.isfinite(g), fin), f"{msg}: finite pattern differs"
    assert torch.equal(g[~fin], w[~fin]), f"{msg}: infinities differ: {g[~fin][:8]} vs {w[~fin][:8]}"
    if fin.any():
        err = (g[fin] - w[fin]).abs().max().item()
        assert err <= atol, f"{msg}: max abs error {err:.3g} > {atol}"

"""Helpers shared by the attention-op tests (sparse_prefill, decode_mla, the SGLang
routes): tolerances, seeds, inputs and comparisons."""
import os
import random

import torch

from capdispatch.backends.canary_checks import STAT_ATOL, assert_stats_close, rel_err  # noqa: F401
from capdispatch.backends.kv_cache.inputs import v4_pool  # noqa: F401

SCALE = 512 ** -0.5          # DeepSeek-V4's softmax scale
OUT_RTOL = 1e-2              # attention outputs: relative error (Frobenius)
# Softmax statistics (max logits, lse): STAT_ATOL (1e-3 absolute), infinities identical.
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



def v4_view(pool, page_size):
    """The [num_pages, page_size, 1, 584] view SGLang's DSv4 backend hands to FlashMLA."""
    return pool[:, :page_size * 584].view(pool.shape[0], page_size, 1, 584)




"""Comparisons shared by the attention-op tests (sparse_prefill, decode_mla)."""
import torch

# Softmax statistics (max logits, lse) in fp32: 1e-3 absolute, infinities identical.
STAT_ATOL = 1e-3


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

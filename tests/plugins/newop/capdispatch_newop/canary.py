"""row_scale's canary (Op.canary) and comparison (Op.compare): a small problem checked
bit-exactly against the reference. Imports torch: loaded only when a backend is verified."""
import torch

from capdispatch.backends import Comparison

from .kernels import reference


def row_scale_compare(got, want, args) -> Comparison:
    """Bit-exact: each row of x times its weight is one rounding, the same in every backend."""
    bad = int((got != want).sum()) if got.shape == want.shape else got.numel()
    return Comparison(bad == 0, "bit-identical to the reference" if not bad else
                      f"{bad} values differ from the reference", float(bad), 0.0)


def row_scale(fn, device, seed: int, backend: str = "") -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 64, generator=gen).to(device)
    w = torch.randn(37, generator=gen).to(device)
    row_scale_compare(fn(x, w), reference(x, w), (x, w)).check("output")
    return {"tolerance": "bit-exact", "checked": x.shape[0]}
